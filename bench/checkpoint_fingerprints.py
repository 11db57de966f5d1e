"""What a checkpoint file's fingerprint costs (pretrain/checkpoint/fingerprints.py).

    .venv/bin/python bench/checkpoint_fingerprints.py [--gib 4] [--files 64] [--file-mib 64]

Two cases, in a temporary folder (`--dir`, default the system's), files of random bytes written
and fsynced, then dropped from the page cache (posix_fadvise DONTNEED on those files only) before
each cold read:

- one big file of `--gib` GiB: the time to write and fsync it, to fingerprint it cold and from the
  page cache, and to digest it whole cold (the alternative: a BLAKE2b over every byte);
- `--files` files of `--file-mib` MiB (a step of many rank files): `fingerprints.record` over all
  of them, as the commit does, cold and from the page cache.

`ratio` = the big file's cold fingerprint time / its write-and-fsync time. The last line printed
is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time

from pretrain.checkpoint.fingerprints import fingerprint, record

MIB = 2**20


def _write(path: str, mib: int, chunk: bytes) -> float:
    """Write `mib` MiB (a unique head, then `chunk` repeated), fsync; the seconds it took."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(os.urandom(64))
        for _ in range(mib * MIB // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _full_digest(path: str) -> None:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(16 * MIB):
            digest.update(block)


def big_file(folder: str, gib: int, chunk: bytes) -> dict:
    path = os.path.join(folder, "big.bin")
    write = _write(path, gib * 1024, chunk)
    _evict(path)
    cold = _timed(fingerprint, path)
    hot = _timed(fingerprint, path)
    _evict(path)
    full = _timed(_full_digest, path)
    os.remove(path)
    return {
        "gib": gib,
        "write_fsync_s": round(write, 3),
        "fingerprint_cold_s": round(cold, 4),
        "fingerprint_hot_s": round(hot, 4),
        "full_digest_cold_s": round(full, 3),
    }


def many_files(folder: str, files: int, mib: int, chunk: bytes) -> dict:
    names = [f"rank_{i:04d}.pt" for i in range(files)]
    for name in names:
        _write(os.path.join(folder, name), mib, chunk)
        _evict(os.path.join(folder, name))
    cold = _timed(record, folder, names)
    hot = _timed(record, folder, names)
    for name in names:
        os.remove(os.path.join(folder, name))
    return {
        "files": files,
        "mib_each": mib,
        "record_cold_s": round(cold, 3),
        "record_hot_s": round(hot, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=int, default=4)
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--file-mib", type=int, default=64)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    chunk = os.urandom(64 * MIB)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        big = big_file(folder, args.gib, chunk)
        many = many_files(folder, args.files, args.file_mib, chunk)
    ratio = big["fingerprint_cold_s"] / big["write_fsync_s"]
    print(json.dumps({"big_file": big, "many_files": many, "ratio": round(ratio, 6)}))


if __name__ == "__main__":
    main()
