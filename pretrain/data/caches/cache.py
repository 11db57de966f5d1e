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
- `load_or_build_all` serves thousands of caches at once (a blend's prefixes): it loads what is
  there and builds the rest; `cache_writer.CacheWriter` writes them on a thread of its own,
  arrays first (no fsync each), then one `syncfs` of the file system, then the descriptions: the
  same guarantee (a description is never durable before its arrays) for one flush instead of one
  per file. An array, fingerprint or description file that does not exist yet is created under
  its final name (`O_EXCL`, no temporary and rename: file creation dominates a cold build of
  thousands of small caches): nobody trusts an array before the description, written after the
  flush, nobody has it mapped (it is new), and a description cut short by a crash does not equal
  the expected one; an existing file is replaced by a rename, as everywhere else. No
  fingerprint file is written per cache there: the blend's consolidated file
  (`pretrain/data/caches/blend_cache.py`) records every `.idx` fingerprint, and such a cache read on
  its own is treated like Megatron's (used if newer than the `.idx`, then its fingerprint
  recorded). No lock is taken per cache: the blend's builder holds the blend's lock
  (`pretrain/data/blends/blend_build.py`) while it computes, and a writer still writing after it is
  released is harmless: the other processes read the consolidated file, and one that needs one
  of these caches on its own finds no description yet, builds it and writes the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from filelock import FileLock, Timeout

from pretrain.atomic import atomic_write, atomic_write_bytes, file_mode
from pretrain.data.files.indexed_dataset import no_space_error
from pretrain.errors import UserError

log = logging.getLogger(__name__)

# expected (dtype, shape) per array name
Expectation = dict[str, tuple[np.dtype, tuple[int, ...]]]
# arrays -> None when their values are usable, else what is wrong
ValueCheck = Callable[[dict[str, np.ndarray]], str | None]
FINGERPRINT = "idx_fingerprint.txt"
NO_CACHE = "no cache with this description"  # why a cache is built when none was there
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


@dataclass(frozen=True, kw_only=True)
class CacheRequest:
    """One index cache: where it lives, what it must hold, and how to build it."""

    directory: str | None
    """The cache folder; None: build in memory, cache nothing."""
    base_name: str
    """`{md5}-{Class}-{split}`: every file of the cache starts with it (Megatron's names)."""
    description: str
    """The JSON text whose md5 names the cache; a cache is used only if its own equals it."""
    expect: Expectation
    """(dtype, shape) of every array."""
    build: Callable[[], dict[str, np.ndarray]]
    """Computes the arrays (when no valid cache exists)."""
    source: Source | None = None
    """The `.idx` the arrays are computed from (its fingerprint is stored and compared)."""
    check: ValueCheck | None = None
    """Bounds check of loaded values (a damaged file with a valid header)."""

    @property
    def base(self) -> str:
        return os.path.join(self.directory, self.base_name)


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


def try_load(request: CacheRequest, adopt: bool = True) -> tuple[dict[str, np.ndarray] | None, str]:
    """(the cached arrays, "") if the cache is complete and matches, else (None, why not).
    `adopt`: record the fingerprint of a matching cache that has none (Megatron's)."""
    base, source, check = request.base, request.source, request.check
    if _read_text(f"{base}-description.txt") != request.description:
        return None, NO_CACHE
    problem, unrecorded = _source_problem(base, source) if source is not None else (None, False)
    if problem is not None:
        return None, problem
    arrays = {}
    for name, (dtype, shape) in request.expect.items():
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
    if unrecorded and adopt:
        try:
            atomic_write_bytes(f"{base}-{FINGERPRINT}", source.fingerprint.encode("utf-8"))
        except OSError:
            pass  # a read-only cache directory: checked by mtime again next time
    return arrays, ""


