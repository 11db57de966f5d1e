"""Benchmark: samples per CPU-second of the training loader, with and without the document flags.

The training loader in process (`build_pretraining_data_loader` with --num-workers 0: sampler,
`__getitems__` batches, collation) over a blend of two synthetic prefixes (documents of ~1,000
tokens, lognormal lengths), micro-batch 8, measured in CPU-seconds of this process (one core's
capacity, which other jobs on a shared machine do not distort), for three configurations:

    plain          no document flags
    doc_flags      --eod-mask-loss --reset-position-ids
    doc_attention  doc_flags + --reset-attention-mask (the loader adds O(S) document ids)

"need_per_gpu" is the samples/s one H100 consumes training GPT-2 124M at 50% MFU, a stated figure
(no GPU here): 0.5 x 989 TFLOP/s (dense bf16) / FLOPs per sample, with FLOPs per sample from
`pretrain.training.report.flops.flops_per_iteration` (the formula the training log's TFLOP/s and MFU
use): S x [72 L h^2 + 6 L h S + 6 h V], i.e. 6 x N x tokens (N = 12 L h^2 + h V, the matmul
parameters) plus causal attention (6 L h S per token); L=12, h=768, V=50304 (padded).
"ratio" = the slowest configuration's samples per CPU-second / need_per_gpu.

    python bench/loader.py [--seq-length 2048] [--micro-batch-size 8] [--batches 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pretrain.data.builder import build_train_valid_test_datasets  # noqa: E402
from pretrain.data.config import DataConfig  # noqa: E402
from pretrain.data.datasets.samplers import build_pretraining_data_loader  # noqa: E402
from pretrain.data.files.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from pretrain.model.config import ModelConfig  # noqa: E402
from pretrain.tokenizer import NullTokenizer  # noqa: E402
from pretrain.training.report.flops import PEAK_BF16_TFLOPS, flops_per_iteration  # noqa: E402

VOCAB = 50257
MFU = 0.5
CONFIGS = {
    "plain": {},
    "doc_flags": {"eod_mask_loss": True, "reset_position_ids": True},
    "doc_attention": {
        "eod_mask_loss": True,
        "reset_position_ids": True,
        "reset_attention_mask": True,
    },
}


def need_per_gpu(seq_length: int) -> float:
    """Samples/s of GPT-2 124M on one H100 at 50% MFU (the training log's FLOPs formula)."""
    gpt2 = ModelConfig(
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        vocab_size=VOCAB,
        seq_length=seq_length,
        max_position_embeddings=seq_length,
    )
    flops_per_sample = flops_per_iteration(gpt2, 1, gpt2.padded_vocab_size(1))
    return MFU * PEAK_BF16_TFLOPS["H100"] * 1e12 / flops_per_sample


def write_prefix(prefix: str, num_tokens: int, eod: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < num_tokens:
        n = int(np.clip(rng.lognormal(6.4, 1.1), 2, 50_000))
        t = rng.integers(0, VOCAB - 1, n, dtype=np.int64)
        t[-1] = eod
        b.add_document(t, [n])
        written += n
    b.finalize(prefix + ".idx")


def samples_per_cpu_s(dataset, cfg: DataConfig, mbs: int, batches: int, warmup: int = 3) -> float:
    """Samples per CPU-second of this process through the in-process training loader."""
    it = iter(build_pretraining_data_loader(dataset, 0, mbs, 0, 1, cfg))
    for _ in range(warmup):
        next(it)
    cpu = time.process_time()
    for _ in range(batches):
        batch = next(it)
    elapsed = time.process_time() - cpu
    assert batch["tokens"].shape == (mbs, cfg.seq_length)
    assert ("document_ids" in batch) == cfg.reset_attention_mask
    return batches * mbs / elapsed


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=60, help="timed batches per repeat")
    ap.add_argument("--repeats", type=int, default=5, help="the median repeat is reported")
    ap.add_argument("--tokens-per-prefix", type=int, default=20_000_000)
    args = ap.parse_args()
    # what a DataLoader worker runs with (torch sets 1 thread in workers); an intra-op thread
    # pool would also make "per CPU-second" count threads spinning on a shared machine
    torch.set_num_threads(1)
    S, mbs = args.seq_length, args.micro_batch_size
    need = need_per_gpu(S)
    tok = NullTokenizer(VOCAB - 1)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as d:
        prefixes = [os.path.join(d, f"p{i}") for i in range(2)]
        for i, p in enumerate(prefixes):
            write_prefix(
                p, max(args.tokens_per_prefix, 4 * (args.batches + 3) * mbs * S), tok.eod, i
            )
        datasets = {}
        for name, flags in CONFIGS.items():
            cfg = DataConfig(
                seq_length=S,
                blend=(prefixes, [0.7, 0.3]),
                split="98,2,0",
                data_cache_path=os.path.join(d, "cache"),
                num_workers=0,
                **flags,
            )
            n_train = (args.batches + 3) * mbs
            datasets[name] = (build_train_valid_test_datasets(cfg, tok, [n_train, 0, 0])[0], cfg)
        for _ in range(args.repeats):  # interleaved, so a busy spell hits every configuration
            for name, (dataset, cfg) in datasets.items():
                rates[name].append(samples_per_cpu_s(dataset, cfg, mbs, args.batches))

    median = {name: statistics.median(r) for name, r in rates.items()}
    plain = median["plain"]
    print(f"need per GPU (GPT-2 124M, one H100 at 50% MFU, seq {S}): {need:.1f} samples/s")
    for name, rate in median.items():
        print(
            f"{name:14s} {rate:10,.0f} samples per CPU-second  {rate / plain:5.2f}x plain  "
            f"{rate / need:6.1f}x need   (repeats: {', '.join(f'{r:,.0f}' for r in rates[name])})"
        )
    print(
        json.dumps(
            {
                "bench": "loader",
                "seq_length": S,
                "micro_batch_size": mbs,
                "samples_per_cpu_s": {k: round(v, 1) for k, v in median.items()},
                "vs_plain": {k: round(v / plain, 3) for k, v in median.items()},
                "need_per_gpu": round(need, 1),
                "ratio": round(min(median.values()) / need, 2),
                "ratio_definition": "slowest configuration's samples per CPU-second / need_per_gpu",
            }
        )
    )


if __name__ == "__main__":
    main()
