"""Mixture-of-experts layers on the torch backend: the experts sharded by FSDP2 over their own ranks.

At expert-parallel size (EP) > 1 the data-parallel ranks of a stage hold different experts
(`pretrain.parallel.state`: within a stage the TP x DP ranks are re-cut as expert TP x EP x
expert DP), so FSDP2 must not treat an MoE layer's `experts` as one parameter over "dp". Each
MoE layer's `mlp.experts` module gets a `fully_shard` of its own, over a one-dimensional mesh
("edp") made from the expert-data-parallel group (the ranks that hold the same experts), before
the layer's `fully_shard` over "dp" takes the rest (router, shared experts, attention, norms).
The expert weights, gradients and Adam moments are then DTensors sharded on dim 0 (the local
experts) over "edp"; the routers' expert bias is a buffer and stays replicated.

Gradients: one process's gradient is the mean over the global batch. A dense gradient is the
mean over DP of each rank's (FSDP2 averages over "dp"); an expert's is the sum over the expert-DP
ranks of their gradients (each holds the contributions of the tokens the all-to-all brought it
from its EP peers) divided by the DP size, not by the expert-DP size FSDP2 would divide by:
`set_gradient_divide_factor(DP)`, with sum reductions then a division
(`set_force_sum_reduction_for_comms`: gloo has no pre-multiplied sum) where expert DP > 1. Clipping counts each expert once:
`pretrain.parallel.grad_norm` sums the experts' squares over "edp" (`expert_shard_group`), then
over expert TP x EP.

At EP 1 every data-parallel rank holds every expert and the experts stay with their layer (over
"dp"), as a dense MLP would.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from pretrain.parallel import state

MESH_DIM = "edp"


def sharded_apart() -> bool:
    """True when the experts are sharded over their own mesh (EP > 1)."""
    return state.get_expert_model_parallel_world_size() > 1


def expert_mesh(device: torch.device) -> DeviceMesh | None:
    """The ("edp",) mesh over `pretrain.parallel.state`'s expert-data-parallel group (no new
    group); None at EP 1."""
    if not sharded_apart():
        return None
    group = state.get_expert_data_parallel_group()
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=(MESH_DIM,))


def shard_group():
    """The ranks the expert gradients are sharded over (`ClippedAdamW`'s `expert_shard_group`):
    expert DP at EP > 1; None (the dense `shard_group`, DP) at EP 1."""
    return state.get_expert_data_parallel_group() if sharded_apart() else None


def shard_layer_experts(layer: torch.nn.Module, mesh: DeviceMesh | None, options: dict) -> None:
    """Before `layer`'s own `fully_shard`: `fully_shard` its MoE experts (if any) over `mesh`
    with `options` (precision, offload, resharding: the layer's), their gradients summed over
    `mesh` and divided by the data-parallel size. Nothing at EP 1 (`mesh` None)."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if mesh is None or experts is None:
        return
    fully_shard(experts, mesh=mesh, **options)
    experts.set_gradient_divide_factor(float(state.get_data_parallel_world_size()))
    # gloo has no pre-multiplied sum; a one-rank mesh divides once already, and twice with
    # sum reductions forced (torch 2.13's copy path, then its post-divide)
    experts.set_force_sum_reduction_for_comms(mesh.size() > 1)
