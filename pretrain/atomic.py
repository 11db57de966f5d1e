"""Write a file so that readers see either the old file or the complete new one, never a part.

Modes: `tempfile.mkstemp`/`mkdtemp` create 0600/0700 whatever the umask, so a file or folder made
through them and renamed into place would be unreadable by other users. Everything made here gets
the mode a plain `open()`/`os.mkdir` gives: 0o666 & ~umask for files, 0o777 & ~umask for folders.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from pretrain.outputs import failed_write


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows.

    `os.umask` only reads by setting: set-and-restore is racy with other threads (one creating a
    file in between gets the wrong mode). Linux (4.7+) reports it in /proc/self/status (`Umask:`),
    which we read; elsewhere we fall back to set-and-restore.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file now: 0o666 & ~umask."""
    return 0o666 & ~current_umask()


def folder_mode() -> int:
    """The mode a plain `os.mkdir(path)` gives a new folder now: 0o777 & ~umask."""
    return 0o777 & ~current_umask()


def make_temp_folder(directory: str, prefix: str) -> str:
    """`tempfile.mkdtemp(dir=directory, prefix=prefix)` with the mode `os.mkdir` would give it
    (not mkdtemp's 0700), for a folder that is later renamed into place; returns its path."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=directory)
    os.chmod(tmp, folder_mode())
    return tmp


def give_plain_modes(root: str) -> None:
    """Give every file under `root` `file_mode()` and every folder (root included)
    `folder_mode()`: for a temporary folder filled by code that does not honour the umask
    (safetensors writes 0600 files), before it is renamed into place."""
    os.chmod(root, folder_mode())
    for folder, subfolders, files in os.walk(root):
        for name in subfolders:
            os.chmod(os.path.join(folder, name), folder_mode())
        for name in files:
            os.chmod(os.path.join(folder, name), file_mode())


def atomic_write(
    path: str, write: Callable[[BinaryIO], object], *, fsync: bool = True, mode: int | None = None
) -> None:
    """Call `write(f)` on a temporary file beside `path`, fsync it, then rename it over `path`.

    The temporary name carries the host name, so processes on different nodes sharing a directory
    never write the same temporary file. The file gets `mode`, by default `file_mode()` (as
    `open()` would give it). On any error the temporary file is removed; a failed write (a full
    disk, a file-size limit) is an `OSError` naming `path`, also when torch.save reports it as a
    RuntimeError caused by the OSError. `fsync=False`: for a caller that writes many files and
    then makes them durable together (`sync_filesystem`) before anything refers to them.
    """
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.{socket.gethostname()}."
    )
    try:
        os.fchmod(fd, file_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = failed_write(err)
        if cause is not None:
            raise OSError(cause.errno, cause.strerror, path) from None
        raise


def atomic_write_bytes(
    path: str, data: bytes, *, fsync: bool = True, mode: int | None = None
) -> None:
    """Replace `path` with `data` atomically (temporary file, fsync, rename); `fsync` and `mode`
    as for `atomic_write`."""
    atomic_write(path, lambda f: f.write(data), fsync=fsync, mode=mode)


def sync_filesystem(path: str) -> None:
    """Make every write so far to the file system holding `path` durable: one `syncfs` (Linux)
    instead of an fsync per file, else `os.sync`. Thousands of small files written with
    `fsync=False` and then this cost one flush instead of thousands."""
    libc = _libc()
    if libc is not None and hasattr(libc, "syncfs"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    os.sync()


@functools.cache
def _libc():
    """The C library this process runs with (for syncfs), or None where ctypes cannot load it."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
