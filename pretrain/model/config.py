"""`ModelConfig`: the GPT model's only input, with Megatron's defaults and shape checks.

The argument parser (pretrain/arguments.py) builds it from Megatron's flags; tests and tools build
it directly. Derived sizes (`ffn_size`, `head_dim`, `query_groups`) resolve Megatron's `None`
defaults in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pretrain.errors import UserError


@dataclass
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # true tokenizer size; the embedding is padded (see padded_vocab_size)
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # None -> seq_length
    num_query_groups: int | None = None  # None -> MHA (one group per head)
    ffn_hidden_size: int | None = None  # None -> 4h, or int((4h*2/3)/64)*64 with swiglu
    kv_channels: int | None = None  # None -> hidden_size / num_attention_heads
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: int = 10000
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    recompute_activations: bool = False
    seed: int = 1234
    params_dtype: torch.dtype = torch.float32

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return (
            self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads
        )

    @property
    def max_positions(self) -> int:
        return (
            self.max_position_embeddings
            if self.max_position_embeddings is not None
            else self.seq_length
        )

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's padding: the smallest multiple of divisible_by * tp that holds the vocabulary."""
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate(self, tp: int = 1, pp: int = 1, world_size: int | None = None) -> None:
        """Raise one UserError listing every shape problem for this TP/PP layout, with the fix."""
        problems = []
        h, heads, groups = self.hidden_size, self.num_attention_heads, self.query_groups
        for name, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", h),
            ("--num-attention-heads", heads),
            ("vocab size", self.vocab_size),
            ("--seq-length", self.seq_length),
            ("--num-query-groups", groups),
            ("--ffn-hidden-size", self.ffn_size),
        ):
            if value < 1:
                problems.append(f"{name} must be >= 1 (got {value})")
        if problems:
            raise UserError("; ".join(problems))
        if self.kv_channels is None and h % heads != 0:
            problems.append(
                f"--hidden-size {h} is not divisible by --num-attention-heads {heads} "
                f"(choose a hidden size that is a multiple of the head count, or set --kv-channels)"
            )
        if heads % groups != 0:
            problems.append(
                f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups} "
                f"(each query group must hold the same number of heads)"
            )
        if heads % tp != 0:
            problems.append(
                f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp} "
                f"(use a tensor-parallel size that divides the head count)"
            )
        if groups % tp != 0:
            problems.append(
                f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp} "
                f"(use a tensor-parallel size that divides the number of query groups)"
            )
        if self.ffn_size % tp != 0:
            problems.append(
                f"--ffn-hidden-size {self.ffn_size} is not divisible by --tensor-model-parallel-size "
                f"{tp} (set --ffn-hidden-size to a multiple of {tp})"
            )
        if self.num_layers % pp != 0:
            problems.append(
                f"--num-layers {self.num_layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp} (each pipeline stage holds the same number of layers)"
            )
        if world_size is not None and world_size % (tp * pp) != 0:
            problems.append(
                f"world size {world_size} is not divisible by tensor-parallel size {tp} x "
                f"pipeline-parallel size {pp} = {tp * pp} (launch a multiple of {tp * pp} "
                f"processes, or change the parallel sizes)"
            )
        if self.max_positions < self.seq_length:
            problems.append(
                f"--max-position-embeddings {self.max_positions} is smaller than --seq-length "
                f"{self.seq_length} (raise --max-position-embeddings)"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            problems.append(
                f"--position-embedding-type {self.position_embedding_type!r} is not supported "
                f"(use learned_absolute or rope)"
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2 != 0:
            problems.append(
                f"rope needs an even head dimension, got {self.head_dim} (change --kv-channels "
                f"or --hidden-size / --num-attention-heads)"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            problems.append(
                f"--normalization {self.normalization!r} is not supported (use LayerNorm or RMSNorm)"
            )
        for name, p in (
            ("--hidden-dropout", self.hidden_dropout),
            ("--attention-dropout", self.attention_dropout),
        ):
            if not 0.0 <= p < 1.0:
                problems.append(f"{name} {p} must be in [0, 1)")
        if problems:
            raise UserError("invalid model configuration: " + "; ".join(problems))
