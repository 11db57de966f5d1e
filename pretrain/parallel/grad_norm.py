"""The true global L2 norm of the gradients of a model split over TP and PP ranks.

Every gradient element of the model must be counted exactly once:
- TP-sharded parameters (`tensor_model_parallel = True`) hold different elements on every TP rank:
  counted on every rank;
- replicated parameters (norms, row-parallel biases, position embeddings) hold the same gradient on
  all TP ranks: counted on TP rank 0 only;
- a parameter marked `shared = True` (the tied embedding's copy on the last pipeline stage, whose
  gradient equals the first stage's after the tie all-reduce) is skipped.
The sum of squares is then all-reduced over the model-parallel (TP x PP) group. Data-parallel
replicas hold the same (averaged) gradients and are not summed; where the gradients are instead
sharded over the data-parallel ranks (FSDP2's DTensor gradients: each rank holds a disjoint
piece, its `to_local()`), the pieces' sums are also all-reduced over that `shard_group`.
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
    parameters: Iterable[torch.nn.Parameter], model_parallel_group=None, shard_group=None
) -> torch.Tensor:
    """L2 norm (fp32 scalar tensor, identical on every rank of the group) of all gradients.

    `model_parallel_group` defaults to the TP x PP group of pretrain.parallel.state; pass the
    pipeline grid's model-parallel group when DeepSpeed's PipelineModule owns the layout.
    `shard_group`: the gradients are split over these ranks (FSDP2's data-parallel shards).
    """
    is_tp_rank0 = state.get_tensor_model_parallel_rank() == 0
    grads = [
        _local(p.grad)
        for p in parameters
        if p.grad is not None
        and not getattr(p, "shared", False)
        and (is_tp_rank0 or is_tensor_parallel(p))
    ]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        total += grad.detach().float().pow(2).sum()
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        dist.all_reduce(total, group=shard_group)
    if model_parallel_group is None and state.model_parallel_is_initialized():
        model_parallel_group = state.get_model_parallel_group()
    if model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1:
        dist.all_reduce(total, group=model_parallel_group)
    return total.sqrt()
