"""Write a file so that readers see either the old file or the complete new one, never a part."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(f)` on a temporary file beside `path`, fsync it, then rename it over `path`.

    The temporary name carries the host name, so processes on different nodes sharing a directory
    never write the same temporary file. On any error the temporary file is removed; a failed
    write (a full disk, a file-size limit) is an `OSError` naming `path`, also when torch.save
    reports it as a RuntimeError caused by the OSError.
    """
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.{socket.gethostname()}."
    )
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = err.__context__ if isinstance(err, RuntimeError) else err
        if isinstance(cause, OSError) and cause.errno is not None:
            raise OSError(cause.errno, cause.strerror, path) from None
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Replace `path` with `data` atomically (temporary file, fsync, rename)."""
    atomic_write(path, lambda f: f.write(data))
