"""Our mixture-of-experts GPTModel <-> Hugging Face `MixtralForCausalLM`, `Qwen3MoeForCausalLM`,
`Glm4MoeForCausalLM`.

All have our Llama body (RoPE, RMSNorm, GQA, no biases: pretrain/convert/hf_common.py) and differ
in their MoE blocks and q/k norms; which one a model maps to follows from its architecture:
- Mixtral: softmax router, top-k weights renormalised to sum to 1 (= our softmax over the k
  selected logits, i.e. without --moe-router-pre-softmax), every layer MoE, no shared expert,
  no q/k norms.
- Qwen3-MoE: the same router, renormalised (`norm_topk_prob`) or not (= our
  --moe-router-pre-softmax), per-head q/k RMSNorms (our --qk-layernorm), dense layers anywhere
  (`mlp_only_layers`), no shared expert.
- GLM-4.5 (`glm4_moe`, DeepSeek-V3's MoE with plain GQA attention): sigmoid router whose
  `e_score_correction_bias` only picks experts (our expert bias), top-k weights normalised when
  k > 1 (`norm_topk_prob`) and scaled (`routed_scaling_factor`), group-limited routing scoring a
  group by its top 2 (ours by its top k / group_topk), `n_shared_experts` shared experts of
  `moe_intermediate_size` (our one shared MLP of their total width), the first
  `first_k_dense_replace` layers dense, optional q/k norms (`use_qk_norm`).
Expert weights: ours `experts.fc1.weight` [E, 2f, h] ([gate; up]) and `fc2.weight` [E, h, f];
transformers holds them as `experts.gate_up_proj` / `down_proj` of the same shapes in memory
and saves them per expert (Mixtral `block_sparse_moe.experts.<e>.w1/w3/w2`, Qwen3 and GLM
`mlp.experts.<e>.gate_proj/up_proj/down_proj`), which is what an import reads.

Anything the classes cannot express (token dropping, biases, another layer pattern, a router
option they lack) is a UserError naming it. Their configs are read by hf_moe_import.py, which
also refuses by name the MoE models transformers has but our layer cannot run (DeepSeek-V2/V3's
multi-latent attention, Qwen2-MoE's gated shared expert, OLMoE's whole-projection q/k norms).
"""

from __future__ import annotations

import torch
import transformers

from pretrain.convert.hf_common import (
    attention_from_hf,
    attention_to_hf,
    gated_mlp_from_hf,
    gated_mlp_to_hf,
    llama_body_mismatches,
    llama_body_to_hf,
    llama_layer_from_hf,
    llama_layer_to_hf,
)
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig

MIXTRAL = "mixtral"
QWEN3_MOE = "qwen3_moe"
GLM4_MOE = "glm4_moe"
HF_CLASSES = {
    MIXTRAL: "MixtralForCausalLM",
    QWEN3_MOE: "Qwen3MoeForCausalLM",
    GLM4_MOE: "Glm4MoeForCausalLM",
}
GROUP_TOP = 2  # transformers' DeepSeek-V3/GLM router scores a group by its top 2 experts

# --------------------------------------------------------------------------- which class


def _common_mismatches(c: ModelConfig) -> list[str]:
    problems = llama_body_mismatches(c)
    if c.add_bias_linear:
        problems.append("add_bias_linear=True (no biases; add --disable-bias-linear)")
    if c.moe_expert_capacity_factor is not None:
        problems.append(
            f"moe_expert_capacity_factor={c.moe_expert_capacity_factor} (transformers drops no "
            f"tokens: train dropless)"
        )
    return problems


def _softmax_router_mismatches(c: ModelConfig) -> list[str]:
    """What keeps `c` from Mixtral's / Qwen3's router: softmax, no shared expert, no scaling,
    no groups."""
    problems = []
    if c.moe_router_score_function != "softmax":
        problems.append("moe_router_score_function=sigmoid (needs softmax)")
    if c.moe_shared_expert_intermediate_size is not None:
        problems.append("a shared expert (none in this class)")
    if c.moe_router_topk_scaling_factor not in (None, 1.0):
        problems.append(f"moe_router_topk_scaling_factor={c.moe_router_topk_scaling_factor}")
    if c.moe_router_group_topk:
        problems.append("group-limited routing (--moe-router-group-topk)")
    return problems


def _mixtral_mismatches(c: ModelConfig) -> list[str]:
    problems = _common_mismatches(c) + _softmax_router_mismatches(c)
    if not all(c.moe_layers):
        problems.append(f"moe_layer_freq={c.moe_layer_freq} (needs experts in every layer)")
    if c.moe_router_pre_softmax:
        problems.append("--moe-router-pre-softmax (Mixtral renormalises the top-k weights)")
    if c.qk_layernorm:
        problems.append("qk_layernorm=True (no q/k norms)")
    return problems


