"""Where a tool may write: never over one of its own inputs, never over data it does not own, and
a destination it cannot write is one line naming it.

`refuse_output` is the one check every tool runs on each output before it writes anything: the
output may not be (under any name) or hold one of the tool's inputs (`plot_run.py --log run.log
--out run.log` would replace the log with its plot). `protect` (the callers pass
`pretrain.checkpoint.outputs.kept_data`) also refuses an existing dataset or checkpoint file for
a tool whose output is neither. `write_error` is the line for a write that failed (read-only,
immutable or full destination, a file-size limit).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Callable, Iterable, Iterator

from pretrain.errors import UserError

_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _same(a: str, b: str) -> bool:
    """One file or folder under two names (symlinks, hard links, `./x` and `x`)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def overlap(out: str, path: str, nested: bool = False) -> str | None:
    """How writing `out` would replace (part of) `path`: "is" (the same file or folder under
    any name), "holds" (`path` lies inside the folder `out`), with `nested` also "lies inside"
    (`out` inside the folder `path`); else None."""
    if _same(out, path):
        return "is"
    a, b = os.path.realpath(out), os.path.realpath(path)
    common = os.path.commonpath([a, b])
    if common == a:
        return "holds"
    return "lies inside" if nested and common == b else None


def refuse_output(
    flag: str,
    out: str,
    inputs: Iterable[tuple[str, str]] = (),
    *,
    protect: Callable[[str], str | None] | None = None,
    nested: bool = False,
) -> None:
    """Raise a one-line `UserError` when `out` (the value of `flag`) is or holds one of `inputs`
    ((flag, path) pairs; with `nested`, also when it lies inside one), or when `protect(out)`
    names what writing it would replace."""
    for in_flag, path in inputs:
        how = overlap(out, path, nested)
        if how is not None:
            raise UserError(
                f"{flag} {out}: {how} {in_flag} {path}; writing it would replace that input "
                f"(choose another {flag}; nothing was written)"
            )
    kept = protect(out) if protect is not None else None
    if kept is not None:
        raise UserError(
            f"{flag} {out}: is {kept}; writing it would replace that (choose another {flag}; "
            f"nothing was written)"
        )


def ignore_file_size_signal() -> None:
    """A file-size limit (`ulimit -f`) kills a process with SIGXFSZ and no message; ignored, the
    write fails with EFBIG and the tool says which file did not fit."""
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def failed_write(err: BaseException) -> OSError | None:
    """The `OSError` behind a failed write: `err` itself, or the one a `RuntimeError` was raised
    while handling (torch.save reports a failed write so); None for anything else."""
    cause = err.__context__ if isinstance(err, RuntimeError) else err
    return cause if isinstance(cause, OSError) and cause.errno is not None else None


def write_error(flag: str, out: str, err: OSError) -> UserError:
    """The line for a failed write of `out` (`flag`'s value): what the system said, on which file,
    and the fix."""
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(out) else ""
    if err.errno in _FULL:
        fix = "free disk space, raise the file-size limit (ulimit -f) or write elsewhere"
    else:
        fix = "choose a writable place"
    reason = (err.strerror or str(err)).lower()
    return UserError(f"{flag} {out}: cannot write, {reason}{where} ({fix}; nothing was written)")


@contextlib.contextmanager
def reported_writes(flag: str, out: str) -> Iterator[None]:
    """Turn a failed write inside the block (writing `out`: `failed_write`) into `write_error`'s
    line."""
    try:
        yield
    except Exception as err:
        cause = failed_write(err)
        if cause is None:
            raise
        raise write_error(flag, out, cause) from None
