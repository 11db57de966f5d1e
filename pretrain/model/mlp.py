"""The feed-forward block: the dense MLP of every layer, and each expert's and shared expert's
math in a mixture-of-experts layer (pretrain.model.moe).

fc1 (column-parallel; [gate; up] with SwiGLU) -> GELU or SiLU-gate -> fc2 (row-parallel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.parallel import state
from pretrain.parallel.layers import ColumnParallelLinear, RowParallelLinear


def uses_sequence_parallel(config: ModelConfig) -> bool:
    """Sequence parallelism is on: asked for, and more than one TP rank (Megatron turns it off at
    TP 1, where it would only change which generator dropout draws from)."""
    return config.sequence_parallel and state.get_tensor_model_parallel_world_size() > 1


def activation(y: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The MLP nonlinearity on fc1's output: SiLU(gate) * up with SwiGLU (y = [gate, up] on the
    last dimension), else GELU (erf, or tanh with `openai_gelu`)."""
    if config.swiglu:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(y, approximate="tanh" if config.openai_gelu else "none")


class MLP(nn.Module):
    """fc1 (column-parallel; [gate; up] with SwiGLU) -> activation -> fc2 (row-parallel), of
    width `ffn_size` (default: the config's dense MLP width)."""

    def __init__(self, config: ModelConfig, ffn_size: int | None = None):
        super().__init__()
        self.config = config
        ffn_size = config.ffn_size if ffn_size is None else ffn_size
        sequence_parallel = uses_sequence_parallel(config)
        self.fc1 = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn_size if config.swiglu else ffn_size,
            bias=config.add_bias_linear,
            stride=2 if config.swiglu else 1,
            dtype=config.params_dtype,
            sequence_parallel=sequence_parallel,
        )
        self.fc2 = RowParallelLinear(
            ffn_size,
            config.hidden_size,
            bias=config.add_bias_linear,
            dtype=config.params_dtype,
            sequence_parallel=sequence_parallel,
        )

    def initialize(self, prefix: str, std: float, output_std: float) -> None:
        """fc1 ~ N(0, std), fc2 ~ N(0, output_std) (Megatron's scaled init), by GPTModel name."""
        self.fc1.initialize(f"{prefix}.fc1", self.config.seed, std)
        self.fc2.initialize(f"{prefix}.fc2", self.config.seed, output_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.fc1(x), self.config))
