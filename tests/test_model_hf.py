"""Our TP=1 GPT equals transformers' GPT2LMHeadModel / LlamaForCausalLM given the same weights.

This pins the architecture and the weight layouts documented in pretrain/model/gpt.py (fused QKV
per query group, [gate; up] fc1, rotate-half RoPE, exact GELU) that the HF converter relies on.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from pretrain.model import GPTModel, ModelConfig

BASE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
                   hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dataclasses.replace(BASE, num_attention_heads=8, num_query_groups=2, position_embedding_type="rope",
                            normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
                            untie_embeddings_and_output_weights=True, rotary_base=10000)


def gpt2_state_dict(ours: dict, config: ModelConfig) -> dict:
    nh, d, h = config.num_attention_heads, config.head_dim, config.hidden_size
    out = {"transformer.wte.weight": ours["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": ours["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": ours["head.final_norm.weight"],
           "transformer.ln_f.bias": ours["head.final_norm.bias"],
           "lm_head.weight": ours["embedding.word_embeddings.weight"]}
    for i in range(config.num_layers):
        o, t = f"layers.{i}.", f"transformer.h.{i}."
        # ours: per head [q_h; k_h; v_h] rows; HF Conv1D: [in, q_all | k_all | v_all]
        qkv_w = ours[o + "attention.qkv.weight"].view(nh, 3, d, h).transpose(0, 1).reshape(3 * nh * d, h)
        qkv_b = ours[o + "attention.qkv.bias"].view(nh, 3, d).transpose(0, 1).reshape(-1)
        out.update({t + "ln_1.weight": ours[o + "input_norm.weight"], t + "ln_1.bias": ours[o + "input_norm.bias"],
                    t + "attn.c_attn.weight": qkv_w.t(), t + "attn.c_attn.bias": qkv_b,
                    t + "attn.c_proj.weight": ours[o + "attention.proj.weight"].t(),
                    t + "attn.c_proj.bias": ours[o + "attention.proj.bias"],
                    t + "ln_2.weight": ours[o + "post_attention_norm.weight"],
                    t + "ln_2.bias": ours[o + "post_attention_norm.bias"],
                    t + "mlp.c_fc.weight": ours[o + "mlp.fc1.weight"].t(), t + "mlp.c_fc.bias": ours[o + "mlp.fc1.bias"],
                    t + "mlp.c_proj.weight": ours[o + "mlp.fc2.weight"].t(),
                    t + "mlp.c_proj.bias": ours[o + "mlp.fc2.bias"]})
    return out


def llama_state_dict(ours: dict, config: ModelConfig) -> dict:
    nh, ng, d, h = config.num_attention_heads, config.query_groups, config.head_dim, config.hidden_size
    per_group = nh // ng
    out = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"],
           "model.norm.weight": ours["head.final_norm.weight"],
           "lm_head.weight": ours["head.output_layer.weight"]}
    for i in range(config.num_layers):
        o, t = f"layers.{i}.", f"model.layers.{i}."
        qkv = ours[o + "attention.qkv.weight"].view(ng, per_group + 2, d, h)
        gate, up = ours[o + "mlp.fc1.weight"].chunk(2, dim=0)
        out.update({t + "self_attn.q_proj.weight": qkv[:, :per_group].reshape(nh * d, h),
                    t + "self_attn.k_proj.weight": qkv[:, per_group].reshape(ng * d, h),
                    t + "self_attn.v_proj.weight": qkv[:, per_group + 1].reshape(ng * d, h),
                    t + "self_attn.o_proj.weight": ours[o + "attention.proj.weight"],
                    t + "mlp.gate_proj.weight": gate, t + "mlp.up_proj.weight": up,
                    t + "mlp.down_proj.weight": ours[o + "mlp.fc2.weight"],
                    t + "input_layernorm.weight": ours[o + "input_norm.weight"],
                    t + "post_attention_layernorm.weight": ours[o + "post_attention_norm.weight"]})
    return out


def hf_gpt2(config: ModelConfig):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=config.padded_vocab_size(), n_positions=config.max_positions, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_size,
        activation_function="gelu", layer_norm_epsilon=config.norm_epsilon,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_llama(config: ModelConfig):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=config.padded_vocab_size(), hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.query_groups, head_dim=config.head_dim, rms_norm_eps=config.norm_epsilon,
        max_position_embeddings=config.max_positions, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rotary_base)}))


@pytest.mark.parametrize("config, build, convert", [(BASE, hf_gpt2, gpt2_state_dict),
                                                    (LLAMA, hf_llama, llama_state_dict)], ids=["gpt2", "llama"])
def test_logits_equal_transformers(config, build, convert):
    ours = GPTModel(config).eval()
    reference = build(config).eval()
    missing, unexpected = reference.load_state_dict(convert(ours.state_dict(), config), strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)
