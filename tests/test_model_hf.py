"""Our TP=1 GPT equals transformers' GPT2LMHeadModel / LlamaForCausalLM given the same weights.

This pins the architecture and the weight layouts documented in pretrain/model/gpt.py (fused QKV
per query group, [gate; up] fc1, rotate-half RoPE, exact GELU) in one process, through the same
state-dict adapter the HF converter uses (transformers is the oracle; the adapter is only glue).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from pretrain.convert.hf_adapter import to_hf_config, to_hf_state_dict
from pretrain.convert.state_dict import trim_vocab
from pretrain.model import GPTModel, ModelConfig

BASE = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA = dataclasses.replace(
    BASE,
    num_attention_heads=8,
    num_query_groups=2,
    position_embedding_type="rope",
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    rotary_base=10000,
)


# OpenAI's GPT-2 activation (HF "gelu_new"), and Llama 3.x RoPE scaling with a non-default theta:
# original_max_position_embeddings=256 puts this head size's wavelengths (6, 167, 4458, 142000
# for head_dim 8, theta 5e5) in all three bands of the scaling (kept, interpolated, divided).
# (larger weights, so that the tanh approximation differs from the exact GELU by far more than
# the tolerance: test_the_variants_change_the_model)
OPENAI_GPT2 = dataclasses.replace(BASE, openai_gelu=True, init_method_std=0.5)
LLAMA3 = dataclasses.replace(
    LLAMA,
    rotary_base=500000,
    kv_channels=8,
    max_position_embeddings=512,
    use_rope_scaling=True,
    rope_scaling_factor=32.0,
    rope_scaling_low_freq_factor=1.0,
    rope_scaling_high_freq_factor=4.0,
    rope_scaling_original_max_position_embeddings=256,
    init_method_std=0.5,
)


@pytest.mark.parametrize(
    "config",
    [BASE, LLAMA, OPENAI_GPT2, LLAMA3],
    ids=["gpt2", "llama", "gpt2-gelu_new", "llama3-rope-scaling"],
)
def test_logits_equal_transformers(config):
    ours = GPTModel(config).eval()
    hf_config = to_hf_config(config)
    if config.openai_gelu:
        assert hf_config.activation_function == "gelu_new"
    if config.use_rope_scaling:
        assert hf_config.rope_parameters["rope_type"] == "llama3"
    reference = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    weights = to_hf_state_dict(trim_vocab(ours.state_dict(), config.vocab_size), config)
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing), (
        missing,
        unexpected,
    )
    length = 100 if config.use_rope_scaling else config.seq_length  # long positions: scaling shows
    tokens = torch.randint(
        0, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(3)
    )
    # fp32 rounding grows with the logits: |logits| ~ 10 with the variants' larger weights
    atol = 1e-5 if config.init_method_std <= 0.02 else 1e-4
    with torch.no_grad():
        # the padded vocabulary rows (100 -> 128) exist only in ours; compare the real ones
        torch.testing.assert_close(
            ours(tokens)[..., : config.vocab_size], reference(tokens).logits, rtol=1e-5, atol=atol
        )


def test_the_variants_change_the_model():
    """The activation and the RoPE scaling are not no-ops here (else the test above proves nothing)."""
    tokens = torch.randint(0, 100, (1, 100), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for plain, variant in (
            (BASE, OPENAI_GPT2),
            (dataclasses.replace(LLAMA3, use_rope_scaling=False), LLAMA3),
        ):
            a, b = GPTModel(plain).eval(), GPTModel(variant).eval()
            length = 100 if variant.use_rope_scaling else plain.seq_length
            diff = a(tokens[:, :length]) - b(tokens[:, :length])
            assert diff[..., :100].abs().max() > 1e-4  # the padded columns are -inf in both
