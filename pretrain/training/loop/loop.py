"""The training loop: step, then ask the metrics, the evaluator and the checkpointer what is due.

The loop owns only the iteration count and the stopping rules (--train-iters, --exit-interval,
--exit-duration-in-mins); what to log, when to evaluate and when to save are decided by the
small objects it is handed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pretrain.data.blends.mixture_dataset import MixtureCounter, consumed_tokens
from pretrain.testing_hooks import RAISE_IN_STEP, raise_here
from pretrain.training.checkpoints.checkpointing import Checkpointer
from pretrain.training.distributed import any_rank
from pretrain.training.loop.divergence import DivergenceCheck
from pretrain.training.loop.exit_signal import ExitSignal
from pretrain.training.loop.manual_gc import ManualGC, ManualGCConfig
from pretrain.training.loop.skip import flatten_iterations, skip_iteration
from pretrain.training.loop.spikes import Rewinder, SpikeConfig, SpikePolicy
from pretrain.training.report.evaluator import Evaluator
from pretrain.training.report.logging import MetricsLogger, logger
from pretrain.training.schedules.batch_schedule import BatchSchedule
from pretrain.training.state import TrainState
from pretrain.training.step import model_iteration

if TYPE_CHECKING:
    from pretrain.training.engine import Engine


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How much to train, in what batches, and when to stop early."""

    micro_batch_size: int
    """Samples per forward pass per rank (--micro-batch-size)."""
    global_batch_size: int
    """Samples per iteration over all data-parallel ranks (--global-batch-size)."""
    num_microbatches: int
    """Gradient-accumulation steps per data-parallel rank: global / (micro x DP)."""
    batch_schedule: BatchSchedule | None = None
    """--rampup-batch-size / --step-batch-size-schedule; None = always `global_batch_size`."""
    train_iters: int
    """Iterations to train (--train-iters, or --train-samples / global batch)."""
    train_samples: int | None = None
    """Samples to train when sample-based (--train-samples), else None."""
    seq_length: int
    """Tokens per sample (--seq-length)."""
    seed: int = 1234
    """Seed of the weights, dropout and data order (--seed)."""
    exit_interval: int | None = None
    """Save (with --save) and exit after an iteration divisible by this (--exit-interval)."""
    exit_duration_in_mins: float | None = None
    """Save and exit after this many minutes (--exit-duration-in-mins)."""
    train_tokens: int | None = None
    """Also end training once consumed samples x seq_length reach this (--train-tokens,
    Megatron-DeepSpeed's second stopping rule; the run counts as completed)."""
    exit_signal_handler: bool = False
    """On --exit-signal, finish the iteration, save (with --save) and exit 0
    (--exit-signal-handler)."""
    exit_signal: str = "SIGTERM"
    """The signal --exit-signal-handler waits for (--exit-signal)."""
    iterations_to_skip: list[list[int]] | None = None
    """1-indexed iterations whose batches are read and dropped (--iterations-to-skip N|A-B ...)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop every rank at the first NaN/Inf loss or grad norm, before any save
    (--check-for-nan-in-loss-and-grad; off: --no-check-for-nan-in-loss-and-grad)."""
    spikes: SpikeConfig = SpikeConfig()
    """Loss-spike detection and policy (--check-for-spiky-loss, --spiky-loss-*)."""
    manual_gc: ManualGCConfig = ManualGCConfig()
    """When the garbage collector runs (--manual-gc, --manual-gc-interval, --no-manual-gc-eval)."""


def _should_exit(config: TrainingConfig, iteration: int, started: float) -> bool:
    stop = bool(config.exit_interval) and iteration % config.exit_interval == 0  # 0: off
    if config.exit_duration_in_mins is not None:
        minutes = (time.monotonic() - started) / 60
        stop = stop or any_rank(minutes > config.exit_duration_in_mins)
    return stop


def _tokens_done(config: TrainingConfig, train_state: TrainState) -> bool:
    tokens = train_state.consumed_train_samples * config.seq_length
    return config.train_tokens is not None and tokens >= config.train_tokens


def _batch_at(config: TrainingConfig, consumed_samples: int) -> tuple[int, int]:
    """(global batch, micro-batches per rank) of the iteration after `consumed_samples`."""
    if config.batch_schedule is None:
        return config.global_batch_size, config.num_microbatches
    schedule = config.batch_schedule
    return (
        schedule.global_batch_size_at(consumed_samples),
        schedule.num_microbatches_at(consumed_samples),
    )


