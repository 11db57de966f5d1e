"""IndexedDataset reader/builder: Megatron's bytes, computed here from the spec, and bad files."""

import os
import struct
import warnings

import numpy as np
import pytest

from pretrain.data.files.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    optimal_dtype,
)
from pretrain.errors import UserError

DOCS = [  # (tokens of each sequence) per document; one empty document
    [[1, 2, 3], [4]],
    [],
    [[5, 6, 7, 8, 65535]],
    [[9], [10, 11], [12]],
]


def _build(prefix, dtype=np.uint16, docs=DOCS):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        b.add_document([t for seq in doc for t in seq], [len(seq) for seq in doc])
    b.finalize(prefix + ".idx")
    return prefix


def _spec_idx_bytes(docs, code, itemsize):
    """The .idx bytes as docs/DATA_FORMAT.md §1 describes them, written out by hand."""
    lengths = [len(seq) for doc in docs for seq in doc]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * itemsize
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in doc_idx)
    return out


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_idx_and_bin_bytes_match_spec(tmp_path, dtype, code):
    prefix = _build(str(tmp_path / "d"), dtype)
    assert open(prefix + ".idx", "rb").read() == _spec_idx_bytes(
        DOCS, code, np.dtype(dtype).itemsize
    )
    tokens = [t for doc in DOCS for seq in doc for t in seq]
    fmt = "<H" if code == 8 else "<i"
    assert open(prefix + ".bin", "rb").read() == b"".join(struct.pack(fmt, t) for t in tokens)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_reader_views(tmp_path):
    ds = IndexedDataset(_build(str(tmp_path / "d")))
    assert len(ds) == 6 and ds.num_documents == 4 and ds.dtype == np.uint16
    assert ds.document_indices.tolist() == [0, 2, 2, 3, 6]
    assert ds.sequence_lengths.tolist() == [3, 1, 5, 1, 2, 1]
    assert ds[2].tolist() == [5, 6, 7, 8, 65535]
    assert ds.get(2, offset=1, length=2).tolist() == [6, 7]
    assert [a.tolist() for a in ds[4:6]] == [[10, 11], [12]]
    assert not ds[2].flags.owndata  # a view into the memory map, not a copy
    assert IndexedDataset.exists(str(tmp_path / "d")) and not IndexedDataset.exists(
        str(tmp_path / "x")
    )


def test_add_item_end_document_equals_add_document(tmp_path):
    a = _build(str(tmp_path / "a"))
    b = IndexedDatasetBuilder(str(tmp_path / "b.bin"), np.uint16)
    for doc in DOCS:
        for seq in doc:
            b.add_item(np.array(seq, dtype=np.int64))
        b.end_document()
    b.finalize(str(tmp_path / "b.idx"))
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(str(tmp_path / "b") + ext, "rb").read()


def test_merge_with_add_index(tmp_path):
    first, second = DOCS[:2], DOCS[2:]
    _build(str(tmp_path / "p0"), docs=first)
    _build(str(tmp_path / "p1"), docs=second)
    m = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    m.add_index(str(tmp_path / "p0"))
    m.add_index(str(tmp_path / "p1"))
    m.finalize(str(tmp_path / "m.idx"))
    whole = _build(str(tmp_path / "whole"))
    for ext in (".bin", ".idx"):
        assert open(str(tmp_path / "m") + ext, "rb").read() == open(whole + ext, "rb").read()
    bad = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.int32)
    with pytest.raises(UserError, match="dtype uint16 differs"):
        bad.add_index(str(tmp_path / "p0"))


def test_pointers_are_int64_past_2gb(tmp_path):
    """Pointers accumulate in int64: 2^31 bytes of uint16 sequences without writing them."""
    b = IndexedDatasetBuilder(str(tmp_path / "big.bin"), np.uint16)
    n = 1 << 30  # tokens per sequence = 2 GiB per sequence
    b._lengths.extend([n, n, 5])  # index-only: exercise finalize's pointer arithmetic
    b.end_document()
    b.finalize(str(tmp_path / "big.idx"))
    raw = open(str(tmp_path / "big.idx"), "rb").read()
    pointers = np.frombuffer(raw, np.int64, 3, 34 + 12)
    assert pointers.tolist() == [0, 2 * n, 4 * n]


def test_optimal_dtype_and_codes():
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(None) == np.int32
    assert [DType.code_from_dtype(t) for t in (np.uint8, np.int32, np.int64, np.uint16)] == [
        1,
        4,
        5,
        8,
    ]


def test_token_overflow_is_an_error(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16)
    with pytest.raises(UserError, match="does not fit uint16"):
        b.add_document(np.array([70000]), [1])
    b.abort()
    assert os.listdir(tmp_path) == []


def _corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: _corrupt(p + ".idx", 0, b"XXXX"), "bad magic"),
        (lambda p: _corrupt(p + ".idx", 9, struct.pack("<Q", 2)), "version 2"),
        (lambda p: _corrupt(p + ".idx", 17, b"\x09"), "unknown dtype code 9"),
        (lambda p: os.truncate(p + ".idx", 20), "truncated index header"),
        (lambda p: os.truncate(p + ".idx", 100), "needs"),
        (lambda p: os.truncate(p + ".bin", 10), "truncated, 10 bytes"),
        (lambda p: os.remove(p + ".bin"), "missing"),
        # document indices [0, 2, 2, 3, 6] -> [0, 2, 4, 3, 6]: decreasing
        (
            lambda p: _corrupt(p + ".idx", 34 + 12 * 6 + 16, struct.pack("<q", 4)),
            "decrease at position 3",
        ),
        (
            lambda p: _corrupt(p + ".idx", 34 + 12 * 6 + 32, struct.pack("<q", 5)),
            "end at the sequence count",
        ),
    ],
)
def test_corrupt_files_name_the_file(tmp_path, damage, message):
    prefix = _build(str(tmp_path / "d"))
    damage(prefix)
    with pytest.raises(UserError, match=message) as err:
        IndexedDataset(prefix)
    assert str(tmp_path / "d") in str(err.value)


def test_interop_with_megatron_core(tmp_path):
    """megatron-core (test-only oracle) reads our files, and we read files its builder writes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset as mc

    ours = _build(str(tmp_path / "ours"))
    theirs_reader = mc.IndexedDataset(ours)
    assert len(theirs_reader) == 6
    assert theirs_reader.document_indices.tolist() == [0, 2, 2, 3, 6]
    assert [theirs_reader[i].tolist() for i in range(6)] == [s for d in DOCS for s in d]

    theirs = str(tmp_path / "theirs")
    b = mc.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    for doc in DOCS:
        b.add_document([t for seq in doc for t in seq], [len(seq) for seq in doc])
    b.finalize(theirs + ".idx")
    ds = IndexedDataset(theirs)
    assert [ds[i].tolist() for i in range(len(ds))] == [s for d in DOCS for s in d]
    for ext in (".bin", ".idx"):
        assert open(theirs + ext, "rb").read() == open(ours + ext, "rb").read()
