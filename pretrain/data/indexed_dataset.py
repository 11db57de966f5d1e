"""Megatron's mmap dataset format: a `PREFIX.bin` of token ids and a `PREFIX.idx` index.

Byte layout (all little-endian, no padding; docs/DATA_FORMAT.md §1):

    magic b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence count S |
    <Q document_indices length D | int32[S] lengths | int64[S] byte pointers | int64[D] doc indices
    [| int8[S] modes, multimodal only]

The reader memory-maps both files and hands out zero-copy numpy views. The builder streams tokens
to the `.bin` as they arrive and keeps the index in growing numpy arrays (about 12 bytes per
sequence), writes everything under temporary names and renames them when complete, `.idx` last,
so a crashed run never leaves a final-named `.idx` that does not match its `.bin`.
"""

from __future__ import annotations

import enum
import os
import shutil
import struct
from collections.abc import Iterable

import numpy as np

from pretrain.errors import UserError

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_SIZE = _HEADER.size  # 34
TMP_SUFFIX = ".tmp"


class DType(enum.IntEnum):
    """Megatron's dtype codes for the `.bin` tokens."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise UserError(
                f"dtype {name} cannot be stored in a Megatron .bin (use uint16 or int32)"
            )
        return int(cls[name])

    @classmethod
    def dtype_from_code(cls, code: int) -> np.dtype:
        return np.dtype(cls(code).name)


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's rule: uint16 when the vocabulary has fewer than 65500 entries, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def get_bin_path(prefix: str) -> str:
    """`PREFIX.bin`: the token bytes."""
    return prefix + ".bin"


def get_idx_path(prefix: str) -> str:
    """`PREFIX.idx`: the index (lengths, pointers, document boundaries)."""
    return prefix + ".idx"


def _read_header(idx_path: str) -> tuple[np.dtype, int, int]:
    """Validate the `.idx` header and size; return (dtype, sequence count, document count)."""
    try:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as err:
        raise UserError(
            f"{idx_path}: cannot read index file ({err.strerror}; check the prefix)"
        ) from None
    fix = "the file is not a Megatron index or is damaged; re-run tools/preprocess_data.py"
    if len(raw) < HEADER_SIZE:
        raise UserError(
            f"{idx_path}: truncated index header ({len(raw)} of {HEADER_SIZE} bytes; {fix})"
        )
    magic, version, code, n_seq, n_doc = _HEADER.unpack(raw)
    if magic != _MAGIC:
        raise UserError(f"{idx_path}: bad magic {magic!r}, expected {_MAGIC!r} ({fix})")
    if version != _VERSION:
        raise UserError(f"{idx_path}: index version {version}, only version 1 is supported ({fix})")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise UserError(f"{idx_path}: unknown dtype code {code} ({fix})") from None
    expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
    if size not in (expected, expected + n_seq):  # + n_seq: multimodal mode bytes
        raise UserError(
            f"{idx_path}: index is {size} bytes but its header ({n_seq} sequences, {n_doc} document "
            f"indices) needs {expected} ({fix})"
        )
    return dtype, n_seq, n_doc


class IndexedDataset:
    """Read-only view of `PREFIX.bin` + `PREFIX.idx`; `ds[i]` is sequence i as a numpy array."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
        self.dtype, n_seq, n_doc = _read_header(idx_path)
        self._idx_mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_mmap, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx_mmap, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx_mmap, np.int64, n_doc, offset)
        offset += 8 * n_doc
        has_modes = len(self._idx_mmap) > offset
        self.sequence_modes = (
            np.frombuffer(self._idx_mmap, np.int8, n_seq, offset) if has_modes else None
        )
        self._validate(idx_path, bin_path)
        bin_size = os.path.getsize(bin_path)
        # numpy cannot memory-map an empty file; an empty dataset has an empty .bin
        self._bin = (
            np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_size else np.empty(0, self.dtype)
        )

    def _validate(self, idx_path: str, bin_path: str) -> None:
        fix = "re-run tools/preprocess_data.py to rebuild the pair"
        doc = self.document_indices
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != len(self.sequence_lengths):
            first, last = (int(doc[0]), int(doc[-1])) if len(doc) else (None, None)
            raise UserError(
                f"{idx_path}: document indices must start at 0 and end at the sequence count "
                f"{len(self.sequence_lengths)}, found first={first} last={last} ({fix})"
            )
        if len(doc) > 1 and np.any(doc[1:] < doc[:-1]):
            k = int(np.argmax(doc[1:] < doc[:-1]))
            raise UserError(f"{idx_path}: document indices decrease at position {k + 1} ({fix})")
        if not os.path.exists(bin_path):
            raise UserError(f"{bin_path}: missing; the .idx has no matching .bin ({fix})")
        needed = 0
        if len(self.sequence_lengths):
            needed = (
                int(self.sequence_pointers[-1])
                + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            )
        actual = os.path.getsize(bin_path)
        if actual < needed:
            raise UserError(
                f"{bin_path}: truncated, {actual} bytes but {idx_path} points to {needed} ({fix})"
            )

    @staticmethod
    def exists(prefix: str) -> bool:
        return os.path.exists(get_idx_path(prefix)) and os.path.exists(get_bin_path(prefix))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `idx`, a zero-copy view."""
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise IndexError("IndexedDataset slices must be contiguous (step 1)")
            return [self.get(i) for i in range(start, stop)]
        raise TypeError(f"IndexedDataset indices must be int or slice, not {type(idx).__name__}")


class _GrowingArray:
    """An append-only numpy array with amortised doubling (no Python-list-per-element overhead)."""

    def __init__(self, dtype, initial: Iterable[int] = ()):
        init = np.asarray(list(initial), dtype=dtype)
        self._data = np.empty(max(1024, len(init)), dtype=dtype)
        self._size = len(init)
        self._data[: self._size] = init

    def extend(self, values) -> None:
        values = np.asarray(values, dtype=self._data.dtype)
        end = self._size + len(values)
        if end > len(self._data):
            grown = np.empty(max(end, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size : end] = values
        self._size = end

    def append(self, value: int) -> None:
        self.extend((value,))

    def __len__(self) -> int:
        return self._size

    def view(self) -> np.ndarray:
        return self._data[: self._size]


class IndexedDatasetBuilder:
    """Streaming writer of a `.bin/.idx` pair, byte-for-byte Megatron's.

    Tokens are written to `bin_path + ".tmp"` as they arrive; `finalize(idx_path)` writes the index to
    `idx_path + ".tmp"`, removes any old `.idx`, renames the `.bin`, then the `.idx`. `abort()`
    removes the temporary files.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)
        self._tmp_bin = bin_path + TMP_SUFFIX
        try:
            self._bin = open(self._tmp_bin, "wb", buffering=1 << 20)
        except OSError as err:
            raise UserError(
                f"{bin_path}: cannot write output ({err.strerror}; check the output prefix)"
            ) from None
        self._lengths = _GrowingArray(np.int32)
        self._doc_idx = _GrowingArray(np.int64, [0])

    def _as_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and arr.dtype.kind in "iu":
                info = np.iinfo(self.dtype)
                if arr.min() < info.min or arr.max() > info.max:
                    raise UserError(
                        f"{self.bin_path}: token id {int(arr.max())} does not fit {self.dtype.name} "
                        f"(the dtype must hold the whole vocabulary; use int32)"
                    )
            arr = arr.astype(self.dtype)
        return np.ascontiguousarray(arr).reshape(-1)

    def add_item(self, tokens) -> None:
        """One sequence; does not close the document (call `end_document`)."""
        arr = self._as_tokens(tokens)
        self._bin.write(memoryview(arr))
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens, lengths) -> None:
        """All sequences of one document in a single write; `lengths` has one entry per sequence."""
        arr = self._as_tokens(tokens)
        self._bin.write(memoryview(arr))
        self._lengths.extend(lengths)
        self._doc_idx.append(len(self._lengths))

    def add_document_batch(self, tokens, lengths, sequences_per_document) -> None:
        """Many documents at once (one write): same bytes as `add_document` per document."""
        arr = self._as_tokens(tokens)
        self._bin.write(memoryview(arr))
        start = len(self._lengths)
        self._lengths.extend(lengths)
        self._doc_idx.extend(start + np.cumsum(sequences_per_document, dtype=np.int64))

    def add_index(self, prefix: str) -> None:
        """Append another dataset (Megatron's merge): its index shifted, its `.bin` copied verbatim."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise UserError(
                f"{get_idx_path(prefix)}: dtype {other.dtype.name} differs from the output's "
                f"{self.dtype.name} (merge only datasets built with the same tokenizer)"
            )
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths)
        self._doc_idx.extend(offset + other.document_indices[1:])
        with open(get_bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 * 1024 * 1024)

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def finalize(self, idx_path: str) -> None:
        self._bin.close()
        lengths, doc_idx = self._lengths.view(), self._doc_idx.view()
        tmp_idx = idx_path + TMP_SUFFIX
        try:
            with open(tmp_idx, "wb") as f:
                f.write(
                    _HEADER.pack(
                        _MAGIC,
                        _VERSION,
                        DType.code_from_dtype(self.dtype),
                        len(lengths),
                        len(doc_idx),
                    )
                )
                f.write(memoryview(lengths))
                # pointers in int64 bytes, computed in chunks so finalize needs no S-sized temporary
                start = 0
                chunk = 1 << 22
                for i in range(0, len(lengths), chunk):
                    sizes = lengths[i : i + chunk].astype(np.int64) * self.dtype.itemsize
                    ends = np.cumsum(sizes) + start
                    f.write(memoryview(ends - sizes))
                    start = int(ends[-1])
                f.write(memoryview(doc_idx))
        except OSError as err:
            self.abort()
            if os.path.exists(tmp_idx):
                os.remove(tmp_idx)
            raise UserError(
                f"{idx_path}: cannot write output ({err.strerror}; check the output prefix)"
            ) from None
        if os.path.exists(idx_path):
            os.remove(idx_path)  # an old .idx must not pair with the new .bin, even for a moment
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)

    def abort(self) -> None:
        """Close and delete the temporary files; final names are untouched."""
        self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)
