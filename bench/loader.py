"""Benchmark: samples/s of a blended GPT dataset through the training DataLoader at seq 2048.

"need" is the samples/s one GPU's training step consumes, from a stated figure (this machine has no
GPU to measure one): GPT-2 small (124M parameters, 12 layers, d=768) at seq 2048 on one H100
(989 TFLOP/s dense bf16) at 50% MFU, with training FLOPs/token = 6*params + 12*layers*d*seq
(Megatron's accounting incl. attention): ~0.97 GFLOP/token -> ~510k tokens/s -> ~249 samples/s.
A small model on a fast GPU is the demanding case; bigger models need fewer samples/s. Each
data-parallel rank has its own loader, so the comparison is per loader. Override with
--need-samples-per-s.

Measured in the same run: the loader with the attention mask built in the loader (Megatron's
default) and without it (--no-create-attention-mask-in-dataloader, for causal kernels), the same
in the main process (num_workers 0), also per CPU-second of that process (one core's capacity,
robust to other jobs on a shared machine), and the raw single-process gather rate
(token slices from the mmap, no tensors) as a ceiling.
The last line printed is one JSON object. "ratio" = samples per CPU-second of the loader process
(no in-loader mask) / need: the loader's capacity per core, which a shared or overloaded machine
does not distort; "ratio_wall" = wall-clock samples/s with --num-workers workers / need.

    .venv/bin/python bench/loader.py [--seq-length 2048] [--micro-batch-size 8] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pretrain.data.builder import build_train_valid_test_datasets  # noqa: E402
from pretrain.data.config import DataConfig  # noqa: E402
from pretrain.data.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from pretrain.data.samplers import build_pretraining_data_loader  # noqa: E402
from pretrain.tokenizer import NullTokenizer  # noqa: E402

VOCAB = 50257


def need_samples_per_s(seq_length: int) -> float:
    params, layers, d = 124e6, 12, 768
    flops_per_token = 6 * params + 12 * layers * d * seq_length
    return 989e12 * 0.5 / flops_per_token / seq_length


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


def loader_rate(ds, cfg, mbs, batches, warmup=5) -> float:
    it = iter(build_pretraining_data_loader(ds, 0, mbs, 0, 1, cfg))
    for _ in range(warmup):  # worker start-up is not steady state
        next(it)
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        batch = next(it)
        assert batch["tokens"].shape == (mbs, cfg.seq_length)
    n = batches * mbs
    # (wall samples/s, samples per CPU-second of this process: one core's capacity when in process)
    return n / (time.perf_counter() - t), n / (time.process_time() - cpu)


def gather_rate(ds, n) -> float:
    t = time.perf_counter()
    for k in range(n):
        ds.datasets[int(ds.dataset_index[k])].sample_tokens(int(ds.dataset_sample_index[k]))
    return n / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--tokens-per-prefix", type=int, default=20_000_000)
    ap.add_argument("--need-samples-per-s", type=float, default=None)
    args = ap.parse_args()
    S, mbs = args.seq_length, args.micro_batch_size
    need = args.need_samples_per_s or need_samples_per_s(S)
    tok = NullTokenizer(VOCAB - 1)

    with tempfile.TemporaryDirectory() as d:
        prefixes = [os.path.join(d, f"p{i}") for i in range(2)]
        for i, p in enumerate(prefixes):
            write_prefix(p, args.tokens_per_prefix, tok.eod, seed=i)
        n_train = (args.batches + 10) * mbs
        rates = {}
        for mask, workers in ((True, args.num_workers), (False, args.num_workers), (False, 0)):
            cfg = DataConfig(
                seq_length=S,
                blend=(prefixes, [0.7, 0.3]),
                split="98,2,0",
                data_cache_path=os.path.join(d, "cache"),
                create_attention_mask=mask,
                num_workers=workers,
            )
            train, _, _ = build_train_valid_test_datasets(cfg, tok, [n_train, 0, 0])
            rates[mask, workers] = loader_rate(train, cfg, mbs, args.batches)
        raw = gather_rate(train, min(len(train), 2000))

    print(f"need (stated, GPT-2 124M on one H100 at 50% MFU, seq {S}): {need:.0f} samples/s")
    w = args.num_workers
    with_mask, no_mask, (in_process, per_cpu_s) = (
        rates[True, w][0],
        rates[False, w][0],
        rates[False, 0],
    )
    print(
        f"loader ({w} workers), attention mask in loader: {with_mask:,.0f} samples/s ({with_mask / need:.1f}x need)"
    )
    print(
        f"loader ({w} workers), no attention mask:        {no_mask:,.0f} samples/s ({no_mask / need:.1f}x need)"
    )
    print(
        f"loader (in process), no attention mask:        {in_process:,.0f} samples/s ({in_process / need:.1f}x need)"
    )
    print(
        f"  same, per CPU-second of the process:         {per_cpu_s:,.0f} samples/s ({per_cpu_s / need:.1f}x need)"
    )
    print(f"raw token gather, one process:                 {raw:,.0f} samples/s")
    print(
        json.dumps(
            {
                "bench": "loader",
                "seq_length": S,
                "micro_batch_size": mbs,
                "num_workers": w,
                "need_samples_per_s": round(need, 1),
                "loader_samples_per_s_no_mask": round(no_mask, 1),
                "loader_samples_per_s_with_mask": round(with_mask, 1),
                "in_process_samples_per_s": round(in_process, 1),
                "in_process_samples_per_cpu_s": round(per_cpu_s, 1),
                "raw_gather_samples_per_s": round(raw, 1),
                "ratio": round(per_cpu_s / need, 2),
                "ratio_wall": round(no_mask / need, 2),
                "ratio_with_mask": round(with_mask / need, 2),
                "ratio_in_process": round(in_process / need, 2),
                "ratio_definition": "samples per CPU-second of one loader process (no in-loader mask) / stated need; "
                "ratio_wall: wall samples/s with num_workers workers / need",
            }
        )
    )


if __name__ == "__main__":
    main()
