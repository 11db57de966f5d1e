"""Index cache: Megatron's file names, bound to the `.idx` it came from, written atomically under a
file lock, validated on load.

Files: `{dir}/{md5}-{Class}-{split}-description.txt` plus one `{md5}-{Class}-{split}-{name}.npy` per
array (NPY v1, loaded with mmap), and our `{md5}-{Class}-{split}-idx_fingerprint.txt`. How we differ
from Megatron, and why:

- Every file is written under a temporary name and renamed, and the description is renamed *last*:
  a reader that finds the expected description finds complete arrays (Megatron writes in place).
- A cache is used only if its description equals ours, its fingerprint file equals the fingerprint
  of the `.idx` we read (Megatron's description names the prefix, not its content, so a prefix
  re-preprocessed from another corpus would reuse indices into the old one), its arrays have the
  expected dtypes and shapes, and their values pass the caller's bounds check (a `.npy` with a valid
  header and garbage values). Anything else is rebuilt, not trusted. A cache without a fingerprint
  file (written by Megatron-LM) is used only if it is newer than the `.idx`, and then adopted (its
  fingerprint recorded).
- There is no "rank 0 builds, the others wait at a barrier": every process that needs the dataset
  calls `load_or_build`. The first one to take the lock builds, the others wait for the lock and
  then load the finished files. On a cache directory that is not shared between nodes, the first
  process of each node builds its own copy (Megatron issue #907). If the lock does not work across
  nodes (some network filesystems), two nodes may build the same arrays at once; the renames are
  atomic and the contents identical, so the result is still correct.
- The builder, holding the lock, deletes the hidden temporaries a killed builder on this host left
  for the same cache (and those of other hosts older than a day).
- A full disk or file-size limit while writing is a one-line `UserError` naming the file and the
  bytes the cache needs.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from filelock import FileLock, Timeout

from pretrain.atomic import atomic_write, atomic_write_bytes
from pretrain.data.indexed_dataset import no_space_error
from pretrain.errors import UserError

log = logging.getLogger(__name__)

# expected (dtype, shape) per array name
Expectation = dict[str, tuple[np.dtype, tuple[int, ...]]]
# arrays -> None when their values are usable, else what is wrong
ValueCheck = Callable[[dict[str, np.ndarray]], str | None]
FINGERPRINT = "idx_fingerprint.txt"
_STALE_OTHER_HOST_S = 24 * 3600


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True, kw_only=True)
class Source:
    """What a cache is computed from: the `.idx` it indexes."""

    fingerprint: str
    """`IndexedDataset.fingerprint` of the `.idx`; stored beside the cache, compared on load."""
    modified: float
    """The `.idx`'s mtime: a cache without a fingerprint (Megatron's) must be newer."""


def _source_problem(base: str, source: Source) -> tuple[str | None, bool]:
    """(why the cache does not belong to `source` or None, whether to record its fingerprint)."""
    stored = _read_text(f"{base}-{FINGERPRINT}")
    if stored is not None:
        ok = stored == source.fingerprint
        return (None if ok else "the cache was built from another version of the .idx"), False
    # No fingerprint: written by Megatron-LM (or before fingerprints). Usable only if it was
    # built after the .idx last changed; then it is adopted (its fingerprint recorded).
    try:
        built = os.path.getmtime(f"{base}-description.txt")
    except OSError:
        return "no description", False
    if built < source.modified:
        return "the cache has no fingerprint and is older than the .idx", False
    return None, True


def _try_load(
    base: str,
    description: str,
    expect: Expectation,
    source: Source | None,
    check: ValueCheck | None,
) -> tuple[dict[str, np.ndarray] | None, str]:
    """(the cached arrays, "") if the cache is complete and matches, else (None, why not)."""
    if _read_text(f"{base}-description.txt") != description:
        return None, "no cache with this description"
    problem, adopt = _source_problem(base, source) if source is not None else (None, False)
    if problem is not None:
        return None, problem
    arrays = {}
    for name, (dtype, shape) in expect.items():
        try:
            arr = np.load(f"{base}-{name}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None, f"{name}.npy is unreadable"
        if arr.dtype != dtype or arr.shape != shape:
            return None, f"{name}.npy is {arr.dtype}{arr.shape}, expected {dtype}{shape}"
        arrays[name] = arr
    problem = check(arrays) if check is not None else None
    if problem is not None:
        return None, f"its values are damaged: {problem}"
    if adopt:
        try:
            atomic_write_bytes(f"{base}-{FINGERPRINT}", source.fingerprint.encode("utf-8"))
        except OSError:
            pass  # a read-only cache directory: checked by mtime again next time
    return arrays, ""


def _remove_stray_temporaries(directory: str, base_name: str) -> None:
    """Hidden temporaries `.{base_name}-*.{host}.*` of killed builders (we hold the lock)."""
    host, now = socket.gethostname(), time.time()
    for path in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(base_name)}-*")):
        try:
            mine = f".{host}." in os.path.basename(path)
            if mine or now - os.path.getmtime(path) > _STALE_OTHER_HOST_S:
                os.remove(path)
                log.info("removed %s (left by an interrupted cache build)", path)
        except FileNotFoundError:
            pass


def _lock(directory: str, base: str) -> FileLock:
    try:
        os.makedirs(directory, exist_ok=True)
        lock = FileLock(f"{base}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info("waiting for another process to finish building %s", base)
            lock.acquire()
    except OSError as err:
        raise UserError(
            f"cannot write the index cache in {directory} ({err.strerror}); pass "
            "--data-cache-path DIR pointing to a writable directory (node-local is fine)"
        ) from err
    return lock


def _write_npy(f, arr: np.ndarray) -> None:
    """`np.save`'s bytes (NPY v1), written with `f.write`: numpy's own fast path (`tofile`) reports
    a full disk or file-size limit as an OSError without errno, which we could not tell apart."""
    np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
    f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


def _save(base: str, description: str, source: Source | None, arrays, expect: Expectation) -> None:
    """Write every array, the fingerprint, then the description (what makes the cache valid)."""
    needed = sum(arrays[name].nbytes + 128 for name in expect) + len(description) + 64
    path = base
    try:
        for name, (dtype, shape) in expect.items():
            arr = arrays[name]
            if arr.dtype != dtype or arr.shape != shape:
                raise AssertionError(
                    f"{name}: built {arr.dtype}{arr.shape}, expected {dtype}{shape}"
                )
            path = f"{base}-{name}.npy"
            atomic_write(path, lambda f, a=arr: _write_npy(f, a))
        if source is not None:
            path = f"{base}-{FINGERPRINT}"
            atomic_write_bytes(path, source.fingerprint.encode("utf-8"))
        path = f"{base}-description.txt"
        atomic_write_bytes(path, description.encode("utf-8"))
    except OSError as err:
        raise no_space_error(path, err, needed) or UserError(
            f"{path}: cannot write the index cache ({err.strerror or err}; pass --data-cache-path DIR "
            "pointing to a writable directory)"
        ) from None


def load_or_build(
    directory: str | None,
    base_name: str,
    description: str,
    expect: Expectation,
    build: Callable[[], dict[str, np.ndarray]],
    source: Source | None = None,
    check: ValueCheck | None = None,
) -> dict[str, np.ndarray]:
    """Load the cached arrays `expect` names, or build, save and return them.

    `source`: the `.idx` the arrays are computed from (its fingerprint is stored beside the cache
    and compared on load). `check`: a bounds check of the loaded values. `directory` None: build in
    memory, cache nothing. A directory we cannot create or write is reported as a UserError naming
    --data-cache-path.
    """
    if directory is None:
        return build()
    base = os.path.join(directory, base_name)
    arrays, _ = _try_load(base, description, expect, source, check)
    if arrays is not None:
        return arrays
    lock = _lock(directory, base)
    try:
        # another process may have built it while we waited for the lock
        arrays, why = _try_load(base, description, expect, source, check)
        if arrays is not None:
            return arrays
        log.info("building index cache %s (%s)", base, why)
        _remove_stray_temporaries(directory, base_name)
        # A stale or mismatching description goes first, so nobody trusts the files we replace.
        if os.path.exists(f"{base}-description.txt"):
            os.unlink(f"{base}-description.txt")
        arrays = build()
        _save(base, description, source, arrays, expect)
        return arrays
    finally:
        lock.release()
