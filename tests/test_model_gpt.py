"""The GPT model's numbers do not depend on the TP layout, and its parts form pipeline stages.

One 4-rank world builds, per flavour, the TP=1 model (no groups), then TP=2 (dp=2) and TP=4:
weights, logits, per-token loss and every gathered parameter gradient must equal TP=1's.
With document ids (--reset-attention-mask) the model also equals, at TP=1 and TP=2, the same model
whose attention core is plain SDPA with a dense boolean document-causal mask built here.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_on_ranks

import pretrain.model.gpt as gpt_module
from pretrain.errors import UserError
from pretrain.model import Embedding, FinalNormAndHead, GPTModel, ModelConfig, TransformerLayer
from pretrain.parallel import state
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.parallel.grad_norm import global_grad_norm
from pretrain.parallel.random import seed_everything
from pretrain.parallel.sharding import is_tensor_parallel, merge_shards

GPT2 = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=12,
    max_position_embeddings=16,
    make_vocab_size_divisible_by=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA = dataclasses.replace(
    GPT2,
    num_attention_heads=8,
    num_query_groups=4,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    rotary_base=500,
)
TOL = 1e-5


def batch(seq: int = 12):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 100, (2, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


CUTS = (5, 8)  # where the second document starts in sample 0 and sample 1


def reset_documents_and_positions(seq: int = 12):
    """Two documents per sample (split at CUTS): document ids and restarting positions."""
    document_ids = torch.zeros(2, seq, dtype=torch.int32)
    positions = torch.zeros(2, seq, dtype=torch.int64)
    for b, cut in enumerate(CUTS):
        document_ids[b, cut:] = 1
        positions[b, :cut], positions[b, cut:] = torch.arange(cut), torch.arange(seq - cut)
    return document_ids, positions


def dense_document_mask(seq: int = 12) -> torch.Tensor:
    """[2, 1, seq, seq] bool, True = may attend: block-diagonal causal, built from CUTS alone."""
    visible = torch.zeros(2, 1, seq, seq, dtype=torch.bool)
    for b, cut in enumerate(CUTS):
        for lo, hi in ((0, cut), (cut, seq)):
            visible[b, 0, lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo).tril().bool()
    return visible


@contextlib.contextmanager
def dense_mask_attention(visible: torch.Tensor):
    """The model's document attention replaced by plain SDPA with an explicit dense mask."""

    def attend(q, k, v, document_ids, dropout_p=0.0, enable_gqa=False):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, dropout_p=dropout_p, enable_gqa=enable_gqa
        )

    kernel = gpt_module.document_causal_attention
    gpt_module.document_causal_attention = attend
    try:
        yield
    finally:
        gpt_module.document_causal_attention = kernel


def gathered(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    if not is_tensor_parallel(param):
        return tensor
    tp = state.get_tensor_model_parallel_world_size()
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.contiguous(), group=state.get_tensor_model_parallel_group())
    return merge_shards(shards, param.partition_dim, param.partition_stride)


def run_model(config: ModelConfig, document_ids=None, positions=None):
    model = GPTModel(config)
    tokens, labels = batch()
    loss = model(tokens, positions, document_ids, labels=labels)
    loss.mean().backward()
    with torch.no_grad():
        logits = model(tokens, positions, document_ids, gather_logits=True)
    return model, loss.detach(), logits


def check_tp_equivalence(rank: int, config: ModelConfig, tp: int, with_mask: bool) -> None:
    document_ids, positions = reset_documents_and_positions() if with_mask else (None, None)
    ref_model, ref_loss, ref_logits = run_model(config, document_ids, positions)  # TP=1
    ref_params = dict(ref_model.named_parameters())
    ref_norm = global_grad_norm(ref_model.parameters())

    state.initialize_model_parallel(tp, 1)
    model, loss, logits = run_model(config, document_ids, positions)
    what = f"{'llama' if config.swiglu else 'gpt2'} tp={tp} documents={with_mask}"
    assert logits.shape == ref_logits.shape
    torch.testing.assert_close(
        logits, ref_logits, rtol=TOL, atol=TOL, msg=lambda m: f"{what} logits: {m}"
    )
    torch.testing.assert_close(
        loss, ref_loss, rtol=TOL, atol=TOL, msg=lambda m: f"{what} loss: {m}"
    )
    for name, param in model.named_parameters():
        assert torch.equal(gathered(param.detach(), param), ref_params[name].detach()), (
            f"{what} init of {name}"
        )
        torch.testing.assert_close(
            gathered(param.grad, param),
            ref_params[name].grad,
            rtol=TOL,
            atol=TOL,
            msg=lambda m, name=name: f"{what} grad of {name}: {m}",
        )
    torch.testing.assert_close(global_grad_norm(model.parameters()), ref_norm, rtol=TOL, atol=0.0)
    state.destroy_model_parallel()