def _qwen3_mismatches(c: ModelConfig) -> list[str]:
    problems = _common_mismatches(c) + _softmax_router_mismatches(c)
    if not c.qk_layernorm:
        problems.append("qk_layernorm=False (needs --qk-layernorm: q_norm/k_norm)")
    return problems


def _first_dense_layers(c: ModelConfig) -> int | None:
    """k when the first k layers are dense and the rest MoE (GLM's first_k_dense_replace)."""
    k = c.moe_layers.index(True) if any(c.moe_layers) else c.num_layers
    return k if all(c.moe_layers[k:]) else None


def _glm_mismatches(c: ModelConfig) -> list[str]:
    problems = _common_mismatches(c)
    if _first_dense_layers(c) is None:
        problems.append(
            f"moe_layer_freq={c.moe_layer_freq} (needs dense layers first, then MoE layers only)"
        )
    if c.moe_router_score_function != "sigmoid":
        problems.append("moe_router_score_function=softmax (needs sigmoid)")
    g, f = c.moe_shared_expert_intermediate_size, c.moe_ffn_size
    if g is None or g % f:
        problems.append(
            f"moe_shared_expert_intermediate_size={g} (needs a multiple of "
            f"--moe-ffn-hidden-size {f}: n_shared_experts experts of that width)"
        )
    if c.moe_router_group_topk and c.moe_router_topk // c.moe_router_group_topk != GROUP_TOP:
        problems.append(
            f"group-limited routing with --moe-router-topk {c.moe_router_topk} / "
            f"--moe-router-group-topk {c.moe_router_group_topk} experts per group (transformers "
            f"scores a group by its top {GROUP_TOP})"
        )
    return problems


_MISMATCHES = {
    MIXTRAL: _mixtral_mismatches,
    QWEN3_MOE: _qwen3_mismatches,
    GLM4_MOE: _glm_mismatches,
}


def moe_flavour(config: ModelConfig) -> str:
    """MIXTRAL, QWEN3_MOE or GLM4_MOE: the transformers class that computes exactly this MoE
    model."""
    found = {flavour: check(config) for flavour, check in _MISMATCHES.items()}
    for flavour, problems in found.items():
        if not problems:
            return flavour
    reasons = ". As ".join(f"{HF_CLASSES[f]} it has " + "; ".join(p) for f, p in found.items())
    raise UserError(
        f"this mixture-of-experts model has no Hugging Face equivalent: as {reasons}. "
        f"docs/CONVERSION.md lists what each class needs"
    )


# --------------------------------------------------------------------------- configs


def to_hf_config(config: ModelConfig, flavour: str, **specials) -> transformers.PretrainedConfig:
    """The transformers config of the MoE model `config` (flavour from `moe_flavour`)."""
    common = dict(
        **llama_body_to_hf(config),
        num_experts_per_tok=config.moe_router_topk,
        architectures=[HF_CLASSES[flavour]],
        **specials,
    )
    if flavour == MIXTRAL:
        return transformers.MixtralConfig(
            intermediate_size=config.moe_ffn_size,
            num_local_experts=config.num_moe_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
            **common,
        )
    if flavour == QWEN3_MOE:
        return transformers.Qwen3MoeConfig(
            intermediate_size=config.ffn_size,
            moe_intermediate_size=config.moe_ffn_size,
            num_experts=config.num_moe_experts,
            norm_topk_prob=not config.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(config.moe_layers) if not moe],
            attention_bias=False,
            use_sliding_window=False,
            **common,
        )
    grouped = bool(config.moe_router_group_topk)
    common["rope_parameters"] |= {"partial_rotary_factor": 1.0}
    return transformers.Glm4MoeConfig(
        intermediate_size=config.ffn_size,
        moe_intermediate_size=config.moe_ffn_size,
        n_routed_experts=config.num_moe_experts,
        n_shared_experts=config.moe_shared_expert_intermediate_size // config.moe_ffn_size,
        first_k_dense_replace=_first_dense_layers(config),
        norm_topk_prob=config.moe_router_topk > 1,
        routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
        n_group=config.moe_router_num_groups if grouped else 1,
        topk_group=config.moe_router_group_topk if grouped else 1,
        attention_bias=False,
        use_qk_norm=config.qk_layernorm,
        num_nextn_predict_layers=0,
        **common,
    )


