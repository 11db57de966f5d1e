"""--manual-gc: Python's garbage collector runs at the same iterations on every rank.

A collection stops a rank for as long as it walks the heap. Left to itself the collector runs when
a rank's allocations say so, at different moments on each rank, and every collective waits for the
rank that is collecting: at hundreds of ranks those pauses add up to stragglers in most
iterations. With --manual-gc (Megatron-LM's flags and behaviour) the automatic collector is off
for the training loop; every rank collects fully when the loop starts, after every
--manual-gc-interval-th iteration (0: never within the loop), and before each evaluation, then
only the youngest generation after it (what evaluation made), unless --no-manual-gc-eval. Without
the flag nothing changes. Reference counting still frees everything that is not in a cycle.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

from pretrain.data.gc_pause import gc_paused


@dataclass(frozen=True, kw_only=True)
class ManualGCConfig:
    """When the loop collects garbage (--manual-gc, --manual-gc-interval, --no-manual-gc-eval)."""

    enabled: bool = False
    """Turn the automatic collector off during the loop and collect at fixed points (--manual-gc)."""
    interval: int = 0
    """Collect after every iteration divisible by this; 0: only at the start and around
    evaluations (--manual-gc-interval)."""
    at_evaluation: bool = True
    """Collect before each evaluation and the youngest generation after it (off:
    --no-manual-gc-eval)."""

    def problems(self) -> list[str]:
        """What is wrong with the flags."""
        if self.interval < 0:
            return [f"--manual-gc-interval {self.interval}: must be 0 (never) or a positive count"]
        return []


class ManualGC:
    """Asked by the loop: `running()` around it, `after_iteration`, `evaluation()` around each
    evaluation; does nothing when the config is off."""

    def __init__(self, config: ManualGCConfig):
        self.config = config

    @contextlib.contextmanager
    def running(self):
        """The loop: the automatic collector off (restored after), one full collection first."""
        if not self.config.enabled:
            yield
            return
        with gc_paused():
            gc.collect()
            yield

    def after_iteration(self, iteration: int) -> None:
        """A full collection after every --manual-gc-interval-th iteration."""
        interval = self.config.interval
        if self.config.enabled and interval and iteration % interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        """Around an evaluation: everything collected before, its own garbage after."""
        on = self.config.enabled and self.config.at_evaluation
        if on:
            gc.collect()
        yield
        if on:
            gc.collect(generation=0)
