"""Fault-injection points for the test suite, and nothing else.

Product code calls `kill_here(point, ...)` at the few moments where a crash is the worst case
(e.g. after a checkpoint's files are written and before `latest` names it). It does nothing
unless the environment variable for that point is set, which only tests do: the variable's value
names the iteration at which this process sends itself SIGKILL (an uncatchable, real kill: no
cleanup runs, exactly as when a node dies).

Points (environment variable = iteration):
    PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT   rank 0, after every rank wrote its checkpoint files,
                                          before the metadata and `latest` are committed
"""

from __future__ import annotations

import os
import signal

SIGKILL_BEFORE_COMMIT = "PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT"


def kill_here(point: str, iteration: int) -> None:
    """SIGKILL this process if the test hook `point` is armed for `iteration`."""
    if os.environ.get(point) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)
