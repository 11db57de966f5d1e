"""TP/PP/DP/ZeRO do not change the math: every layout reproduces the one-process losses and grad norms.

Real processes under the real `deepspeed` launcher, one launch per world size (1, 2, 4, 8 ranks),
each running every layout of that size for both model flavours through `pretrain(argv)`, with
Megatron's default `--make-vocab-size-divisible-by` (128): the padded vocabulary is 128 rows at
TP = 1 and 256 at TP = 2, and padding never enters the softmax, so the runs still agree.
The `make demo` layout (GPT-2, TP2 PP2 ZeRO-0) and Llama at TP2 PP2 DP2 also save a checkpoint at
iteration 4; its Hugging Face export (padding dropped) computes the loss the run logged at
iteration 5 on that iteration's batch.
`--clip-grad` is small enough that every step is clipped, and the logged norm is the one the
clipping used, so a wrong global gradient norm fails the grad-norm comparison. (DeepSpeed's own
ZeRO-0 clipping under a pipeline logs no norm at all, and its wrong norm moves the losses by only
~3e-6 here because Adam is nearly invariant to the gradient's scale: the norm check is the one
that catches it, measured with tp1_pp2_dp1_zero0.)
The same launches check that DeepSpeed leaves nothing behind in /dev/shm.
"""

import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from convert_fixtures import load_tool
from training_fixtures import (
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
    training_batch,
)

LAYOUTS_BY_WORLD = {  # (TP, PP, DP, ZeRO)
    1: [(1, 1, 1, 0)],
    2: [(2, 1, 1, 0), (1, 2, 1, 0), (1, 1, 2, 1), (1, 1, 2, 2), (1, 1, 2, 3)],
    4: [(2, 2, 1, 0), (1, 2, 2, 0), (2, 2, 1, 1), (2, 1, 2, 2)],
    8: [(2, 2, 2, 1)],
}
FLAVOURS = ("gpt2", "llama")
ITERATIONS = 5
MICRO_BATCH = 2
RTOL = 1e-6  # docs/TRAINING.md states it
EXPORTED = [("gpt2", (2, 2, 1, 0)), ("llama", (2, 2, 2, 1))]  # make demo's layout; Llama 2x2x2
SAVED_AT = ITERATIONS - 1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _argv(flavour: str, corpus: str, layout: tuple[int, int, int, int]) -> list[str]:
    tp, pp, _, zero = layout
    return (
        model_flags(flavour, vocab_divisible_by=None)
        + train_flags(corpus, iters=ITERATIONS, mbs=MICRO_BATCH)
        + layout_flags(tp, pp, zero)
    )


def _shm_deepspeed_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("deepspeed")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("equivalence")
    corpus = make_corpus(tmp / "corpus")
    shm_before = _shm_deepspeed_files()
    metrics, outputs, checkpoints = {}, {}, {}
    for world, layouts in LAYOUTS_BY_WORLD.items():
        argvs = []
        for flavour in FLAVOURS:
            for layout in layouts:
                name = "{}_tp{}_pp{}_dp{}_zero{}".format(flavour, *layout)
                metrics[flavour, layout] = tmp / f"{name}.jsonl"
                argvs.append(
                    _argv(flavour, corpus, layout) + ["--metrics-file", str(tmp / f"{name}.jsonl")]
                )
                if (flavour, layout) in EXPORTED:
                    checkpoints[flavour, layout] = tmp / f"{name}_ckpt"
                    argvs[-1] += ["--save", str(tmp / f"{name}_ckpt")]
                    argvs[-1] += ["--save-interval", str(SAVED_AT)]
        result = run(multirun_cmd(world, argvs, tmp / f"runs_{world}.json"), timeout=240)
        outputs[world] = result.stdout
        assert result.returncode == 0, f"world {world} failed:\n{result.stdout[-8000:]}"
    return {
        "metrics": {k: read_metrics(p) for k, p in metrics.items()},
        "checkpoints": checkpoints,
        "corpus": corpus,
        "outputs": outputs,
        "shm_before": shm_before,
        "shm_after": _shm_deepspeed_files(),
    }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize(
    "layout",
    [lay for lays in LAYOUTS_BY_WORLD.values() for lay in lays if lay != (1, 1, 1, 0)],
    ids=lambda lay: "tp{}_pp{}_dp{}_zero{}".format(*lay),
)
def test_layout_matches_one_process(runs, flavour, layout):
    ref = runs["metrics"][flavour, (1, 1, 1, 0)]
    got = runs["metrics"][flavour, layout]
    assert sorted(ref) == sorted(got) == list(range(1, ITERATIONS + 1))
    for it in ref:
        assert got[it]["grad-norm"] is not None, f"no grad norm logged at iteration {it}"
        assert _rel(got[it]["lm-loss"], ref[it]["lm-loss"]) <= RTOL, (
            it,
            got[it]["lm-loss"],
            ref[it]["lm-loss"],
        )
        assert _rel(got[it]["grad-norm"], ref[it]["grad-norm"]) <= RTOL, (
            it,
            got[it]["grad-norm"],
            ref[it]["grad-norm"],
        )
    # clipping was active (norm above --clip-grad), so the norm fed into the update
    assert all(ref[it]["grad-norm"] > 0.05 for it in ref)
    # and the model learned something in 5 steps: not a frozen or diverging run
    assert ref[ITERATIONS]["lm-loss"] < ref[1]["lm-loss"]


def _logged_loss(model: transformers.PreTrainedModel, batch: dict) -> float:
    """Megatron's lm loss of a global batch: each micro-batch's loss-masked token mean, averaged."""
    means = []
    with torch.no_grad():
        for start in range(0, len(batch["tokens"]), MICRO_BATCH):
            rows = slice(start, start + MICRO_BATCH)
            logits = model(batch["tokens"][rows]).logits.float()
            per_token = F.cross_entropy(
                logits.flatten(0, 1), batch["labels"][rows].flatten(), reduction="none"
            )
            mask = batch["loss_mask"][rows].flatten().float()
            means.append((per_token * mask).sum() / mask.sum())
    return float(torch.stack(means).mean())


@pytest.mark.parametrize("flavour, layout", EXPORTED, ids=lambda x: str(x))
def test_hf_export_computes_the_training_loss(runs, tmp_path, flavour, layout):
    out = tmp_path / "hf"
    load_tool("convert_to_hf").main(
        ["--load", str(runs["checkpoints"][flavour, layout]), "--iteration", str(SAVED_AT)]
        + ["--output-dir", str(out)]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, local_files_only=True
    ).eval()
    assert hf.config.vocab_size == 101  # trained with 256 rows at TP 2: the padding is dropped
    batch = training_batch(_argv(flavour, runs["corpus"], (1, 1, 1, 0)), SAVED_AT + 1)
    logged = runs["metrics"][flavour, layout][SAVED_AT + 1]["lm-loss"]
    assert _rel(_logged_loss(hf, batch), logged) <= RTOL, (_logged_loss(hf, batch), logged)


def test_log_lines_in_megatron_format(runs):
    out = runs["outputs"][8]
    assert (
        " iteration        5/       5 | consumed samples:           40 | elapsed time per iteration (ms): "
        in out
    )
    assert "| global batch size:     8 | lm loss: " in out
    assert " layout           |  TP=2  PP=2  DP=2  ZeRO-1  (fp32)" in out


def test_deepspeed_launcher_leaves_no_shm_buffers(runs):
    assert runs["shm_after"] - runs["shm_before"] == set()
