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


@pytest.mark.parametrize("config", [BASE, LLAMA], ids=["gpt2", "llama"])
def test_logits_equal_transformers(config):
    ours = GPTModel(config).eval()
    reference = transformers.AutoModelForCausalLM.from_config(to_hf_config(config)).eval()
    weights = to_hf_state_dict(trim_vocab(ours.state_dict(), config.vocab_size), config)
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing), (
        missing,
        unexpected,
    )
    tokens = torch.randint(
        0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        # the padded vocabulary rows (100 -> 128) exist only in ours; compare the real ones
        torch.testing.assert_close(
            ours(tokens)[..., : config.vocab_size], reference(tokens).logits, rtol=1e-5, atol=1e-5
        )