RECOMPUTE_SETTINGS = (  # none, the attention core, whole layers
    {},
    {"recompute_granularity": "selective"},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
)


def check_recompute_and_dropout(rank: int) -> None:
    """TP=2 with dropout: recomputed activations replay the same masks (both RNG streams), and
    replicated parameters get identical grads on both TP ranks (TP peers drop the same elements)."""
    config = dataclasses.replace(LLAMA, hidden_dropout=0.2, attention_dropout=0.2)
    state.initialize_model_parallel(2, 1)
    tokens, labels = batch()
    results = []
    for recompute in RECOMPUTE_SETTINGS:
        model = GPTModel(dataclasses.replace(config, **recompute)).train()
        seed_everything(99)
        model(tokens, labels=labels).mean().backward()
        results.append({n: p.grad for n, p in model.named_parameters()})
    for recomputed in results[1:]:
        for name, grad in results[0].items():
            torch.testing.assert_close(
                recomputed[name], grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
            )
    norm_grad = results[0]["layers.0.input_norm.weight"]
    peers = [torch.empty_like(norm_grad) for _ in range(2)]
    dist.all_gather(peers, norm_grad, group=state.get_tensor_model_parallel_group())
    assert torch.equal(peers[0], peers[1])
    no_dropout = GPTModel(dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0))
    no_dropout(tokens, labels=labels).mean().backward()
    assert not torch.allclose(no_dropout.layers[0].input_norm.weight.grad, norm_grad), (
        "dropout had no effect"
    )
    state.destroy_model_parallel()


