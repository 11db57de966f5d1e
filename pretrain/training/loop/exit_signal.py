"""Megatron's `--exit-signal-handler`: a signal asks every rank to stop after its iteration.

The handler only records the signal (whatever the rank is doing when it arrives, it finishes).
Once per iteration the loop asks `requested()`, an all-reduce (MAX) of one integer, so a signal
that reached any rank (Slurm signals every task, a user may signal one) stops all ranks after the
same iteration; the loop then saves and returns, and the process exits 0.

The launcher's death counts as the signal (`count`, which `exit_with_launcher`'s watch calls): a
`deepspeed` command killed by SIGTERM does not pass it on, and a Kubernetes or Slurm SIGKILL of
the launcher may come before the ranks see anything. The DataLoader workers ignore the signal
(`pretrain.data.datasets.samplers.ignore_exit_signals`), so a signal to every process (Slurm, a launcher's
process-group kill) reaches the rank's handler and nothing else.
"""

from __future__ import annotations

import signal

from pretrain.data.datasets.samplers import EXIT_SIGNALS
from pretrain.training.distributed import any_rank

SIGNALS = EXIT_SIGNALS  # Megatron's choices for --exit-signal; the DataLoader workers ignore them


class ExitSignal:
    """Context manager: while active, `name` (e.g. "SIGTERM") is recorded instead of acted on."""

    def __init__(self, name: str = "SIGTERM"):
        self.name = name
        self.received = False
        self._signum = getattr(signal, name)
        self._previous = None
        self._active = False

    def __enter__(self) -> ExitSignal:
        self._previous = signal.signal(self._signum, self._record)
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        signal.signal(self._signum, self._previous)

    def _record(self, signum, frame) -> None:
        self.received = True

    def count(self) -> bool:
        """Record the signal as if it had arrived (any thread may call it). Outside the `with`
        block: True when the run already stopped for the signal (it is ending by itself: the
        launcher's death during the exit save or teardown is not an error), else False."""
        if self._active:
            self.received = True
        return self._active or self.received

    def requested(self) -> bool:
        """True on every rank once any rank has received the signal (a collective: call it on
        every rank at the same point); the ranks that did not receive it record it then. The
        answer is the all-reduce's, never `received` read afterwards: a signal arriving just
        after the all-reduce would make this rank's answer differ from the others' (a hang)."""
        agreed = any_rank(self.received)
        if agreed:
            self.received = True
        return agreed
