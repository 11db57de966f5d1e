"""Megatron's learning-rate schedule, counted in samples.

Megatron steps its scheduler by the global batch size after every applied optimizer step, so the
schedule depends on samples seen, not on iterations; an fp16 step skipped for overflow does not
advance it (DeepSpeed calls `step()` only for applied steps, which gives the same behaviour).

lr(n): linear warmup from `warmup_init` to `max_lr` over the first `warmup_samples`; then, up to
`decay_samples`, r = (n - warmup) / (decay - warmup) and lr = min + coeff(r) (max - min) with
coeff = 1 - r (linear), 0.5 (1 + cos(pi r)) (cosine) or 1 (constant); after that min_lr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pretrain.errors import UserError


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """Megatron's learning-rate schedule, with every span already in samples."""

    lr: float
    """Peak learning rate (--lr)."""
    min_lr: float = 0.0
    """Floor after the decay (--min-lr)."""
    decay_style: str = "linear"
    """"constant", "linear" or "cosine" (--lr-decay-style)."""
    decay_samples: int
    """Samples from the start to the end of the decay (--lr-decay-iters x global batch, or
    --lr-decay-samples; default the whole run)."""
    warmup_samples: int = 0
    """Samples of linear warmup (--lr-warmup-iters/-samples/-fraction)."""
    warmup_init: float = 0.0
    """Learning rate at sample 0 of the warmup (--lr-warmup-init)."""


def lr_at(
    samples: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_samples: int,
    decay_samples: int,
    style: str,
    warmup_init: float = 0.0,
) -> float:
    """The learning rate after `samples` samples (the formula in the module docstring)."""
    if warmup_samples > 0 and samples <= warmup_samples:
        return warmup_init + (max_lr - warmup_init) * samples / warmup_samples
    if style == "constant":
        return max_lr
    if samples > decay_samples:
        return min_lr
    r = (samples - warmup_samples) / (decay_samples - warmup_samples)
    if style == "linear":
        coeff = 1.0 - r
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
    else:
        raise ValueError(f"unknown lr decay style {style!r}")
    return min_lr + coeff * (max_lr - min_lr)


class SampleLRScheduler:
    """Sets every param group's lr from `lr_at(samples)`; `step()` adds one global batch.

    DeepSpeed drives it as its `lr_scheduler` (step() after each applied optimizer step) and saves
    `state_dict()` in its checkpoints, so the schedule resumes where it stopped.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: LRScheduleConfig, *, global_batch_size: int
    ):
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self._kwargs = dict(
            max_lr=config.lr,
            min_lr=config.min_lr,
            warmup_samples=config.warmup_samples,
            decay_samples=config.decay_samples,
            style=config.decay_style,
            warmup_init=config.warmup_init,
        )
        self.num_samples = 0
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.num_samples, **self._kwargs)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> list[float]:
        """The learning rate of each param group now."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """Same as `get_lr` (torch's scheduler API, which DeepSpeed calls)."""
        return self.get_lr()

    def step(self, increment: int | None = None) -> None:
        """Advance by `increment` samples (default one global batch) and set the new lr."""
        self.num_samples += self.global_batch_size if increment is None else increment
        self._apply()

    def state_dict(self) -> dict:
        """The position (samples seen) and the shape, for DeepSpeed's checkpoint."""
        return {"num_samples": self.num_samples, **self._kwargs}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the shape comes from this run's flags."""
        # As Megatron's default --override-opt_param-scheduler would.
        self.num_samples = int(state["num_samples"])
        self._apply()


def spans_in_samples(
    *,
    train_iters: int | None,
    train_samples: int,
    global_batch_size: int,
    decay_iters: int | None,
    decay_samples: int | None,
    warmup_iters: int,
    warmup_samples: int,
    warmup_fraction: float | None,
) -> tuple[int, int]:
    """(decay, warmup) in samples, as Megatron counts them: iteration flags x global batch with
    --train-iters, sample flags with --train-samples; the decay defaults to the whole run."""
    gbs = global_batch_size
    iteration_based = train_iters is not None
    if iteration_based and (decay_samples is not None or warmup_samples):
        raise UserError(
            "--lr-decay-samples/--lr-warmup-samples go with --train-samples; with --train-iters "
            "use --lr-decay-iters/--lr-warmup-iters"
        )
    if not iteration_based and (decay_iters is not None or warmup_iters):
        raise UserError(
            "--lr-decay-iters/--lr-warmup-iters go with --train-iters; with --train-samples "
            "use --lr-decay-samples/--lr-warmup-samples"
        )
    if iteration_based:
        decay_iters = decay_iters if decay_iters is not None else train_iters
        decay = decay_iters * gbs
        warmup_fixed = warmup_iters * gbs
    else:
        decay = decay_samples if decay_samples is not None else train_samples
        warmup_fixed = warmup_samples
    if warmup_fraction is not None:
        if warmup_fixed:
            raise UserError(
                "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive "
                "(keep one)"
            )
        warmup = int(warmup_fraction * decay)
    else:
        warmup = warmup_fixed
    if warmup > decay:
        raise UserError(
            f"warmup ({warmup} samples) is longer than the decay span ({decay} samples) "
            f"(shorten --lr-warmup-* or lengthen --lr-decay-*)"
        )
    return decay, warmup
