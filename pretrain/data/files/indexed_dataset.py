"""Megatron's mmap dataset format: a `PREFIX.bin` of token ids and a `PREFIX.idx` index.

Byte layout (all little-endian, no padding; docs/DATA_FORMAT.md §1):

    magic b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence count S |
    <Q document_indices length D | int32[S] lengths | int64[S] byte pointers | int64[D] doc indices
    [| int8[S] modes, multimodal only]

The reader memory-maps both files, checks the whole index against the `.bin` when it opens them
(vectorised, O(sequences)), and hands out zero-copy numpy views. The builder streams tokens to the
`.bin` as they arrive and keeps the index in growing numpy arrays (about 12 bytes per sequence),
writes everything under unique temporary names and renames them when complete, `.idx` last, so a
crashed run never leaves a final-named `.idx` that does not match its `.bin`.
"""

from __future__ import annotations

import enum
import errno
import glob
import mmap
import os
import resource
import socket
import struct
import uuid
from collections.abc import Iterable

import numpy as np
import xxhash

from pretrain.errors import UserError

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_SIZE = _HEADER.size  # 34
TMP_SUFFIX = ".tmp"
# errors that mean "the disk (or the file-size limit) cannot hold the output", not a bug
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_CHUNK = 1 << 22  # sequences per step of the O(S) passes, so no S-sized temporary is needed
_READ_INDEX_BELOW = 1 << 20  # bytes: a smaller .idx is read, a larger one memory-mapped


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
    """`PREFIX.bin`, the tokens."""
    return prefix + ".bin"


def get_idx_path(prefix: str) -> str:
    """`PREFIX.idx`, the index."""
    return prefix + ".idx"


def _read_header(idx_path: str, raw: bytes, size: int) -> tuple[np.dtype, int, int]:
    """Validate the `.idx` header (its first bytes `raw`) against the file's `size`; return
    (dtype, sequence count, document count)."""
    raw = raw[:HEADER_SIZE]
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


def read_index_header(idx_path: str) -> tuple[np.dtype, int, int]:
    """(dtype, sequence count, document count) from the validated `.idx` header alone."""
    try:
        with open(idx_path, "rb") as f:
            return _read_header(idx_path, f.read(HEADER_SIZE), os.fstat(f.fileno()).st_size)
    except OSError as err:
        raise UserError(
            f"{idx_path}: cannot read index file ({err.strerror}; check the prefix)"
        ) from None


