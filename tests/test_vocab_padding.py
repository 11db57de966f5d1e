"""Padded vocabulary rows never enter a softmax, so the model is one function at every padded size.

Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP, so the padded
size changes with TP. Here, in one process: the loss, the logits and every real gradient are the
same whatever the padding; padding rows start at zero, get zero gradient and -inf logits; and
transformers, holding the unpadded weights, computes our loss. (That every TP, PP, DP and ZeRO
layout trains the same model with default flags is tests/test_training_equivalence.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.convert.hf_folder import SpecialTokens, build_hf_model
from pretrain.convert.verify import LOSS_TOLERANCE, compare_logits
from pretrain.model import GPTModel, ModelConfig

VOCAB = 101
GPT2 = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=VOCAB,
    seq_length=12,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA = dataclasses.replace(
    GPT2,
    num_query_groups=2,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
FLAVOURS = {"gpt2": GPT2, "llama": LLAMA}
VOCAB_ROWS = ("embedding.word_embeddings.weight", "head.output_layer.weight")


def batch():
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def trained_step(config: ModelConfig):
    """The model after one backward: (model, per-token loss, gathered logits)."""
    model = GPTModel(config)
    tokens, labels = batch()
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    with torch.no_grad():
        logits = model(tokens, gather_logits=True)
    return model, loss.detach(), logits


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_loss_logits_and_gradients_do_not_depend_on_the_padded_size(flavour):
    config = FLAVOURS[flavour]
    ref_model, ref_loss, ref_logits = trained_step(
        dataclasses.replace(config, make_vocab_size_divisible_by=1)  # 101 rows: no padding
    )
    ref = dict(ref_model.named_parameters())
    for divisible_by in (128, 256, 1000):  # Megatron's default at TP 1 and 2, and a large one
        padded = dataclasses.replace(config, make_vocab_size_divisible_by=divisible_by)
        model, loss, logits = trained_step(padded)
        assert torch.equal(loss, ref_loss), divisible_by
        assert logits.shape == (2, 12, VOCAB) and torch.equal(logits, ref_logits)
        for name, param in model.named_parameters():
            if name not in VOCAB_ROWS:
                assert torch.equal(param, ref[name]) and torch.equal(param.grad, ref[name].grad)
                continue
            assert param.shape[0] == padded.padded_vocab_size(1) == divisible_by
            assert torch.equal(param[:VOCAB], ref[name]), f"{name}: real rows start alike"
            assert torch.equal(param.grad[:VOCAB], ref[name].grad)
            assert not param[VOCAB:].any(), f"{name}: padding rows start at zero"
            assert not param.grad[VOCAB:].any(), f"{name}: padding rows get no gradient"
    local = model(batch()[0])  # TP-local logits keep the padded columns, at -inf
    assert local.shape[-1] == 1000 and torch.isneginf(local[..., VOCAB:]).all()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_transformers_computes_our_loss_on_the_unpadded_weights(flavour):
    """The export drops the padding rows; transformers then computes our loss to fp32 rounding,
    whereas a softmax that counted the (zero) padding logits would be ~0.2 higher."""
    config = FLAVOURS[flavour]  # padded to 128
    model = GPTModel(config).eval()
    with torch.no_grad():  # move the weights off their initial values, padding rows included
        for name, param in model.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if name in VOCAB_ROWS:
                param[VOCAB:] = 0.0
    unpadded = {k: v[:VOCAB] if k in VOCAB_ROWS else v for k, v in model.state_dict().items()}
    hf = build_hf_model(unpadded, config, SpecialTokens(None, None, None), torch.float32)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(5))
    result = compare_logits(model, hf, tokens)
    assert abs(result.our_loss - result.hf_loss) <= LOSS_TOLERANCE * result.hf_loss, result
    assert result.ok, result.report()

    with torch.no_grad():  # what a softmax over the padded vocabulary would have given
        with_padding = model(tokens[:, :-1])
        with_padding[..., VOCAB:] = 0.0  # zero rows give zero logits
        megatron_style = torch.nn.functional.cross_entropy(
            with_padding.reshape(-1, 128), tokens[:, 1:].reshape(-1)
        )
    assert megatron_style.item() - result.hf_loss > 0.05
