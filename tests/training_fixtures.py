"""Shared pieces of the training tests: a tiny corpus, tiny-model flags, launching real ranks.

Every launch runs in its own process group with a hard timeout; on timeout the whole group is
killed and the test fails with the captured output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from pretrain.launch import free_port

REPO = Path(__file__).resolve().parents[1]
PYTHON = (
    str(REPO / ".venv" / "bin" / "python")
    if (REPO / ".venv" / "bin" / "python").exists()
    else sys.executable
)
BIN = Path(PYTHON).parent
VOCAB = 100  # NullTokenizer ids 0..99, eod = 100: 101 tokens


def make_corpus(prefix: Path, num_docs: int = 200, seed: int = 0) -> str:
    """A tiny NullTokenizer corpus: documents of 5-60 random ids, each ending with eod."""
    from pretrain.data.files.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    for _ in range(num_docs):
        doc = rng.integers(0, VOCAB, size=int(rng.integers(5, 60)))
        builder.add_item(np.append(doc, VOCAB))
        builder.end_document()
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


def model_flags(
    flavour: str, layers: int = 2, hidden: int = 32, vocab_divisible_by: int | None = 64
) -> list[str]:
    """Tiny-model flags. The vocabulary pads to a multiple of `vocab_divisible_by` x TP: 64 gives
    128 rows at TP 1 and 2 alike; None leaves Megatron's default (128: 128 rows at TP 1, 256 at 2)."""
    padding = (
        []
        if vocab_divisible_by is None
        else ["--make-vocab-size-divisible-by", str(vocab_divisible_by)]
    )
    common = padding + [
        "--num-layers",
        str(layers),
        "--hidden-size",
        str(hidden),
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
    if flavour == "llama":
        return common + [
            "--position-embedding-type",
            "rope",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--ffn-hidden-size",
            "64",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
        ]
    raise ValueError(flavour)


def train_flags(data_prefix: str, iters: int = 5, gbs: int = 8, mbs: int = 2) -> list[str]:
    return [
        "--micro-batch-size",
        str(mbs),
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-warmup-iters",
        "2",
        "--lr-decay-style",
        "cosine",
        "--clip-grad",
        "0.05",
        "--weight-decay",
        "0.1",
        "--seed",
        "7",
        "--data-path",
        data_prefix,
        "--split",
        "90,10,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        "--log-interval",
        "1",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "0",
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


def test_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO)
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE"):
        env.pop(key, None)
    env.update(extra)
    return env


def start(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> subprocess.Popen:
    """`cmd` in a new session (its own process group), stdout and stderr together."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env or test_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run(
    cmd: list[str], timeout: float, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run `cmd` in a new session; kill the whole process group on timeout."""
    proc = start(cmd, env, cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def deepspeed_cmd(nproc: int, args: list[str], script: str = "pretrain_gpt.py") -> list[str]:
    return [
        str(BIN / "deepspeed"),
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(REPO / script),
        *args,
    ]


def multirun_cmd(nproc: int, runs: list[list[str]], runs_file: Path) -> list[str]:
    """The deepspeed launcher running tests/training_multirun.py over several argv lists."""
    runs_file.write_text(json.dumps(runs))
    return deepspeed_cmd(nproc, [str(runs_file)], script="tests/training_multirun.py")


def one_rank_multirun(runs: list, runs_file: Path, timeout: float) -> subprocess.CompletedProcess:
    """tests/training_multirun.py over several runs in one process, a world of one rank."""
    runs_file.write_text(json.dumps(runs))
    env = test_env(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    return run([PYTHON, str(REPO / "tests" / "training_multirun.py"), str(runs_file)], timeout, env)


def multirun_outputs(output: str) -> list[str]:
    """The output of each run of a training_multirun.py launch, in order, split at the `multirun:
    run N` line rank 0 prints before each run (exact at one rank; at several, a run's lines come
    before the next header when the run ends in a barrier, as pretrain() does)."""
    return re.split(r"^multirun: run \d+\n", output, flags=re.M)[1:]


def torchrun_cmd(nproc: int, args: list[str], *extra: str) -> list[str]:
    return [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        str(nproc),
        *extra,
        str(REPO / "pretrain_gpt.py"),
        *args,
    ]


def read_metrics(path: Path) -> dict[int, dict]:
    """iteration -> metrics, the training and evaluation lines of an iteration merged; a later
    value for the same iteration and key (a resumed run) replaces an earlier one."""
    out = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["iteration"], {}).update(record)
    return out


LOG_LINE = re.compile(
    r" iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| .* lm loss: ([0-9.E+-]+) \|"
)


def logged_losses(output: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(4)) for m in LOG_LINE.finditer(output)}


def training_batch(argv: list[str], iteration: int) -> dict:
    """The global batch `pretrain_gpt.py argv` trains on at `iteration` (1-based), read through the
    data pipeline in this process: samples [(iteration - 1) gbs, iteration gbs) of the train split.
    `argv` must be a one-process layout (the samples do not depend on the layout)."""
    from pretrain.cli import parse_args
    from pretrain.data.builder import build_train_valid_test_datasets
    from pretrain.data.config import train_valid_test_num_samples
    from pretrain.tokenizer import build_tokenizer

    cfg = parse_args(argv, env={})
    t, ev = cfg.training, cfg.evaluation
    num_samples = train_valid_test_num_samples(
        t.train_iters, t.train_samples, ev.eval_interval, ev.eval_iters, t.global_batch_size
    )
    train = build_train_valid_test_datasets(cfg.data, build_tokenizer(cfg.tokenizer), num_samples)[
        0
    ]
    first = (iteration - 1) * t.global_batch_size
    return train.__getitems__(list(range(first, first + t.global_batch_size)))


def checkpointed_model(checkpoint: str, iteration: int | None = None):
    """The checkpoint's model as one fp32 GPTModel (unpadded vocabulary, eval mode): the
    reference the logged losses are checked against."""
    import dataclasses

    import torch

    from pretrain.convert.checkpoint_reader import read_checkpoint
    from pretrain.model.gpt import GPTModel

    ck = read_checkpoint(checkpoint, iteration)
    config = dataclasses.replace(
        ck.config, make_vocab_size_divisible_by=1, params_dtype=torch.float32
    )
    model = GPTModel(config).eval()
    model.load_state_dict(ck.state_dict)
    model.iteration = ck.iteration
    return model


def token_losses(model, batch: dict):
    """(per-token cross-entropy [b, s], loss mask), both float64, of `model` on `batch`."""
    import torch

    with torch.no_grad():
        logits = model(batch["tokens"], position_ids=batch["position_ids"], gather_logits=True)
    per_token = torch.nn.functional.cross_entropy(
        logits.double().flatten(0, 1), batch["labels"].flatten(), reduction="none"
    ).view_as(batch["labels"])
    return per_token, batch["loss_mask"].double()


def megatron_loss(per_token, mask, micro_batch_size: int) -> float:
    """Megatron's iteration (and validation) loss: the mean over micro-batches of each
    micro-batch's masked mean."""
    import torch

    micro = [
        (per_token[i : i + micro_batch_size] * mask[i : i + micro_batch_size]).sum()
        / mask[i : i + micro_batch_size].sum()
        for i in range(0, len(mask), micro_batch_size)
    ]
    return float(torch.stack(micro).mean())