def remove_stray_temporaries(directory: str, base_names: set[str]) -> None:
    """Hidden temporaries `.{base_name}-*.{host}.*` of killed builders of the caches `base_names`
    (we build them): this host's, and other hosts' older than a day. One listing of `directory`."""
    host, now = socket.gethostname(), time.time()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(".") or "-".join(name[1:].split("-", 3)[:3]) not in base_names:
            continue
        path = os.path.join(directory, name)
        try:
            if f".{host}." in name or now - os.path.getmtime(path) > _STALE_OTHER_HOST_S:
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


@functools.lru_cache(maxsize=4096)
def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """`np.save`'s NPY v1 header of a C-ordered array (made once per dtype and shape)."""
    out = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue()


def _npy_chunks(arr: np.ndarray) -> list:
    """`np.save`'s bytes (NPY v1) of a plain array, as chunks for `f.write`: numpy's own fast path
    (`tofile`) reports a full disk or file-size limit as an OSError without errno, which we
    could not tell apart."""
    arr = np.ascontiguousarray(arr)
    return [_npy_header(arr.dtype.str, arr.shape), memoryview(arr).cast("B")]


def _write_chunks(f, chunks) -> None:
    for chunk in chunks:
        f.write(chunk)


def write_new(path: str, chunks, mode: int) -> None:
    """Create `path` with `chunks` under its final name, or replace an existing one by a rename
    (no fsync either way): for `cache_writer` only (module docstring)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        atomic_write(path, lambda f: _write_chunks(f, chunks), fsync=False, mode=mode)
        return
    try:
        for chunk in chunks:  # plain writes: no file object per file (thousands of them)
            view = memoryview(chunk).cast("B")
            while view:
                view = view[os.write(fd, view) :]
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def _write_error(path: str, err: OSError, needed: int) -> UserError:
    return no_space_error(path, err, needed) or UserError(
        f"{path}: cannot write the index cache ({err.strerror or err}; pass --data-cache-path DIR "
        "pointing to a writable directory)"
    )


def save_arrays(request: CacheRequest, arrays, *, batch: bool, mode: int) -> None:
    """Every array of `request` (no description): each renamed into place and fsynced, with the
    fingerprint, or, in a `batch` (`cache_writer`), with `write_new` and no fingerprint (the
    blend's file holds it; a stale one goes)."""
    base = request.base
    needed = sum(arrays[name].nbytes + 128 for name in request.expect) + 64
    files = []
    for name, (dtype, shape) in request.expect.items():
        arr = arrays[name]
        if arr.dtype != dtype or arr.shape != shape:
            raise AssertionError(f"{name}: built {arr.dtype}{arr.shape}, expected {dtype}{shape}")
        files.append((f"{base}-{name}.npy", _npy_chunks(arr)))
    if request.source is not None and not batch:
        files.append((f"{base}-{FINGERPRINT}", [request.source.fingerprint.encode("utf-8")]))
    elif request.source is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{base}-{FINGERPRINT}")
    for path, chunks in files:
        try:
            if batch:
                write_new(path, chunks, mode)
            else:
                atomic_write(path, lambda f, c=chunks: _write_chunks(f, c), mode=mode)
        except OSError as err:
            raise _write_error(path, err, needed) from None


def save_description(
    request: CacheRequest, *, fsync: bool, mode: int, in_place: bool = False
) -> None:
    """The description, written last: what makes the cache valid. `in_place`: a new file is
    created under its final name (`cache_writer.py` says when that is safe)."""
    path = f"{request.base}-description.txt"
    data = request.description.encode("utf-8")
    try:
        if in_place:
            write_new(path, [data], mode)
        else:
            atomic_write_bytes(path, data, fsync=fsync, mode=mode)
    except OSError as err:
        raise _write_error(path, err, len(request.description) + 64) from None


def drop_description(request: CacheRequest) -> None:
    """A stale or mismatching description goes first, so nobody trusts the files we replace."""
    try:
        os.unlink(f"{request.base}-description.txt")
    except FileNotFoundError:
        pass


def load_or_build(request: CacheRequest) -> dict[str, np.ndarray]:
    """Load the cached arrays `request.expect` names, or build, save and return them.

    `request.directory` None: build in memory, cache nothing. A directory we cannot create or
    write is reported as a UserError naming --data-cache-path.
    """
    if request.directory is None:
        return request.build()
    arrays, _ = try_load(request)
    if arrays is not None:
        return arrays
    lock = _lock(request.directory, request.base)
    try:
        # another process may have built it while we waited for the lock
        arrays, why = try_load(request)
        if arrays is not None:
            return arrays
        log.info("building index cache %s (%s)", request.base, why)
        remove_stray_temporaries(request.directory, {request.base_name})
        drop_description(request)
        arrays = request.build()
        mode = file_mode()
        save_arrays(request, arrays, batch=False, mode=mode)
        save_description(request, fsync=True, mode=mode)
        return arrays
    finally:
        lock.release()


def remove_stray_temporaries_of(requests: Sequence[CacheRequest]) -> None:
    """`remove_stray_temporaries` for many caches, one listing per folder: for a caller that holds
    the lock that makes it the only builder of them (`blend_build.py`, before it builds)."""
    folders: dict[str, set[str]] = {}
    for request in requests:
        if request.directory is not None:
            folders.setdefault(request.directory, set()).add(request.base_name)
    for directory, names in folders.items():
        remove_stray_temporaries(directory, names)


def make_folders(requests: Sequence[CacheRequest]) -> None:
    """Create the cache folders of `requests`; one that cannot be made is a UserError naming
    --data-cache-path."""
    for directory in {r.directory for r in requests}:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as err:
            raise UserError(
                f"cannot write the index cache in {directory} ({err.strerror}); pass "
                "--data-cache-path DIR pointing to a writable directory (node-local is fine)"
            ) from err


@dataclass
class Batch:
    """What `load_or_build_all` found and built."""

    arrays: list[dict[str, np.ndarray]]
    """The arrays of each request, in order."""
    built: int
    """How many requests had no valid cache (built, and handed to `on_built`)."""
    reasons: dict[str, int]
    """{why a cache was built: how many}."""


def _listings(requests: Sequence[CacheRequest]) -> dict[str, set[str]]:
    """{folder: its file names} of each folder holding several of `requests`: one listing
    instead of a failed lookup per cache that is not there (a cold blend of thousands)."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.directory is not None:
            counts[request.directory] = counts.get(request.directory, 0) + 1
    listed = {}
    for directory, n in counts.items():
        if n > 1:
            try:
                listed[directory] = set(os.listdir(directory))
            except FileNotFoundError:
                listed[directory] = set()
    return listed


def load_or_build_all(
    requests: Sequence[CacheRequest],
    threads: int = 1,
    on_built: Callable[[CacheRequest, dict[str, np.ndarray]], None] | None = None,
) -> Batch:
    """The arrays of every request: loaded where a valid cache exists, else built (on `threads`
    threads); the caller writes what was built (`cache_writer.CacheWriter`, handed each build as
    it is made through `on_built`), holding the lock that makes it the only builder of this
    set."""

    listed = _listings(requests)

    def one(request: CacheRequest):
        names = listed.get(request.directory)
        if request.directory is None:
            arrays, why = None, ""
        elif names is not None and f"{request.base_name}-description.txt" not in names:
            arrays, why = None, NO_CACHE
        else:
            arrays, why = try_load(request, adopt=False)
        if arrays is not None:
            return arrays, False, ""
        arrays = request.build()
        if on_built is not None:
            on_built(request, arrays)
        return arrays, True, why

    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(one, requests))
    else:
        results = [one(r) for r in requests]
    reasons: dict[str, int] = {}
    for _, built, why in results:
        if built:
            reasons[why or "in memory"] = reasons.get(why or "in memory", 0) + 1
    return Batch(
        arrays=[arrays for arrays, _, _ in results],
        built=sum(1 for _, built, _ in results if built),
        reasons=reasons,
    )
