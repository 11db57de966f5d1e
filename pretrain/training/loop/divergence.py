"""A run that diverges stops, says so, and saves nothing non-finite.

`--check-for-nan-in-loss-and-grad` (Megatron-LM main's flag, on by default;
`--no-check-for-nan-in-loss-and-grad` turns it off): after every iteration the ranks agree, with
one all-reduce of two flags, whether the loss or the global grad norm was NaN/Inf anywhere. If
so, a background save staged before it (finite) is committed, rank 0 prints one `error: iteration
N: ...` line (what was non-finite, the fix, the newest committed checkpoint to resume from), the
other ranks wait for it, and every rank exits with status 2 (`EXIT_USER_ERROR`) at that
iteration, before the evaluator or the checkpointer's save of that iteration run. With fp16, a
non-finite grad norm on a step the loss scaler skipped (an overflow: the weights were not
updated, the scale is lowered) is not a divergence; a non-finite loss always is.

Whatever the flag, the checkpointer asks `checkpointing.nonfinite_state` before every save and refuses one whose
weights or optimizer state hold NaN/Inf on any rank (docs/CHECKPOINTS.md, "Non-finite state").
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pretrain.errors import EXIT_USER_ERROR
from pretrain.training.distributed import collective_device

if TYPE_CHECKING:
    from pretrain.training.engine import Engine


def _described(name: str, value: float | None, flagged: bool) -> str | None:
    """`<name> is nan` (or inf) for a flagged value; None for one that was not flagged."""
    if not flagged:
        return None
    if value is not None and not math.isfinite(value):
        return f"{name} is {value}"
    return f"{name} is NaN/Inf on another rank"


def _message(
    iteration: int,
    loss: float,
    grad_norm: float | None,
    flags: tuple[bool, bool],
    resume: str | None,
) -> str:
    """The one line: the iteration, what was non-finite, the fix and where to resume from."""
    what = [_described("loss", loss, flags[0]), _described("grad norm", grad_norm, flags[1])]
    where = (
        f"resume from the last checkpoint, {resume} (nothing was saved after it; a lower --lr "
        f"there needs --override-opt_param-scheduler)"
        if resume is not None
        else "start again (no checkpoint was saved; --save with --save-interval keeps one)"
    )
    return (
        f"iteration {iteration}: {' and '.join(w for w in what if w)} "
        f"(--check-for-nan-in-loss-and-grad): training diverged; lower --lr or enable "
        f"--clip-grad and {where}"
    )


class DivergenceCheck:
    """Asked after every optimizer step (`after_step`); does nothing when the check is off."""

    def __init__(self, enabled: bool, engine: Engine):
        self.enabled, self.engine = enabled, engine
        self._skipped = engine.skipped_steps

    def after_step(self, iteration: int, loss: float, resume: Callable[[], str | None]) -> None:
        """Stop every rank here (SystemExit, status 2; rank 0 prints the one line, naming
        `resume()`, the checkpoint to resume from: called on every rank, it may be a collective
        that commits what is pending) if this iteration's loss or grad norm was NaN/Inf on any
        rank (a grad norm the fp16 loss scaler skipped the step for excepted)."""
        skipped = self.engine.skipped_steps != self._skipped
        self._skipped = self.engine.skipped_steps
        if not self.enabled:
            return
        grad_norm = self.engine.grad_norm()
        scaler_handles_it = self.engine.fp16 and skipped
        local = [
            not math.isfinite(loss),
            grad_norm is not None and not math.isfinite(grad_norm) and not scaler_handles_it,
        ]
        flags = torch.tensor(local, dtype=torch.int32, device=collective_device())
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        bad = (bool(flags[0]), bool(flags[1]))
        if not any(bad):
            return
        where = resume()
        if torch.distributed.get_rank() == 0:
            message = _message(iteration, loss, grad_norm, bad, where)
            print(f"error: {message}", file=sys.stderr, flush=True)
        torch.distributed.barrier()  # the line is out before any rank exits (and its launcher kills)
        raise SystemExit(EXIT_USER_ERROR)
