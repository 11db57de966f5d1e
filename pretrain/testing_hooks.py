"""Fault-injection points for the test suite, and nothing else.

Product code calls these at the moments where a crash is the worst case. They do nothing unless
the environment variable for that point is set, which only tests do; a triggered point sends
this process SIGKILL (an uncatchable, real kill: no cleanup runs, exactly as when a node dies).

Points (environment variable = value):
    PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT   "<iteration>": rank 0, after every rank wrote its
                                          checkpoint files, before the step is renamed into
                                          place and `latest` committed
    PRETRAIN_TEST_SIGKILL_IN_SAVE         "<iteration>:<event>:<bytes>": during the save of
                                          that iteration, at its <event>-th event (0-based),
                                          counted over every `torch.save` call (DeepSpeed's
                                          own writes and ours) and every commit step
                                          (`save_event`): a `torch.save` writes only its first
                                          <bytes> bytes (fsynced) before the kill; a commit
                                          step is killed before it runs
"""

from __future__ import annotations

import contextlib
import io
import os
import signal

SIGKILL_BEFORE_COMMIT = "PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT"
SIGKILL_IN_SAVE = "PRETRAIN_TEST_SIGKILL_IN_SAVE"

_armed: dict | None = None  # {"target": event index, "bytes": n, "seen": events so far}


def kill_here(point: str, iteration: int) -> None:
    """SIGKILL this process if the test hook `point` is armed for `iteration`."""
    if os.environ.get(point) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def save_event(name: str) -> None:
    """One commit step of an armed save (see SIGKILL_IN_SAVE); `name` is for readers only."""
    if _armed is None:
        return
    if _armed["seen"] == _armed["target"]:
        _die()
    _armed["seen"] += 1


def _write_part_and_die(real_save, obj, f, args, kwargs) -> None:
    buffer = io.BytesIO()
    real_save(obj, buffer, *args, **kwargs)
    part = buffer.getvalue()[: _armed["bytes"]]
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


@contextlib.contextmanager
def armed_save(iteration: int):
    """Arm SIGKILL_IN_SAVE around the save of `iteration` (when the variable names it)."""
    global _armed
    spec = os.environ.get(SIGKILL_IN_SAVE, "").split(":")
    if len(spec) != 3 or spec[0] != str(iteration):
        yield
        return
    import torch

    real_save = torch.save
    _armed = {"target": int(spec[1]), "bytes": int(spec[2]), "seen": 0}

    def save(obj, f, *args, **kwargs):
        if _armed["seen"] == _armed["target"]:
            _write_part_and_die(real_save, obj, f, args, kwargs)
        _armed["seen"] += 1
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    try:
        yield
    finally:
        torch.save = real_save
        _armed = None
