"""Real checkpoints for the conversion tests, written once per session by real training runs.

One launch of 4 ranks (deepspeed launcher, gloo) trains the tiny GPT-2 and Llama flavours at
(TP, PP, ZeRO) = (1,1,0) [DP 4], (2,2,1) [DP 1] and (1,1,3) [DP 4], and Llama also at (2,1,3)
[DP 2], for 2 iterations from the same seed and data. The vocabulary has 256 tokens, a multiple
of 128 x TP for TP <= 2, so no layout pads it differently and all runs compute the same model:
their merged weights must agree.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
from training_fixtures import REPO, make_corpus, multirun_cmd, run

LAYOUTS = {"110": (1, 1, 0), "221": (2, 2, 1), "113": (1, 1, 3)}
FLAVOURS = ("gpt2", "llama")
# plus ZeRO-3 under TP (DP 2), where DeepSpeed's zero_to_fp32 alone would mix the TP ranks' files
RUNS = [(f, name, layout) for f in FLAVOURS for name, layout in LAYOUTS.items()] + [
    ("llama", "213", (2, 1, 3))
]
WORLD = 4
NULL_VOCAB = 255  # NullTokenizer: ids 0..254 + eod 255 = 256 tokens


def model_flags(flavour: str) -> list[str]:
    common = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
    ]
    if flavour == "gpt2":
        return common
    return common + [
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--ffn-hidden-size",
        "96",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--rotary-base",
        "500",
    ]


def train_flags(corpus: str, iters: int) -> list[str]:
    return [
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-warmup-iters",
        "1",
        "--seed",
        "7",
        "--data-path",
        corpus,
        "--split",
        "100,0,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(NULL_VOCAB),
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--eval-interval",
        "1000",
        "--num-workers",
        "0",
        "--distributed-backend",
        "gloo",
    ]


def layout_flags(tp: int, pp: int, zero: int) -> list[str]:
    return [
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--zero-stage",
        str(zero),
    ]


_launches = itertools.count()


def launch_runs(runs: list[list[str]], workdir: Path, timeout: float = 400) -> str:
    """Run several pretrain_gpt.py argv lists in one 4-rank deepspeed world; returns the output."""
    result = run(
        multirun_cmd(WORLD, runs, workdir / f"runs_{next(_launches)}.json"), timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


def load_tool(name: str):
    """tools/<name>.py as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# pytest builds a session fixture once per test module that imports it: both conversion test
# modules share one build through this cache.
_built: dict[str, object] = {}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    if "corpus" not in _built:
        _built["corpus"] = make_corpus(tmp_path_factory.mktemp("convert_data") / "corpus")
    return _built["corpus"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, corpus) -> dict[tuple[str, str], Path]:
    """(flavour, layout) -> checkpoint directory, layout in {"110", "221", "113"} (+ ("llama", "213"))."""
    if "checkpoints" not in _built:
        root = tmp_path_factory.mktemp("convert_ckpt")
        out, runs = {}, []
        for flavour, name, layout in RUNS:
            out[flavour, name] = root / f"{flavour}_{name}"
            runs.append(
                model_flags(flavour)
                + train_flags(corpus, iters=2)
                + layout_flags(*layout)
                + ["--save", str(out[flavour, name]), "--save-interval", "2"]
            )
        launch_runs(runs, root)
        _built["checkpoints"] = out
    return _built["checkpoints"]
