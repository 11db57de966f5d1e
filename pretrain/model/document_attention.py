"""Document-causal attention (`--reset-attention-mask`) from O(S) document ids, no [S, S] mask.

`document_ids` [b, s] (int) numbers the documents of each sample in order: 0 up to and including
the first EOD, 1 up to the next, and so on (non-decreasing along s). Position q attends to kv iff
kv <= q and both hold the same id. The ids are all the loader builds and all that travels between
pipeline stages; the kernels below take them directly:

- CUDA, no attention dropout, s a multiple of FLEX_BLOCK: FlexAttention (compiled) with a block
  mask computed from the first and last id of each 128-token block, O((s/128)^2) per sample.
  Blocks that lie inside one document run unmasked, blocks no document spans are skipped.
- otherwise (CPU, where FlexAttention has no backward; attention dropout, which FlexAttention
  lacks): one causal `scaled_dot_product_attention` call per document, so every kernel call is
  plain causal attention (flash where the device has it) and no call sees another document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_BLOCK = 128  # FlexAttention's default sparse block size

_compiled_flex = None


def _flex():
    """flex_attention compiled once per process (eager flex_attention materialises the scores)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention within documents: q [b, nh, s, d], k/v [b, ng, s, d] -> [b, nh, s, d]."""
    if q.is_cuda and dropout_p == 0.0 and q.shape[-2] % FLEX_BLOCK == 0:
        return _flex()(q, k, v, block_mask=document_block_mask(document_ids), enable_gqa=enable_gqa)
    return per_document_attention(q, k, v, document_ids, dropout_p, enable_gqa)


def document_spans(document_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per sample, the [start, end) of each document, in order (one host copy of the ids)."""
    ids = document_ids.detach().cpu()
    s = ids.shape[-1]
    changes = torch.nonzero(ids[:, 1:] != ids[:, :-1]).tolist()
    cuts: list[list[int]] = [[0] for _ in range(ids.shape[0])]
    for row, before in changes:
        cuts[row].append(before + 1)
    return [list(zip(c, c[1:] + [s], strict=True)) for c in cuts]


def per_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """One causal SDPA call per document: memory O(s) beyond what plain causal SDPA uses."""
    spans = document_spans(document_ids)
    if all(len(row) == 1 for row in spans):  # no boundary anywhere: one batched call
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa
        )
    rows = []
    for b, row in enumerate(spans):
        pieces = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, lo:hi],
                k[b : b + 1, :, lo:hi],
                v[b : b + 1, :, lo:hi],
                dropout_p=dropout_p,
                is_causal=True,
                enable_gqa=enable_gqa,
            )
            for lo, hi in row
        ]
        rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, nq, nkv] bool -> (count [b, 1, nq], kv block indices [b, 1, nq, nkv], selected first)."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return count.unsqueeze(1), order.to(torch.int32).unsqueeze(1)


def document_block_mask(document_ids: torch.Tensor, block_size: int = FLEX_BLOCK) -> BlockMask:
    """FlexAttention block mask of document-causal attention, built from the ids per block.

    With non-decreasing ids, q block i and kv block j <= i share a document iff the last id of j
    is >= the first id of i; the pair is entirely visible (no mask_mod needed) iff j < i and the
    first id of j equals the last id of i (then every id in between is the same).
    """
    b, s = document_ids.shape
    if s % block_size:
        raise ValueError(f"sequence length {s} is not a multiple of the block size {block_size}")
    n = s // block_size
    per_block = document_ids.view(b, n, block_size)
    first, last = per_block[..., 0], per_block[..., -1]  # [b, n]
    index = torch.arange(n, device=document_ids.device)
    below = index[None, :] < index[:, None]  # [q block, kv block]: kv block strictly earlier
    shares = last[:, None, :] >= first[:, :, None]  # [b, q block, kv block]
    visible = (below | torch.eye(n, dtype=torch.bool, device=index.device)) & shares
    full = below & (first[:, None, :] == last[:, :, None])
    partial_count, partial_index = _ordered(visible & ~full)
    full_count, full_index = _ordered(full)
    ids = document_ids

    def same_document_causal(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (ids[batch, q_idx] == ids[batch, kv_idx])

    return BlockMask.from_kv_blocks(
        partial_count,
        partial_index,
        full_count,
        full_index,
        BLOCK_SIZE=block_size,
        mask_mod=same_document_causal,
        seq_lengths=(s, s),
    )
