"""How a full (TP=1) tensor maps to per-rank tensor-parallel shards, and back.

A sharded parameter carries three attributes that clipping, ZeRO, initialisation and converters read:
`tensor_model_parallel = True`, `partition_dim` (the split dimension) and `partition_stride`.
With stride 1, rank r holds the r-th contiguous 1/tp of that dimension. With stride s, the full
dimension is s blocks laid end to end (SwiGLU's fc1 is [gate; up], s = 2); each block is split
into tp chunks and rank r holds its chunk of every block, concatenated ([gate_r; up_r]).
Replicated parameters carry none of the attributes.
"""

from __future__ import annotations

import torch


def mark_tensor_parallel(param: torch.Tensor, partition_dim: int, stride: int = 1) -> torch.Tensor:
    """Tag `param` as a TP shard along `partition_dim` (read by clipping, ZeRO, converters)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a parameter split over TP ranks."""
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_tensor(
    full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1
) -> torch.Tensor:
    """Rank `rank`'s shard of `full` (a copy-free view when stride is 1)."""
    if world == 1:
        return full
    if full.shape[dim] % (world * stride) != 0:
        raise ValueError(
            f"dimension {dim} of size {full.shape[dim]} does not split into "
            f"{stride} block(s) x {world} ranks"
        )
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([block.chunk(world, dim=dim)[rank] for block in blocks], dim=dim)


def merge_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of `shard_tensor`: the full tensor from every rank's shard, in rank order."""
    if len(shards) == 1:
        return shards[0]
    per_rank_blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([blocks[b] for b in range(stride) for blocks in per_rank_blocks], dim=dim)
