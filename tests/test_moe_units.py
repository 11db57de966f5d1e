"""Megatron's MoE unit invariants, in one process (fp32, CPU): permutation, capacity, padding,
grouped GEMM vs the per-expert loop, how the auxiliary losses reach backward, the expert bias,
recomputation, the MoE flags' rules, and MoE layers inside GPTModel."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel
from pretrain.model.mlp import MLP
from pretrain.model.moe import losses, metrics
from pretrain.model.moe.config import moe_layer_pattern, parse_layer_freq
from pretrain.model.moe.experts import Experts
from pretrain.model.moe.layer import MoELayer
from pretrain.model.moe.permutation import permute, unpermute
from pretrain.model.moe.routing import drop_over_capacity, expert_capacity, topk_routing
from pretrain.parallel.random import checkpoint

BATCH, SEQ, HIDDEN = 2, 12, 16


def _config(**moe) -> ModelConfig:
    values = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        vocab_size=64,
        seq_length=SEQ,
        ffn_hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=4,
        moe_ffn_hidden_size=16,
    )
    return ModelConfig(**(values | moe))


def _layer(config: ModelConfig) -> MoELayer:
    layer = MoELayer(config, 0)
    layer.initialize("layers.0.mlp", 0.02, 0.01)
    return layer


def _forward_backward(layer, x, upstream, padding_mask=None):
    x = x.clone().requires_grad_()
    out = layer(x, padding_mask)
    (out * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    return out.detach(), x.grad, grads


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, SEQ, HIDDEN)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


@pytest.mark.parametrize("topk", [1, 3])
def test_permute_then_unpermute_restores_the_tokens_and_their_gradient(topk):
    tokens = torch.randn(10, 6, requires_grad=True)
    logits = torch.randn(10, 5)
    _, routing_map = topk_routing(logits, topk, pre_softmax=True)
    rows, indices = permute(tokens, routing_map)
    assert rows.shape[0] == 10 * topk
    # expert-major, each expert's tokens in token order
    experts = routing_map.T.nonzero()[:, 0]
    assert torch.equal(indices, routing_map.T.nonzero()[:, 1]) and (experts.diff() >= 0).all()
    restored = unpermute(rows, indices, 10)
    torch.testing.assert_close(restored, topk * tokens, rtol=0, atol=1e-6)
    upstream = torch.randn(10, 6)
    (restored * upstream).sum().backward()
    torch.testing.assert_close(tokens.grad, topk * upstream, rtol=0, atol=1e-6)


def test_capacity_drop_and_pad_invariants():
    torch.manual_seed(1)
    logits = torch.randn(40, 4) * 3  # unbalanced on purpose
    probs, routing_map = topk_routing(logits, 2)
    capacity = expert_capacity(40, 4, 2, 0.5)
    assert capacity == 10
    assert routing_map.sum(0).max() > capacity  # something is over capacity
    for policy in ("probs", "position"):
        kept_probs, kept = drop_over_capacity(probs, routing_map, capacity, policy)
        assert (kept.sum(0) <= capacity).all() and not (kept & ~routing_map).any()
        assert torch.equal(kept_probs, probs * kept)
        for e in range(4):
            dropped, stays = routing_map[:, e] & ~kept[:, e], kept[:, e]
            if not dropped.any():
                continue
            if policy == "probs":  # every kept weight >= every dropped weight
                assert probs[stays, e].min() >= probs[dropped, e].max()
            else:  # the first routed tokens are kept
                assert stays.nonzero().max() < dropped.nonzero().min()
        padded_probs, padded = drop_over_capacity(probs, routing_map, capacity, policy, pad=True)
        assert (padded.sum(0) == capacity).all()
        assert torch.equal(padded & routing_map, kept)  # padding adds only weight-0 entries
        assert torch.equal(padded_probs, kept_probs)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_padded_and_unpadded_runs_are_equal(policy):
    x, upstream = _inputs()
    base = dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy=policy)
    unpadded = _forward_backward(_layer(_config(**base)), x, upstream)
    padded_layer = _layer(_config(**base, moe_pad_expert_input_to_capacity=True))
    padded = _forward_backward(padded_layer, x, upstream)
    assert padded_layer.router.stats.dropped > 0
    torch.testing.assert_close(padded[0], unpadded[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(padded[1], unpadded[1], rtol=0, atol=1e-6)
    for name, grad in unpadded[2].items():
        torch.testing.assert_close(padded[2][name], grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("swiglu,bias", [(True, False), (False, True)])
def test_grouped_gemm_equals_the_loop_with_an_empty_expert(swiglu, bias):
    counts = [5, 0, 3, 7]  # expert 1 receives no token
    config = _config(swiglu=swiglu, add_bias_linear=bias)
    loop, grouped = (
        Experts(config, range(4)),
        Experts(_config(swiglu=swiglu, add_bias_linear=bias, moe_grouped_gemm=True), range(4)),
    )
    loop.initialize("experts", 0.02, 0.01)
    grouped.load_state_dict(loop.state_dict())
    x, probs = torch.randn(sum(counts), HIDDEN), torch.rand(sum(counts))
    results = []
    for experts in (loop, grouped):
        inputs = x.clone().requires_grad_()
        out = experts(inputs, counts, probs)
        out.sum().backward()  # a broadcast gradient: the grouped GEMM needs it made contiguous
        results.append((out, inputs.grad, [p.grad for p in experts.parameters()]))
    (out_a, grad_a, params_a), (out_b, grad_b, params_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-6, atol=1e-6)
    for a, b in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert loop.fc1.weight.grad[1].abs().sum() == 0  # the empty expert gets no gradient
    for i, rows in enumerate(x.split(counts)):  # and each expert is its own MLP
        weight = probs.split(counts)[i].unsqueeze(-1)
        hidden = rows @ loop.fc1.weight[i].T + (loop.fc1.bias[i] if bias else 0)
        if swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = torch.nn.functional.silu(gate) * up
        else:
            hidden = torch.nn.functional.gelu(hidden)
        expected = (hidden * weight) @ loop.fc2.weight[i].T + (
            loop.fc2.bias[i] * weight if bias else 0
        )
        torch.testing.assert_close(out_a.split(counts)[i], expected, rtol=1e-6, atol=1e-6)


def _explicit_aux_loss(layer, x, config) -> torch.Tensor:
    """The load-balancing and z losses of `layer` on `x`, computed from the formulas directly."""
    tokens = x.transpose(0, 1).reshape(-1, HIDDEN)
    logits = tokens @ layer.router.weight.T + layer.router.bias
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(2).indices, 1.0)
    experts, count = config.num_moe_experts, tokens.shape[0]
    balance = (scores.sum(0) * chosen.sum(0)).sum() * experts / (2 * count * count)
    z = torch.logsumexp(logits, -1).square().mean()
    return config.moe_aux_loss_coeff * balance + config.moe_z_loss_coeff * z


def test_aux_losses_reach_backward_as_if_added_to_the_loss():
    config = _config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    x, upstream = _inputs()
    layer = _layer(config)
    attached = _forward_backward(layer, x, upstream)[2]
    logged = layer.router.stats.losses
    with torch.no_grad():
        explicit = _explicit_aux_loss(layer, x, config)
    expected_log = config.moe_aux_loss_coeff * logged["load_balancing_loss"]
    expected_log += config.moe_z_loss_coeff * logged["z_loss"]
    torch.testing.assert_close(explicit.double(), expected_log, rtol=1e-6, atol=0)
    layer.eval()  # no aux loss attached: add it by hand instead
    x_eval = x.clone().requires_grad_()
    loss = (layer(x_eval) * upstream).sum() + _explicit_aux_loss(layer, x_eval, config)
    loss.backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, attached[name], rtol=1e-5, atol=1e-7)
    layer.zero_grad()
    layer.train()
    losses.set_backward_scale(0.0)  # the scale multiplies exactly the aux losses' gradient
    try:
        without = _forward_backward(layer, x, upstream)[2]
    finally:
        losses.set_backward_scale(1.0)
    assert not torch.allclose(without["router.weight"], attached["router.weight"])
    layer.eval()
    plain = _forward_backward(layer, x, upstream)[2]
    torch.testing.assert_close(without["router.weight"], plain["router.weight"])


def test_expert_bias_picks_experts_ignores_padding_and_updates():
    config = _config(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01,
        add_bias_linear=False,
    )
    layer = _layer(config)
    x, upstream = _inputs()
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[0, -5:] = True
    _forward_backward(layer, x, upstream, padding)
    counts = layer.router.local_tokens_per_expert.clone()
    assert counts.sum() == (BATCH * SEQ - 5) * config.moe_router_topk  # padding not counted
    metrics.finish_iteration(layer)
    expected = 0.01 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert layer.router.expert_bias.abs().sum() > 0
    assert layer.router.local_tokens_per_expert.sum() == 0
    # a large bias picks expert 3 for every token; the weights stay the unbiased scores
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
        tokens = x.transpose(0, 1).reshape(-1, HIDDEN)
        probs, routing_map = layer.router.eval()(tokens, SEQ)
        assert routing_map[:, 3].all()
        scores = torch.sigmoid(layer.router.logits(tokens))
        chosen = scores * routing_map
        torch.testing.assert_close(probs, chosen / chosen.sum(-1, keepdim=True))


def test_recomputation_counts_tokens_once():
    config = _config(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_aux_loss_coeff=0.1,
    )
    x, upstream = _inputs()
    plain, recomputed = _layer(config), _layer(config)
    expected = _forward_backward(plain, x, upstream)
    x_recomputed = x.clone().requires_grad_()
    (checkpoint(recomputed, x_recomputed) * upstream).sum().backward()
    torch.testing.assert_close(x_recomputed.grad, expected[1])
    for name, param in recomputed.named_parameters():
        torch.testing.assert_close(param.grad, expected[2][name])
    assert torch.equal(
        recomputed.router.local_tokens_per_expert, plain.router.local_tokens_per_expert
    )
    assert (
        recomputed.router.stats.micro_batches
        == plain.router.stats.micro_batches
        == {"load_balancing_loss": 1}
    )


def test_moe_layer_freq_expressions():
    assert parse_layer_freq("2") == 2
    assert parse_layer_freq("([1]*3+[0])*2") == (1, 1, 1, 0, 1, 1, 1, 0)
    assert parse_layer_freq("[0, 1]") == (0, 1)
    assert moe_layer_pattern(2, 5) == (True, False, True, False, True)
    for bad in ("__import__('os')", "[1, 'a']", "1.5", "[1]*[2]"):
        with pytest.raises(ValueError, match="--moe-layer-freq"):
            parse_layer_freq(bad)


@pytest.mark.parametrize(
    "fields,layout,message",
    [
        (dict(moe_router_topk=5), {}, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
        (dict(moe_router_topk=1), {}, "needs --moe-router-pre-softmax"),
        (dict(moe_router_enable_expert_bias=True), {}, "needs --moe-router-score-function sigmoid"),
        (dict(moe_router_group_topk=2), {}, "needs --moe-router-num-groups"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=1), {}, "must divide --num-experts 4"),
        (dict(moe_pad_expert_input_to_capacity=True), {}, "needs --moe-expert-capacity-factor"),
        (dict(moe_expert_capacity_factor=0.0), {}, "drop the flag for dropless"),
        (dict(moe_router_load_balancing_type="sinkhorn"), {}, "'sinkhorn' is not implemented"),
        (dict(moe_token_dispatcher_type="flex"), {}, "'flex' is not implemented"),
        (dict(moe_layer_freq=(1, 0, 1)), {}, "one 0/1 per layer (2)"),
        (dict(seq_length=15), dict(tp=2), "routes each TP rank's chunk of --seq-length 15"),
        (dict(), dict(ep=3), "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
        (dict(), dict(tp=2, etp=2), "expert biases need --expert-tensor-parallel-size 1"),
        (dict(moe_shared_expert_intermediate_size=8), {}, "add --disable-bias-linear"),
        (dict(moe_grouped_gemm=True, moe_ffn_hidden_size=6), {}, "multiples of 4"),
        (
            dict(
                moe_router_load_balancing_type="global_aux_loss",
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
            ),
            {},
            "global_aux_loss with --recompute-granularity full",
        ),
    ],
)
def test_unsupported_moe_settings_are_one_line(fields, layout, message):
    with pytest.raises(UserError, match=None) as error:
        _config(**fields).validate(**layout)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_gpt_model_places_moe_layers_and_names_their_weights():
    config = _config(
        num_layers=4,
        moe_layer_freq=(0, 1, 1, 0),
        moe_aux_loss_coeff=0.01,
        add_bias_linear=False,
        moe_shared_expert_intermediate_size=8,
        swiglu=True,
    )
    model = GPTModel(config)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [MLP, MoELayer, MoELayer, MLP]
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if ".mlp." in name}
    assert shapes["layers.1.mlp.router.weight"] == (4, HIDDEN)
    assert shapes["layers.1.mlp.experts.fc1.weight"] == (4, 32, HIDDEN)
    assert shapes["layers.1.mlp.experts.fc2.weight"] == (4, HIDDEN, 16)
    assert shapes["layers.2.mlp.shared_experts.fc1.weight"] == (16, HIDDEN)
    assert shapes["layers.0.mlp.fc1.weight"] == (64, HIDDEN)
    expert = model.layers[1].mlp.experts.fc1.weight
    assert expert.expert_parallel and expert.expert_partition_dim == 0
    tokens = torch.randint(0, 64, (BATCH, SEQ))
    model(tokens, labels=tokens).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    collected = metrics.collect(model, config)
    assert len(collected.losses["load_balancing_loss"]) == 2
    assert math.isclose(
        collected.total_losses["load_balancing_loss"],
        sum(collected.losses["load_balancing_loss"]) / 2,
    )
    assert 0 < min(collected.min_share) <= 0.25 <= max(collected.max_share) < 1
    assert collected.dropped_fraction == 0


def test_expert_bias_and_counts_stay_fp32_in_a_bf16_model():
    config = _config(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        add_bias_linear=False,
        params_dtype=torch.bfloat16,
    )
    layer = _layer(config)
    state = {name: t.clone() for name, t in layer.state_dict().items()}
    state["router.expert_bias"] = torch.full((4,), 1e-3) + torch.arange(4.0)  # not bf16-exact
    layer.bfloat16()  # what DeepSpeed's bf16 engine does to the module
    layer.load_state_dict(state)
    assert layer.router.expert_bias.dtype == torch.float32
    assert torch.equal(layer.router.expert_bias, state["router.expert_bias"])
    x = torch.randn(32, SEQ, HIDDEN, dtype=torch.bfloat16)
    for _ in range(2):  # 2 x 768 routed tokens: counts past bf16's exact integers (256)
        layer(x)
    assert layer.router.local_tokens_per_expert.dtype == torch.float32
    assert layer.router.local_tokens_per_expert.sum() == 2 * 32 * SEQ * 2
