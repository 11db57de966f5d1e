"""Tensor parallelism on torch.distributed: process groups, collectives, layers, loss, RNG.

One concept per module: state (groups), mappings (autograd collectives), layers (TP linear and
embedding layers), cross_entropy (vocab-parallel loss), random (layout-independent init, TP dropout
RNG), sharding (full tensor <-> per-rank shards), grad_norm (global gradient norm).
"""

from pretrain.parallel import state
from pretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.parallel.grad_norm import global_grad_norm
from pretrain.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pretrain.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from pretrain.parallel.random import seed_everything, tensor_parallel_rng
from pretrain.parallel.sharding import is_tensor_parallel, merge_shards, shard_tensor
from pretrain.parallel.state import destroy_model_parallel, initialize_model_parallel, mpu

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_model_parallel_region",
    "destroy_model_parallel",
    "gather_from_tensor_model_parallel_region",
    "global_grad_norm",
    "initialize_model_parallel",
    "is_tensor_parallel",
    "merge_shards",
    "mpu",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "seed_everything",
    "shard_tensor",
    "state",
    "tensor_parallel_rng",
    "vocab_parallel_cross_entropy",
]
