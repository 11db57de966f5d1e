"""Read a corpus as a stream of small batches of records, each tagged with its file and line.

Accepted inputs (several may be given; they are read in the order given):
- JSON lines: `.jsonl`/`.json`, optionally compressed as `.gz` or `.zst`. Lines are passed on as raw
  bytes: the workers parse them, so the reading process stays cheap.
- `.parquet` files (read by row groups with pyarrow).
- A Hugging Face dataset folder written by `Dataset.save_to_disk` (read with `datasets`).
- A directory (every supported file below it, in sorted path order) or a glob pattern (sorted).
"""

from __future__ import annotations

import glob
import gzip
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

import zstandard

from pretrain.data.files.indexed_dataset import get_bin_path, get_idx_path
from pretrain.data.files.token_stats import FILE_NAME as TOKEN_STATS_FILE
from pretrain.errors import UserError

JSON_SUFFIXES = (".jsonl", ".json")
COMPRESSED_SUFFIXES = (".gz", ".zst")
SUPPORTED = (
    ".jsonl, .json (optionally .gz/.zst), .parquet, a save_to_disk folder, a directory or a glob"
)


@dataclass
class RecordBatch:
    """Consecutive records of one source. `lines` are 1-based line (or row) numbers.

    `raw` holds undecoded JSON lines (bytes) for JSON sources; `rows` holds dicts for columnar ones.
    """

    source: str
    lines: list[int]
    raw: list[bytes] | None = None
    rows: list[dict] | None = None

    @property
    def nbytes(self) -> int:
        if self.raw is not None:
            return sum(len(r) for r in self.raw)
        return sum(len(v) if isinstance(v, str) else 0 for row in self.rows for v in row.values())


def _is_hf_dataset_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(
        os.path.join(path, "dataset_info.json")
    )


def _is_supported_file(path: str) -> bool:
    name = path.lower()
    for comp in ("",) + COMPRESSED_SUFFIXES:
        if any(name.endswith(s + comp) for s in JSON_SUFFIXES):
            return True
    return name.endswith(".parquet")


def _is_pipeline_file(path: str) -> bool:
    """A `.json` our data tools write, never a corpus: a dataset's fingerprint sidecar
    (`PREFIX.json` beside `PREFIX.bin`/`.idx`, of this run or another) or a cache folder's
    `TokenStats.json`."""
    if not path.endswith(".json"):
        return False
    prefix = path[: -len(".json")]
    return (
        os.path.basename(path) == TOKEN_STATS_FILE
        or os.path.exists(get_idx_path(prefix))
        or os.path.exists(get_bin_path(prefix))
    )


def _found(path: str, own: tuple[str, ...]) -> bool:
    """Whether a folder or glob input reads `path`: a corpus file, not this run's output, not a
    file of the data pipeline."""
    return _is_supported_file(path) and not _is_own(path, own) and not _is_pipeline_file(path)


def _is_own(path: str, own: tuple[str, ...]) -> bool:
    """Whether `path` is one of `own` (absolute paths) or a temporary of one (`OWN.*.tmp`)."""
    real = os.path.realpath(path)
    return any(real == o or (real.startswith(o + ".") and real.endswith(".tmp")) for o in own)


def expand_inputs(inputs: list[str], own: tuple[str, ...] = ()) -> list[str]:
    """Files and dataset folders to read, in order; a clear error for anything unusable.

    `own` are the run's output files (real paths): naming one is an error, and a directory or
    glob never yields one (the run would read, then replace, its own output)."""
    out: list[str] = []
    for item in inputs:
        if own and _is_own(item, own):
            raise UserError(
                f"--input {item}: is one of this run's outputs (or their sidecar or temporaries), "
                "which the run replaces; choose another --output-prefix"
            )
        if os.path.isdir(item):
            if os.path.isfile(os.path.join(item, "dataset_dict.json")):
                splits = sorted(d for d in os.listdir(item) if os.path.isdir(os.path.join(item, d)))
                raise UserError(
                    f"{item}: a DatasetDict with splits {splits} (pass one split folder, e.g. {os.path.join(item, splits[0] if splits else 'train')})"
                )
            if _is_hf_dataset_dir(item):
                out.append(item)
                continue
            found = sorted(
                os.path.join(root, f)
                for root, _, files in os.walk(item)
                for f in files
                if _found(os.path.join(root, f), own)
            )
            if not found:
                raise UserError(f"--input {item}: directory holds no supported files ({SUPPORTED})")
            out.extend(found)
        elif os.path.isfile(item):
            if not _is_supported_file(item):
                raise UserError(f"--input {item}: unsupported file type (use {SUPPORTED})")
            out.append(item)
        elif glob.has_magic(item):
            found = sorted(
                p for p in glob.glob(item, recursive=True) if os.path.isfile(p) and _found(p, own)
            )
            if not found:
                raise UserError(
                    f"--input {item}: the pattern matches no supported files ({SUPPORTED})"
                )
            out.extend(found)
        else:
            raise UserError(f"--input {item}: no such file or directory")
    return out


