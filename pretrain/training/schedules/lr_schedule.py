"""Megatron's learning-rate schedule, counted in samples.

Megatron steps its scheduler by the iteration's global batch size after every applied optimizer
step, so the schedule depends on samples seen, not on iterations (with a batch-size schedule the
increment changes as the batch grows); an fp16 step skipped for overflow does not advance it
(DeepSpeed calls `step()` only for applied steps, which gives the same behaviour).

lr(n), n = samples seen: linear warmup from `warmup_init` to `max_lr` over the first
`warmup_samples` (n <= warmup); `constant` stays at max_lr for ever; otherwise min_lr once
n > `decay_samples`, and in between

- `linear`: coeff = 1 - r, `cosine`: coeff = (1 + cos(pi r)) / 2, with r = (n - warmup) /
  (decay - warmup), lr = min + coeff (max - min);
- `inverse-square-root`: lr = max(min, max_lr sqrt(max(warmup, 1)) / sqrt(max(n, 1)));
- `WSD` (warmup-stable-decay): coeff = 1 until the anneal starts at decay - wsd, then with
  w = (n - (decay - wsd)) / wsd: `linear` 1 - w, `cosine` (1 + cos(pi w)) / 2,
  `exponential` 2 * 0.5^w - 1, `minus_sqrt` 1 - sqrt(w).

Spans are in samples: with --train-iters, the iteration flags times the global batch size; with
--train-samples, the sample flags; a warmup fraction is fraction x decay, kept fractional as
Megatron keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pretrain.errors import UserError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """Megatron's learning-rate schedule, with every span already in samples."""

    lr: float
    """Peak learning rate (--lr)."""
    min_lr: float = 0.0
    """Floor after the decay (--min-lr)."""
    decay_style: str = "linear"
    """One of DECAY_STYLES (--lr-decay-style)."""
    decay_samples: int
    """Samples from the start to the end of the decay (--lr-decay-iters x global batch, or
    --lr-decay-samples; default the whole run)."""
    warmup_samples: float = 0
    """Samples of linear warmup (--lr-warmup-iters/-samples, or --lr-warmup-fraction x decay,
    which may be fractional)."""
    warmup_init: float = 0.0
    """Learning rate at sample 0 of the warmup (--lr-warmup-init)."""
    wsd_decay_samples: int | None = None
    """WSD: samples of the final anneal (--lr-wsd-decay-iters x global batch, or
    --lr-wsd-decay-samples); None for the other styles."""
    wsd_decay_style: str = "exponential"
    """WSD: the anneal's shape, one of WSD_DECAY_STYLES (--lr-wsd-decay-style)."""


def _wsd_coeff(samples: int, decay_samples: int, wsd_samples: int, style: str) -> float:
    anneal_start = decay_samples - wsd_samples
    if samples <= anneal_start:
        return 1.0
    w = (samples - anneal_start) / wsd_samples
    if style == "linear":
        return 1.0 - w
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * w) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, w) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(w)
    raise ValueError(f"unknown WSD decay style {style!r}")


def lr_at(
    samples: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_samples: float,
    decay_samples: int,
    style: str,
    warmup_init: float = 0.0,
    wsd_decay_samples: int | None = None,
    wsd_style: str = "exponential",
) -> float:
    """The learning rate after `samples` samples (the formulas in the module docstring)."""
    if warmup_samples > 0 and samples <= warmup_samples:
        return warmup_init + (max_lr - warmup_init) * float(samples) / float(warmup_samples)
    if style == "constant":
        return max_lr
    if samples > decay_samples:
        return min_lr
    if style == "inverse-square-root":
        lr = max_lr * max(warmup_samples, 1) ** 0.5 / max(samples, 1) ** 0.5
        return max(min_lr, lr)
    r = float(samples - warmup_samples) / float(decay_samples - warmup_samples)
    if style == "linear":
        coeff = 1.0 - r
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
    elif style == "WSD":
        coeff = _wsd_coeff(samples, decay_samples, wsd_decay_samples, wsd_style)
    else:
        raise ValueError(f"unknown lr decay style {style!r}")
    return min_lr + coeff * (max_lr - min_lr)


# The schedule's values in checkpoints, by Megatron's `OptimizerParamScheduler` names (its
# state_dict's for the first five, its constructor's for the last three, which its state_dict
# omits) -> our `lr_at` keyword (also the key checkpoints written before held the value under).
STATE_NAMES = {
    "max_lr": "max_lr",
    "min_lr": "min_lr",
    "lr_warmup_steps": "warmup_samples",
    "lr_decay_steps": "decay_samples",
    "lr_decay_style": "style",
    "init_lr": "warmup_init",
    "wsd_decay_steps": "wsd_decay_samples",
    "lr_wsd_decay_style": "wsd_style",
}


def saved_schedule(state: dict) -> tuple[int, dict]:
    """(samples seen, the schedule values it records by Megatron's names) from a scheduler
    `state_dict`, ours in either naming (Megatron's since issue 25, `lr_at`'s before)."""
    position = state["num_steps"] if "num_steps" in state else state["num_samples"]
    values = {}
    for name, old in STATE_NAMES.items():
        if name in state or old in state:
            values[name] = state[name] if name in state else state[old]
    return int(position), values


