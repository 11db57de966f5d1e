"""When and how to evaluate during and after training (Megatron's schedule and log lines).

During training: `eval_iters` validation batches after every `eval_interval` iterations. After a
run that reached --train-iters (not an early exit): one more validation pass and, when the test
split exists, one test pass, printed "... at iteration N on validation set" / "on test set"
exactly as Megatron-LM prints them.

A pass evaluates every validation set in turn (`validation_sets`: the valid split, or one set
per --valid-data-path prefix with --multiple-validation-sets).

Without a validation split (e.g. `--split 100,0,0`) Megatron silently never evaluates; so do we,
after one info line saying why. `--eval-iters 0` means no evaluation and no valid/test loaders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pretrain.training.report.logging import MetricsLogger, logger
from pretrain.training.report.per_source import SourceLosses
from pretrain.training.report.validation_sets import ValidationSet
from pretrain.training.state import TrainState

if TYPE_CHECKING:  # imports deepspeed, which must wait for the launch environment
    from pretrain.training.engine import Engine


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Megatron's evaluation flags."""

    eval_interval: int = 1000
    """Evaluate after every this many iterations (--eval-interval)."""
    eval_iters: int = 100
    """Global batches per evaluation (of each validation set); 0 = never evaluate (--eval-iters)."""
    multiple_validation_sets: bool = False
    """Evaluate each --valid-data-path prefix as its own set (--multiple-validation-sets)."""
    validation_set_names: list[str] | None = None
    """Those sets' names in log lines and scalars, instead of 0, 1, ... (--validation-set-names)."""


class Evaluator:
    """Runs and logs the validation (and, at the end, test) passes; `should_evaluate` says when."""

    def __init__(
        self,
        config: EvalConfig,
        valid_sets: list[ValidationSet],
        test_batches,
        *,
        global_batch_size: int,
        num_microbatches: int,
        use_document_ids: bool,
        device: torch.device,
        metrics: MetricsLogger,
    ):
        self.config, self.metrics = config, metrics
        self.valid_sets, self.test_batches = valid_sets, test_batches
        self.global_batch_size, self.num_microbatches = global_batch_size, num_microbatches
        self.use_document_ids, self.device = use_document_ids, device

    def note_missing_data(self, source: str) -> None:
        """Say once (info) why --eval-iters > 0 evaluates nothing, or only the final test pass;
        `source` names where the splits come from (e.g. "--split 100,0,0")."""
        if self.config.eval_iters == 0 or self.valid_sets:
            return
        test = (
            "only the final test pass runs"
            if self.test_batches is not None
            else "no evaluation runs (nor a final test pass)"
        )
        logger.info(
            f"no validation data ({source} leaves the valid split empty): "
            f"--eval-iters {self.config.eval_iters} is unused and {test}"
        )

    def should_evaluate(self, iteration: int) -> bool:
        """True after the iterations at which Megatron evaluates (and only if there is data)."""
        return (
            bool(self.valid_sets)
            and self.config.eval_iters > 0
            and iteration % self.config.eval_interval == 0
        )

    def _loss(self, engine: Engine, batches, sources: SourceLosses | None = None) -> float:
        return engine.evaluation_loss(
            batches,
            self.config.eval_iters,
            self.num_microbatches,
            self.use_document_ids,
            self.device,
            sources,
        )

    def evaluate(self, engine: Engine, train_state: TrainState, where: str = "") -> None:
        """One validation pass over every set; advances the consumed validation samples (the
        position in each set: every set draws the same samples per pass) and logs the losses."""
        for valid in self.valid_sets:
            sources = SourceLosses(valid.sources, self.device) if valid.sources else None
            loss = self._loss(engine, valid.batches, sources)
            self.metrics.log_validation(train_state.iteration, loss, where, suffix=valid.suffix)
            if sources is not None:
                sources.reduce()
                self.metrics.log_validation_sources(train_state.iteration, sources, where)
        train_state.consumed_valid_samples += self.config.eval_iters * self.global_batch_size

    def evaluate_at_end(self, engine: Engine, train_state: TrainState) -> None:
        """Megatron's passes after the last iteration: validation, then test if it exists."""
        if self.config.eval_iters == 0:
            return
        if self.valid_sets:
            self.evaluate(engine, train_state, " on validation set")
        if self.test_batches is not None:
            loss = self._loss(engine, self.test_batches)
            self.metrics.log_validation(train_state.iteration, loss, " on test set", split="test")
