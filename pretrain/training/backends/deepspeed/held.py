"""What the DeepSpeed backend's helper modules (`steps`, `full_state`, `masters`) read of its
engine: the type they take, so they need not import `engine.py`, which imports them."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import deepspeed

    from pretrain.training.schedules.lr_schedule import SampleLRScheduler


class Held(Protocol):
    """`DeepSpeedEngine` as its helpers see it (`engine.DeepSpeedEngine` documents each part)."""

    ds: deepspeed.DeepSpeedEngine
    pipeline: bool
    scheduler: SampleLRScheduler
    padded_vocab_size: int
    fp16: bool

    @property
    def precision(self) -> str: ...

    def step_counters(self) -> tuple[int, int, int]: ...

    def withheld_update(
        self, counters: tuple[int, int, int]
    ) -> contextlib.AbstractContextManager: ...
