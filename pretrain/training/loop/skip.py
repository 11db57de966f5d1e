"""Skipping bad data: Megatron-LM's --iterations-to-skip.

Megatron main: before iteration `i` (1-indexed) in --iterations-to-skip, the iteration's micro-
batches are read from the training iterator and dropped; the iteration count and the consumed
samples advance by one global batch, nothing else happens (no forward, no optimizer or LR
scheduler step). We do the same, print one line saying so, and record the skipped *sample range*
[start, end) of consumed training samples in the TrainState (and so in every later checkpoint):
iteration numbers change meaning with the batch size, sample ranges do not. Extension: `A-B`
skips iterations A..B inclusive.
"""

from __future__ import annotations

import argparse

from pretrain.training.report.logging import logger
from pretrain.training.state import TrainState


def iteration_spec(value: str) -> list[int]:
    """argparse type of one --iterations-to-skip value: `N` or the inclusive range `A-B`."""
    first, sep, last = value.partition("-")
    try:
        start, end = int(first), int(last if sep else first)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an iteration N or a range A-B (e.g. 120 or 120-125)"
        ) from None
    if start < 1 or end < start:
        raise argparse.ArgumentTypeError(
            f"{value!r}: iterations are 1-indexed and a range A-B needs 1 <= A <= B"
        )
    return list(range(start, end + 1))


def flatten_iterations(specs: list[list[int]] | None) -> frozenset[int]:
    """The set of iterations named by the parsed --iterations-to-skip values."""
    return frozenset(i for spec in specs or () for i in spec)


def skip_iteration(
    train_batches,
    num_microbatches: int,
    global_batch_size: int,
    train_state: TrainState,
    reason: str = "--iterations-to-skip",
) -> None:
    """Read and drop this rank's micro-batches of the next iteration, then `record_skip`."""
    for _ in range(num_microbatches):
        next(train_batches)
    record_skip(train_state, global_batch_size, reason)


def record_skip(train_state: TrainState, global_batch_size: int, reason: str) -> None:
    """Count the next iteration as done without a step: advance the state, record the skipped
    samples [start, end) and say so in one line naming `reason`."""
    start = train_state.consumed_train_samples
    end = start + global_batch_size
    train_state.iteration += 1
    train_state.consumed_train_samples = end
    ranges = train_state.skipped_train_samples
    if ranges and ranges[-1][1] == start:  # consecutive skips: one range
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))
    logger.info(
        f" iteration {train_state.iteration:8d} | skipped ({reason}): training samples "
        f"[{start}, {end}) consumed without a step"
    )


def skipped_in(ranges, start: int, end: int) -> bool:
    """True if any sample of [start, end) lies in one of the skipped ranges."""
    return any(a < end and start < b for a, b in ranges)
