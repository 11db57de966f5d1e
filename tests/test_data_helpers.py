"""numba index kernels against a slow pure-Python reference (written from the spec) and against
megatron-core's compiled helpers (a test-only oracle), on random inputs."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.datasets import helpers_cpp  # test-only oracle (dev dependency)

from pretrain.data.datasets import helpers

# ---- pure-Python references, written from docs/DATA_FORMAT.md §3/§4 ----------


def reference_sample_index(sizes, doc_idx, S, E, T, drop_last, x):
    if drop_last:
        n = (E * T - x) // S
    else:
        n = math.ceil(np.float32(E * T - x) / np.float32(S))
    rows = [(0, 0)]
    d, off = 0, 0
    for _ in range(n):
        need = S + x
        while need != 0:
            length = int(sizes[doc_idx[d]]) - off
            need -= length
            if need <= 0:
                off += need + length - x
                need = 0
            elif d == len(doc_idx) - 1:
                off = int(sizes[doc_idx[d]]) - x
                break
            else:
                d += 1
                off = 0
        rows.append((d, off))
    return rows


def reference_blending(weights, size):
    counts = [0] * len(weights)
    di, dsi = [], []
    for i in range(size):
        t = float(max(i, 1))
        errors = [w * t - c for w, c in zip(weights, counts, strict=False)]
        best = max(range(len(weights)), key=lambda j: (errors[j], -j))
        di.append(best)
        dsi.append(counts[best])
        counts[best] += 1
    return di, dsi


def reference_exhaustive_blending(sizes):
    total = sum(sizes)
    weights = [s / total for s in sizes]
    counts = [0] * len(sizes)
    di, dsi = [], []
    for i in range(total):
        t = float(max(i, 1))
        best, best_error = None, None
        for j in range(len(sizes)):
            if counts[j] < sizes[j]:
                error = weights[j] * t - counts[j]
                if best is None or error > best_error:
                    best, best_error = j, error
        di.append(best)
        dsi.append(counts[best])
        counts[best] += 1
    return di, dsi


# ---- worked examples from the spec ----------------------------------------------------------------


def test_spec_worked_example_sample_index():
    sizes = np.array([5, 3, 7], dtype=np.int32)
    doc_idx = np.array([2, 0, 1], dtype=np.int32)
    out = helpers.build_sample_index(sizes, doc_idx, 4, 1, 15, drop_last=True, extra_token=1)
    assert out.dtype == np.int32
    assert out.tolist() == [[0, 0], [0, 4], [1, 1], [2, 0]]
    out = helpers.build_sample_index(sizes, doc_idx, 4, 1, 15, drop_last=False, extra_token=1)
    assert out.tolist() == [[0, 0], [0, 4], [1, 1], [2, 0], [2, 2]]


def test_spec_worked_example_blending():
    di, dsi = helpers.build_blending_indices(np.array([0.3, 0.7]), 10)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    assert di.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert dsi.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]


def test_sample_index_dtype_becomes_int64_past_int32():
    # one document longer than 2**31 - 1 tokens: offsets no longer fit int32
    big = 2**31 + 10
    sizes = np.array([big], dtype=np.int64)
    out = helpers.build_sample_index(sizes, np.array([0], np.int32), 2**30, 1, big)
    assert out.dtype == np.int64
    assert out.tolist() == [
        list(r) for r in reference_sample_index(sizes, [0], 2**30, 1, big, True, 1)
    ]
    assert out.tolist() == [[0, 0], [0, 2**30], [0, 2**31]]


def test_exhaustive_blending_small():
    di, dsi = helpers.build_exhaustive_blending_indices(np.array([2, 0, 3]))
    assert list(zip(di.tolist(), dsi.tolist(), strict=False)) == list(
        zip(*reference_exhaustive_blending([2, 0, 3]), strict=False)
    )
    assert sorted(zip(di.tolist(), dsi.tolist(), strict=False)) == [
        (0, 0),
        (0, 1),
        (2, 0),
        (2, 1),
        (2, 2),
    ]


# ---- random inputs ---------------------------------------------------------------------------------


@st.composite
def sample_index_inputs(draw):
    num_seq = draw(st.integers(1, 12))
    sizes = np.array(
        draw(st.lists(st.integers(0, 20), min_size=num_seq, max_size=num_seq)), np.int32
    )
    indices = np.array(
        sorted(set(draw(st.lists(st.integers(0, num_seq - 1), min_size=1, max_size=num_seq)))),
        np.int32,
    )
    x = draw(st.sampled_from([0, 1]))
    T = int(sizes[indices].sum())
    if T <= x:  # megatron needs at least one token beyond the extra token per epoch
        sizes[indices[0]] += x + 1 - T
        T = int(sizes[indices].sum())
    E = draw(st.integers(1, 3))
    S = draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**32 - 1))
    doc_idx = np.tile(indices, E)
    np.random.RandomState(seed).shuffle(doc_idx)
    drop_last = draw(st.booleans())
    return sizes, doc_idx, S, E, T, drop_last, x


@settings(max_examples=150, deadline=None)
@given(sample_index_inputs())
def test_sample_index_matches_reference_and_megatron(args):
    sizes, doc_idx, S, E, T, drop_last, x = args
    ours = helpers.build_sample_index(sizes, doc_idx, S, E, T, drop_last=drop_last, extra_token=x)
    assert ours.tolist() == [
        list(r) for r in reference_sample_index(sizes, doc_idx, S, E, T, drop_last, x)
    ]
    theirs = helpers_cpp.build_sample_idx_int32(sizes, doc_idx, S, E, T, drop_last, x)
    assert ours.dtype == theirs.dtype == np.int32
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.001, 1.0), min_size=1, max_size=6), st.integers(0, 300))
def test_blending_matches_reference_and_megatron(raw, size):
    weights = np.array(raw) / np.sum(raw)
    di, dsi = helpers.build_blending_indices(weights, size)
    ref_di, ref_dsi = reference_blending(weights.tolist(), size)
    assert di.tolist() == ref_di and dsi.tolist() == ref_dsi
    m_di = np.zeros(size, np.int16)
    m_dsi = np.zeros(size, np.int64)
    helpers_cpp.build_blending_indices(m_di, m_dsi, weights, len(weights), size, False)
    np.testing.assert_array_equal(di, m_di)
    np.testing.assert_array_equal(dsi, m_dsi)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0))
def test_exhaustive_blending_matches_reference_and_megatron(sizes):
    di, dsi = helpers.build_exhaustive_blending_indices(np.array(sizes))
    ref_di, ref_dsi = reference_exhaustive_blending(sizes)
    assert di.tolist() == ref_di and dsi.tolist() == ref_dsi
    # every sample of every dataset exactly once
    assert np.bincount(di, minlength=len(sizes)).tolist() == sizes
    if 0 in sizes:
        return  # megatron never passes an empty dataset here (it asserts weights > 0); its C++ would overrun
    m_di = np.zeros(sum(sizes), np.int16)
    m_dsi = np.zeros(sum(sizes), np.int64)
    helpers_cpp.build_exhaustive_blending_indices(
        m_di, m_dsi, np.array(sizes, np.int64), len(sizes)
    )
    np.testing.assert_array_equal(di, m_di)
    np.testing.assert_array_equal(dsi, m_dsi)
