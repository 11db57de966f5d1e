"""Document-causal attention from document ids equals dense-mask SDPA, and no [S, S] tensor exists.

References are independent of the code under test: plain `scaled_dot_product_attention` with a
dense boolean mask built here, and torch's own `create_block_mask` evaluating the mask function
on every (q, kv) pair.
"""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.data.config import DataConfig, add_data_args, add_sample_count_args
from pretrain.errors import UserError
from pretrain.model import GPTModel, ModelConfig
from pretrain.model.document_attention import (
    document_block_mask,
    document_causal_attention,
    document_spans,
    per_document_attention,
)


def random_document_ids(batch: int, seq: int, p_boundary: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < p_boundary
    starts[:, 0] = False
    ids = torch.cumsum(starts.int(), dim=1).to(torch.int32)
    ids[0] = 0  # one sample that is a single document
    return ids


def dense_visible(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True = may attend, by the definition: same document and not later."""
    b, s = document_ids.shape
    visible = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for i in range(b):
        for q in range(s):
            for k in range(q + 1):
                visible[i, 0, q, k] = bool(document_ids[i, q] == document_ids[i, k])
    return visible


def qkv(b, heads, groups, s, d, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, heads, s, d), (b, groups, s, d), (b, groups, s, d)]
    return [torch.randn(*shape, generator=g).requires_grad_(grad) for shape in shapes]


def test_document_spans():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    assert document_spans(ids) == [[(0, 2), (2, 5), (5, 6)], [(0, 6)]]


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("p_boundary", [0.02, 0.15, 0.6])
def test_per_document_attention_equals_dense_mask_forward_and_backward(heads, groups, p_boundary):
    ids = random_document_ids(3, 48, p_boundary, seed=int(p_boundary * 100))
    visible = dense_visible(ids)
    q, k, v = qkv(3, heads, groups, 48, 8, seed=1)
    out = per_document_attention(q, k, v, ids, enable_gqa=groups != heads)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=groups != heads)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # on CPU the entry point takes this path (FlexAttention has no CPU backward)
    torch.testing.assert_close(document_causal_attention(q, k, v, ids, 0.0, groups != heads), out)


@pytest.mark.parametrize("p_boundary", [0.01, 0.05, 0.3])
def test_block_mask_equals_torchs_own_and_flex_equals_dense(p_boundary):
    ids = random_document_ids(3, 64, p_boundary, seed=5)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    ours = document_block_mask(ids, block_size=8)
    torchs = create_block_mask(mask_mod, 3, None, 64, 64, device="cpu", BLOCK_SIZE=8)
    assert torch.equal(ours.to_dense(), torchs.to_dense())
    # the same blocks are skipped, computed unmasked (full) and masked (partial)
    assert torch.equal(ours.kv_num_blocks, torchs.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, torchs.full_kv_num_blocks)
    for count, index, t_index in (
        (ours.kv_num_blocks, ours.kv_indices, torchs.kv_indices),
        (ours.full_kv_num_blocks, ours.full_kv_indices, torchs.full_kv_indices),
    ):
        for b in range(3):
            for row in range(8):
                n = int(count[b, 0, row])
                assert set(index[b, 0, row, :n].tolist()) == set(t_index[b, 0, row, :n].tolist())
    # FlexAttention with it (eager here; compiled on GPU) equals dense-mask SDPA, forward only:
    # FlexAttention has no backward on CPU
    q, k, v = qkv(3, 4, 2, 64, 16, seed=2, grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out = flex_attention(q, k, v, block_mask=ours, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_visible(ids), enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_block_mask_refuses_a_ragged_last_block():
    with pytest.raises(ValueError, match="not a multiple"):
        document_block_mask(torch.zeros(1, 20, dtype=torch.int32), block_size=8)


class SquareTensorWatch(TorchDispatchMode):
    """Records every tensor an op produces whose shape holds the sequence length twice."""

    def __init__(self, seq: int):
        super().__init__()
        self.seq, self.found = seq, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.seq) >= 2:
                self.found.append((str(func), tuple(t.shape)))
        return out


def test_training_step_with_documents_never_builds_an_s_by_s_tensor():
    seq = 80  # a size no weight has (qkv 96, ffn 128), so only [S, S] matches
    config = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=100,
        seq_length=seq,
        max_position_embeddings=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, seq), generator=g)
    ids = random_document_ids(2, seq, 0.05, seed=4)
    ids[0, seq // 2 :] = 1  # every sample has several documents
    watch = SquareTensorWatch(seq)
    with watch:
        loss = model(tokens, None, ids, labels=tokens).mean()
        loss.backward()
    assert watch.found == []
    # the watch does see an [S, S] tensor when one is made: a dense-mask call trips it
    dense = SquareTensorWatch(seq)
    q, k, v = qkv(2, 4, 4, seq, 8, seed=6, grad=False)
    with dense:
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(seq, seq, dtype=torch.bool))
    assert dense.found


def parse_data_flags(argv: list[str]) -> DataConfig:
    parser = argparse.ArgumentParser()
    add_data_args(parser)
    add_sample_count_args(parser)
    return DataConfig.from_args(parser.parse_args(argv))


def test_reset_attention_mask_without_loader_ids_is_refused_up_front():
    argv = ["--data-path", "p", "--split", "1", "--seq-length", "8", "--reset-attention-mask"]
    with pytest.raises(UserError, match="drop --no-create-attention-mask-in-dataloader"):
        parse_data_flags(argv + ["--no-create-attention-mask-in-dataloader"])
    assert parse_data_flags(argv).reset_attention_mask
