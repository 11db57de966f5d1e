"""The language-model loss of one micro-batch, the same at every layout.

Megatron's default normalisation: the mean of the per-token losses over the micro-batch's
unmasked tokens. The training step (PP = 1) and the last pipeline stage (PP > 1) both use it, so
an iteration's loss does not depend on the layout.
"""

from __future__ import annotations

import torch


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean loss over the micro-batch's unmasked tokens (0 when every token is masked)."""
    loss_mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