class _ZstdReader(io.RawIOBase):
    """Decompress a (multi-frame) .zst file; a truncated last frame is an error, not a silent EOF
    (zstandard's stream_reader just stops there)."""

    def __init__(self, path: str):
        self._file = open(path, "rb")
        self._chunks = self._decompressed()
        self._buf, self._pos = memoryview(b""), 0

    def _decompressed(self):
        dctx = zstandard.ZstdDecompressor()
        frame, fed = dctx.decompressobj(), False
        while chunk := self._file.read(1 << 20):
            while chunk:
                fed = True
                yield frame.decompress(chunk)
                chunk = b""
                if frame.eof:  # the frame ended inside this chunk: the rest starts the next frame
                    chunk = frame.unused_data
                    frame, fed = dctx.decompressobj(), False
        if fed and not frame.eof:
            raise EOFError("the zstd stream ends inside a frame")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._buf):
            try:
                self._buf, self._pos = memoryview(next(self._chunks)), 0
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_binary(path: str):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    if path.lower().endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path), buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


def _json_batches(path: str, batch_bytes: int, max_records: int) -> Iterator[RecordBatch]:
    lines: list[int] = []
    raw: list[bytes] = []
    size = 0
    try:
        with _open_binary(path) as f:
            for number, line in enumerate(f, start=1):
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]  # a UTF-8 byte-order mark is not part of the first record
                if not line.strip():
                    continue  # blank lines (e.g. a trailing one) hold no record
                lines.append(number)
                raw.append(line)
                size += len(line)
                if size >= batch_bytes or len(raw) >= max_records:
                    yield RecordBatch(path, lines, raw=raw)
                    lines, raw, size = [], [], 0
    except (OSError, EOFError, zstandard.ZstdError) as err:  # unreadable file, bad gzip/zstd stream
        raise UserError(
            f"{path}: cannot read ({err}; check the file is complete and not corrupt)"
        ) from None
    if raw:
        yield RecordBatch(path, lines, raw=raw)


def _check_columns(path: str, columns, keys: list[str]) -> None:
    missing = [k for k in keys if k not in columns]
    if missing:
        raise UserError(
            f"{path}: no column {', '.join(map(repr, missing))} (columns are {list(columns)}; choose --json-keys)"
        )


def _rows_to_batch(path: str, columns: dict[str, list], first_row: int) -> RecordBatch:
    keys = list(columns)
    n = len(columns[keys[0]]) if keys else 0
    rows = [{k: columns[k][i] for k in keys} for i in range(n)]
    return RecordBatch(path, list(range(first_row, first_row + n)), rows=rows)


def _parquet_batches(path: str, keys: list[str], max_records: int) -> Iterator[RecordBatch]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:
        raise UserError(f"{path}: not a readable parquet file ({err})") from None
    _check_columns(path, pf.schema_arrow.names, keys)
    row = 1
    for batch in pf.iter_batches(batch_size=max_records, columns=keys):
        yield _rows_to_batch(path, batch.to_pydict(), row)
        row += batch.num_rows


def _hf_batches(path: str, keys: list[str], max_records: int) -> Iterator[RecordBatch]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as err:
        raise UserError(f"{path}: not a dataset saved with save_to_disk ({err})") from None
    _check_columns(path, ds.column_names, keys)
    row = 1
    for batch in ds.select_columns(keys).iter(batch_size=max_records):
        out = _rows_to_batch(path, batch, row)
        row += len(out.lines)
        yield out


def iter_record_batches(
    sources: list[str], keys: list[str], batch_bytes: int = 1 << 20, max_records: int = 1024
) -> Iterator[RecordBatch]:
    """Batches of about `batch_bytes` (or `max_records` records), in input order."""
    for path in sources:
        if os.path.isdir(path):
            yield from _hf_batches(path, keys, max_records)
        elif path.lower().endswith(".parquet"):
            yield from _parquet_batches(path, keys, max_records)
        else:
            yield from _json_batches(path, batch_bytes, max_records)


def total_input_bytes(sources: list[str]) -> int | None:
    """Size of uncompressed JSON inputs (for a progress total); None when it cannot be known cheaply."""
    total = 0
    for path in sources:
        if os.path.isdir(path) or not path.lower().endswith(JSON_SUFFIXES):
            return None
        total += os.path.getsize(path)
    return total
