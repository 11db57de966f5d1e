"""What the torch backend's helper modules (`steps`, `full_state`, `dcp`) read of its engine:
the type they take, so they need not import `engine.py`, which imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from pretrain.training.backends.torch.pipeline import Pipeline
    from pretrain.training.schedules.lr_schedule import SampleLRScheduler


class Held(Protocol):
    """`TorchEngine` as its helpers see it (`engine.TorchEngine` documents each part)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: SampleLRScheduler
    checkpoint_group: torch.distributed.ProcessGroup
    padded_vocab_size: int
    pipe: Pipeline | None

    @property
    def precision(self) -> str: ...

    def loss_scale(self) -> float: ...
