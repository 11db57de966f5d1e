"""transformers' mixture-of-experts configs -> our ModelConfig (what an import reads), and the
MoE model types transformers has that our layer cannot compute, refused by name.

The classes and what each maps to: pretrain/convert/hf_moe.py (their weights and the export).
Every setting that changes what the HF model computes is read or refused; none is guessed.
"""

from __future__ import annotations

from pretrain.convert.hf_common import llama_body_from_hf, rope_parameters
from pretrain.convert.hf_moe import GLM4_MOE, GROUP_TOP, MIXTRAL, QWEN3_MOE
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig

# model types transformers has that our MoE layer does not compute, and why
REFUSED = {
    "qwen2_moe": "a shared expert scaled by its own sigmoid gate (shared_expert_gate) and "
    "biases on q/k/v only",
    "deepseek_v2": "multi-latent attention (kv_lora_rank), which our attention does not have",
    "deepseek_v3": "multi-latent attention (kv_lora_rank), which our attention does not have",
    "olmoe": "RMSNorms over the whole query and key projections (q_norm/k_norm)",
}


def _body(hf, seq_length: int | None) -> dict:
    """Our fields of a Llama-family body without biases."""
    return dict(llama_body_from_hf(hf, seq_length), add_bias_linear=False, num_moe_experts=None)


def _refuse(model_type: str, problems: list[str]) -> None:
    if problems:
        raise UserError(
            f"config.json: this {model_type} model cannot be expressed by our model: "
            + "; ".join(problems)
        )


def _mixtral_config(hf, seq_length: int | None) -> ModelConfig:
    problems = []
    window = getattr(hf, "sliding_window", None)
    if window is not None and window < hf.max_position_embeddings:
        problems.append(f"sliding_window={window} (our attention is full causal)")
    if hf.num_experts_per_tok == 1:
        problems.append(
            "num_experts_per_tok=1 (Mixtral gives the one expert weight 1; ours its probability)"
        )
    _refuse(MIXTRAL, problems)
    return ModelConfig(
        **_body(hf, seq_length)
        | dict(
            ffn_hidden_size=hf.intermediate_size,
            num_moe_experts=hf.num_local_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size,
        )
    )


def _qwen3_config(hf, seq_length: int | None) -> ModelConfig:
    problems = []
    if hf.attention_bias:
        problems.append("attention_bias=True (our MoE models have no biases)")
    if getattr(hf, "use_sliding_window", False):
        problems.append("use_sliding_window=True (our attention is full causal)")
    if hf.num_experts_per_tok == 1 and hf.norm_topk_prob:
        problems.append(
            "num_experts_per_tok=1 with norm_topk_prob (weight 1; ours its probability)"
        )
    _refuse(QWEN3_MOE, problems)
    pattern = tuple(
        int(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0)
        for i in range(hf.num_hidden_layers)
    )
    return ModelConfig(
        **_body(hf, seq_length)
        | dict(
            qk_layernorm=True,
            ffn_hidden_size=hf.intermediate_size,
            num_moe_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_layer_freq=1 if all(pattern) else pattern,
            moe_router_pre_softmax=not hf.norm_topk_prob,
        )
    )


def _glm_problems(hf) -> list[str]:
    problems = []
    if hf.attention_bias:
        problems.append("attention_bias=True (biases on q/k/v only; ours are on every linear)")
    partial = rope_parameters(hf).get(
        "partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)
    )
    if partial != 1.0:
        problems.append(f"partial_rotary_factor={partial} (our RoPE rotates the whole head)")
    if hf.n_group > 1 and hf.num_experts_per_tok // hf.topk_group != GROUP_TOP:
        problems.append(
            f"n_group={hf.n_group} with num_experts_per_tok / topk_group != {GROUP_TOP} (our "
            f"group score sums the top num_experts_per_tok / topk_group experts)"
        )
    if hf.norm_topk_prob != (hf.num_experts_per_tok > 1):
        problems.append(
            f"norm_topk_prob={hf.norm_topk_prob} with num_experts_per_tok="
            f"{hf.num_experts_per_tok} (ours normalises the sigmoid weights exactly when k > 1)"
        )
    if hf.n_shared_experts < 1:
        problems.append("n_shared_experts=0")
    return problems


def _glm_config(hf, seq_length: int | None) -> ModelConfig:
    _refuse(GLM4_MOE, _glm_problems(hf))
    dense = min(hf.first_k_dense_replace, hf.num_hidden_layers)
    grouped = hf.n_group > 1
    return ModelConfig(
        **_body(hf, seq_length)
        | dict(
            ffn_hidden_size=hf.intermediate_size,
            num_moe_experts=hf.n_routed_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_layer_freq=(0,) * dense + (1,) * (hf.num_hidden_layers - dense) if dense else 1,
            moe_shared_expert_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=hf.routed_scaling_factor
            if hf.routed_scaling_factor != 1.0
            else None,
            moe_router_num_groups=hf.n_group if grouped else None,
            moe_router_group_topk=hf.topk_group if grouped else None,
            moe_router_dtype="fp32",
            qk_layernorm=bool(hf.use_qk_norm),
        )
    )


MODEL_TYPES = {MIXTRAL: _mixtral_config, QWEN3_MOE: _qwen3_config, GLM4_MOE: _glm_config}


def from_hf_config(hf, seq_length: int | None = None) -> ModelConfig:
    """Our ModelConfig for a transformers Mixtral / Qwen3-MoE / GLM-4.5 config; UserError
    otherwise."""
    model_type = getattr(hf, "model_type", None)
    if model_type in REFUSED:
        raise UserError(
            f"config.json: model_type={model_type!r} uses {REFUSED[model_type]}; it cannot be "
            f"converted (mixture-of-experts models that can: {', '.join(MODEL_TYPES)})"
        )
    return MODEL_TYPES[model_type](hf, seq_length)
