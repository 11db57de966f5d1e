"""Conjugate tensor-parallel collectives as autograd functions.

Each op's backward is the collective that makes gradients correct for its forward:

    op                        forward                  backward
    copy_to_tp_region         identity                 all-reduce
    reduce_from_tp_region     all-reduce               identity
    scatter_to_tp_region      keep own last-dim chunk  all-gather last dim
    gather_from_tp_region     all-gather last dim      keep own last-dim chunk

All act on the tensor-parallel group; with one TP rank they are the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.parallel import state


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=state.get_tensor_model_parallel_group())
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = state.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    if x.shape[-1] % world != 0:
        raise ValueError(
            f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {world}"
        )
    return x.chunk(world, dim=-1)[state.get_tensor_model_parallel_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = state.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone())


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce the gradient over TP."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _CopyToTPRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduce over TP forward; identity backward."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _ReduceFromTPRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather backward."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _ScatterToTPRegion.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather the last dim over TP forward; keep this rank's slice backward."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _GatherFromTPRegion.apply(x)
