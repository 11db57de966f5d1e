"""When and how to evaluate on the validation split during training (Megatron's schedule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pretrain.training.logging import MetricsLogger
from pretrain.training.state import TrainState
from pretrain.training.step import evaluation_loss

if TYPE_CHECKING:  # imports deepspeed, which must wait for the launch environment
    from pretrain.training.engine import Engine


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Megatron's evaluation flags."""

    eval_interval: int = 1000
    """Evaluate after every this many iterations (--eval-interval)."""
    eval_iters: int = 100
    """Global batches per evaluation; 0 = never evaluate (--eval-iters)."""


class Evaluator:
    """Runs `eval_iters` validation batches every `eval_interval` iterations and logs the loss."""

    def __init__(
        self,
        config: EvalConfig,
        batches,
        *,
        global_batch_size: int,
        num_microbatches: int,
        use_mask: bool,
        device: torch.device,
        metrics: MetricsLogger,
    ):
        self.config, self.batches, self.metrics = config, batches, metrics
        self.global_batch_size, self.num_microbatches = global_batch_size, num_microbatches
        self.use_mask, self.device = use_mask, device

    def should_evaluate(self, iteration: int) -> bool:
        """True after the iterations at which Megatron evaluates (and only if there is data)."""
        return (
            self.batches is not None
            and self.config.eval_iters > 0
            and iteration % self.config.eval_interval == 0
        )

    def evaluate(self, engine: Engine, train_state: TrainState) -> float:
        """One evaluation; advances the consumed validation samples and logs the loss."""
        loss = evaluation_loss(
            engine,
            self.batches,
            self.config.eval_iters,
            self.num_microbatches,
            self.use_mask,
            self.device,
        )
        train_state.consumed_valid_samples += self.config.eval_iters * self.global_batch_size
        self.metrics.log_validation(train_state.iteration, loss)
        return loss
