"""What every Llama-family Hugging Face class shares with our Llama flavour: the body's checks,
RoPE parameters, and the per-layer weights of the norms, the attention and a gated MLP.

`LlamaForCausalLM`, `MixtralForCausalLM`, `Qwen3MoeForCausalLM` and `Glm4MoeForCausalLM`
(pretrain/convert/hf_moe.py) differ only in their MLPs and in per-head q/k RMSNorms (`q_norm`,
`k_norm`: our --qk-layernorm): their attention is q/k/v/o projections around rotate-half RoPE and
their norms RMSNorms named `input_layernorm` / `post_attention_layernorm`. Our fused QKV is per
query group [its q heads; k; v]; our fc1 is [gate; up]. Names: `o` is our layer prefix
(`layers.<i>.`), `t` the HF one (`model.layers.<i>.`).
"""

from __future__ import annotations

import torch

from pretrain.errors import UserError
from pretrain.model.config import ModelConfig


def llama_body_mismatches(c: ModelConfig) -> list[str]:
    """What keeps `c` from being a Llama-family body (RoPE, RMSNorm, SwiGLU)."""
    problems = []
    if c.position_embedding_type != "rope":
        problems.append(f"position_embedding_type={c.position_embedding_type} (needs rope)")
    if c.normalization != "RMSNorm":
        problems.append(f"normalization={c.normalization} (needs RMSNorm)")
    if not c.swiglu:
        problems.append("swiglu=False (needs SwiGLU)")
    return problems


def to_hf_rope(config: ModelConfig) -> dict:
    """transformers 5's `rope_parameters` (older versions' `rope_scaling` + `rope_theta`)."""
    params = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.use_rope_scaling:
        params |= {
            "rope_type": "llama3",
            "factor": float(config.rope_scaling_factor),
            "low_freq_factor": float(config.rope_scaling_low_freq_factor),
            "high_freq_factor": float(config.rope_scaling_high_freq_factor),
            "original_max_position_embeddings": config.rope_scaling_original_max_position_embeddings,
        }
    return params


SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_parameters(hf) -> dict:
    """The config's RoPE parameters: `rope_parameters` (transformers 5) or `rope_scaling`."""
    return dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})


def from_hf_rope(hf) -> dict:
    """Our RoPE fields from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    params = rope_parameters(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(
            f"config.json: rope_type={rope_type!r} is not supported by our model (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}; 'llama3' is Megatron's --use-rope-scaling)"
        )
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
    fields = {"rotary_base": int(theta) if float(theta).is_integer() else float(theta)}
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in params]
        if missing:
            raise UserError(
                f"config.json: rope_type 'llama3' lacks {', '.join(missing)} (a Llama 3.x config "
                f"sets all of {', '.join(_LLAMA3_KEYS)})"
            )
        fields |= {
            "use_rope_scaling": True,
            "rope_scaling_factor": float(params["factor"]),
            "rope_scaling_low_freq_factor": float(params["low_freq_factor"]),
            "rope_scaling_high_freq_factor": float(params["high_freq_factor"]),
            "rope_scaling_original_max_position_embeddings": int(
                params["original_max_position_embeddings"]
            ),
        }
    return fields


def _suffixes(c: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if c.add_bias_linear else ("weight",)


def attention_to_hf(ours: dict, o: str, t: str, c: ModelConfig) -> dict:
    """The layer's norms and q/k/v/o projections (HF names) from ours."""
    nh, ng, d = c.num_attention_heads, c.query_groups, c.head_dim
    per_group = nh // ng
    out = {
        t + "input_layernorm.weight": ours[o + "input_norm.weight"],
        t + "post_attention_layernorm.weight": ours[o + "post_attention_norm.weight"],
    }
    if c.qk_layernorm:  # Qwen3's per-head RMSNorms
        out |= {
            t + f"self_attn.{p}_norm.weight": ours[o + f"attention.{p}_norm.weight"] for p in "qk"
        }
    for suffix in _suffixes(c):
        qkv = ours[o + "attention.qkv." + suffix]
        rest = qkv.shape[1:]
        grouped = qkv.reshape(ng, per_group + 2, d, *rest)  # per group: q heads, k, v
        out |= {
            t + "self_attn.q_proj." + suffix: grouped[:, :per_group].reshape(nh * d, *rest),
            t + "self_attn.k_proj." + suffix: grouped[:, per_group].reshape(ng * d, *rest),
            t + "self_attn.v_proj." + suffix: grouped[:, per_group + 1].reshape(ng * d, *rest),
            t + "self_attn.o_proj." + suffix: ours[o + "attention.proj." + suffix],
        }
    return out


