"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Y = X A^T + b with the weight A stored as [out, in] (torch.nn.Linear's layout):
- Column: A split along `out`; every rank sees the whole input and produces its slice of the
  output. The input goes through `copy_to_tensor_model_parallel_region`, whose backward all-reduces
  dX (each rank only contributes its slice's share of it).
- Row: A split along `in`; each rank multiplies its slice of the input, the partial products are
  all-reduced, then the (replicated) bias is added once.
- VocabParallelEmbedding: rank r holds rows [r V/t, (r+1) V/t); ids outside give zero rows, and an
  all-reduce assembles the full embedding (with `reduce_scatter=True`, a reduce-scatter: this
  rank's sequence chunk). V is the padded vocabulary; the padding rows are zeros, and
  `mask_padded_vocab_` keeps them out of every softmax over logits.

Sequence parallelism (`sequence_parallel=True`, Megatron's): the input of a column layer and the
output of a row layer are [b, s/t, h], this rank's chunk of the sequence. The column layer
all-gathers the sequence before its matmul (its backward reduce-scatters dX), the row layer
reduce-scatters the partial products instead of all-reducing them, then adds its replicated bias
to its chunk. That bias (like the norm weights around it) then sees s/t tokens per rank, so its
gradient is summed over TP in backward (`sum_grad_over_tensor_parallel`); such parameters are
marked `sequence_parallel = True`.

Parameters are allocated uninitialised; `initialize(name, seed, std)` fills them with their shard
of the layout-independent full tensor (pretrain.parallel.random.init_normal_), biases with zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.parallel import state
from pretrain.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    gather_sequence,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from pretrain.parallel.random import init_normal_
from pretrain.parallel.sharding import mark_tensor_parallel, merge_shards


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, or ValueError naming `what` if it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor-parallel size {denominator}"
        )
    return numerator // denominator


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """x (replicated over TP; with `sequence_parallel`, this rank's [b, s/t, h] chunk, gathered
    first) @ weight-shard^T: this rank's slice of the output features for the whole sequence."""
    if sequence_parallel and state.get_tensor_model_parallel_world_size() > 1:
        return _SequenceParallelColumnLinear.apply(x, weight, bias)
    return F.linear(copy_to_tensor_model_parallel_region(x), weight, bias)


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """F.linear on the all-gathered sequence that keeps only this rank's [b, s/t, h] chunk for
    backward and gathers it again there (Megatron's choice): the memory sequence parallelism
    saves includes these inputs, which a plain gather-then-linear would keep whole."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(gather_sequence(x), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = gather_sequence(x).flatten(0, -2)
        grad_rows = grad.flatten(0, -2)
        grad_x = reduce_scatter_sequence(grad.matmul(weight))
        grad_weight = grad_rows.t().matmul(whole)
        grad_bias = grad_rows.sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias


def sum_grad_over_tensor_parallel(param: torch.Tensor) -> torch.Tensor:
    """`param` as it is forward; its gradient summed over TP ranks backward. For a replicated
    parameter applied to this rank's chunk of the sequence (sequence parallelism, where such
    parameters are marked `sequence_parallel = True`): each rank's gradient covers s/t tokens,
    the sum covers the whole sequence, as without sequence parallelism.

    Megatron sums these gradients once per step (finalize_model_grads); here the sum is part of
    autograd, one small all-reduce per parameter and micro-batch, so it is right under every
    DeepSpeed engine (ZeRO 0-3 gradient hooks, the pipeline engine) without a training-loop hook.
    """
    return copy_to_tensor_model_parallel_region(param)


class _ParallelLinear(nn.Module):
    """What both parallel linears share: a (sharded) normal-initialised weight and a zero bias."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def initialize(self, name: str, seed: int, std: float) -> None:
        init_normal_(self.weight, f"{name}.weight", seed, std)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer with the output features split over TP ranks.

    `stride` > 1 declares that the full output dimension is `stride` blocks each split separately
    (see pretrain.parallel.sharding), e.g. SwiGLU's [gate; up].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        world = state.get_tensor_model_parallel_world_size()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        local_out = divide(out_features, world, "output features")
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(local_out, in_features, dtype=dtype)), 0, stride
        )
        self.bias = (
            mark_tensor_parallel(nn.Parameter(torch.zeros(local_out, dtype=dtype)), 0, stride)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, self.sequence_parallel)
        if not self.gather_output:
            return y
        # rank order: [shard_0, shard_1, ...]
        gathered = gather_from_tensor_model_parallel_region(y)
        world = state.get_tensor_model_parallel_world_size()
        return merge_shards(list(gathered.chunk(world, dim=-1)), -1, self.weight.partition_stride)


class RowParallelLinear(_ParallelLinear):
    """Linear layer with the input features split over TP ranks; the bias is added after the reduce
    (with `sequence_parallel`: a reduce-scatter to this rank's sequence chunk)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        world = state.get_tensor_model_parallel_world_size()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")

        local_in = divide(in_features, world, "input features")
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(out_features, local_in, dtype=dtype)), 1
        )
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if sequence_parallel and self.bias is not None:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if state.get_tensor_model_parallel_world_size() == 1:  # nothing to reduce: one fused addmm
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        partial = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_tensor_model_parallel_region(partial)
            return y + self.bias if self.bias is not None else y
        y = reduce_scatter_to_sequence_parallel_region(partial)
        return y + sum_grad_over_tensor_parallel(self.bias) if self.bias is not None else y


def padded_vocab_columns(local_vocab: int, vocab_size: int) -> slice | None:
    """This TP rank's columns (of `local_vocab`) whose global vocabulary id is padding (>= vocab_size)."""
    start = state.get_tensor_model_parallel_rank() * local_vocab
    first_padded = max(vocab_size - start, 0)
    return slice(first_padded, None) if first_padded < local_vocab else None


def mask_padded_vocab_(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set this rank's logits [..., V_padded/tp] at padded ids to -inf, in place; returns `logits`.

    Padding rows then never enter a softmax: exp(-inf) = 0 in the loss, in evaluation and in
    sampling, and their gradient is exactly zero, so the model is the same at every padded size.
    In place, so the logits (the largest activation) are not copied; the matmul that produced them
    does not keep its output for backward.
    """
    padded = padded_vocab_columns(logits.shape[-1], vocab_size)
    if padded is not None:
        logits[..., padded] = float("-inf")
    return logits


class VocabParallelEmbedding(nn.Module):
    """Embedding table with the vocabulary (rows) split over TP ranks.

    `num_embeddings` is the padded size; `vocab_size` (default: the same) the true one: rows at and
    after it are padding, initialised to zeros, and never looked up.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        vocab_size: int | None = None,
        reduce_scatter: bool = False,
    ):
        super().__init__()
        self.reduce_scatter = reduce_scatter  # sequence parallelism: return [b, s/t, h]
        world, rank = (
            state.get_tensor_model_parallel_world_size(),
            state.get_tensor_model_parallel_rank(),
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size
        local = divide(num_embeddings, world, "vocabulary size")
        self.vocab_start, self.vocab_end = rank * local, (rank + 1) * local
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype)), 0
        )

    def initialize(self, name: str, seed: int, std: float) -> None:
        """Real rows from the layout-independent draw for `name`; padding rows zero."""
        init_normal_(self.weight, f"{name}.weight", seed, std, real_rows=self.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if state.get_tensor_model_parallel_world_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter:
            return reduce_scatter_to_sequence_parallel_region(rows)
        return reduce_from_tensor_model_parallel_region(rows)
