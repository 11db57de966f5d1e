"""Megatron's `--exit-signal-handler`: a signal asks every rank to stop after its iteration.

The handler only records the signal (whatever the rank is doing when it arrives, it finishes).
Once per iteration the loop asks `requested()`, an all-reduce (MAX) of one integer, so a signal
that reached any rank (Slurm signals every task, a user may signal one) stops all ranks after the
same iteration; the loop then saves and returns, and the process exits 0.
"""

from __future__ import annotations

import signal

import torch

from pretrain.training.distributed import collective_device

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")  # Megatron's choices for --exit-signal


class ExitSignal:
    """Context manager: while active, `name` (e.g. "SIGTERM") is recorded instead of acted on."""

    def __init__(self, name: str = "SIGTERM"):
        self.name = name
        self.received = False
        self._signum = getattr(signal, name)
        self._previous = None

    def __enter__(self) -> ExitSignal:
        self._previous = signal.signal(self._signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self._signum, self._previous)

    def _record(self, signum, frame) -> None:
        self.received = True

    def requested(self) -> bool:
        """True on every rank once any rank has received the signal (a collective: call it on
        every rank at the same point)."""
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=collective_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
