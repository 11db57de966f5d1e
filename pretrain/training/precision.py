"""`PrecisionConfig`: the training precision and fp16 loss scaling, whatever the backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Training precision and fp16 loss scaling (Megatron's flags)."""

    bf16: bool = False
    """bf16 weights and activations, fp32 master weights (--bf16)."""
    fp16: bool = False
    """fp16 with loss scaling (--fp16; GPU only)."""
    loss_scale: float | None = None
    """Static fp16 loss scale; None = dynamic (--loss-scale)."""
    initial_loss_scale: float = 2.0**32
    """First dynamic loss scale (--initial-loss-scale)."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale (--min-loss-scale)."""
    loss_scale_window: int = 1000
    """Good steps before the scale grows (--loss-scale-window)."""
    hysteresis: int = 2
    """Overflows tolerated before the scale shrinks (--hysteresis)."""

    @property
    def name(self) -> str:
        """ "bf16", "fp16" or "fp32"."""
        return "bf16" if self.bf16 else ("fp16" if self.fp16 else "fp32")