def train(
    config: TrainingConfig,
    engine: Engine,
    train_state: TrainState,
    train_batches,
    *,
    metrics: MetricsLogger,
    evaluator: Evaluator,
    checkpointer: Checkpointer,
    use_document_ids: bool,
    device: torch.device,
    exit_signal: ExitSignal | None = None,
    rewinder: Rewinder | None = None,
    mixture: MixtureCounter | None = None,
) -> bool:
    """Train from `train_state` to --train-iters (or an early exit); save at the end if any
    iteration ran (a finished run launched again saves nothing). `mixture` counts each
    source's samples into `train_state.data_mixture` after every iteration.

    Returns True when --train-iters was reached, False after an early exit (Megatron runs its
    final evaluation only in the first case)."""
    started, first_iteration = time.monotonic(), train_state.iteration
    to_skip = flatten_iterations(config.iterations_to_skip)
    divergence = DivergenceCheck(config.check_for_nan_in_loss_and_grad, engine)
    spikes = SpikePolicy(config.spikes, train_state, rewinder)
    gc_points = ManualGC(config.manual_gc)
    with gc_points.running(), checkpointer.committing_on_error(engine):
        while train_state.iteration < config.train_iters and not _tokens_done(config, train_state):
            # Megatron's update_num_microbatches(consumed): the batch of this iteration
            global_batch, num_microbatches = _batch_at(config, train_state.consumed_train_samples)
            engine.set_global_batch_size(global_batch)
            if train_state.iteration + 1 in to_skip:
                skip_iteration(train_batches, num_microbatches, global_batch, train_state)
                continue
            if spikes.pending():  # a batch a spike rewind marked
                reason = "--spiky-loss-policy rewind"
                skip_iteration(train_batches, num_microbatches, global_batch, train_state, reason)
                continue
            step_start = time.perf_counter()
            raise_here(RAISE_IN_STEP, train_state.iteration + 1)
            spikes.before_step()
            with model_iteration(engine, num_microbatches, lambda: spikes.applied):
                loss = engine.train_step(
                    train_batches, num_microbatches, use_document_ids, device, spikes.judge
                )
            if not spikes.applied:  # a spike under skip/rewind: no update was made
                if config.spikes.policy == "rewind":  # to the newest step: a pending one too
                    checkpointer.wait(engine)
                train_batches = spikes.withhold(global_batch, train_batches)
                continue
            seconds = time.perf_counter() - step_start
            train_state.iteration += 1
            train_state.consumed_train_samples += global_batch
            source_tokens = _count_sources(train_state, mixture, config.seq_length)
            _record(metrics, engine, train_state, global_batch, loss, seconds, source_tokens)
            divergence.after_step(
                train_state.iteration, loss, lambda: checkpointer.committed_before_stop(engine)
            )
            gc_points.after_iteration(train_state.iteration)
            _evaluate_and_save(engine, train_state, evaluator, checkpointer, gc_points)
            why = _exit_reason(config, train_state.iteration, started, exit_signal)
            if why is not None:
                _stop(engine, train_state, checkpointer, why)
                return False
    if train_state.iteration > first_iteration:
        _count_sources(train_state, mixture, config.seq_length)  # after skipped iterations
        checkpointer.save_if_unsaved(engine, train_state)
    return True


def _record(
    metrics: MetricsLogger,
    engine: Engine,
    train_state: TrainState,
    global_batch: int,
    loss: float,
    seconds: float,
    source_tokens: dict[str, int] | None,
) -> None:
    """Hand the iteration that just ran to the metrics (the engine's figures after its step,
    as Megatron logs them)."""
    metrics.record_iteration(
        iteration=train_state.iteration,
        consumed_samples=train_state.consumed_train_samples,
        global_batch_size=global_batch,
        loss=loss,
        seconds=seconds,
        learning_rate=engine.learning_rate(),
        grad_norm=engine.grad_norm(),
        loss_scale=engine.loss_scale(),
        skipped_steps=engine.skipped_steps,
        source_tokens=source_tokens,
    )


def _evaluate_and_save(
    engine: Engine,
    train_state: TrainState,
    evaluator: Evaluator,
    checkpointer: Checkpointer,
    gc_points: ManualGC,
) -> None:
    """After an iteration: evaluate when due, commit a finished background save, save when due."""
    if evaluator.should_evaluate(train_state.iteration):
        with gc_points.evaluation():
            evaluator.evaluate(engine, train_state)
    checkpointer.poll(engine)  # commits a background save once every rank has written it
    if checkpointer.should_save(train_state.iteration):
        checkpointer.save(engine, train_state)


def _exit_reason(
    config: TrainingConfig, iteration: int, started: float, exit_signal: ExitSignal | None
) -> str | None:
    """Why the run stops early after `iteration`, as the exit line says it; None: it goes on."""
    if _should_exit(config, iteration, started):
        return " (--exit-interval / --exit-duration-in-mins)"
    if exit_signal is not None and exit_signal.requested():
        return f": {exit_signal.name} received (--exit-signal-handler)"
    return None


def _stop(engine: Engine, train_state: TrainState, checkpointer: Checkpointer, why: str) -> None:
    """An early exit: save this iteration (with --save) and commit it, then one line naming
    the step a relaunch resumes from."""
    checkpointer.save_if_unsaved(engine, train_state)
    resume = checkpointer.committed_before_stop(engine)
    logger.info(
        f"exiting after iteration {train_state.iteration}{why}"
        + (f"; a relaunch resumes from {resume}" if resume else "; no checkpoint to resume from")
    )


def _count_sources(
    train_state: TrainState, mixture: MixtureCounter | None, seq_length: int
) -> dict[str, int] | None:
    """Set `train_state.data_mixture` at its consumed samples; return the training tokens read
    per source when the train data has several (None otherwise)."""
    if mixture is None:
        return None
    train_state.data_mixture = mixture.record(train_state.consumed_train_samples)
    tokens = consumed_tokens(train_state.data_mixture, seq_length)
    return tokens if len(tokens) > 1 else None
