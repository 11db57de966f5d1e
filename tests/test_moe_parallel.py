"""The MoE layer is the same function at every layout: EP {1,2,4} x TP {1,2} (expert TP 1 and 2)
x both dispatchers reproduce one process (fp32, 4 real gloo ranks, one spawn); at TP 2 with and
without sequence parallelism.

The global batch is always 4 micro-batches: each of the DP replicas runs 4 / DP of them (under
TP, with sequence parallelism, each TP rank its chunk of each; without it every TP rank the
whole micro-batch, and its output and input gradient must be the whole reference's). The
reference runs the 4 micro-batches through the layer in one process (TP = EP = 1, the same
layout-independent init). Per layout and rank: the output and the input gradient equal the
reference's slice; the router's and shared experts' gradients summed over DP, and the experts'
gradients summed over expert DP, equal the reference's summed over micro-batches (their shard);
the logged metrics (aux/z losses, token shares, dropped tokens) equal the reference's; after
`finish_iteration` the expert bias has moved, identically at every DP size.
Configs: Mixtral-like (softmax top-2 of 8, SwiGLU, aux + z loss; the alltoall runs use the
grouped GEMM), DeepSeek-like (sigmoid, groups, scaling, shared expert, expert bias, seq aux
loss), and with capacity (biases, probs policy; padded too), at TP 1 only, where every layout
routes the same tokens per rank, so the same tokens are dropped.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks

WORLD, BATCH, SEQ, HIDDEN = 4, 2, 8, 16
BASE = dict(
    num_layers=1,
    hidden_size=HIDDEN,
    num_attention_heads=2,
    vocab_size=64,
    seq_length=SEQ,
    ffn_hidden_size=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    sequence_parallel=True,
    num_moe_experts=8,
    moe_ffn_hidden_size=16,
    seed=7,
)
CONFIGS = {
    "mixtral": dict(
        swiglu=True,
        add_bias_linear=False,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
    ),
    "deepseek": dict(
        swiglu=True,
        add_bias_linear=False,
        moe_router_topk=4,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=16,
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3,
    ),
    "capacity": dict(moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=1e-2),
    "padded": dict(
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        moe_token_drop_policy="position",
    ),
}
# (tp, ep, expert tp)
DROPLESS_LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 1, 1), (2, 2, 1), (2, 4, 1), (2, 1, 2), (2, 2, 2)]
CAPACITY_LAYOUTS = [(1, 2, 1), (1, 4, 1)]
# TP 2 without sequence parallelism: whole experts (expert TP 1) at EP 1 and 2, expert TP 2
NO_SP_LAYOUTS = [(2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)]


def _config(name: str, dispatcher: str):
    from pretrain.model.config import ModelConfig

    grouped = name == "mixtral" and dispatcher == "alltoall"
    return ModelConfig(
        **BASE,
        **CONFIGS[name],
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped,
    )


def _data():
    generator = torch.Generator().manual_seed(3)
    shape = (WORLD, BATCH, SEQ, HIDDEN)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _run(layer, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad


def _reference(config) -> dict:
    """One process: every replica's micro-batch in turn; gradients summed over replicas."""
    from pretrain.model.moe import metrics
    from pretrain.model.moe.layer import MoELayer

    layer = MoELayer(config, 0)
    layer.initialize("layers.0.mlp", 0.02, 0.01)
    inputs, upstream = _data()
    runs = [_run(layer, inputs[d], upstream[d]) for d in range(WORLD)]
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    collected = metrics.collect(layer, config)
    metrics.finish_iteration(layer)
    return dict(runs=runs, grads=grads, metrics=collected, bias=layer.router.expert_bias)


