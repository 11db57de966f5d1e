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

import torch


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
        self,
        optimizer: torch.optim.Optimizer,
        *,
        global_batch_size: int,
        max_lr: float,
        min_lr: float,
        warmup_samples: int,
        decay_samples: int,
        style: str,
        warmup_init: float = 0.0,
    ):
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self._kwargs = dict(
            max_lr=max_lr,
            min_lr=min_lr,
            warmup_samples=warmup_samples,
            decay_samples=decay_samples,
            style=style,
            warmup_init=warmup_init,
        )
        self.num_samples = 0
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.num_samples, **self._kwargs)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def step(self, increment: int | None = None) -> None:
        self.num_samples += self.global_batch_size if increment is None else increment
        self._apply()

    def state_dict(self) -> dict:
        return {"num_samples": self.num_samples, **self._kwargs}

    def load_state_dict(self, state: dict) -> None:
        # The schedule's shape comes from this run's flags (as Megatron's default
        # --override-opt_param-scheduler would); only the position is restored.
        self.num_samples = int(state["num_samples"])
        self._apply()
