"""Megatron's per-prefix index-cache files of a blend, written on a thread of their own.

A cold blend of thousands of prefixes builds thousands of small caches; creating their files (four
per prefix, in one folder) costs as much as computing them. `CacheWriter` creates them on a
background thread while the builder goes on computing (file system calls release the GIL), at a
lower scheduling priority than the ranks' own work (`NICENESS`), with the guarantee
`pretrain/data/caches/cache.py` describes: arrays first, created under their final names, then one flush
of each file system, then the descriptions, so a description is never durable before its arrays. A
description is created in place too (no temporary and rename): a reader of ours trusts a cache only
if its description is complete and equal to the expected one, and Megatron-LM only checks that the
four files exist, by which time the arrays are durable.

The blend's own consolidated cache (`blend_cache.py`) is what this project reads, so training does
not wait for the writer: a `pretrain_gpt.py` rank that built the caches starts training while its
writer finishes (a non-daemon thread, so the process ends after it). A writer that fails (a full
disk) logs one warning and stops; `wait_all` raises its error instead where the process said it
would (`caller_reports`: `build_data_cache.py`, whose job is the files). An interrupted writer
leaves arrays without descriptions: nobody trusts them, and the next build replaces them. The
writer removes no one's temporaries: it may still run after the blend's lock is released, when a
temporary of one of its caches belongs to a live builder (the blend's builder removes stray ones
before it builds, holding the lock).
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import numpy as np

from pretrain.atomic import file_mode, sync_filesystem
from pretrain.data.caches.cache import (
    CacheRequest,
    drop_description,
    make_folders,
    save_arrays,
    save_description,
)

log = logging.getLogger(__name__)

_END = object()
NICENESS = 10
_running: list[CacheWriter] = []
_running_lock = threading.Lock()
_caller_reports = False


class CacheWriter:
    """Writes the caches handed to `add` on its own thread; `finish` ends the stream."""

    def __init__(self, what: str):
        self.what = what
        """What the caches are for, in the warning a failure logs."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._waited = False
        self._thread = threading.Thread(target=self._run, name="cache-writer", daemon=False)
        self._thread.start()
        with _running_lock:
            _running.append(self)

    def add(self, request: CacheRequest, arrays: dict[str, np.ndarray]) -> None:
        """Queue one built cache (thread-safe; `request.directory` None: nothing to write)."""
        if request.directory is not None:
            self._queue.put((request, arrays))

    def finish(self) -> None:
        """No more caches: the thread flushes, writes the descriptions and ends."""
        self._queue.put(_END)

    def wait(self) -> None:
        """Wait for the thread; raise what made it fail."""
        self._waited = True
        self._thread.join()
        with _running_lock:
            if self in _running:
                _running.remove(self)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        _yield_the_cpu()
        written: list[CacheRequest] = []
        folders: set[str] = set()
        mode = file_mode()
        item = None
        try:
            while (item := self._queue.get()) is not _END:
                request, arrays = item
                if request.directory not in folders:
                    make_folders([request])
                    folders.add(request.directory)
                drop_description(request)
                save_arrays(request, arrays, batch=True, mode=mode)
                written.append(request)
            self._commit(written, mode)
        except BaseException as err:  # noqa: BLE001 - reported by wait() or the warning
            self._error = err
            if not (self._waited or _caller_reports):
                log.warning("%s: index caches for Megatron-LM not all written: %s", self.what, err)
            while item is not _END:  # let the producer finish
                item = self._queue.get()

    @staticmethod
    def _commit(written: list[CacheRequest], mode: int) -> None:
        for directory in dict.fromkeys(r.directory for r in written):
            sync_filesystem(directory)
        for request in written:
            save_description(request, fsync=False, mode=mode, in_place=True)


def _yield_the_cpu() -> None:
    """Lower this thread's scheduling priority (Linux: `nice` is per thread) by `NICENESS`: on a
    machine where the other ranks are starting up, creating thousands of files (kernel time that
    grows when the file system recently freed many inodes) must not slow them down."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)
        )
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


def caller_reports() -> None:
    """This process calls `wait_all` and reports what it raises: writers do not log their
    failures."""
    global _caller_reports
    _caller_reports = True


def wait_all() -> None:
    """Wait for every writer of this process; raise the first error."""
    with _running_lock:
        writers = list(_running)
    errors = []
    for writer in writers:
        try:
            writer.wait()
        except BaseException as err:  # noqa: BLE001 - the first is raised below
            errors.append(err)
    if errors:
        raise errors[0]
