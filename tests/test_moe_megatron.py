"""Our MoE layer equals megatron-core 0.16.1's `MoELayer` (fp32/fp64, CPU, one gloo rank).

megatron-core runs on CPU with its all-gather dispatcher and `SequentialMLP` after two patches
(`torch.cuda.current_device` -> "cpu"; `moe_utils.te_general_gemm = None`, a name 0.16.1 leaves
undefined without Transformer Engine), and a third for expert biases (see `_compare_all`). Each case builds megatron-core's layer, copies its weights
(and a random expert bias) into ours, runs the same input with padding tokens, and compares the
output, the logged aux/z losses, the expert-bias token counts, and the gradients of the input and
of every weight for the same upstream gradient (the aux losses' gradients included: both attach
them with backward scale 1). The cases: Mixtral (softmax top-2 of 8, SwiGLU, aux + z loss),
DeepSeek (sigmoid, groups, scaling, shared expert, expert bias, seq aux loss, fp64 router),
GPT-2-like with biases and capacity (probs policy, global aux loss), and top-1 with padded
capacity. Not the "position" drop policy: megatron-core picks the kept tokens with torch.topk over
a 0/1 map, whose choice among equal values is unspecified (on CPU it does not keep the first
tokens); ours keeps the first, as Megatron documents (tests/test_moe_units.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from distributed import run_on_ranks

SEQ, BATCH, HIDDEN = 6, 3, 16

CASES = {
    "mixtral": dict(
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        swiglu=True,
        add_bias_linear=False,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_router_dtype="fp32",
    ),
    "deepseek": dict(
        num_moe_experts=8,
        moe_router_topk=4,
        moe_ffn_hidden_size=12,
        swiglu=True,
        add_bias_linear=False,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=24,
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_router_dtype="fp64",
    ),
    "gpt2_capacity": dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=20,
        add_bias_linear=True,
        moe_expert_capacity_factor=1.0,
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_router_pre_softmax=True,
    ),
    "padded": dict(
        num_moe_experts=4,
        moe_router_topk=1,
        moe_ffn_hidden_size=20,
        add_bias_linear=False,
        moe_router_pre_softmax=True,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        moe_aux_loss_coeff=1e-2,
    ),
}


def _megatron_layer(case: dict):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer

    swiglu = case.get("swiglu", False)
    names = {"swiglu": None, "moe_ffn_hidden_size": "ffn_hidden_size"}
    fields = {names.get(k, k): v for k, v in case.items() if names.get(k, k) is not None}
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="allgather",
        **fields,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=case["num_moe_experts"])
    layer = MoELayer(config, spec.submodules, layer_number=1)
    layer.set_layer_number(1)  # what megatron-core's TransformerLayer does: the router logs
    return layer


def _our_layer(case: dict):
    from pretrain.model.config import ModelConfig
    from pretrain.model.moe.layer import MoELayer

    config = ModelConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        vocab_size=64,
        seq_length=SEQ,
        ffn_hidden_size=4 * HIDDEN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **case,
    )
    config.validate()
    return MoELayer(config, layer_number=0)


@torch.no_grad()
def _copy_weights(ours, theirs) -> None:
    ours.router.weight.copy_(theirs.router.weight)
    if ours.router.bias is not None:
        ours.router.bias.copy_(theirs.router.bias)
    if ours.router.expert_bias is not None:
        theirs.router.expert_bias.copy_(torch.randn(theirs.router.expert_bias.shape) * 0.1)
        ours.router.expert_bias.copy_(theirs.router.expert_bias)
    for e, expert in enumerate(theirs.experts.local_experts):
        for mine, name in ((ours.experts.fc1, "linear_fc1"), (ours.experts.fc2, "linear_fc2")):
            linear = getattr(expert, name)
            mine.weight[e].copy_(linear.weight)
            if mine.bias is not None:
                mine.bias[e].copy_(linear.bias)
    if ours.shared_experts is not None:
        ours.shared_experts.fc1.weight.copy_(theirs.shared_experts.linear_fc1.weight)
        ours.shared_experts.fc2.weight.copy_(theirs.shared_experts.linear_fc2.weight)


def _grads(ours, theirs) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    pairs = [("router.weight", ours.router.weight.grad, theirs.router.weight.grad)]
    for e, expert in enumerate(theirs.experts.local_experts):
        for mine, name in ((ours.experts.fc1, "linear_fc1"), (ours.experts.fc2, "linear_fc2")):
            linear = getattr(expert, name)
            pairs.append((f"{name}[{e}]", mine.weight.grad[e], linear.weight.grad))
            if mine.bias is not None:
                pairs.append((f"{name}.bias[{e}]", mine.bias.grad[e], linear.bias.grad))
    if ours.shared_experts is not None:
        pairs.append(
            (
                "shared fc1",
                ours.shared_experts.fc1.weight.grad,
                theirs.shared_experts.linear_fc1.weight.grad,
            )
        )
    return pairs


def _compare_case(name: str, case: dict) -> dict:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    torch.manual_seed(5)
    theirs = _megatron_layer(case).train()
    ours = _our_layer(case).train()
    _copy_weights(ours, theirs)
    x = torch.randn(SEQ, BATCH, HIDDEN)  # megatron-core's [s, b, h]
    # megatron-core 0.16.1 cannot count expert-bias tokens with a padding mask ([T, E] & [T]
    # does not broadcast in TopKRouter._apply_expert_bias): no padding with an expert bias
    padding = None
    if "moe_router_enable_expert_bias" not in case:
        padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        padding[1, -2:] = True
    upstream = torch.randn(SEQ, BATCH, HIDDEN)
    x_theirs = x.clone().requires_grad_()
    out_theirs, _ = theirs(x_theirs, padding_mask=padding)
    (out_theirs * upstream).sum().backward()
    x_ours = x.transpose(0, 1).clone().requires_grad_()
    out_ours = ours(x_ours, padding_mask=padding)
    (out_ours * upstream.transpose(0, 1)).sum().backward()
    assert out_theirs.abs().max() > 0 and ours.experts.fc1.weight.grad.abs().sum() > 0, name
    if "moe_expert_capacity_factor" in case:  # the capacity really drops tokens here
        assert ours.router.stats.dropped > 0, name
    result = {
        "output": (out_ours.transpose(0, 1) - out_theirs).abs().max().item(),
        "input grad": (x_ours.grad.transpose(0, 1) - x_theirs.grad).abs().max().item(),
    }
    for grad_name, mine, megatron in _grads(ours, theirs):
        result[f"grad {grad_name}"] = (mine - megatron).abs().max().item()
    tracked = moe_utils.get_moe_layer_wise_logging_tracker()
    for loss_name, value in ours.router.stats.losses.items():
        result[f"loss {loss_name}"] = abs(value.item() - tracked[loss_name]["values"][0].item())
    assert set(ours.router.stats.losses) == set(tracked), (name, tracked.keys())
    if ours.router.expert_bias is not None:
        counts = ours.router.local_tokens_per_expert
        result["bias counts"] = (counts - theirs.router.local_tokens_per_expert).abs().max().item()
        assert counts.sum() > 0
    return result


def _compare_all(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    # a third shim, for expert biases: with one rank megatron-core's all-reduce returns its input
    # as-is and SequentialMLP then adds the bias to it in place, which autograd forbids
    reduce = mappings._reduce
    mappings._reduce = lambda x, group: reduce(x, group).clone()
    parallel_state.initialize_model_parallel(1, 1)
    return {name: _compare_case(name, case) for name, case in CASES.items()}


@pytest.mark.slow
def test_moe_layer_equals_megatron_core():
    results = run_on_ranks(_compare_all, world_size=1, timeout=300)[0]
    for case, differences in results.items():
        for what, difference in differences.items():
            assert difference < 1e-5, (case, what, difference)
