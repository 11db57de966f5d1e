"""numba kernels for the GPT sample index and the blending indices.

These replace megatron-core's `helpers.cpp`: the same arithmetic, the same outputs (values and
dtypes), but JIT-compiled by numba with `cache=True`, so there is no C++ build at launch and the
compile cost is paid once per machine (the compiled code is cached next to this file, or under
`NUMBA_CACHE_DIR`). Everything that needs a random generator (document and shuffle indices) stays in
numpy, in `gpt_dataset.py`, because it must consume `numpy.random.RandomState` exactly as Megatron does.
"""

from __future__ import annotations

import math

import numba
import numpy as np

INT32_MAX = np.iinfo(np.int32).max


def num_samples_in_sample_index(
    num_epochs: int, tokens_per_epoch: int, seq_length: int, drop_last: bool, extra_token: int
) -> int:
    """Number of samples the sample index describes (its rows minus one).

    With drop_last the partial trailing sample is dropped. Without it, Megatron rounds up in
    *single precision* (`ceil(float(E*T - x) / S)` evaluated on floats in C++); we keep that quirk
    so that the row count matches even where float32 rounding makes it differ from exact math.
    """
    usable = num_epochs * tokens_per_epoch - extra_token
    if drop_last:
        return usable // seq_length
    return int(math.ceil(np.float32(usable) / np.float32(seq_length)))


@numba.njit(cache=True, nogil=True)
def _fill_sample_index(sizes, doc_idx, seq_length, extra_token, out):
    """Walk the epochs' documents and record where each sample starts: (doc_idx position, offset).

    Sample k covers seq_length + extra_token tokens; the next sample starts extra_token tokens before
    the end of that span, so consecutive samples overlap by extra_token tokens.
    """
    num_rows = out.shape[0]
    last = doc_idx.shape[0] - 1
    d = 0
    offset = 0
    out[0, 0] = 0
    out[0, 1] = 0
    for k in range(1, num_rows):
        need = seq_length + extra_token
        while need != 0:
            remaining = sizes[doc_idx[d]] - offset
            need -= remaining
            if need <= 0:
                offset += need + remaining - extra_token
                need = 0
            elif d == last:
                # only reachable without drop_last: the final partial sample ends at the data's end
                offset = sizes[doc_idx[d]] - extra_token
                break
            else:
                d += 1
                offset = 0
        out[k, 0] = d
        out[k, 1] = offset


def build_sample_index(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last: bool = True,
    extra_token: int = 1,
) -> np.ndarray:
    """The [num_samples + 1, 2] sample index over `doc_idx` (positions into it) and token offsets.

    dtype is int32 when every stored value fits (max(len(doc_idx), max(sizes)) <= 2**31 - 1), else
    int64, as megatron-core decides since Dec 2024.
    """
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    num_samples = num_samples_in_sample_index(
        num_epochs, tokens_per_epoch, seq_length, drop_last, extra_token
    )
    largest = max(doc_idx.shape[0], int(sizes.max()) if sizes.shape[0] else 0)
    dtype = np.int32 if largest <= INT32_MAX else np.int64
    out = np.empty((max(num_samples, 0) + 1, 2), dtype=dtype)
    if doc_idx.shape[0] == 0:
        out[:] = 0
        return out
    # copying a large mmap'd lengths array into RAM pays off when most of it is visited
    sizes = np.ascontiguousarray(sizes)
    if doc_idx.shape[0] * 2 > sizes.shape[0] and not sizes.flags.writeable:
        sizes = sizes.copy()
    _fill_sample_index(
        sizes, np.ascontiguousarray(doc_idx, dtype=np.int32), seq_length, extra_token, out
    )
    return out


@numba.njit(cache=True, nogil=True)
def _fill_blending_indices(weights, dataset_index, dataset_sample_index):
    """Greedy blend: each step picks the dataset furthest behind its share (lowest index on ties)."""
    counts = np.zeros(weights.shape[0], dtype=np.int64)
    for i in range(dataset_index.shape[0]):
        t = float(max(i, 1))
        best = 0
        best_error = weights[0] * t - counts[0]
        for j in range(1, weights.shape[0]):
            error = weights[j] * t - counts[j]
            if error > best_error:
                best_error = error
                best = j
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of length `size` for normalized weights."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    _fill_blending_indices(weights, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


@numba.njit(cache=True, nogil=True)
def _fill_exhaustive_blending_indices(sizes, dataset_index, dataset_sample_index):
    """Greedy blend by size shares over the datasets that still have samples, until all are used."""
    total = sizes.sum()
    weights = sizes.astype(np.float64) / total
    counts = np.zeros(sizes.shape[0], dtype=np.int64)
    for i in range(dataset_index.shape[0]):
        t = float(max(i, 1))
        best = -1
        best_error = 0.0
        for j in range(sizes.shape[0]):
            if counts[j] < sizes[j]:
                error = weights[j] * t - counts[j]
                if best == -1 or error > best_error:
                    best_error = error
                    best = j
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1


def build_exhaustive_blending_indices(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blend every sample of every dataset exactly once: arrays of length sum(sizes)."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    dataset_index = np.empty(total, dtype=np.int16)
    dataset_sample_index = np.empty(total, dtype=np.int64)
    if total:
        _fill_exhaustive_blending_indices(sizes, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index
