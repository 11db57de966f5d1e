"""Expert parameters at expert-parallel size > 1 on DeepSpeed: kept out of its data parallelism.

At EP > 1 the data-parallel ranks of a stage hold different experts (`pretrain.parallel.state`:
EP groups cut across DP), so DeepSpeed must neither broadcast them from data-parallel rank 0
when it builds the engine nor average their gradients over the data-parallel group. The ranks
that hold the same expert shard form the expert-data-parallel group; an expert gradient is the
sum over it divided by the data-parallel size (each rank's loss is its micro-batches' mean,
averaged over DP like a dense gradient). In every case `keep_local` marks the expert parameters
as DeepSpeed's per-rank parameters (`ds_optim_param`: never broadcast) before
`deepspeed.initialize`.

ZeRO-0 (DeepSpeed's non-partitioned optimizer): `reduce_over_expert_data_parallel` wraps the
engine's `allreduce_gradients` (the one gradient reduction of its ZeRO-0 engine and pipeline
engine) so that DeepSpeed reduces the dense gradients only (the experts hidden) and the expert
ones are reduced over their group right after; our AdamW clips by the true global norm
(`pretrain.parallel.grad_norm`).

ZeRO 1-2: DeepSpeed's own MoE parameter groups (`use_expert_groups`): expert parameters marked
`allreduce = False` with `group_name`, in optimizer groups of their own (`moe`, `name`), which its
ZeRO optimizer partitions over the expert-data-parallel group and reduces there (divided by the
data-parallel size), counting their norm over the data-parallel group. DeepSpeed switches this on
only for a model holding its `deepspeed.moe.layer.MoE`: `_ExpertGroups` is such a module without
a layer, present while the engine is built (it also puts our EP and expert-DP groups into
DeepSpeed's group registry under its name `ep_size_<EP>`); afterwards (`finish`) it is removed
and the engine's MoE flag cleared, so DeepSpeed saves and loads its ordinary files (an EP > 1
checkpoint resumes through the full state). The expert norm is the true one where EP lies inside
the data-parallel group (expert TP = TP); `pretrain.cli.resolve.check_moe_training` refuses the
rest, PP > 1 (DeepSpeed's ZeRO takes the expert groups per stage) and ZeRO-3.
"""

from __future__ import annotations

import contextlib

import torch
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pretrain.parallel import state

MARKER = "_deepspeed_expert_groups"


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


class _ExpertGroups(MoE):
    """Stands in for DeepSpeed's MoE layer while the engine is built (see the module doc): an
    `nn.Module` without parameters and without DeepSpeed's layer."""

    def __init__(self, num_experts: int):  # not MoE.__init__: no layer wanted
        torch.nn.Module.__init__(self)
        self.num_experts = num_experts

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's hook to create its expert groups: ours are registered already."""


def group_name() -> str:
    """DeepSpeed's name for the expert groups of this EP size."""
    return f"ep_size_{state.get_expert_model_parallel_world_size()}"


def use_expert_groups(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list, num_experts: int
) -> None:
    """Before the LR scheduler and `deepspeed.initialize` (ZeRO 1-2, EP > 1): mark `params` as
    DeepSpeed's expert parameters, move them into MoE groups of `optimizer` (same weight decay),
    register our EP and expert-DP groups with DeepSpeed and put `_ExpertGroups` into `model`."""
    name = group_name()
    groups._EXPERT_PARALLEL_GROUP[name] = state.get_expert_model_parallel_group()
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = state.get_expert_data_parallel_group()
    ids = {id(p) for p in params}
    for param in params:
        param.allreduce, param.group_name = False, name
    expert_groups = []
    for group in optimizer.param_groups:
        experts = [p for p in group["params"] if id(p) in ids]
        group["params"] = [p for p in group["params"] if id(p) not in ids]
        if experts:
            expert_groups.append({**group, "params": experts, "moe": True, "name": name})
    optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]] + expert_groups
    model.add_module(MARKER, _ExpertGroups(num_experts))


def finish(ds_engine, model: torch.nn.Module) -> None:
    """After `deepspeed.initialize`: drop `_ExpertGroups` from `model` and clear the engine's
    MoE flag (its ZeRO optimizer keeps its own)."""
    if MARKER in model._modules:
        del model._modules[MARKER]
        ds_engine.has_moe_layers = False
