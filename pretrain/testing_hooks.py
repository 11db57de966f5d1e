"""Fault-injection points for the test suite, and nothing else.

Product code calls these at the moments where a crash is the worst case. They do nothing unless
the environment variable for that point is set, which only tests do; a triggered point sends
this process SIGKILL (an uncatchable, real kill: no cleanup runs, exactly as when a node dies).

Points (environment variable = value):
    PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT   "<iteration>": rank 0, after every rank wrote its
                                          checkpoint files, before the step is renamed into
                                          place and `latest` committed
    PRETRAIN_TEST_SIGKILL_IN_SAVE         "<iteration>:<bytes>:<event>": during the save of
                                          that iteration, at the first event named <event>.
                                          The events of a save are this process's `torch.save`
                                          calls (DeepSpeed's own writes and ours), named by the
                                          file's base name (`rng_state_0.pt`), and its commit
                                          steps (`save_event`: "metadata written", ...): a
                                          `torch.save` writes only its first <bytes> bytes
                                          (fsynced) before the kill; a commit step is killed
                                          right after it ran
                                          Background writes (--async-save: DCP's files and
                                          the files queued behind them) are events too, named
                                          by their base name (`__0_0.distcp`), through
                                          `stream_watcher`, and cut the same way
    PRETRAIN_TEST_RAISE_IN_STEP           "<iteration>": every rank raises a RuntimeError as
                                          that iteration's step begins (an exception, not a
                                          kill: what follows it in the process runs)
    PRETRAIN_TEST_SAVE_EVENTS             "<file>": every event of every save is appended to
                                          <file> as one line "<iteration> <event>" (before a
                                          kill at it), so a test can see which events a save
                                          has and where a killed one stopped
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading

SIGKILL_BEFORE_COMMIT = "PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT"
SIGKILL_IN_SAVE = "PRETRAIN_TEST_SIGKILL_IN_SAVE"
SAVE_EVENTS = "PRETRAIN_TEST_SAVE_EVENTS"
RAISE_IN_STEP = "PRETRAIN_TEST_RAISE_IN_STEP"

# during an armed save: {"iteration", "target": event name or None, "bytes", "log": path or None}
_armed: dict | None = None


def kill_here(point: str, iteration: int) -> None:
    """SIGKILL this process if the test hook `point` is armed for `iteration`."""
    if os.environ.get(point) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)


def raise_here(point: str, iteration: int) -> None:
    """Raise a RuntimeError if the test hook `point` is armed for `iteration`."""
    if os.environ.get(point) == str(iteration):
        raise RuntimeError(f"{point}={iteration}: the test hook's exception")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _is_target(name: str, armed: dict | None = None) -> bool:
    """Record the event `name` of the armed save (`armed`, default the one armed now); True if
    the save is to be killed at it."""
    armed = armed or _armed
    if armed["log"]:
        with open(armed["log"], "a") as f:
            f.write(f"{armed['iteration']} {name}\n")
    return name == armed["target"]


def save_event(name: str) -> None:
    """One commit step of a save, just done (see SIGKILL_IN_SAVE)."""
    if _armed is not None and _is_target(name):
        _die()


class _CutStream:
    """A write stream that lets `limit` bytes through in all, then fsyncs and kills."""

    def __init__(self, stream, limit: int):
        self._stream, self._left = stream, limit

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) < self._left:
            self._left -= len(data)
            return self._stream.write(data)
        self._stream.write(data[: self._left])
        self.die()

    def die(self) -> None:
        """Flush and fsync what was written, then SIGKILL this process."""
        self._stream.flush()
        os.fsync(self._stream.fileno())
        _die()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def stream_watcher():
    """Inside an armed save: `watch(stream, name)`, a context giving the stream to write a file
    of the save with later, in the background. It records the event `name` and, when the save
    is armed at it, gives a stream that writes the armed number of bytes (or the whole file,
    if shorter), fsyncs and kills. Outside an armed save it gives the stream itself."""
    armed = _armed

    @contextlib.contextmanager
    def watch(stream, name: str):
        if armed is None or not _is_target(name, armed):
            yield stream
            return
        cut = _CutStream(stream, armed["bytes"])
        yield cut
        cut.die()  # the file was shorter than the armed bytes

    return watch


def _write_part_and_die(real_save, obj, f, args, kwargs, limit: int) -> None:
    buffer = io.BytesIO()
    real_save(obj, buffer, *args, **kwargs)
    part = buffer.getvalue()[:limit]
    if isinstance(f, str | os.PathLike):
        with open(f, "wb") as out:
            out.write(part)
            out.flush()
            os.fsync(out.fileno())
    elif hasattr(f, "write"):
        f.write(part)
        f.flush()
        os.fsync(f.fileno())
    _die()


def _file_name(f) -> str:
    path = f if isinstance(f, str | os.PathLike) else getattr(f, "name", "<stream>")
    return os.path.basename(os.fspath(path)) if isinstance(path, str | os.PathLike) else str(path)


@contextlib.contextmanager
def armed_save(iteration: int):
    """Arm SIGKILL_IN_SAVE (when it names `iteration`) and SAVE_EVENTS around one save."""
    global _armed
    spec = os.environ.get(SIGKILL_IN_SAVE, "").split(":", 2)
    target = spec[2] if len(spec) == 3 and spec[0] == str(iteration) else None
    log = os.environ.get(SAVE_EVENTS) or None
    if target is None and log is None:
        yield
        return
    import torch

    real_save = torch.save
    armed = {"iteration": iteration, "target": target, "log": log}
    armed["bytes"] = int(spec[1]) if target is not None else 0
    _armed, owner = armed, threading.get_ident()

    def save(obj, f, *args, **kwargs):
        # the saving thread's own writes (a background save's files are `stream_watcher`'s)
        if threading.get_ident() == owner and _is_target(_file_name(f), armed):
            _write_part_and_die(real_save, obj, f, args, kwargs, armed["bytes"])
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    try:
        yield
    finally:
        torch.save = real_save
        _armed = None