# --------------------------------------------------------------------------- weights


def _expert_bias(ours: dict, o: str, config: ModelConfig) -> torch.Tensor:
    name = o + "mlp.router.expert_bias"
    return ours[name] if name in ours else torch.zeros(config.num_moe_experts)


def _mixtral_layer_to_hf(ours: dict, o: str, t: str, c: ModelConfig) -> dict:
    return attention_to_hf(ours, o, t, c) | {
        t + "mlp.gate.weight": ours[o + "mlp.router.weight"],
        t + "mlp.experts.gate_up_proj": ours[o + "mlp.experts.fc1.weight"],
        t + "mlp.experts.down_proj": ours[o + "mlp.experts.fc2.weight"],
    }


def _is_moe_layer(o: str, c: ModelConfig) -> bool:
    return c.moe_layers[int(o.split(".")[1])]


def _qwen3_layer_to_hf(ours: dict, o: str, t: str, c: ModelConfig) -> dict:
    if not _is_moe_layer(o, c):
        return llama_layer_to_hf(ours, o, t, c)
    return _mixtral_layer_to_hf(ours, o, t, c)


def _glm_layer_to_hf(ours: dict, o: str, t: str, c: ModelConfig) -> dict:
    if not _is_moe_layer(o, c):
        return llama_layer_to_hf(ours, o, t, c)
    return (
        _mixtral_layer_to_hf(ours, o, t, c)
        | {t + "mlp.gate.e_score_correction_bias": _expert_bias(ours, o, c)}
        | gated_mlp_to_hf(ours, o + "mlp.shared_experts.", t + "mlp.shared_experts.")
    )


def _stacked_experts(hf: dict, t: str, c: ModelConfig, names: tuple[str, str, str]) -> dict:
    """Per-expert gate/up/down files -> our stacked experts.fc1 ([gate; up]) and fc2."""
    gate, up, down = names
    fc1 = [
        torch.cat([hf[f"{t}{e}.{gate}.weight"], hf[f"{t}{e}.{up}.weight"]])
        for e in range(c.num_moe_experts)
    ]
    fc2 = [hf[f"{t}{e}.{down}.weight"] for e in range(c.num_moe_experts)]
    return {"experts.fc1.weight": torch.stack(fc1), "experts.fc2.weight": torch.stack(fc2)}


def _mixtral_layer_from_hf(hf: dict, t: str, o: str, c: ModelConfig) -> dict:
    moe = t + "block_sparse_moe."
    experts = _stacked_experts(hf, moe + "experts.", c, ("w1", "w3", "w2"))
    return attention_from_hf(hf, t, o, c) | {
        o + "mlp.router.weight": hf[moe + "gate.weight"],
        **{o + "mlp." + k: v for k, v in experts.items()},
    }


def _qwen3_layer_from_hf(hf: dict, t: str, o: str, c: ModelConfig) -> dict:
    if not _is_moe_layer(o, c):
        return llama_layer_from_hf(hf, t, o, c)
    experts = _stacked_experts(hf, t + "mlp.experts.", c, ("gate_proj", "up_proj", "down_proj"))
    return attention_from_hf(hf, t, o, c) | {
        o + "mlp.router.weight": hf[t + "mlp.gate.weight"],
        **{o + "mlp." + k: v for k, v in experts.items()},
    }


def _glm_layer_from_hf(hf: dict, t: str, o: str, c: ModelConfig) -> dict:
    if not _is_moe_layer(o, c):
        return llama_layer_from_hf(hf, t, o, c)
    return (
        _qwen3_layer_from_hf(hf, t, o, c)
        | {o + "mlp.router.expert_bias": hf[t + "mlp.gate.e_score_correction_bias"].float()}
        | gated_mlp_from_hf(hf, t + "mlp.shared_experts.", o + "mlp.shared_experts.")
    )


LAYER_TO_HF = {
    MIXTRAL: _mixtral_layer_to_hf,
    QWEN3_MOE: _qwen3_layer_to_hf,
    GLM4_MOE: _glm_layer_to_hf,
}
LAYER_FROM_HF = {
    MIXTRAL: _mixtral_layer_from_hf,
    QWEN3_MOE: _qwen3_layer_from_hf,
    GLM4_MOE: _glm_layer_from_hf,
}


def ignored_hf_tensor(name: str, flavour: str, config: ModelConfig) -> bool:
    """Tensors an import drops, as transformers does: GLM-4.5's multi-token-prediction layers
    (`model.layers.<num_hidden_layers + j>.*`), which the causal LM does not run."""
    if flavour != GLM4_MOE or not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= config.num_layers