def attention_from_hf(hf: dict, t: str, o: str, c: ModelConfig) -> dict:
    """Our norms and fused QKV / proj of one layer from the HF names."""
    nh, ng, d = c.num_attention_heads, c.query_groups, c.head_dim
    out = {
        o + "input_norm.weight": hf[t + "input_layernorm.weight"],
        o + "post_attention_norm.weight": hf[t + "post_attention_layernorm.weight"],
    }
    if c.qk_layernorm:
        out |= {
            o + f"attention.{p}_norm.weight": hf[t + f"self_attn.{p}_norm.weight"] for p in "qk"
        }
    for suffix in _suffixes(c):
        q, k, v = (hf[t + f"self_attn.{p}_proj." + suffix] for p in "qkv")
        rest = q.shape[1:]
        grouped = [q.reshape(ng, nh // ng, d, *rest), k.reshape(ng, 1, d, *rest)]
        grouped.append(v.reshape(ng, 1, d, *rest))
        out |= {
            o + "attention.qkv." + suffix: torch.cat(grouped, dim=1).reshape(-1, *rest),
            o + "attention.proj." + suffix: hf[t + "self_attn.o_proj." + suffix],
        }
    return out


def gated_mlp_to_hf(ours: dict, o: str, t: str, suffixes=("weight",)) -> dict:
    """A SwiGLU MLP `<o>fc1` ([gate; up]) / `<o>fc2` as `<t>gate_proj`, `up_proj`, `down_proj`."""
    out = {}
    for suffix in suffixes:
        gate, up = ours[o + "fc1." + suffix].chunk(2, dim=0)
        out |= {
            t + "gate_proj." + suffix: gate,
            t + "up_proj." + suffix: up,
            t + "down_proj." + suffix: ours[o + "fc2." + suffix],
        }
    return out


def gated_mlp_from_hf(hf: dict, t: str, o: str, suffixes=("weight",)) -> dict:
    """`<t>gate_proj`, `up_proj`, `down_proj` as our `<o>fc1` ([gate; up]) and `<o>fc2`."""
    out = {}
    for suffix in suffixes:
        gate, up = hf[t + "gate_proj." + suffix], hf[t + "up_proj." + suffix]
        out |= {
            o + "fc1." + suffix: torch.cat([gate, up]),
            o + "fc2." + suffix: hf[t + "down_proj." + suffix],
        }
    return out


def llama_layer_to_hf(ours: dict, o: str, t: str, c: ModelConfig) -> dict:
    """One dense Llama layer."""
    mlp = gated_mlp_to_hf(ours, o + "mlp.", t + "mlp.", _suffixes(c))
    return attention_to_hf(ours, o, t, c) | mlp


def llama_layer_from_hf(hf: dict, t: str, o: str, c: ModelConfig) -> dict:
    """One dense Llama layer."""
    mlp = gated_mlp_from_hf(hf, t + "mlp.", o + "mlp.", _suffixes(c))
    return attention_from_hf(hf, t, o, c) | mlp


def llama_body_to_hf(config: ModelConfig) -> dict:
    """transformers' config fields of our Llama-family body (RoPE, RMSNorm, GQA, SwiGLU), which
    LlamaConfig and the MoE classes' configs share."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.query_groups,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_positions,
        initializer_range=config.init_method_std,
        rms_norm_eps=config.norm_epsilon,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        rope_parameters=to_hf_rope(config),
        attention_dropout=config.attention_dropout,
    )


def llama_body_from_hf(hf, seq_length: int | None) -> dict:
    """Our ModelConfig fields of a transformers Llama-family body (biases and the MLP are the
    caller's); a hidden_act other than silu is refused in one line."""
    if hf.hidden_act != "silu":
        raise UserError(
            f"config.json: hidden_act={hf.hidden_act!r} cannot be expressed by our model (our "
            f"SwiGLU uses silu)"
        )
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        vocab_size=hf.vocab_size,
        seq_length=seq_length or hf.max_position_embeddings,
        max_position_embeddings=hf.max_position_embeddings,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        position_embedding_type="rope",
        **from_hf_rope(hf),
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        swiglu=True,
        untie_embeddings_and_output_weights=not hf.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=hf.attention_dropout,
        init_method_std=hf.initializer_range,
    )