def check_documents_equal_dense_reference(config: ModelConfig, tp: int) -> None:
    """Loss, logits and gradients with document ids equal those of dense-mask SDPA at this TP."""
    document_ids, positions = reset_documents_and_positions()
    if tp > 1:
        state.initialize_model_parallel(tp, 1)
    with dense_mask_attention(dense_document_mask()):
        ref_model, ref_loss, ref_logits = run_model(config, document_ids, positions)
    model, loss, logits = run_model(config, document_ids, positions)
    what = f"{'llama' if config.swiglu else 'gpt2'} tp={tp}"
    torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(logits, ref_logits, rtol=TOL, atol=TOL)
    ref_params = dict(ref_model.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad, ref_params[name].grad, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the documents really are apart: causal attention over the whole sample differs
    assert not torch.allclose(run_model(config, None, positions)[1], loss, atol=1e-4), what
    if tp > 1:
        state.destroy_model_parallel()


def model_world(rank: int, world: int) -> str:
    for config in (GPT2, LLAMA):
        for tp in (2, 4):
            check_tp_equivalence(rank, config, tp, with_mask=(tp == 2))
        check_documents_equal_dense_reference(config, tp=2)
    # --qk-layernorm: each TP rank normalises its own heads with the replicated norms
    check_tp_equivalence(rank, dataclasses.replace(LLAMA, qk_layernorm=True), 2, with_mask=False)
    check_recompute_and_dropout(rank)
    return "ok"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_both_flavours_equal_tp1_at_tp2_and_tp4():
    assert run_on_ranks(model_world, 4, timeout=240) == ["ok"] * 4


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_document_attention_equals_dense_mask_reference_tp1(config):
    check_documents_equal_dense_reference(config, tp=1)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_pipeline_parts_start_from_the_whole_models_weights(config):
    whole = GPTModel(config)
    tokens, labels = batch()
    # a "last stage" built alone holding layer 1, constructed before anything else
    layer1 = TransformerLayer(config, 1)
    head = FinalNormAndHead(config)
    embedding = Embedding(config)
    layer0 = TransformerLayer(config, 0)
    for part, prefix in (
        (embedding, "embedding"),
        (layer0, "layers.0"),
        (layer1, "layers.1"),
        (head, "head"),
    ):
        for name, param in part.named_parameters():
            assert torch.equal(param, whole.get_parameter(f"{prefix}.{name}")), f"{prefix}.{name}"
    hidden = layer1(layer0(embedding(tokens)))
    output_weight = (
        None if config.untie_embeddings_and_output_weights else embedding.word_embeddings.weight
    )
    loss = vocab_parallel_cross_entropy(head(hidden, output_weight), labels)
    torch.testing.assert_close(loss, whole(tokens, labels=labels), rtol=0, atol=0)


def test_one_document_per_sample_equals_is_causal():
    model = GPTModel(LLAMA)
    tokens, _ = batch()
    one_document = torch.zeros(2, 12, dtype=torch.int32)
    torch.testing.assert_close(
        model(tokens, None, one_document), model(tokens), rtol=1e-6, atol=1e-6
    )


def test_losses_are_per_token_fp32_and_logits_padded():
    model = GPTModel(GPT2)
    tokens, labels = batch()
    loss = model(tokens, labels=labels)
    assert loss.shape == (2, 12) and loss.dtype == torch.float32
    assert model(tokens).shape == (2, 12, 128)
    # untrained model: loss close to log(padded vocab)
    assert abs(loss.mean().item() - torch.log(torch.tensor(128.0)).item()) < 0.5


def test_grad_norm_skips_shared_copies():
    model = GPTModel(GPT2)
    tokens, labels = batch()
    model(tokens, labels=labels).sum().backward()
    full = global_grad_norm(model.parameters())
    expected = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    torch.testing.assert_close(full, expected)
    word = model.embedding.word_embeddings.weight
    word.shared = True
    without = global_grad_norm(model.parameters())
    torch.testing.assert_close(without, torch.sqrt(expected**2 - word.grad.pow(2).sum()))


def test_megatron_defaults_and_vocab_padding():
    assert (
        ModelConfig(num_layers=1, hidden_size=4096, num_attention_heads=32, vocab_size=100).ffn_size
        == 16384
    )
    # int((4h*2/3)/64)*64
    assert (
        ModelConfig(
            num_layers=1, hidden_size=4096, num_attention_heads=32, vocab_size=100, swiglu=True
        ).ffn_size
        == 10880
    )
    gpt2 = ModelConfig(num_layers=1, hidden_size=768, num_attention_heads=12, vocab_size=50257)
    assert [gpt2.padded_vocab_size(t) for t in (1, 2, 4, 8)] == [50304, 50432, 50688, 51200]


@pytest.mark.parametrize(
    "change, tp, pp, expected",
    [
        (
            dict(num_attention_heads=6),
            4,
            1,
            r"--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            dict(num_attention_heads=8, num_query_groups=2),
            4,
            1,
            r"--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            dict(hidden_size=30),
            1,
            1,
            r"--hidden-size 30 is not divisible by --num-attention-heads 4",
        ),
        (
            dict(num_layers=3),
            1,
            2,
            r"--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
        ),
    ],
)
def test_bad_configurations_raise_one_clear_error(change, tp, pp, expected):
    config = dataclasses.replace(GPT2, **change)
    with pytest.raises(UserError, match=expected) as err:
        config.validate(tp, pp)
    assert "(" in str(err.value), "the message says how to fix it"


def test_world_size_must_split_into_tp_x_pp():
    with pytest.raises(
        UserError,
        match=r"world size 6 is not divisible by --tensor-model-parallel-size 2 x "
        r"--pipeline-model-parallel-size 2 = 4 \(launch a multiple of 4",
    ):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, world_size=6)
    assert ParallelConfig(tensor_model_parallel_size=2, world_size=8).data_parallel_size == 4


def test_all_problems_in_one_error():
    config = dataclasses.replace(GPT2, num_attention_heads=8, hidden_size=30)
    with pytest.raises(UserError) as err:
        config.validate(3)
    assert "--hidden-size 30" in str(err.value) and "--tensor-model-parallel-size 3" in str(
        err.value
    )


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_bf16_model_runs_and_tracks_fp32(config):
    tokens, labels = batch()
    fp32 = GPTModel(config)(tokens, labels=labels)
    model = GPTModel(dataclasses.replace(config, params_dtype=torch.bfloat16))
    loss = model(tokens, labels=labels)
    assert loss.dtype == torch.float32 and model(tokens).dtype == torch.bfloat16
    torch.testing.assert_close(loss, fp32, rtol=0.0, atol=0.05)
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_megatron_init_scales_output_projections():
    config = dataclasses.replace(GPT2, hidden_size=64, num_layers=8, init_method_std=0.05)
    layer = TransformerLayer(config, 3)
    output_std = 0.05 / (2 * 8) ** 0.5
    for weight, std in (
        (layer.attention.qkv.weight, 0.05),
        (layer.mlp.fc1.weight, 0.05),
        (layer.attention.proj.weight, output_std),
        (layer.mlp.fc2.weight, output_std),
    ):
        assert abs(weight.std().item() / std - 1) < 0.1
    assert torch.equal(layer.attention.qkv.bias, torch.zeros_like(layer.attention.qkv.bias))
    assert torch.equal(layer.input_norm.weight, torch.ones(64))
    other = TransformerLayer(config, 4)
    assert not torch.equal(layer.attention.qkv.weight, other.attention.qkv.weight), (
        "layers get their own draws"
    )
