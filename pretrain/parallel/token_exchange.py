"""Autograd collectives that move tokens (rows, dim 0) between the ranks of any group.

What the mixture-of-experts dispatchers are built from; each op's backward is its conjugate:

    op                    forward                                backward
    all_to_all_tokens     rank r sends rows [split_r] to rank r  the same exchange, reversed
    gather_tokens         every rank's rows, in group-rank order  reduce-scatter: the sum of the
                                                                 gradients of this rank's rows
    reduce_scatter_tokens this rank's rows of the sum over ranks  gather the gradients

Row counts may differ per rank (`sizes`, the rows each group rank contributes or receives). All
three run on `torch.distributed.all_to_all_single`, which takes uneven splits on every backend
(gloo included: tests/test_moe_parallel.py checks it), so there is one code path for even and uneven
sizes. With a group of one rank every op is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in `group` (1 for None: one process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in `group` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over `group` in place (nothing with one rank); returns `x`. Not autograd."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def _exchange(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _gather(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    world = len(sizes)
    return _exchange(x.repeat(world, *([1] * (x.dim() - 1))), group, sizes, [x.shape[0]] * world)


def _reduce_scatter(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    mine = sizes[group_rank(group)]
    parts = _exchange(x, group, [mine] * len(sizes), sizes)
    return parts.view(len(sizes), mine, *x.shape[1:]).sum(0)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, ctx.group, input_splits, output_splits), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.sizes), None, None


def all_to_all_tokens(
    x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Send rows [sum(input_splits[:r]), +input_splits[r]) of `x` to group rank r; receive
    output_splits[r] rows from rank r, in rank order."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


def gather_tokens(x: torch.Tensor, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Every group rank's rows concatenated in rank order (`sizes[r]`: rank r's row count; None:
    all equal to this rank's)."""
    world = group_size(group)
    if world == 1:
        return x
    return _Gather.apply(x, group, list(sizes) if sizes else [x.shape[0]] * world)


def reduce_scatter_tokens(x: torch.Tensor, group, sizes: list[int] | None = None) -> torch.Tensor:
    """This rank's rows of the sum of `x` over the group: `x` is every rank's rows in rank order,
    `sizes[r]` of them for rank r (None: equal shares)."""
    world = group_size(group)
    if world == 1:
        return x
    return _ReduceScatter.apply(x, group, list(sizes) if sizes else [x.shape[0] // world] * world)