class SampleLRScheduler:
    """Sets every param group's lr from `lr_at(samples)`; `step()` adds one global batch.

    DeepSpeed drives it as its `lr_scheduler` (step() after each applied optimizer step) and saves
    `state_dict()` in its checkpoints, so the schedule resumes where it stopped. With a batch-size
    schedule the loop sets `increment` to the iteration's global batch before each step. A load
    takes the position and keeps the checkpoint's values in `loaded`; which schedule continues is
    `pretrain.training.checkpoints.scheduler_resume`'s decision.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: LRScheduleConfig, *, global_batch_size: int
    ):
        self.optimizer = optimizer
        self.increment = global_batch_size
        self._kwargs = dict(
            max_lr=config.lr,
            min_lr=config.min_lr,
            warmup_samples=config.warmup_samples,
            decay_samples=config.decay_samples,
            style=config.decay_style,
            warmup_init=config.warmup_init,
            wsd_decay_samples=config.wsd_decay_samples,
            wsd_style=config.wsd_decay_style,
        )
        self.num_samples = 0
        self.loaded: dict | None = None
        """The schedule values (Megatron's names) of the last `load_state_dict`; None before."""
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
        """Advance by `increment` samples (default `self.increment`, the iteration's global
        batch) and set the new lr."""
        self.num_samples += self.increment if increment is None else increment
        self._apply()

    def values(self) -> dict:
        """The schedule this scheduler follows, by Megatron's names (`STATE_NAMES`)."""
        return {name: self._kwargs[key] for name, key in STATE_NAMES.items()}

    def use_values(self, values: dict) -> None:
        """Follow `values` (Megatron's names, any subset) from the current position."""
        for name, value in values.items():
            self._kwargs[STATE_NAMES[name]] = value
        self._apply()

    def state_dict(self) -> dict:
        """The position (`num_steps`, samples seen) and the schedule, by Megatron's names."""
        return {"num_steps": self.num_samples, **self.values()}

    def load_state_dict(self, state: dict) -> None:
        """Take the position; keep the checkpoint's schedule values in `loaded` (this run's
        flags' schedule stays until `scheduler_resume` decides)."""
        self.num_samples, self.loaded = saved_schedule(state)
        self._apply()


@dataclass(frozen=True, kw_only=True)
class ScheduleSpans:
    """The LR schedule's spans, in samples, as Megatron derives them from the flags."""

    decay: int
    """End of the decay (lr_decay_steps)."""
    warmup: float
    """End of the warmup (lr_warmup_steps; fractional with --lr-warmup-fraction)."""
    wsd: int | None
    """WSD anneal length (wsd_decay_steps), None when not given."""


def _check_mode(iteration_based: bool, iteration_flags: dict, sample_flags: dict) -> None:
    """Refuse sample-span flags with --train-iters and iteration-span flags with --train-samples."""
    wrong = sample_flags if iteration_based else iteration_flags
    given = [flag for flag, value in wrong.items() if value]
    if given:
        mode, other = (
            ("--train-iters", "-iters") if iteration_based else ("--train-samples", "-samples")
        )
        raise UserError(
            f"{'/'.join(given)} cannot be used with {mode}; use the {other} form of the flag"
        )


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
    wsd_decay_iters: int | None = None,
    wsd_decay_samples: int | None = None,
) -> ScheduleSpans:
    """The spans in samples, as Megatron counts them: iteration flags x global batch with
    --train-iters, sample flags with --train-samples; the decay defaults to the whole run."""
    gbs = global_batch_size
    iteration_based = train_iters is not None
    _check_mode(
        iteration_based,
        {
            "--lr-decay-iters": decay_iters is not None,
            "--lr-warmup-iters": bool(warmup_iters),
            "--lr-wsd-decay-iters": wsd_decay_iters is not None,
        },
        {
            "--lr-decay-samples": decay_samples is not None,
            "--lr-warmup-samples": bool(warmup_samples),
            "--lr-wsd-decay-samples": wsd_decay_samples is not None,
        },
    )
    if iteration_based:
        decay = (decay_iters if decay_iters is not None else train_iters) * gbs
        warmup_fixed = warmup_iters * gbs
        wsd = None if wsd_decay_iters is None else wsd_decay_iters * gbs
    else:
        decay = decay_samples if decay_samples is not None else train_samples
        warmup_fixed = warmup_samples
        wsd = wsd_decay_samples
    if warmup_fraction is not None:
        if warmup_fixed:
            raise UserError(
                "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive "
                "(keep one)"
            )
        warmup = warmup_fraction * decay
    else:
        warmup = warmup_fixed
    if warmup > decay:
        raise UserError(
            f"warmup ({warmup} samples) is longer than the decay span ({decay} samples) "
            f"(shorten --lr-warmup-* or lengthen --lr-decay-*)"
        )
    return ScheduleSpans(decay=decay, warmup=warmup, wsd=wsd)


def check_wsd(style: str, spans: ScheduleSpans) -> None:
    """WSD needs an anneal length within the decay span; other styles take none."""
    if style != "WSD":
        return
    if spans.wsd is None:
        raise UserError(
            "--lr-decay-style WSD needs the anneal length: --lr-wsd-decay-iters (with "
            "--train-iters) or --lr-wsd-decay-samples (with --train-samples)"
        )
    if not 0 < spans.wsd <= spans.decay:
        raise UserError(
            f"the WSD anneal ({spans.wsd} samples) must be positive and at most the decay span "
            f"({spans.decay} samples) (fix --lr-wsd-decay-iters/-samples or --lr-decay-*)"
        )
