"""Iteration time of `pretrain_gpt.py` (TP = PP = DP = 1) vs a plain PyTorch loop on the same model.

    .venv/bin/python bench/train_step.py [--iters 30] [--hidden-size 256 ...]

Both sides train the same `GPTModel` on the same micro-batches (micro-batch x gradient accumulation
= the global batch) with AdamW (same groups) and clipping. Ours runs as a real `pretrain_gpt.py`
process (DeepSpeed engine, data loader from a generated NullTokenizer corpus, logging, metrics
file); the plain loop runs in this process on random tokens of the same shape. Median iteration
times exclude the first `--warmup` iterations; the plain loop runs before and after ours. ratio = ours / plain (target <= 1.05).
On a CUDA machine the defaults switch to a ~1.3B GPT in bf16 (24 x 2048, seq 2048) and MFU is
reported against the table in pretrain/training/report/flops.py (or --peak-tflops).
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pretrain.data.files.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path  # noqa: E402
from pretrain.model.config import ModelConfig  # noqa: E402
from pretrain.model.gpt import GPTModel  # noqa: E402
from pretrain.model.loss import masked_mean_loss  # noqa: E402
from pretrain.training.report.flops import flops_per_iteration, peak_tflops_per_device  # noqa: E402
from pretrain.training.schedules.optimizer import param_groups  # noqa: E402


def parse() -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-layers", type=int, default=24 if gpu else 4)
    p.add_argument("--hidden-size", type=int, default=2048 if gpu else 256)
    p.add_argument("--num-attention-heads", type=int, default=16 if gpu else 8)
    p.add_argument("--seq-length", type=int, default=2048 if gpu else 256)
    p.add_argument("--vocab-size", type=int, default=50257 if gpu else 8000)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--bf16", action="store_true", default=gpu)
    p.add_argument("--peak-tflops", type=float)
    return p.parse_args()


def model_flags(a) -> list[str]:
    return [
        "--num-layers",
        str(a.num_layers),
        "--hidden-size",
        str(a.hidden_size),
        "--num-attention-heads",
        str(a.num_attention_heads),
        "--seq-length",
        str(a.seq_length),
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
    ] + (["--bf16"] if a.bf16 else [])


def make_corpus(prefix: str, vocab: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(
        get_bin_path(prefix), dtype=np.int32 if vocab >= 65500 else np.uint16
    )
    for _ in range(max(1, tokens // 1000)):
        builder.add_item(np.append(rng.integers(0, vocab, 999), vocab))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def run_ours(a, workdir: str, threads: int) -> list[float]:
    prefix = os.path.join(workdir, "corpus")
    make_corpus(
        prefix, a.vocab_size, (a.iters + 2) * a.global_batch_size * (a.seq_length + 1) * 11 // 10
    )
    metrics = os.path.join(workdir, "metrics.jsonl")
    cmd = [
        sys.executable,
        str(REPO / "pretrain_gpt.py"),
        *model_flags(a),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--global-batch-size",
        str(a.global_batch_size),
        "--train-iters",
        str(a.iters),
        "--lr",
        "1e-4",
        "--data-path",
        prefix,
        "--split",
        "100,0,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(a.vocab_size),
        "--log-interval",
        str(a.iters),
        "--eval-iters",
        "0",
        "--num-workers",
        "1",
        "--metrics-file",
        metrics,
    ]
    if a.peak_tflops:
        cmd += ["--peak-tflops", str(a.peak_tflops)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"pretrain_gpt.py failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    print(next(line for line in out.stdout.splitlines() if " iteration " in line))
    records = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    return [r["iteration-time"] for r in records]


def run_plain(a, threads: int) -> list[float]:
    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        vocab_size=a.vocab_size + 1,
        seq_length=a.seq_length,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16 if a.bf16 else torch.float32,
    )
    model = GPTModel(cfg).to(device)
    opt = torch.optim.AdamW(
        param_groups(model.named_parameters(), 0.01), lr=1e-4, weight_decay=0.01
    )
    steps = a.global_batch_size // a.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(a.iters):
        batches = [
            torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=gen)
            for _ in range(steps)
        ]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for tokens in batches:
            tokens = tokens.to(device)
            loss = masked_mean_loss(
                model(tokens[:, :-1], labels=tokens[:, 1:]), torch.ones_like(tokens[:, 1:])
            )
            (loss / steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    a = parse()
    threads = int(os.environ.get("OMP_NUM_THREADS", len(os.sched_getaffinity(0))))
    # The plain loop runs before and after ours, so load from other processes on a shared machine
    # falls on both sides alike.
    plain = run_plain(a, threads)[a.warmup :]
    with tempfile.TemporaryDirectory() as workdir:
        ours = run_ours(a, workdir, threads)[a.warmup :]
    plain += run_plain(a, threads)[a.warmup :]
    ours_s = statistics.median(ours)
    plain_s = statistics.median(plain)
    cfg = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        vocab_size=a.vocab_size + 1,
        seq_length=a.seq_length,
    )
    flops = flops_per_iteration(cfg, a.global_batch_size, cfg.padded_vocab_size(1))
    tokens = a.global_batch_size * a.seq_length
    peak = peak_tflops_per_device(a.peak_tflops)
    result = {
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu x{threads} threads",
        "model": f"L{a.num_layers} h{a.hidden_size} s{a.seq_length} V{cfg.padded_vocab_size(1)}",
        "precision": "bf16" if a.bf16 else "fp32",
        "global_batch": a.global_batch_size,
        "ours_iter_ms": round(ours_s * 1000, 2),
        "plain_iter_ms": round(plain_s * 1000, 2),
        "ours_tokens_per_s": round(tokens / ours_s, 1),
        "plain_tokens_per_s": round(tokens / plain_s, 1),
        "ours_tflops": round(flops / ours_s / 1e12, 4),
        "mfu": None if peak is None else round(flops / ours_s / 1e12 / peak, 4),
        "ratio": round(ours_s / plain_s, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
