"""Conjugate tensor-parallel collectives as autograd functions.

Each op's backward is the collective that makes gradients correct for its forward:

    op                        forward                  backward
    copy_to_tp_region         identity                 all-reduce
    reduce_from_tp_region     all-reduce               identity
    scatter_to_tp_region      keep own last-dim chunk  all-gather last dim
    gather_from_tp_region     all-gather last dim      keep own last-dim chunk

Sequence parallelism (activations [b, s, h], the sequence is dim 1, SEQUENCE_DIM):

    op                                  forward                  backward
    scatter_to_sequence_parallel_region keep own sequence chunk  all-gather sequence
    gather_from_sequence_parallel_region all-gather sequence     reduce-scatter sequence (the
                                                                 consumer is TP-sharded: each rank
                                                                 holds a partial gradient), or keep
                                                                 own chunk (replicated consumer)
    reduce_scatter_to_sequence_parallel_region
                                        reduce-scatter sequence  all-gather sequence

Rank r's sequence chunk is positions [r s/t, (r+1) s/t). An all-gather plus a reduce-scatter move
the same bytes as one all-reduce, so sequence parallelism costs no extra communication.

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


SEQUENCE_DIM = 1  # activations are [b, s, h]

# torch 2.13 renamed the single-tensor collectives; older torch (a user's CUDA build) has only
# the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _sequence_chunk(length: int, world: int) -> int:
    if length % world != 0:
        raise ValueError(
            f"sequence length {length} is not divisible by tensor-parallel size {world} "
            f"(sequence parallelism splits the sequence over TP ranks)"
        )
    return length // world


def _split_sequence(x: torch.Tensor) -> torch.Tensor:
    world = state.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    chunk = _sequence_chunk(x.shape[SEQUENCE_DIM], world)
    start = state.get_tensor_model_parallel_rank() * chunk
    return x.narrow(SEQUENCE_DIM, start, chunk).contiguous()


def _gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """[b, s/t, ...] from every TP rank -> [b, s, ...] (rank order along the sequence)."""
    world = state.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    b, chunk, rest = x.shape[0], x.shape[SEQUENCE_DIM], x.shape[2:]
    # the collective concatenates along dim 0 (every backend): [t b, s/t, ...]
    out = torch.empty((world * b, chunk, *rest), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=state.get_tensor_model_parallel_group())
    # [t, b, s/t, ...] -> [b, t, s/t, ...] -> [b, s, ...]; no copy when b == 1
    return out.view(world, b, chunk, *rest).movedim(0, 1).reshape(b, world * chunk, *rest)


def _reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """[b, s, ...] partial sums on every TP rank -> this rank's [b, s/t, ...] of their sum."""
    world = state.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    b, chunk = x.shape[0], _sequence_chunk(x.shape[SEQUENCE_DIM], world)
    rest = x.shape[2:]
    # the collective scatters along dim 0: rank r's sequence chunk at rows [r b, (r+1) b)
    by_rank = x.reshape(b, world, chunk, *rest).movedim(1, 0).reshape(world * b, chunk, *rest)
    out = torch.empty((b, chunk, *rest), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, by_rank, group=state.get_tensor_model_parallel_group())
    return out


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


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_sequence(grad), None
        return _split_sequence(grad), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad)


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


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (dim 1) forward; all-gather the sequence backward."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather the sequence (dim 1) over TP forward. Backward: reduce-scatter the gradient
    when the consumer is TP-sharded (a column-parallel linear: each rank holds part of the input
    gradient), else keep this rank's chunk (`tensor_parallel_output_grad=False`: the consumer is
    replicated, so every rank already holds the whole gradient)."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP and keep this rank's chunk of the sequence (dim 1) forward; all-gather the
    sequence backward."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x)


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """All-gather the sequence (dim 1) over TP; a plain collective, outside autograd."""
    return _gather_sequence(x)


def reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP and keep this rank's sequence chunk; a plain collective, outside autograd."""
    return _reduce_scatter_sequence(x)
