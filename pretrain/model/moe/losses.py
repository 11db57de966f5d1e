"""The router's auxiliary losses and how they reach the backward pass.

Load balancing (Switch Transformer; megatron-core's `switch_load_balancing_loss_func`):

    loss = coeff x E / (k x T^2) x sum_e (sum of the scores of expert e) x (tokens routed to e)

with T tokens and E experts over the loss's scope. The scores are this rank's; the token counts
are summed over the scope's ranks, so the per-rank losses add up to the scope's loss and their
gradients to its gradient, however the tokens are split over ranks.

z-loss (ST-MoE): coeff x mean over tokens of logsumexp(logits)^2.

Neither loss is added to the language-model loss value. As in Megatron, `attach` ties the loss to
an activation (the routing weights, the logits) with an identity whose backward also starts the
loss's own backward with gradient `backward_scale()`: the loss's gradient reaches the weights
exactly as if it had been added to the micro-batch's loss, and pipeline stages need not pass it
on. The training step sets the scale to what it multiplies the loss by before backward (1 /
gradient-accumulation steps, times an fp16 loss scale): `set_backward_scale`. The default 1.0 is
one micro-batch's `loss.backward()`.
"""

from __future__ import annotations

import torch

_BACKWARD_SCALE = [1.0]


def set_backward_scale(scale: float) -> None:
    """The factor the training step applies to the loss before backward (see the module doc)."""
    _BACKWARD_SCALE[0] = float(scale)


def backward_scale() -> float:
    """The current factor (1.0 unless the training step set another)."""
    return _BACKWARD_SCALE[0]


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, loss):
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, backward_scale())


def attach(activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`activation` unchanged; its backward also back-propagates `loss` (see the module doc)."""
    return _Attach.apply(activation, loss)


def switch_load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: float,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """This rank's share of the load-balancing loss: `scores` [t, E] are its tokens' (t of the
    scope's `total_tokens`), `tokens_per_expert` [E] the scope's routed token counts."""
    weighted = torch.sum(scores.sum(dim=0) * tokens_per_expert)
    return weighted * (num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """coeff x the mean of logsumexp(logits)^2 over the tokens that are not padding."""
    squares = torch.logsumexp(logits, dim=-1).square()
    if padding_mask is None:
        return squares.mean() * coeff
    valid = ~padding_mask
    return (squares * valid).sum() / valid.sum().clamp(min=1) * coeff