def _local_slice(name: str, param, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a full (TP = EP = 1) tensor named `name`."""
    from pretrain.model.moe.layer import local_experts
    from pretrain.parallel import state
    from pretrain.parallel.sharding import shard_tensor

    if getattr(param, "expert_parallel", False):
        experts = local_experts(full.shape[0])
        full = full[experts.start : experts.stop]
        dim = getattr(param, "expert_tensor_partition_dim", None)
        if dim is None:
            return full
        rank, world = (
            state.get_expert_tensor_parallel_rank(),
            state.get_expert_tensor_parallel_world_size(),
        )
        return shard_tensor(full, dim, rank, world, param.partition_stride)
    if getattr(param, "tensor_model_parallel", False):
        rank, world = (
            state.get_tensor_model_parallel_rank(),
            state.get_tensor_model_parallel_world_size(),
        )
        return shard_tensor(full, param.partition_dim, rank, world, param.partition_stride)
    return full


def _compare_layout(
    config, reference: dict, tp: int, ep: int, etp: int, sequence_parallel: bool = True
) -> dict:
    from pretrain.model.moe import metrics
    from pretrain.model.moe.layer import MoELayer
    from pretrain.parallel import state

    config = dataclasses.replace(config, sequence_parallel=sequence_parallel)
    config.validate(tp, 1, ep, etp)
    state.initialize_model_parallel(tp, 1, ep, etp)
    dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
    tp_rank = state.get_tensor_model_parallel_rank()
    chunk = slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)
    if not sequence_parallel:  # every TP rank holds the whole sequence
        chunk = slice(None)
    layer = MoELayer(config, 0)
    layer.initialize("layers.0.mlp", 0.02, 0.01)
    inputs, upstream = _data()
    diff = {"output": 0.0, "input grad": 0.0}
    for micro_batch in range(dp_rank, WORLD, dp):  # the same global batch at every DP size
        out, grad = _run(layer, inputs[micro_batch][:, chunk], upstream[micro_batch][:, chunk])
        ref_out, ref_grad = reference["runs"][micro_batch]
        diff["output"] = max(diff["output"], (out - ref_out[:, chunk]).abs().max().item())
        diff["input grad"] = max(diff["input grad"], (grad - ref_grad[:, chunk]).abs().max().item())
    for name, param in layer.named_parameters():
        # what autograd has not summed yet: over expert DP for experts, over DP for the rest and
        # for what was summed over TP already (router, experts at expert TP 1 and EP 1)
        expert = getattr(param, "expert_parallel", False) and not param.sequence_parallel
        group = (
            state.get_expert_data_parallel_group() if expert else state.get_data_parallel_group()
        )
        total = param.grad.clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        expected = _local_slice(name, param, reference["grads"][name])
        diff[f"grad {name}"] = (total - expected).abs().max().item()
    collected = metrics.collect(layer, config)
    diff.update(_metric_differences(collected, reference["metrics"]))
    metrics.finish_iteration(layer)
    if layer.router.expert_bias is not None:
        diff["expert bias"] = (layer.router.expert_bias - reference["bias"]).abs().max().item()
    state.destroy_model_parallel()
    return diff


def _metric_differences(ours, reference) -> dict:
    diff = {
        f"metric {name}": max(
            abs(a - b) for a, b in zip(values, reference.losses[name], strict=True)
        )
        for name, values in ours.losses.items()
    }
    assert ours.losses.keys() == reference.losses.keys()
    diff["metric shares"] = max(
        abs(a - b)
        for a, b in zip(
            ours.min_share + ours.max_share, reference.min_share + reference.max_share, strict=True
        )
    )
    diff["metric dropped"] = abs(ours.dropped_fraction - reference.dropped_fraction)
    return diff


def _all_layouts(rank: int, world_size: int) -> dict:
    results = {}
    for name in CONFIGS:
        layouts = DROPLESS_LAYOUTS if name in ("mixtral", "deepseek") else CAPACITY_LAYOUTS
        for dispatcher in ("allgather", "alltoall"):
            config = _config(name, dispatcher)
            reference = _reference(config)
            if config.moe_expert_capacity_factor is not None:
                assert reference["metrics"].dropped_fraction > 0, name
            if config.moe_router_enable_expert_bias:
                assert reference["bias"].abs().max() > 0, "the expert bias did not move"
            for tp, ep, etp in layouts:
                results[(name, dispatcher, tp, ep, etp)] = _compare_layout(
                    config, reference, tp, ep, etp
                )
            for tp, ep, etp in NO_SP_LAYOUTS if name in ("mixtral", "deepseek") else []:
                results[(name, dispatcher, tp, ep, etp, "no SP")] = _compare_layout(
                    config, reference, tp, ep, etp, sequence_parallel=False
                )
    return results


@pytest.mark.slow
def test_moe_layer_is_the_same_at_every_layout():
    for rank_results in run_on_ranks(_all_layouts, world_size=WORLD, timeout=600):
        for case, differences in rank_results.items():
            for what, difference in differences.items():
                assert difference < 1e-5, (case, what, difference)
