"""The largest token id of data without a sidecar, scanned once and kept in one file per folder.

Megatron-made data has no `PREFIX.json` saying its largest token id, so the check that the data
fits the vocabulary scans the `.bin` once. The results of every prefix go into one file,
`{dir}/TokenStats.json` (dir: --data-cache-path, else the first such prefix's Megatron cache
folder), keyed by the prefix's absolute path and bound to its `.idx` fingerprint and `.bin` size:
a rank reads one file at start-up, not one per prefix. The first process that misses entries
scans under the file's lock and merges its results in; the others wait and read them. One line
says what was scanned.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
from filelock import FileLock

from pretrain.atomic import atomic_write_bytes
from pretrain.data.files.indexed_dataset import IndexedDataset, get_bin_path
from pretrain.data.files.notices import Notices
from pretrain.errors import UserError

log = logging.getLogger(__name__)

FORMAT = "pretrain-token-stats/2"
FILE_NAME = "TokenStats.json"
_CHUNK_TOKENS = 1 << 24  # streaming pass: 16 M tokens per read


def stats_path(cache_dir: str | None, prefix: str) -> str:
    """Where the largest token ids of `prefix` (and its blend) are kept."""
    directory = cache_dir or os.path.join(prefix, "cache", "GPTDataset_indices")
    return os.path.join(directory, FILE_NAME)


def scan_max_token(ds: IndexedDataset) -> int:
    """Largest token id in the dataset's .bin (its validated bytes), in one streaming pass of
    reads, no mapping kept (-1 when empty)."""
    largest, left, path = -1, ds.bin_bytes // ds.dtype.itemsize, get_bin_path(ds.prefix)
    with open(path, "rb") as f:
        while left > 0:
            chunk = np.fromfile(f, ds.dtype, min(left, _CHUNK_TOKENS))
            if not len(chunk):
                raise UserError(f"{path}: shrank while being read (re-run preprocess_data.py)")
            largest, left = max(largest, int(chunk.max())), left - len(chunk)
    return largest


def _key(ds: IndexedDataset) -> list:
    return [ds.fingerprint, ds.bin_bytes]


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    entries = data.get("prefixes")
    return entries if isinstance(entries, dict) else {}


def _known(entries: dict, datasets: dict[str, IndexedDataset]) -> dict[str, int]:
    """{prefix: largest id} of the entries that still describe their files."""
    out = {}
    for prefix, ds in datasets.items():
        entry = entries.get(os.path.abspath(prefix))
        if isinstance(entry, dict) and entry.get("key") == _key(ds):
            value = entry.get("max_token_id")
            if isinstance(value, int):
                out[prefix] = value
    return out


def _size(n: int) -> str:
    """Bytes for people: 812 B, 3.4 kB, 1.2 MB, 7.9 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _scan(datasets: dict[str, IndexedDataset], path: str, cached: bool) -> dict[str, int]:
    """Scan every dataset; one line says how many, the biggest named."""
    start, notices, out = time.perf_counter(), Notices(), {}
    for prefix, ds in datasets.items():
        out[prefix] = scan_max_token(ds)
        notices.add(prefix, _size(ds.bin_bytes), ds.bin_bytes)
    where = f"kept in {path}" if cached else f"not kept: {path} cannot be written"
    notices.log(
        log,
        logging.INFO,
        f"largest token ids: scanned {len(datasets):,} .bin files without a fingerprint "
        f"(PREFIX.json) in {time.perf_counter() - start:.1f} s, {where}",
    )
    return out


def largest_token_ids(datasets: dict[str, IndexedDataset], path: str) -> dict[str, int]:
    """{prefix: largest token id} of `datasets` (opened, without sidecars) from the stats file at
    `path`, scanning (under its lock) what it does not hold yet."""
    known = _known(_read(path), datasets)
    missing = {p: ds for p, ds in datasets.items() if p not in known}
    if not missing:
        return known
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = FileLock(f"{path}.lock")
        lock.acquire()
    except OSError as err:  # a read-only folder: the check still works, just uncached
        log.warning("could not keep the token scans in %s (%s)", path, err.strerror)
        return {**known, **_scan(missing, path, cached=False)}
    try:
        entries = _read(path)
        known.update(_known(entries, missing))
        missing = {p: ds for p, ds in missing.items() if p not in known}
        if missing:
            scanned = _scan(missing, path, cached=True)
            for prefix, value in scanned.items():
                entries[os.path.abspath(prefix)] = {
                    "key": _key(missing[prefix]),
                    "max_token_id": value,
                }
            # compact: json's C encoder (an indent runs the pure-Python one, slow for thousands)
            data = json.dumps({"format": FORMAT, "prefixes": entries}, separators=(",", ":"))
            try:
                atomic_write_bytes(path, data.encode("utf-8"))
            except OSError as err:  # a full disk: the check still works, just uncached
                log.warning("could not keep the token scans in %s (%s)", path, err.strerror)
            known.update(scanned)
        return known
    finally:
        lock.release()
