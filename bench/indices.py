"""Benchmark: build the GPT document + sample + shuffle indices for ~10M samples.

Compares, in the same run and on the same inputs:
  - ours: pretrain.data.datasets.gpt_dataset.build_indices (numba sample-index kernel), cold (fresh numba
    cache: JIT compile included, measured in a subprocess) and warm (compiled code cached on disk);
  - numpy: the same arrays with a vectorized numpy sample index (cumsum + searchsorted), a strong
    pure-numpy baseline;
  - python: the spec's pure-Python sample-index loop, on a prefix of the samples (too slow for all);
  - megatron: megatron-core's compiled C++ `build_sample_idx` (if installed), same numpy doc/shuffle.
Every implementation's arrays are checked equal to ours before any time is reported.
The last line printed is one JSON object; "ratio" = megatron C++ seconds / our warm seconds
(> 1: we are faster), or numpy seconds / ours when megatron-core is absent.

    .venv/bin/python bench/indices.py [--samples 10000000] [--seq-length 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pretrain.data.datasets import gpt_dataset, helpers  # noqa: E402


def document_lengths(num_tokens: int, seed: int) -> np.ndarray:
    """Web-text-like lengths: lognormal around ~600 tokens with a long tail, 1..200k."""
    rng = np.random.default_rng(seed)
    n = int(num_tokens / 1100) + 1
    lengths = np.clip(rng.lognormal(mean=6.4, sigma=1.1, size=n), 1, 200_000).astype(np.int32)
    return lengths


def numpy_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, extra_token=1):
    """Vectorized drop_last sample index: sample k starts at global token k*S; the row is the first
    doc_idx position whose cumulative end reaches k*S + x, and the offset into it."""
    n = (num_epochs * tokens_per_epoch - extra_token) // seq_length
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)
    starts_at = np.arange(1, n + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts_at + extra_token, side="left")
    out = np.empty((n + 1, 2), dtype=np.int32)
    out[0] = 0
    out[1:, 0] = pos
    out[1:, 1] = starts_at - (ends[pos] - sizes[doc_idx[pos]])
    return out


def python_sample_index(sizes, doc_idx, seq_length, num_samples, extra_token=1):
    rows = [(0, 0)]
    d, off = 0, 0
    for _ in range(num_samples):
        need = seq_length + extra_token
        while need != 0:
            length = int(sizes[doc_idx[d]]) - off
            need -= length
            if need <= 0:
                off += need + length - extra_token
                need = 0
            else:
                d += 1
                off = 0
        rows.append((d, off))
    return np.array(rows, dtype=np.int32)


def timed(fn, repeat=1):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def with_sample_index(sample_index_fn, sizes, indices, plan, seq_length, seed):
    """Our build_indices with the sample-index kernel swapped, so doc/shuffle work is identical."""
    real = helpers.build_sample_index
    helpers.build_sample_index = sample_index_fn
    try:
        return gpt_dataset.build_indices(sizes, indices, plan, seq_length, seed)
    finally:
        helpers.build_sample_index = real


COLD = """
import sys, time, numpy as np
sys.path.insert(0, {root!r})
t = time.perf_counter()
from pretrain.data.datasets import helpers
helpers.build_sample_index(np.array([5, 3, 7], np.int32), np.array([2, 0, 1], np.int32), 4, 1, 15)
print(time.perf_counter() - t)
"""


def cold_start_seconds() -> float:
    """Import + first call in a fresh process with an empty numba cache (JIT compile included)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        out = subprocess.run(
            [sys.executable, "-c", COLD.format(root=root)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument(
        "--python-samples", type=int, default=200_000, help="samples for the pure-Python loop"
    )
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    S, N = args.seq_length, args.samples

    sizes = document_lengths(N * S + 1, args.seed)
    indices = np.arange(len(sizes), dtype=np.int32)
    T = int(sizes.sum(dtype=np.int64))
    plan = gpt_dataset.plan_epochs(T, N, S, 1)
    print(
        f"{len(sizes):,} documents, {T:,} tokens/epoch, {plan.num_epochs} epoch(s), "
        f"separate final epoch: {plan.separate_final_epoch}, S={S}, requested {N:,} samples"
    )

    cold = cold_start_seconds()
    # load the cached JIT
    helpers.build_sample_index(sizes[:3], indices[:3], 4, 1, int(sizes[:3].sum()))
    t_ours, ours = timed(
        lambda: gpt_dataset.build_indices(sizes, indices, plan, S, args.seed), repeat=2
    )
    t_kernel, _ = timed(
        lambda: helpers.build_sample_index(sizes, ours["document_index"], S, plan.num_epochs, T),
        repeat=2,
    )
    print(
        f"ours    : {t_ours:.2f} s (all three indices; sample-index kernel {t_kernel:.2f} s); "
        f"cold start incl. JIT {cold:.2f} s"
    )

    t_np, np_arrays = timed(
        lambda: with_sample_index(
            lambda s, d, S_, E, T_, drop, x: numpy_sample_index(s, d, S_, E, T_, x),
            sizes,
            indices,
            plan,
            S,
            args.seed,
        )
    )
    for k in ours:
        assert np.array_equal(ours[k], np_arrays[k]) and ours[k].dtype == np_arrays[k].dtype, k
    print(f"numpy   : {t_np:.2f} s (arrays equal)")

    n_py = min(args.python_samples, N)
    t_py, py_rows = timed(lambda: python_sample_index(sizes, ours["document_index"], S, n_py))
    assert np.array_equal(py_rows, ours["sample_index"][: n_py + 1])
    print(
        f"python  : {t_py:.2f} s for the first {n_py:,} samples' sample index ({n_py / t_py:,.0f} samples/s; "
        f"ours: {N / t_kernel:,.0f} samples/s)"
    )

    result = {
        "bench": "indices",
        "samples": int(len(ours["shuffle_index"])),
        "seq_length": S,
        "documents": int(len(sizes)),
        "epochs": plan.num_epochs,
        "ours_warm_s": round(t_ours, 3),
        "ours_sample_index_kernel_s": round(t_kernel, 3),
        "ours_cold_start_s": round(cold, 3),
        "numpy_s": round(t_np, 3),
        "python_samples_per_s": round(n_py / t_py),
        "ours_kernel_samples_per_s": round(N / t_kernel),
    }
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:
        helpers_cpp = None
    if helpers_cpp is not None:

        def megatron_sample_index(s, d, S_, E, T_, drop, x):
            return helpers_cpp.build_sample_idx_int32(s, d, S_, E, T_, drop, x)

        t_m, m_arrays = timed(
            lambda: with_sample_index(megatron_sample_index, sizes, indices, plan, S, args.seed),
            repeat=2,
        )
        t_mk, _ = timed(
            lambda: helpers_cpp.build_sample_idx_int32(
                sizes, ours["document_index"], S, plan.num_epochs, T, True, 1
            ),
            repeat=2,
        )
        for k in ours:
            assert np.array_equal(ours[k], m_arrays[k]) and ours[k].dtype == m_arrays[k].dtype, k
        print(f"megatron: {t_m:.2f} s (C++ sample-index kernel {t_mk:.2f} s; arrays equal)")
        result.update(
            megatron_cpp_s=round(t_m, 3),
            megatron_cpp_kernel_s=round(t_mk, 3),
            ratio=round(t_m / t_ours, 3),
            kernel_ratio=round(t_mk / t_kernel, 3),
            ratio_definition="megatron-core C++ seconds / ours (all three indices)",
        )
    else:
        result.update(ratio=round(t_np / t_ours, 3), ratio_definition="numpy seconds / ours")
    result["vs_numpy"] = round(t_np / t_ours, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
