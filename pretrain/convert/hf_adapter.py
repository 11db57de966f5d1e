"""Our GPTModel <-> Hugging Face `GPT2LMHeadModel` / `LlamaForCausalLM` (and, through
pretrain/convert/hf_moe.py, the mixture-of-experts classes): configs and weights.

State dicts on our side are *full* (TP = 1) and *unpadded*: GPTModel names (`embedding.*`,
`layers.<i>.*`, `head.*`, see pretrain/model/gpt.py), with exactly `vocab_size` rows in the word
embedding and output layer (pretrain/convert/state_dict.py pads and shards them).

Which Hugging Face class a model maps to follows from its architecture, never from a name:
- GPT-2: learned absolute positions, LayerNorm, GELU MLP, biases on every linear, MHA with
  head_dim = hidden / heads. HF's Conv1D stores weights as [in, out] (ours: [out, in]) and c_attn
  is [q_all | k_all | v_all] (ours: per head [q_h; k_h; v_h]).
- Llama: RoPE (rotate-half, as ours), RMSNorm, SwiGLU; GQA; biases on every linear or on none.
  Our fused QKV is per query group [its q heads; k; v]; fc1 is [gate; up].
Either may have a tied or an untied LM head. GPT-2's GELU is exact ("gelu") or OpenAI's tanh
approximation ("gelu_new", our `openai_gelu`); Llama's RoPE is plain ("default") or Llama 3.x's
scaled one ("llama3", our `use_rope_scaling`). Anything else (e.g. RoPE with LayerNorm, learned
positions with RMSNorm, biases on some linears only, another activation or rope type) raises a
UserError naming what does not fit, because a silently different model is worse than none.
A model with MoE layers is never one of these two: hf_moe.py picks its class or refuses it.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers

from pretrain.convert import hf_moe, hf_moe_import
from pretrain.convert.hf_common import (
    llama_body_from_hf,
    llama_body_mismatches,
    llama_body_to_hf,
    llama_layer_from_hf,
    llama_layer_to_hf,
)
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig

GPT2 = "gpt2"
LLAMA = "llama"
HF_CLASSES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM"} | hf_moe.HF_CLASSES


# --------------------------------------------------------------------------- architecture checks


def _gpt2_mismatches(c: ModelConfig) -> list[str]:
    problems = []
    if c.position_embedding_type != "learned_absolute":
        problems.append(
            f"position_embedding_type={c.position_embedding_type} (needs learned_absolute)"
        )
    if c.normalization != "LayerNorm":
        problems.append(f"normalization={c.normalization} (needs LayerNorm)")
    if c.swiglu:
        problems.append("swiglu=True (needs a GELU MLP)")
    if not c.add_bias_linear:
        problems.append("add_bias_linear=False (GPT-2 has biases on every linear)")
    if c.query_groups != c.num_attention_heads:
        problems.append(f"num_query_groups={c.query_groups} (needs multi-head attention)")
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        problems.append(f"kv_channels={c.head_dim} (needs hidden_size / num_attention_heads)")
    return problems + _no_qk_norms(c)


def _no_qk_norms(c: ModelConfig) -> list[str]:
    return ["qk_layernorm=True (no q/k norms)"] if c.qk_layernorm else []


def hf_flavour(config: ModelConfig) -> str:
    """GPT2, LLAMA or an MoE flavour (pretrain/convert/hf_moe.py): the Hugging Face class that
    computes exactly what `config` computes."""
    if config.is_moe:
        return hf_moe.moe_flavour(config)
    gpt2, llama = _gpt2_mismatches(config), llama_body_mismatches(config) + _no_qk_norms(config)
    if not gpt2:
        return GPT2
    if not llama:
        return LLAMA
    raise UserError(
        "this model has no Hugging Face equivalent: as GPT2LMHeadModel it has "
        + "; ".join(gpt2)
        + ". As LlamaForCausalLM it has "
        + "; ".join(llama)
        + ". Train with the GPT-2 flags (default) or the Llama flags (--position-embedding-type rope "
        "--normalization RMSNorm --swiglu) to export"
    )


# --------------------------------------------------------------------------- configs


def to_hf_config(
    config: ModelConfig, bos: int | None = None, eos: int | None = None, pad: int | None = None
) -> transformers.PretrainedConfig:
    """The transformers config of `config` (true vocabulary size, no padding)."""
    tied = not config.untie_embeddings_and_output_weights
    specials = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    flavour = hf_flavour(config)
    if flavour in hf_moe.HF_CLASSES:
        return hf_moe.to_hf_config(config, flavour, **specials)
    if flavour == GPT2:
        return transformers.GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.max_positions,
            n_embd=config.hidden_size,
            n_layer=config.num_layers,
            n_head=config.num_attention_heads,
            n_inner=None if config.ffn_size == 4 * config.hidden_size else config.ffn_size,
            activation_function="gelu_new" if config.openai_gelu else "gelu",
            layer_norm_epsilon=config.norm_epsilon,
            resid_pdrop=config.hidden_dropout,
            embd_pdrop=config.hidden_dropout,
            attn_pdrop=config.attention_dropout,
            initializer_range=config.init_method_std,
            tie_word_embeddings=tied,
            architectures=[HF_CLASSES[GPT2]],
            **specials,
        )
    return transformers.LlamaConfig(
        **llama_body_to_hf(config),
        intermediate_size=config.ffn_size,
        attention_bias=config.add_bias_linear,
        mlp_bias=config.add_bias_linear,
        architectures=[HF_CLASSES[LLAMA]],
        **specials,
    )


def default_sizes_as_none(config: ModelConfig) -> ModelConfig:
    """Sizes that equal Megatron's defaults become None, as when their flags are left out: the
    checkpoint then matches a run that does not pass --ffn-hidden-size / --kv-channels / GQA flags."""
    default = dataclasses.replace(
        config, num_query_groups=None, ffn_hidden_size=None, kv_channels=None
    )
    return dataclasses.replace(
        config,
        num_query_groups=None
        if config.query_groups == default.query_groups
        else config.num_query_groups,
        ffn_hidden_size=None if config.ffn_size == default.ffn_size else config.ffn_hidden_size,
        kv_channels=None if config.head_dim == default.head_dim else config.kv_channels,
    )


def from_hf_config(hf: transformers.PretrainedConfig, seq_length: int | None = None) -> ModelConfig:
    """Our ModelConfig for a transformers GPT-2, Llama, Mixtral or GLM-4.5 config; UserError for
    anything we cannot run."""
    if (
        getattr(hf, "model_type", None)
        in hf_moe_import.MODEL_TYPES.keys() | hf_moe_import.REFUSED.keys()
    ):
        return default_sizes_as_none(hf_moe_import.from_hf_config(hf, seq_length))
    return default_sizes_as_none(_from_hf_config(hf, seq_length))


def _from_hf_config(hf: transformers.PretrainedConfig, seq_length: int | None) -> ModelConfig:
    model_type = getattr(hf, "model_type", None)
    if model_type == GPT2:
        problems = []
        if hf.activation_function not in ("gelu", "gelu_new"):
            problems.append(
                f"activation_function={hf.activation_function!r} (supported: 'gelu', the exact "
                f"GELU, and 'gelu_new', OpenAI's tanh approximation = --openai-gelu)"
            )
        if getattr(hf, "scale_attn_by_inverse_layer_idx", False):
            problems.append("scale_attn_by_inverse_layer_idx=True")
        if not getattr(hf, "scale_attn_weights", True):
            problems.append("scale_attn_weights=False")
        if problems:
            raise UserError(
                "this GPT-2 model cannot be expressed by our model: " + "; ".join(problems)
            )
        return ModelConfig(
            num_layers=hf.n_layer,
            hidden_size=hf.n_embd,
            num_attention_heads=hf.n_head,
            vocab_size=hf.vocab_size,
            seq_length=seq_length or hf.n_positions,
            max_position_embeddings=hf.n_positions,
            ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
            openai_gelu=hf.activation_function == "gelu_new",
            norm_epsilon=hf.layer_norm_epsilon,
            untie_embeddings_and_output_weights=not hf.tie_word_embeddings,
            hidden_dropout=hf.resid_pdrop,
            attention_dropout=hf.attn_pdrop,
            init_method_std=hf.initializer_range,
        )
    if model_type == LLAMA:
        if bool(hf.attention_bias) != bool(hf.mlp_bias):
            raise UserError(
                f"this Llama model cannot be expressed by our model: attention_bias={hf.attention_bias} "
                f"but mlp_bias={hf.mlp_bias} (our --disable-bias-linear applies to every linear layer, "
                f"so both must be equal)"
            )
        return ModelConfig(
            **llama_body_from_hf(hf, seq_length),
            ffn_hidden_size=hf.intermediate_size,
            add_bias_linear=bool(hf.attention_bias),
        )
    supported = ", ".join(repr(t) for t in (GPT2, LLAMA, *hf_moe_import.MODEL_TYPES))
    raise UserError(
        f"model_type={model_type!r} is not supported (config.json's model_type must be one of "
        f"{supported})"
    )


# --------------------------------------------------------------------------- weights


def _gpt2_layer_to_hf(ours: dict, o: str, t: str, c: ModelConfig) -> dict:
    nh, d, h = c.num_attention_heads, c.head_dim, c.hidden_size
    # ours: per head [q_h; k_h; v_h] rows; HF Conv1D: [in, q_all | k_all | v_all]
    qkv_w = (
        ours[o + "attention.qkv.weight"].view(nh, 3, d, h).transpose(0, 1).reshape(3 * nh * d, h)
    )
    qkv_b = ours[o + "attention.qkv.bias"].view(nh, 3, d).transpose(0, 1).reshape(-1)
    return {
        t + "ln_1.weight": ours[o + "input_norm.weight"],
        t + "ln_1.bias": ours[o + "input_norm.bias"],
        t + "attn.c_attn.weight": qkv_w.t(),
        t + "attn.c_attn.bias": qkv_b,
        t + "attn.c_proj.weight": ours[o + "attention.proj.weight"].t(),
        t + "attn.c_proj.bias": ours[o + "attention.proj.bias"],
        t + "ln_2.weight": ours[o + "post_attention_norm.weight"],
        t + "ln_2.bias": ours[o + "post_attention_norm.bias"],
        t + "mlp.c_fc.weight": ours[o + "mlp.fc1.weight"].t(),
        t + "mlp.c_fc.bias": ours[o + "mlp.fc1.bias"],
        t + "mlp.c_proj.weight": ours[o + "mlp.fc2.weight"].t(),
        t + "mlp.c_proj.bias": ours[o + "mlp.fc2.bias"],
    }


def _gpt2_layer_from_hf(hf: dict, t: str, o: str, c: ModelConfig) -> dict:
    nh, d, h = c.num_attention_heads, c.head_dim, c.hidden_size
    qkv_w = (
        hf[t + "attn.c_attn.weight"].t().reshape(3, nh, d, h).transpose(0, 1).reshape(3 * nh * d, h)
    )
    qkv_b = hf[t + "attn.c_attn.bias"].reshape(3, nh, d).transpose(0, 1).reshape(-1)
    return {
        o + "input_norm.weight": hf[t + "ln_1.weight"],
        o + "input_norm.bias": hf[t + "ln_1.bias"],
        o + "attention.qkv.weight": qkv_w,
        o + "attention.qkv.bias": qkv_b,
        o + "attention.proj.weight": hf[t + "attn.c_proj.weight"].t(),
        o + "attention.proj.bias": hf[t + "attn.c_proj.bias"],
        o + "post_attention_norm.weight": hf[t + "ln_2.weight"],
        o + "post_attention_norm.bias": hf[t + "ln_2.bias"],
        o + "mlp.fc1.weight": hf[t + "mlp.c_fc.weight"].t(),
        o + "mlp.fc1.bias": hf[t + "mlp.c_fc.bias"],
        o + "mlp.fc2.weight": hf[t + "mlp.c_proj.weight"].t(),
        o + "mlp.fc2.bias": hf[t + "mlp.c_proj.bias"],
    }


_LLAMA_PREFIXES = ("model.embed_tokens.weight", "model.norm.", "model.layers.")
_PREFIXES = {GPT2: ("transformer.wte.weight", "transformer.ln_f.", "transformer.h.")} | {
    flavour: _LLAMA_PREFIXES for flavour in (LLAMA, *hf_moe.HF_CLASSES)
}
_LAYER_TO_HF = {GPT2: _gpt2_layer_to_hf, LLAMA: llama_layer_to_hf} | hf_moe.LAYER_TO_HF
_LAYER_FROM_HF = {GPT2: _gpt2_layer_from_hf, LLAMA: llama_layer_from_hf} | hf_moe.LAYER_FROM_HF


def to_hf_state_dict(ours: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Full, unpadded GPTModel state dict -> the HF model's state dict (contiguous tensors)."""
    flavour = hf_flavour(config)
    embed, final_norm, layers = _PREFIXES[flavour]
    out = {
        embed: ours["embedding.word_embeddings.weight"],
        final_norm + "weight": ours["head.final_norm.weight"],
    }
    if config.normalization == "LayerNorm":
        out[final_norm + "bias"] = ours["head.final_norm.bias"]
    if flavour == GPT2:
        out["transformer.wpe.weight"] = ours["embedding.position_embeddings.weight"]
    out["lm_head.weight"] = (
        ours["head.output_layer.weight"]
        if config.untie_embeddings_and_output_weights
        else ours["embedding.word_embeddings.weight"]
    )
    for i in range(config.num_layers):
        out.update(_LAYER_TO_HF[flavour](ours, f"layers.{i}.", f"{layers}{i}.", config))
    return {k: v.contiguous() for k, v in out.items()}