def _read_index(idx_path: str) -> tuple[np.dtype, int, int, float, object]:
    """(dtype, sequence count, document count, mtime, the whole file as a buffer) with one open:
    a small `.idx` is read into memory (no mapping per prefix: blends of thousands of prefixes
    stay far from the kernel's limit on mappings), a large one memory-mapped."""
    try:
        with open(idx_path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            if st.st_size <= _READ_INDEX_BELOW:
                buffer = f.readall()
            else:
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            dtype, n_seq, n_doc = _read_header(idx_path, buffer[:HEADER_SIZE], st.st_size)
    except OSError as err:
        raise UserError(
            f"{idx_path}: cannot read index file ({err.strerror}; check the prefix)"
        ) from None
    return dtype, n_seq, n_doc, st.st_mtime, buffer


def _check_document_indices(idx_path: str, doc: np.ndarray, n_seq: int, fix: str) -> None:
    if len(doc) == 0 or doc[0] != 0 or doc[-1] != n_seq:
        first, last = (int(doc[0]), int(doc[-1])) if len(doc) else (None, None)
        raise UserError(
            f"{idx_path}: document indices must start at 0 and end at the sequence count "
            f"{n_seq}, found first={first} last={last} ({fix})"
        )
    for i in range(0, len(doc) - 1, _CHUNK):
        part = doc[i : i + _CHUNK + 1]
        decreasing = part[1:] < part[:-1]
        if decreasing.any():  # where, only then: thousands of small prefixes open at start-up
            bad = np.flatnonzero(decreasing)
            raise UserError(
                f"{idx_path}: document indices decrease at position {i + int(bad[0]) + 1} ({fix})"
            )


def _check_lengths_and_pointers(
    idx_path: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int, fix: str
) -> int:
    """Validate lengths and pointers chunk by chunk; return the bytes the `.bin` must hold."""
    end = 0  # byte offset where the next sequence must start
    for i in range(0, len(lengths), _CHUNK):
        part = lengths[i : i + _CHUNK]
        if part.min() < 0:
            k = i + int(np.flatnonzero(part < 0)[0])
            raise UserError(
                f"{idx_path}: sequence {k} has negative length {int(lengths[k])} ({fix})"
            )
        sizes = part.astype(np.int64) * itemsize
        ends = np.cumsum(sizes) + end
        mismatch = pointers[i : i + _CHUNK] != ends - sizes
        if mismatch.any():
            k = i + int(np.flatnonzero(mismatch)[0])
            raise UserError(
                f"{idx_path}: sequence {k} points to byte {int(pointers[k])}, but the lengths before "
                f"it put it at byte {int(ends[k - i] - sizes[k - i])} (a damaged length or pointer; "
                f"{fix})"
            )
        end = int(ends[-1])
    return end


def _open_file_limit_raised() -> bool:
    """Raise this process's soft limit on open files to its hard limit; False if it was there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return False
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return True


def _map_once(path: str, size: int) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)


def _map(path: str, size: int) -> mmap.mmap:
    """The first `size` bytes of `path`, mapped read-only. A mapping keeps a file descriptor; a
    blend of more prefixes than the soft open-file limit raises it (to the hard limit) once."""
    try:
        return _map_once(path, size)
    except OSError as err:
        failure = err
    if failure.errno == errno.EMFILE and _open_file_limit_raised():
        try:
            return _map_once(path, size)
        except OSError as err:
            failure = err
    if failure.errno == errno.EMFILE:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise UserError(
            f"{path}: cannot map it: too many open files (limit {limit}); each prefix a blend "
            "reads keeps its .bin mapped: raise `ulimit -n` above the number of prefixes"
        )
    raise UserError(f"{path}: cannot map it ({failure.strerror})")


class IndexedDataset:
    """Read-only view of `PREFIX.bin` + `PREFIX.idx`; `ds[i]` is sequence i as a numpy array."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
        self.dtype, n_seq, n_doc, self.idx_modified, buffer = _read_index(idx_path)
        # a small .idx was read: its arrays are copied out aligned (the 34-byte header leaves
        # them unaligned, which makes every numpy reduction over them take a slow path)
        own = (lambda a: a.copy()) if isinstance(buffer, bytes) else (lambda a: a)
        offset = HEADER_SIZE
        self.sequence_lengths = own(np.frombuffer(buffer, np.int32, n_seq, offset))
        offset += 4 * n_seq
        self.sequence_pointers = own(np.frombuffer(buffer, np.int64, n_seq, offset))
        offset += 8 * n_seq
        self.document_indices = own(np.frombuffer(buffer, np.int64, n_doc, offset))
        offset += 8 * n_doc
        has_modes = len(buffer) > offset
        modes = np.frombuffer(buffer, np.int8, n_seq, offset) if has_modes else None
        self.sequence_modes = None if modes is None else own(modes)
        self._fingerprint: str | None = None
        self._tokens: np.ndarray | None = None  # the .bin, mapped on first use
        self._validate(idx_path, bin_path)

    def _validate(self, idx_path: str, bin_path: str) -> None:
        """Check the whole index and the `.bin` size; a `UserError` names the file and the problem.

        One vectorised pass over the index in chunks: lengths >= 0, pointers equal to the exclusive
        cumulative sum of lengths x itemsize, document indices from 0 increasing to the sequence
        count, and the `.bin` exactly as long as the index says (a longer `.bin` would make a merge
        shift every later dataset).
        """
        fix = "re-run tools/preprocess_data.py to rebuild the pair"
        _check_document_indices(idx_path, self.document_indices, len(self.sequence_lengths), fix)
        needed = _check_lengths_and_pointers(
            idx_path, self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize, fix
        )
        try:
            actual = os.stat(bin_path).st_size
        except FileNotFoundError:
            raise UserError(f"{bin_path}: missing; the .idx has no matching .bin ({fix})") from None
        if actual < needed:
            raise UserError(
                f"{bin_path}: truncated, {actual} bytes but {idx_path} points to {needed} ({fix})"
            )
        if actual > needed:
            raise UserError(
                f"{bin_path}: {actual} bytes but {idx_path} describes exactly {needed}; "
                f"{actual - needed} bytes at the end belong to no sequence ({fix})"
            )
        self.bin_bytes = needed

    @property
    def fingerprint(self) -> str:
        """A digest of what the index caches depend on: dtype, sequence lengths, document indices.

        The pointers follow from the lengths (validated at open), so this binds a cache to the
        content of the `.idx` it was built from. xxh3 hashes at memory speed (GB/s), once per
        dataset and process.
        """
        if self._fingerprint is None:
            h = xxhash.xxh3_128()
            h.update(f"{self.dtype.name}:{len(self)}:{len(self.document_indices)}:".encode())
            for arr in (self.sequence_lengths, self.document_indices):
                for i in range(0, len(arr), _CHUNK):
                    h.update(memoryview(np.ascontiguousarray(arr[i : i + _CHUNK])))
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the `.bin`, exactly the validated bytes, memory-mapped on first use (a
        blend opens the `.bin` of a prefix only when a sample reads it)."""
        if self._tokens is None:
            if self.bin_bytes == 0:  # an empty file cannot be mapped
                self._tokens = np.empty(0, self.dtype)
            else:
                self._tokens = np.frombuffer(
                    _map(get_bin_path(self.prefix), self.bin_bytes), self.dtype
                )
        return self._tokens

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
        return self.tokens[start : start + length]

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


def temporary_name(path: str) -> str:
    """A name beside `path` that no other run (process, node) uses: `PATH.HOST.PID.RANDOM.tmp`."""
    return f"{path}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"


def _owner_alive(stray: str, path: str) -> bool:
    """Whether the run that named `stray` (`PATH.HOST.PID.RANDOM.tmp`) may still be writing it:
    a live pid on this host, or any other host (its processes cannot be seen from here)."""
    parts = stray[len(path) + 1 : -len(TMP_SUFFIX)].rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return False  # no owner recorded in the name
    host, pid = parts[0], int(parts[1])
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def remove_stray_temporaries(path: str) -> tuple[list[str], list[str]]:
    """Delete the temporaries a killed run left for `path` (call only while holding its lock);
    return (removed, kept): a temporary whose owner (host, pid) may be alive is kept."""
    removed, kept = [], []
    for stray in glob.glob(glob.escape(path) + ".*" + TMP_SUFFIX) + glob.glob(
        glob.escape(path) + TMP_SUFFIX
    ):
        if _owner_alive(stray, path):
            kept.append(stray)
            continue
        try:
            os.remove(stray)
            removed.append(stray)
        except FileNotFoundError:
            pass
    return removed, kept


def no_space_error(path: str, err: OSError, needed: int) -> UserError | None:
    """A one-line `UserError` for a full disk or file-size limit while writing `path`, else None."""
    if err.errno not in _NO_SPACE:
        return None
    return UserError(
        f"{path}: cannot write, {err.strerror.lower()} ({needed:,} bytes needed; free disk space, "
        "raise the file-size limit (ulimit -f) or write elsewhere)"
    )


class IndexedDatasetBuilder:
    """Streaming writer of a `.bin/.idx` pair, byte-for-byte Megatron's.

    Tokens are written to a unique temporary beside `bin_path` as they arrive; `prepare(idx_path)`
    writes the index to its own temporary, `commit()` removes any old `.idx`, renames the `.bin`,
    then the `.idx` (`finalize` does both). Several builders (one per JSON key) prepare first and
    commit together, so a full disk while writing any index leaves every old output intact.
    `abort()` removes the temporary files. A full disk or file-size limit is a one-line `UserError`
    naming the path and the bytes needed.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)
        self._tmp_bin = temporary_name(bin_path)
        self._tmp_idx: str | None = None
        self._idx_path: str | None = None
        self._bin_bytes = 0
        try:
            self._bin = open(self._tmp_bin, "wb", buffering=1 << 20)
        except OSError as err:
            raise UserError(
                f"{bin_path}: cannot write output ({err.strerror}; check the output prefix)"
            ) from None
        self._lengths = _GrowingArray(np.int32)
        self._doc_idx = _GrowingArray(np.int64, [0])

    def _write_bin(self, data) -> None:
        data = memoryview(data).cast("B")
        try:
            self._bin.write(data)
        except OSError as err:
            self._raise_write_error(err, self._bin_bytes + data.nbytes)
        self._bin_bytes += data.nbytes

    def _raise_write_error(self, err: OSError, needed: int) -> None:
        self.abort()
        raise no_space_error(self.bin_path, err, needed) or err

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
        self._write_bin(arr)
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens, lengths) -> None:
        """All sequences of one document in a single write; `lengths` has one entry per sequence."""
        arr = self._as_tokens(tokens)
        self._write_bin(arr)
        self._lengths.extend(lengths)
        self._doc_idx.append(len(self._lengths))

    def add_document_batch(self, tokens, lengths, sequences_per_document) -> None:
        """Many documents at once (one write): same bytes as `add_document` per document."""
        arr = self._as_tokens(tokens)
        self._write_bin(arr)
        start = len(self._lengths)
        self._lengths.extend(lengths)
        self._doc_idx.extend(start + np.cumsum(sequences_per_document, dtype=np.int64))

    def add_index(self, source: str | IndexedDataset) -> None:
        """Append another dataset (Megatron's merge): its index shifted, its `.bin` copied verbatim.

        `source` is a prefix or an already opened (so validated) `IndexedDataset`.
        """
        other = source if isinstance(source, IndexedDataset) else IndexedDataset(source)
        prefix = other.prefix
        if other.dtype != self.dtype:
            raise UserError(
                f"{get_idx_path(prefix)}: dtype {other.dtype.name} differs from the output's "
                f"{self.dtype.name} (merge only datasets built with the same tokenizer)"
            )
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths)
        self._doc_idx.extend(offset + other.document_indices[1:])
        # exactly the validated bytes, never "to the end of the file": a .bin that grew since it
        # was opened must not shift the datasets after it
        step = 16 * 1024 * 1024 // other.dtype.itemsize
        tokens = other.tokens
        for i in range(0, len(tokens), step):
            self._write_bin(np.ascontiguousarray(tokens[i : i + step]))

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def prepare(self, idx_path: str) -> None:
        """Close the `.bin` and write the index to a temporary beside `idx_path`."""
        try:
            self._bin.close()
        except OSError as err:  # the buffered tail of the .bin did not fit
            self._raise_write_error(err, self._bin_bytes)
        lengths, doc_idx = self._lengths.view(), self._doc_idx.view()
        self._idx_path, self._tmp_idx = idx_path, temporary_name(idx_path)
        needed = HEADER_SIZE + 12 * len(lengths) + 8 * len(doc_idx)
        try:
            with open(self._tmp_idx, "wb") as f:
                code = DType.code_from_dtype(self.dtype)
                f.write(_HEADER.pack(_MAGIC, _VERSION, code, len(lengths), len(doc_idx)))
                f.write(memoryview(lengths))
                # pointers in int64 bytes, computed in chunks so there is no S-sized temporary
                start = 0
                for i in range(0, len(lengths), _CHUNK):
                    sizes = lengths[i : i + _CHUNK].astype(np.int64) * self.dtype.itemsize
                    ends = np.cumsum(sizes) + start
                    f.write(memoryview(ends - sizes))
                    start = int(ends[-1])
                f.write(memoryview(doc_idx))
        except OSError as err:
            self.abort()
            raise no_space_error(idx_path, err, needed) or UserError(
                f"{idx_path}: cannot write output ({err.strerror}; check the output prefix)"
            ) from None

    def commit(self) -> None:
        """Rename the prepared files into place, `.idx` last."""
        if os.path.exists(self._idx_path):
            os.remove(self._idx_path)  # an old .idx must not pair with the new .bin, even briefly
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self._idx_path)

    def finalize(self, idx_path: str) -> None:
        """`prepare` then `commit`: the pair appears under its final names."""
        self.prepare(idx_path)
        self.commit()

    def abort(self) -> None:
        """Close and delete the temporary files; final names are untouched."""
        try:
            self._bin.close()
        except OSError:
            pass  # flushing the buffered tail failed: the file is deleted anyway
        for tmp in (self._tmp_bin, self._tmp_idx):
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
