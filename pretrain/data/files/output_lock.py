"""`PREFIX.lock`: what a writer of `PREFIX.bin`/`.idx` (preprocess_data.py, merge_datasets.py) holds
while it writes, so that a second run on the same files refuses instead of replacing them.

The lock is an flock on the file `PREFIX.lock`. A run that ends, finished or failed, removes the
file while it still holds it (`OutputLock.remove`; only a killed run leaves it, empty and free), and a run that takes the lock checks, once it holds it, that the
file it locked is still the one at `PREFIX.lock` (a finished run may have unlinked it while this one
was opening it): so removing the file never lets two runs hold "the" lock at once.
"""

from __future__ import annotations

import os

from filelock import FileLock, Timeout

from pretrain.errors import UserError

_ATTEMPTS = 5  # each retry means another run finished meanwhile and removed its lock file


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class OutputLock:
    """`PREFIX.lock`, held by this run (from `lock_output`)."""

    def __init__(self, lock: FileLock, path: str, inode: tuple[int, int]):
        self._lock, self.path, self._inode = lock, path, inode

    def remove(self) -> None:
        """Delete `PREFIX.lock` while still holding it (unless it is no longer the file this run
        locked), then release: for a run that ends, finished or failed."""
        try:
            if _inode(self.path) == self._inode:
                os.remove(self.path)
        except FileNotFoundError:
            pass
        finally:
            self._lock.release()


def lock_output(prefix: str, flag: str = "--output-prefix", label: str | None = None) -> OutputLock:
    """Take `PREFIX.lock` without waiting; a `UserError` if another run holds it or it cannot be
    created. `label` starts the message (default `FLAG PREFIX`)."""
    head, path = label or f"{flag} {prefix}", prefix + ".lock"
    for _ in range(_ATTEMPTS):
        try:  # filelock reports a lock file it cannot open as held by another run: check first
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o666))
        except OSError as err:
            raise UserError(
                f"{head}: cannot be written: cannot create {path} ({err.strerror}); choose "
                "another prefix"
            ) from None
        before = _inode(path)
        lock = FileLock(path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if _inode(path) != before:
                continue  # the holder finished and removed the file: take the new one
            raise UserError(
                f"{head}: another run is writing {prefix}.bin/.idx (it holds {path}); wait for "
                "it to finish or choose another prefix"
            ) from None
        except OSError as err:
            raise UserError(
                f"{head}: cannot be written: cannot create {path} ({err.strerror})"
            ) from None
        if before is not None and _inode(path) == before:
            return OutputLock(lock, path, before)
        lock.release()  # locked a file a finished run had just removed: try the new one
    raise UserError(
        f"{head}: {path} keeps being replaced by other runs; wait for them to finish or choose "
        "another prefix"
    )
