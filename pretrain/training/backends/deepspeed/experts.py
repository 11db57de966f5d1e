"""Expert parameters at expert-parallel size > 1 on DeepSpeed: kept out of its data parallelism.

At EP > 1 the data-parallel ranks of a stage hold different experts (`pretrain.parallel.state`:
EP groups cut across DP), so DeepSpeed must neither broadcast them from data-parallel rank 0
when it builds the engine nor average their gradients over the data-parallel group. The ranks
that hold the same expert shard form the expert-data-parallel group; an expert gradient is the
sum over it divided by the data-parallel size (each rank's loss is its micro-batches' mean,
averaged over DP like a dense gradient).

DeepSpeed's own MoE support (`allreduce = False`, `group_name`, its expert groups, MoE parameter
groups in ZeRO) switches on only for models built from its `deepspeed.moe.layer.MoE` class and
then also writes its expert checkpoint files from those modules, so it is not used. Instead:
`keep_local` marks the expert parameters as DeepSpeed's per-rank parameters (`ds_optim_param`:
never broadcast) before `deepspeed.initialize`, and `reduce_over_expert_data_parallel` wraps the
engine's `allreduce_gradients` (the one gradient reduction of its ZeRO-0 engine and pipeline
engine) so that DeepSpeed reduces the dense gradients only and the expert ones are reduced over
their group right after. This needs DeepSpeed's non-partitioned optimizer: ZeRO 1-3 flatten every
parameter of the optimizer into partitions over the whole data-parallel group, which mixes
different experts; `pretrain.cli.resolve.check_moe_training` refuses them at EP > 1.
"""

from __future__ import annotations

import contextlib

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pretrain.parallel import state


def expert_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of `model` that differ between the data-parallel ranks of a stage (experts
    at EP > 1); empty at EP 1, where experts are ordinary data-parallel replicas."""
    if state.get_expert_model_parallel_world_size() == 1:
        return []
    return [p for p in model.parameters() if getattr(p, "expert_parallel", False)]


def keep_local(params: list[torch.nn.Parameter]) -> None:
    """Before `deepspeed.initialize`: DeepSpeed broadcasts every parameter from data-parallel
    rank 0 except those it treats as unique per rank (`ds_optim_param`, its mark for
    `OptimizedLinear` shards); mark `params` so."""
    for param in params:
        param.ds_optim_param = True


@contextlib.contextmanager
def _hidden(params: list[torch.nn.Parameter]):
    """Inside: `params` do not require gradients (DeepSpeed's reduction skips them)."""
    for param in params:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in params:
            param.requires_grad_(True)


@torch.no_grad()
def reduce_expert_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of `params` over the expert-data-parallel group and divide by the
    data-parallel size (in place, one flat all-reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    group = state.get_expert_data_parallel_group()
    if state.get_expert_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(flat, group=group)
    flat /= state.get_data_parallel_world_size()
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)


def reduce_over_expert_data_parallel(ds_engine, params: list[torch.nn.Parameter]) -> None:
    """Make `ds_engine.allreduce_gradients` (called by `backward` at the accumulation boundary
    and by the pipeline's reduce instruction) reduce the dense gradients as before and the
    gradients of `params` over the expert-data-parallel group."""
    if not params:
        return
    reduce = type(ds_engine).allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        with _hidden(params):
            reduce(ds_engine, *args, **kwargs)
        if ds_engine.is_gradient_accumulation_boundary():
            reduce_expert_gradients(params)

    ds_engine.allreduce_gradients = allreduce_gradients
