"""The true global L2 norm of the gradients of a model split over TP and PP ranks.

Every gradient element of the model must be counted exactly once:
- TP-sharded parameters (`tensor_model_parallel = True`) hold different elements on every TP rank:
  counted on every rank;
- replicated parameters (norms, row-parallel biases, position embeddings) hold the same gradient on
  all TP ranks: counted on TP rank 0 only;
- a parameter marked `shared = True` (the tied embedding's copy on the last pipeline stage, whose
  gradient equals the first stage's after the tie all-reduce) is skipped;
- an expert parameter (`expert_parallel = True`, `pretrain.model.moe.experts`) holds, on each
  rank of its expert-TP x expert-parallel group, a different piece of the stage's experts (the
  expert-data-parallel ranks hold the same, reduced, gradients): counted on every rank, summed
  over that group.
The expert sum of squares, all-reduced over expert TP x EP (the whole stage's experts, on every
rank of the stage), joins the dense one as 1/TP per TP rank; the sum is then all-reduced over the
model-parallel (TP x PP) group. Data-parallel replicas hold the same (averaged) gradients and are
not summed; where the gradients are instead sharded over the data-parallel ranks (FSDP2's DTensor
gradients: each rank holds a disjoint piece, its `to_local()`), both sums of squares are first
all-reduced over that `shard_group`; the experts' over `expert_shard_group` instead when they are
sharded over other ranks (the torch backend at EP > 1: FSDP2 over the expert-data-parallel group).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from pretrain.parallel import state
from pretrain.parallel.sharding import is_tensor_parallel


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The elements of `grad` this rank holds (a DTensor's local shard; a plain tensor itself)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def global_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    model_parallel_group=None,
    shard_group=None,
    expert_shard_group=None,
) -> torch.Tensor:
    """L2 norm (fp32 scalar tensor, identical on every rank of the group) of all gradients.

    `model_parallel_group` defaults to the TP x PP group of pretrain.parallel.state; pass the
    pipeline grid's model-parallel group when DeepSpeed's PipelineModule owns the layout.
    `shard_group`: the gradients are split over these ranks (FSDP2's data-parallel shards);
    `expert_shard_group`: the expert gradients are split over these ranks instead (default:
    `shard_group`).
    """
    expert_shard_group = shard_group if expert_shard_group is None else expert_shard_group
    is_tp_rank0 = state.get_tensor_model_parallel_rank() == 0
    with_grad = [p for p in parameters if p.grad is not None and not getattr(p, "shared", False)]
    experts = [_local(p.grad) for p in with_grad if getattr(p, "expert_parallel", False)]
    dense = [
        _local(p.grad)
        for p in with_grad
        if not getattr(p, "expert_parallel", False) and (is_tp_rank0 or is_tensor_parallel(p))
    ]
    total = _reduced(_squares(dense), shard_group)
    if experts:  # every rank of a stage with MoE layers holds experts: a collective of the stage
        stage_experts = _reduced(
            _reduced(_squares(experts), expert_shard_group),
            state.get_expert_tensor_and_model_parallel_group(),
        )
        total = total + stage_experts / state.get_tensor_model_parallel_world_size()
    if model_parallel_group is None and state.model_parallel_is_initialized():
        model_parallel_group = state.get_model_parallel_group()
    return _reduced(total, model_parallel_group).sqrt()


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 sum of squares of `grads` (0 on the CPU when there are none)."""
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        total += grad.detach().float().pow(2).sum()
    return total


def _reduced(total: torch.Tensor, group) -> torch.Tensor:
    """`total` summed over `group` (as is for None or a one-rank group)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total
