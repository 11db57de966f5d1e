"""AdamW with Megatron's parameter groups, and clipping by the true global gradient norm.

Megatron applies no weight decay to biases and 1-D parameters (norm weights). At ZeRO-0 in fp32
DeepSpeed would clip with a norm that, in a pipeline grid, counts replicated parameters on the
first stage only (docs/TRAINING.md); `ClippedAdamW` instead computes the norm with
`pretrain.parallel.grad_norm.global_grad_norm` (TP shards once, replicated parameters once, tied
copies once, summed over TP x PP) right before the update, after DeepSpeed has averaged the
gradients over data-parallel ranks and summed the tied embedding's. The engine reads the norm
from `_global_grad_norm` (DeepSpeed's convention) for logging.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pretrain.parallel.grad_norm import global_grad_norm


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay, and the global gradient-norm clip."""

    weight_decay: float = 0.01
    """Decay of matrices; biases and norm weights get none (--weight-decay)."""
    adam_beta1: float = 0.9
    """First-moment decay (--adam-beta1)."""
    adam_beta2: float = 0.999
    """Second-moment decay (--adam-beta2)."""
    adam_eps: float = 1e-8
    """Denominator epsilon (--adam-eps)."""
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this; 0 = off (--clip-grad)."""


def param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict]:
    """Megatron's two groups: matrices with `weight_decay`, biases and 1-D parameters without."""
    decay, no_decay = [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class ClippedAdamW(torch.optim.AdamW):
    """AdamW whose step first clips all gradients to `clip_grad` by the true global L2 norm."""

    def __init__(
        self,
        params,
        *,
        clip_grad: float,
        model_parallel_group=None,
        shard_group=None,
        expert_shard_group=None,
        **adamw_kwargs,
    ):
        super().__init__(params, **adamw_kwargs)
        self.clip_grad = clip_grad
        self.model_parallel_group = model_parallel_group
        self.shard_group = shard_group  # the gradients are DTensor shards over these ranks
        self.expert_shard_group = expert_shard_group  # the experts' (default: shard_group)
        self._global_grad_norm = None

    @property
    def last_grad_norm(self) -> float | None:
        """The global norm the last step clipped with."""
        return self._global_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = global_grad_norm(
            params, self.model_parallel_group, self.shard_group, self.expert_shard_group
        )
        self._global_grad_norm = float(norm)
        if self.clip_grad > 0:
            coeff = float(self.clip_grad / (norm + 1e-6))  # fp32, exactly (DTensors take floats)
            if coeff < 1.0:
                torch._foreach_mul_([p.grad for p in params], coeff)
        return super().step(closure)


def build_optimizer(
    named_params,
    config: OptimizerConfig,
    *,
    lr: float,
    we_clip: bool,
    model_parallel_group=None,
    shard_group=None,
    expert_shard_group=None,
) -> torch.optim.Optimizer:
    """AdamW over Megatron's groups; with `we_clip` it clips by the true global norm first
    (ZeRO-0 fp32; the torch backend, whose gradients are sharded over `shard_group`, the
    experts' over `expert_shard_group`), else DeepSpeed's ZeRO/bf16/fp16 optimizer clips and
    this is plain AdamW."""
    groups = param_groups(named_params, config.weight_decay)
    adamw = dict(
        lr=lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    if not we_clip:
        return torch.optim.AdamW(groups, **adamw)
    return ClippedAdamW(
        groups,
        clip_grad=config.clip_grad,
        model_parallel_group=model_parallel_group,
        shard_group=shard_group,
        expert_shard_group=expert_shard_group,
        **adamw,
    )
