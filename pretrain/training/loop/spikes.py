"""Loss spikes: --check-for-spiky-loss and what to do about one (--spiky-loss-policy).

An iteration's loss (already averaged over micro-batches and data-parallel ranks) is a spike
when it exceeds mean + K x sigma of the trailing window of the last W losses whose updates were
applied (sigma: the sample standard deviation), once the window holds at least `min_fill` of
them. Megatron main's `--check-for-spiky-loss` is the switch (Megatron re-runs the step through
its rerun state machine; we apply a policy instead, OLMo-core's skip-step idea):

- `warn`: one line naming the iteration; the update is applied and training goes on.
- `skip`: the update is withheld (`Engine.withheld_update`: weights, optimizer state, LR
  schedule, DeepSpeed's counters and this rank's RNG states are as before the iteration) and the
  batch is recorded as skipped, exactly like `--iterations-to-skip` for that iteration.
- `rewind`: reload the last committed checkpoint in --save, remember the offending batch's
  sample range as pending, and skip it when the run reaches it again (no checkpoint yet: one line,
  then `skip`).

The window and the pending ranges are `TrainState` fields, so every checkpoint carries them and a
resumed run detects exactly as the uninterrupted one. Every rank takes the same decision (one
all-reduce of the verdict).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.training.checkpoints.checkpointing import CheckpointConfig, rng_state
from pretrain.training.checkpoints.resume import (
    check_before_launch,
    load_checkpoint,
    restore_rng_state,
)
from pretrain.training.distributed import any_rank
from pretrain.training.loop.skip import record_skip
from pretrain.training.report.logging import logger
from pretrain.training.state import TrainState

if TYPE_CHECKING:  # imports deepspeed, which must wait for the launch environment
    from pretrain.training.engine import Engine

POLICIES = ("warn", "skip", "rewind")


@dataclass(frozen=True, kw_only=True)
class SpikeConfig:
    """Loss-spike detection and policy (--check-for-spiky-loss and the --spiky-loss-* flags)."""

    check_for_spiky_loss: bool = False
    """Detect loss spikes at all (--check-for-spiky-loss, Megatron main's switch)."""
    policy: str = "warn"
    """What a spike does: warn | skip | rewind (--spiky-loss-policy)."""
    window: int = 128
    """Trailing losses the mean and sigma come from (--spiky-loss-window; OLMo-core's 128)."""
    factor: float = 6.0
    """A spike exceeds mean + factor x sigma (--spiky-loss-factor; OLMo-core's 6)."""
    min_fill: int | None = None
    """Losses the window must hold before anything counts as a spike (--spiky-loss-min-window;
    None = half the window)."""

    @property
    def required(self) -> int:
        """The window fill at which detection starts."""
        return self.min_fill if self.min_fill is not None else max(2, self.window // 2)

    def problems(self, save: str | None) -> list[str]:
        """What is wrong with the flags; without detection only a policy, which would do
        nothing (Megatron main's --check-for-spiky-loss is the switch: the policy does not imply
        it, as the window and factor do not)."""
        if not self.check_for_spiky_loss:
            if self.policy == "warn":
                return []
            return [
                f"--spiky-loss-policy {self.policy} needs --check-for-spiky-loss (without it no "
                f"loss is checked for spikes; add it, or drop the policy)"
            ]
        out = []
        if self.window < 2 or not 2 <= self.required <= self.window:
            out.append(
                f"--spiky-loss-window {self.window} / --spiky-loss-min-window {self.min_fill}: "
                f"need 2 <= min-window <= window"
            )
        if not (math.isfinite(self.factor) and self.factor > 0):
            out.append(
                f"--spiky-loss-factor {self.factor}: must be a finite number > 0 (inf: no loss "
                f"is ever a spike)"
            )
        if self.policy == "rewind" and not save:
            out.append("--spiky-loss-policy rewind needs --save (it reloads the last checkpoint)")
        return out


def is_spike(window: list[float], loss: float, factor: float, required: int) -> bool:
    """True if `loss` exceeds mean + factor x sample-sigma of `window` (at least `required`
    values); a non-finite loss is never a spike (that is the NaN check's business)."""
    if len(window) < required or not math.isfinite(loss):
        return False
    return loss > statistics.fmean(window) + factor * statistics.stdev(window)


Rewinder = Callable[[TrainState], object | None]
"""Reloads the last committed checkpoint in --save into the given state (in place) and returns
the train batch iterator positioned after its consumed samples; None when there is none."""


def checkpoint_rewinder(
    config: CheckpointConfig,
    model: ModelConfig,
    parallel: ParallelConfig,
    engine: Engine,
    batches_after: Callable[[int], object],
) -> Rewinder:
    """The `Rewinder` of a run: resume (as --load does) from the newest complete checkpoint in
    --save; `batches_after(consumed)` gives the train batches after that many samples."""

    def rewind(train_state: TrainState):
        ckpt = dataclasses.replace(config, load=config.save, finetune=False, no_load_optim=False)
        choice = check_before_launch(ckpt, model, parallel)
        if choice is None:
            return None
        loaded, rng = load_checkpoint(ckpt, engine, choice, parallel)
        vars(train_state).update(vars(loaded))
        batches = batches_after(loaded.consumed_train_samples)
        if rng is not None:  # last, as at start-up: building loaders draws from the generator
            restore_rng_state(rng)
        return batches

    return rewind


class SpikePolicy:
    """The loop's spike hook. Per iteration: `before_step` (keeps the RNG states a withheld
    update puts back), `judge` for the step (the loss, before the update: apply it?), and after
    a withheld update `withhold` (skip, or rewind); `pending` says the next batch is one a
    rewind marked."""

    def __init__(self, config: SpikeConfig, train_state: TrainState, rewinder: Rewinder | None):
        self.config, self.state, self.rewinder = config, train_state, rewinder
        self.applied, self._loss, self._rng = True, math.nan, None
        self.judge = self._judge if config.check_for_spiky_loss else None
        """The step's judge (None without --check-for-spiky-loss: nothing to ask)."""

    def pending(self) -> bool:
        """True if the next batch lies in a range a rewind marked (ranges behind are dropped)."""
        start = self.state.consumed_train_samples
        ranges = self.state.spike_pending_skips
        ranges[:] = [r for r in ranges if r[1] > start]
        return any(a <= start for a, _ in ranges)

    def before_step(self) -> None:
        """Keep this rank's RNG states when an update may be withheld (skip, rewind)."""
        if self.config.check_for_spiky_loss and self.config.policy != "warn":
            self._rng = rng_state()

    def _judge(self, loss: float) -> bool:
        """Called on every rank with the iteration's loss before the update: True to apply it.
        The same answer on every rank; an applied loss joins the window."""
        c = self.config
        window = self.state.spike_loss_window
        spike = any_rank(is_spike(window, loss, c.factor, c.required))
        self.applied, self._loss = not spike or c.policy == "warn", loss
        if spike:
            logger.warning(
                f"WARNING: iteration {self.state.iteration + 1}: lm loss {loss:.6E} is a spike "
                f"(> mean {statistics.fmean(window):.6E} + {c.factor:g} x sigma "
                f"{statistics.stdev(window):.6E} of the last {len(window)} iterations); "
                + ("training on it" if self.applied else "update withheld")
                + f" (--spiky-loss-policy {c.policy})"
            )
        if self.applied and math.isfinite(loss):
            window.append(loss)
            del window[: -c.window]
        return self.applied

    def withhold(self, global_batch_size: int, train_batches):
        """After a withheld update: put the RNG states back, then rewind (the batch becomes
        pending) or skip (recorded like --iterations-to-skip); returns the batches to go on with."""
        restore_rng_state(self._rng)
        state, start = self.state, self.state.consumed_train_samples
        if self.config.policy == "rewind":
            # skips since the checkpoint must happen again after it, and this batch too
            again = state.spike_pending_skips + state.skipped_train_samples
            again = again + [(start, start + global_batch_size)]
            batches = self.rewinder(state) if self.rewinder is not None else None
            if batches is not None:
                done = state.skipped_train_samples
                state.spike_pending_skips[:] = [
                    r for r in again if r not in done and r[1] > state.consumed_train_samples
                ]
                logger.info(
                    f"rewound to iteration {state.iteration} (--spiky-loss-policy rewind); "
                    f"training samples [{start}, {start + global_batch_size}) will be skipped"
                )
                return batches
            logger.warning(
                "WARNING: --spiky-loss-policy rewind: no committed checkpoint in --save yet; "
                "skipping the batch instead"
            )
        reason = f"--spiky-loss-policy {self.config.policy}, lm loss {self._loss:.6E}"
        record_skip(state, global_batch_size, reason)
        return train_batches