class _ReadTracker(dict):
    """The HF state dict, remembering which tensors the mapping read (to find ones it did not)."""

    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise UserError(
                f"the Hugging Face weights lack {name}, which config.json implies (the safetensors "
                f"files do not belong to this config.json)"
            )
        self.read.add(name)
        return super().__getitem__(name)


# buffers older transformers versions saved with GPT-2 (the causal mask), not weights
_IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 / Llama / MoE state dict (as saved: MoE experts one by one) -> full, unpadded
    GPTModel state dict."""
    flavour = hf_flavour(config)
    embed, final_norm, layers = _PREFIXES[flavour]
    hf = _ReadTracker(hf)
    out = {
        "embedding.word_embeddings.weight": hf[embed],
        "head.final_norm.weight": hf[final_norm + "weight"],
    }
    if config.normalization == "LayerNorm":
        out["head.final_norm.bias"] = hf[final_norm + "bias"]
    if flavour == GPT2:
        out["embedding.position_embeddings.weight"] = hf["transformer.wpe.weight"]
    if config.untie_embeddings_and_output_weights:
        out["head.output_layer.weight"] = hf["lm_head.weight"]
    elif "lm_head.weight" in hf:  # a tied head saved anyway: the same tensor as the embedding
        hf.read.add("lm_head.weight")
    for i in range(config.num_layers):
        out.update(_LAYER_FROM_HF[flavour](hf, f"{layers}{i}.", f"layers.{i}.", config))
    unused = sorted(
        k
        for k in hf.keys() - hf.read
        if not k.endswith(_IGNORED_HF_SUFFIXES) and not hf_moe.ignored_hf_tensor(k, flavour, config)
    )
    if unused:
        raise UserError(
            f"the Hugging Face weights hold {len(unused)} tensor(s) config.json does not describe, e.g. "
            f"{', '.join(unused[:3])} (our model would silently drop them; check config.json, e.g. "
            f"attention_bias / mlp_bias / num_hidden_layers)"
        )
    return {k: v.contiguous() for k, v in out.items()}
