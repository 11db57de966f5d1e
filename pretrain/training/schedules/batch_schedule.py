"""Batch-size schedules: the global batch size as a function of the samples consumed so far.

Megatron-LM has two generations, both reproduced here (docs/TRAINING.md, "Batch-size schedules"):

- `--rampup-batch-size START INCREMENT SAMPLES` (megatron-core <= 0.16,
  `RampupBatchsizeNumMicroBatchesCalculator`; Megatron-DeepSpeed): the batch grows from START to
  --global-batch-size in steps of INCREMENT, each step lasting SAMPLES / ((final - START) /
  INCREMENT) samples (a float); after SAMPLES consumed samples it is the final size.
- `--step-batch-size-schedule "THRESHOLD:BS ..."` (Megatron-LM main,
  `StepBatchsizeNumMicroBatchesCalculator`): the batch is the BS of the last entry whose
  threshold is <= the consumed samples. Numbers take K/M/B/T suffixes (1e3 .. 1e12); thresholds
  are tokens, turned into samples by integer division by --seq-length; the first must be 0.

The number of micro-batches of an iteration is its batch / (micro batch x DP); the samplers are
micro-batch granular (each micro-batch step takes the next micro x DP samples), so the data order
is that of a constant batch and only the number of micro-batches per iteration changes, as in
Megatron. The schedule is evaluated at the consumed samples *before* the iteration.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pretrain.errors import UserError

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str, entry: str) -> int:
    """'2.4B' -> 2400000000, as Megatron parses it (int(float(digits) x multiplier))."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if multiplier != 1 else text
    try:
        return int(float(digits) * multiplier)
    except ValueError:
        raise UserError(
            f'--step-batch-size-schedule: "{entry}" is not THRESHOLD:BATCH with numbers '
            f"(suffixes K, M, B, T allowed), e.g. '0:256 10B:512'"
        ) from None


def parse_step_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """ "0:768 250B:1536" -> ((0, 768), (250e9 // seq_length, 1536)), sorted; UserError if bad."""
    entries = text.strip().replace(",", " ").split()
    if not entries:
        raise UserError("--step-batch-size-schedule is empty (give e.g. '0:256 10B:512')")
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise UserError(
                f'--step-batch-size-schedule: entry "{entry}" has no ":" (expected '
                f"THRESHOLD:BATCH, e.g. '0:256 10B:512')"
            )
        threshold, batch = (_number(part, entry) for part in entry.split(":", 1))
        if seq_length is not None:
            threshold //= seq_length
        schedule.append((threshold, batch))
    schedule.sort(key=lambda pair: pair[0])
    if schedule[0][0] != 0:
        raise UserError(
            f"--step-batch-size-schedule: the first threshold must be 0, got {schedule[0][0]} "
            f"samples (add a '0:BATCH' entry)"
        )
    for (before, _), (after, _) in zip(schedule, schedule[1:], strict=False):
        if after <= before:
            raise UserError(
                f"--step-batch-size-schedule: thresholds must increase, got {before} then "
                f"{after} samples (tokens are divided by --seq-length; make them distinct)"
            )
    if any(batch <= 0 for _, batch in schedule):
        raise UserError("--step-batch-size-schedule: every batch size must be positive")
    return tuple(schedule)


def _check_rampup(start: int, increment: int, samples: int, final: int) -> None:
    problems = []
    if start <= 0 or increment <= 0:
        problems.append("START and INCREMENT must be positive")
    if samples <= 0 and start != final:
        problems.append("SAMPLES must be positive (megatron-core divides by it)")
    if start > final:
        problems.append(f"START {start} is larger than --global-batch-size {final}")
    elif increment > 0 and (final - start) % increment:
        problems.append(
            f"--global-batch-size {final} - START {start} = {final - start} is not a multiple of "
            f"INCREMENT {increment}"
        )
    if problems:
        raise UserError(
            f"--rampup-batch-size {start} {increment} {samples}: " + "; ".join(problems)
        )


@dataclass(frozen=True, kw_only=True)
class BatchSchedule:
    """The global batch size (and micro-batch count) at any number of consumed samples."""

    micro_batch_size: int
    """Samples per forward pass per rank (--micro-batch-size)."""
    data_parallel_size: int
    """Data-parallel ranks sharing each micro-batch step."""
    global_batch_size: int
    """The final (and, without a schedule, only) global batch size."""
    rampup: tuple[int, int, int] | None = None
    """(START, INCREMENT, SAMPLES) of --rampup-batch-size, or None."""
    steps: tuple[tuple[int, int], ...] | None = None
    """((threshold samples, batch), ...) of --step-batch-size-schedule, or None."""

    def __post_init__(self):
        if self.rampup is not None and self.steps is not None:
            raise UserError(
                "--rampup-batch-size and --step-batch-size-schedule are exclusive (keep one)"
            )
        if self.rampup is not None:
            _check_rampup(*self.rampup, self.global_batch_size)

    @property
    def varies(self) -> bool:
        """True when the batch size changes during the run."""
        return self.rampup is not None or self.steps is not None

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples` samples."""
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, size in self.steps:
                if consumed_samples < threshold:
                    break
                batch = size
            return batch
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        increments = (self.global_batch_size - start) // increment
        if consumed_samples > samples or increments == 0:
            return self.global_batch_size
        samples_per_increment = samples / increments
        return start + int(consumed_samples / samples_per_increment) * increment

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Micro-batches per rank in the iteration that starts after `consumed_samples`."""
        per_step = self.micro_batch_size * self.data_parallel_size
        return self.global_batch_size_at(consumed_samples) // per_step

    def _changes_end(self) -> int:
        """Consumed samples from which the batch no longer changes."""
        if self.steps is not None:
            return self.steps[-1][0]
        return self.rampup[2] + 1 if self.rampup is not None else 0

    def iterations(self, consumed_samples: int, train_samples: int) -> Iterator[tuple[int, int]]:
        """(consumed before, batch) of each iteration from `consumed_samples` while the batch
        can still change and the run has samples left."""
        consumed = consumed_samples
        while consumed < min(self._changes_end(), train_samples):
            batch = self.global_batch_size_at(consumed)
            yield consumed, batch
            consumed += batch

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a --train-samples run, counted as Megatron counts them."""
        if self.steps is not None:  # Megatron-LM main: iterate until the samples are reached
            consumed = iterations = 0
            while consumed < train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
            return iterations
        if self.rampup is None:
            return train_samples // self.global_batch_size
        # megatron-core 0.16: the ramp-up phase (its loop includes the boundary sample), then
        # whole final-size batches, dropping a partial last one
        consumed = iterations = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def check_divisible(self, consumed_samples: int, train_samples: int) -> None:
        """UserError unless every batch from `consumed_samples` on divides into micro x DP."""
        per_step = self.micro_batch_size * self.data_parallel_size
        sizes = {self.global_batch_size_at(consumed_samples)}
        sizes.update(batch for _, batch in self.iterations(consumed_samples, train_samples))
        if consumed_samples < train_samples and self._changes_end() < train_samples:
            sizes.add(self.global_batch_size_at(max(consumed_samples, self._changes_end())))
        bad = sorted(size for size in sizes if size % per_step)
        if bad:
            flag = (
                "--rampup-batch-size" if self.rampup is not None else "--step-batch-size-schedule"
            )
            raise UserError(
                f"{flag}: global batch size(s) {', '.join(map(str, bad))} are not divisible by "
                f"--micro-batch-size {self.micro_batch_size} x data-parallel size "
                f"{self.data_parallel_size} = {per_step} (use batch sizes that are multiples of "
                f"{per_step})"
            )
