"""The GPT's parallel form on the torch backend: our TP layers, FSDP2 over the data-parallel ranks.

The ranks form a `DeviceMesh` ("pp", "dp", "tp") over the process groups of
`pretrain.parallel.state` (rank = tp_rank + TP (dp_rank + DP pp_rank), so no new group is made);
the TP layers keep their own collectives, and FSDP2 uses the mesh's "dp" dimension: `fully_shard`
on every `TransformerLayer`, then on the root (embedding, final norm, head), so each layer's
parameters are gathered just before it runs and its gradients reduce-scattered (averaged over DP)
as soon as its backward ends. Parameters, gradients and Adam state are DTensors sharded on dim 0
over "dp".

Precision: the parameters FSDP2 shards are the fp32 masters; with --bf16 a
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` gathers them as bf16 for compute and
reduces gradients in fp32. Offload: `CPUOffloadPolicy` keeps the sharded parameters, gradients
and the optimizer step in CPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from pretrain.parallel import state
from pretrain.training.backends.torch.experts import shard_layer_experts

MARKS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "sequence_parallel",
    "expert_parallel",
    "expert_partition_dim",
    "expert_tensor_partition_dim",
)
"""The attributes our TP and MoE layers put on parameters (clipping and the full state read
them)."""


@dataclass(frozen=True, kw_only=True)
class ShardingPolicy:
    """How FSDP2 holds the model: compute precision and offload."""

    bf16: bool = False
    """Gather parameters as bf16 for compute; reduce gradients in fp32 (masters stay fp32)."""
    offload: bool = False
    """Sharded parameters, gradients and the optimizer step in CPU memory."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (gather again for backward).
    False under a pipeline (PP > 1, torchtitan's choice): a stage stays gathered from its first
    forward to its last backward of the iteration (the schedule's UNSHARD/RESHARD actions), and
    the zero-bubble schedules' deferred weight-gradient pass finds the gathered parameters it
    differentiates (with resharded ones it computed no weight gradient at all, measured)."""


def device_mesh(device: torch.device) -> DeviceMesh:
    """The ("pp", "dp", "tp") mesh over `pretrain.parallel.state`'s groups (which must exist)."""
    pp = state.get_pipeline_model_parallel_world_size()
    dp = state.get_data_parallel_world_size()
    tp = state.get_tensor_model_parallel_world_size()
    ranks = torch.arange(pp * dp * tp).view(pp, dp, tp)  # TP fastest, then DP, then PP
    groups = [
        state.get_pipeline_model_parallel_group(),
        state.get_data_parallel_group(),
        state.get_tensor_model_parallel_group(),
    ]
    return DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=("pp", "dp", "tp"))


def shard_model(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    mesh: DeviceMesh,
    policy: ShardingPolicy,
    expert_mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """`fully_shard` each of `layers` (first its MoE experts over `expert_mesh`, at EP > 1:
    `experts.shard_layer_experts`), then `model` (the root), over `mesh["dp"]`; the parameters
    keep our TP and MoE marks. Returns `model`, now an FSDP module."""
    marks = {name: _marks(p) for name, p in model.named_parameters()}
    options = {
        "mesh": mesh["dp"],
        "reshard_after_forward": policy.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if policy.bf16 else None, reduce_dtype=torch.float32
        ),
    }
    if policy.offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in layers:
        shard_layer_experts(layer, expert_mesh, {k: v for k, v in options.items() if k != "mesh"})
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for name, param in model.named_parameters():
        for mark, value in marks[name].items():
            setattr(param, mark, value)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered parameter: a forward without backward (evaluation) leaves the root's
    (embedding, head) gathered, as plain tensors in the module, until the next step."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _marks(param: torch.nn.Parameter) -> dict:
    return {m: getattr(param, m) for m in MARKS if hasattr(param, m)}


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
