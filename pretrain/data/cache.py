"""Index cache: Megatron's file names, written atomically under a file lock, validated on load.

Files: `{dir}/{md5}-{Class}-{split}-description.txt` plus one `{md5}-{Class}-{split}-{name}.npy` per
array (NPY v1, loaded with mmap). How we differ from Megatron, and why:

- Every file is written under a temporary name and renamed, and the description is renamed *last*:
  a reader that finds the expected description finds complete arrays (Megatron writes in place).
- A cache is used only if its description equals ours and its arrays have the expected dtypes and
  shapes; anything else (a truncated file, a different description) is rebuilt, not trusted.
- There is no "rank 0 builds, the others wait at a barrier": every process that needs the dataset
  calls `load_or_build`. The first one to take the lock builds, the others wait for the lock and
  then load the finished files. On a cache directory that is not shared between nodes, the first
  process of each node builds its own copy (Megatron issue #907). If the lock does not work across
  nodes (some network filesystems), two nodes may build the same arrays at once; the renames are
  atomic and the contents identical, so the result is still correct.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
from filelock import FileLock, Timeout

from pretrain.atomic import atomic_write, atomic_write_bytes
from pretrain.errors import UserError

log = logging.getLogger(__name__)

# expected (dtype, shape) per array name
Expectation = dict[str, tuple[np.dtype, tuple[int, ...]]]


def cache_file_base(directory: str, description_hash: str, cls_name: str, split: str) -> str:
    """Megatron's cache path stem: `<dir>/<md5 of description>-<class>-<split>`."""
    return os.path.join(directory, f"{description_hash}-{cls_name}-{split}")


def _try_load(base: str, description: str, expect: Expectation) -> dict[str, np.ndarray] | None:
    """The cached arrays if the cache is complete and matches, else None."""
    try:
        with open(f"{base}-description.txt", encoding="utf-8") as f:
            if f.read() != description:
                return None
    except OSError:
        return None
    arrays = {}
    for name, (dtype, shape) in expect.items():
        try:
            arr = np.load(f"{base}-{name}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None
        if arr.dtype != dtype or arr.shape != shape:
            return None
        arrays[name] = arr
    return arrays


def load_or_build(
    directory: str | None,
    base_name: str,
    description: str,
    expect: Expectation,
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Load the cached arrays `expect` names, or build, save and return them.

    `directory` None: build in memory, cache nothing. A directory we cannot create or write is
    reported as a UserError naming --data-cache-path.
    """
    if directory is None:
        return build()
    base = os.path.join(directory, base_name)
    arrays = _try_load(base, description, expect)
    if arrays is not None:
        return arrays
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
    try:
        arrays = _try_load(base, description, expect)  # another process may have built it meanwhile
        if arrays is not None:
            return arrays
        log.info("building index cache %s", base)
        # A stale or mismatching description goes first, so nobody trusts the files we replace.
        if os.path.exists(f"{base}-description.txt"):
            os.unlink(f"{base}-description.txt")
        arrays = build()
        for name, (dtype, shape) in expect.items():
            arr = arrays[name]
            if arr.dtype != dtype or arr.shape != shape:
                raise AssertionError(
                    f"{name}: built {arr.dtype}{arr.shape}, expected {dtype}{shape}"
                )
            atomic_write(f"{base}-{name}.npy", lambda f, a=arr: np.save(f, a, allow_pickle=False))
        atomic_write_bytes(f"{base}-description.txt", description.encode("utf-8"))
        return arrays
    finally:
        lock.release()
