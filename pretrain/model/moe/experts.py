"""The experts held by this rank: every expert's MLP in one pair of stacked weights.

    fc1.weight [E_local, (2 x) f / etp, h]   fc1.bias [E_local, (2 x) f]   (SwiGLU: [gate; up])
    fc2.weight [E_local, h, f / etp]         fc2.bias [E_local, h]

(f = --moe-ffn-hidden-size; each expert's matrix in torch.nn.Linear's [out, in] layout.) Rows
arrive sorted by local expert (`counts` rows each); the expert's output is
fc2(activation(fc1(x)) x weight) + fc2.bias x weight: the routing weight is applied before fc2,
as megatron-core does. With expert TP the output is this rank's partial sum (the dispatcher's
reduce-scatter adds the expert-TP ranks' parts).

Two ways to compute the same thing: a loop over the experts (the reference, an expert with zero
rows included) or, with --moe-grouped-gemm, one `torch._grouped_mm` per weight (its backward
needs row strides that are multiples of 16 bytes: ModelConfig.validate checks the sizes).

Layout attributes, for the optimizer and checkpoint code: every parameter has
`expert_parallel = True` and `expert_partition_dim = 0` (the experts, split over EP: rank r holds
experts [r E/ep, (r+1) E/ep)); the matrices split over expert TP also have
`expert_tensor_partition_dim` (1 for fc1, 2 for fc2) and `partition_stride` (2 for SwiGLU's fc1:
each rank holds [gate_r; up_r]). When the expert-TP group is the TP group (expert TP = TP > 1)
the matrices are also ordinary TP shards (`tensor_model_parallel`, `partition_dim` = the same
dimension): clipping, ZeRO and the full-state checkpoint treat them as such. With expert TP 1 and
EP 1 under TP, every TP rank holds whole experts fed by its own sequence chunk (with or without
sequence parallelism: MoELayer routes each TP rank's chunk): their gradients
are summed over TP in backward and they are marked `sequence_parallel = True` (replicated over
TP, like the norms). Initialisation draws each expert's full matrix from
(seed, "<name>[<expert>]") and keeps this rank's shard, so any EP/ETP layout starts from the same
model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.mlp import activation
from pretrain.parallel import state
from pretrain.parallel.layers import sum_grad_over_tensor_parallel
from pretrain.parallel.random import draw_full_normal
from pretrain.parallel.sharding import mark_tensor_parallel, shard_tensor


def mark_expert_parallel(param: nn.Parameter, etp_dim: int | None, stride: int = 1):
    """Tag an expert parameter (see the module doc)."""
    param.expert_parallel = True
    param.expert_partition_dim = 0
    if etp_dim is not None:
        param.expert_tensor_partition_dim = etp_dim
        param.partition_stride = stride
        if _etp_is_tp():  # the expert-TP group is then the TP group: a TP shard like any other
            mark_tensor_parallel(param, etp_dim, stride)
    param.sequence_parallel = _summed_over_tp()
    return param


def _etp_is_tp() -> bool:
    tp = state.get_tensor_model_parallel_world_size()
    return tp > 1 and state.get_expert_tensor_parallel_world_size() == tp


def _summed_over_tp() -> bool:
    """With expert TP 1 and EP 1 under TP (each TP rank routes its chunk), every TP rank holds every
    expert whole and runs it on its own sequence chunk: like a norm weight, the gradient is the
    sum over TP (`sum_grad_over_tensor_parallel`)."""
    return (
        state.get_tensor_model_parallel_world_size() > 1
        and state.get_expert_tensor_parallel_world_size() == 1
        and state.get_expert_model_parallel_world_size() == 1
    )


def _tp_summed(param: nn.Parameter | None, summed: bool) -> torch.Tensor | None:
    """`param`, its gradient summed over TP when `summed` (`_summed_over_tp`, decided when the
    layer is built: the parameter a forward sees may be a copy without the marks, such as the
    one FSDP2 gathers)."""
    if param is None or not summed:
        return param
    return sum_grad_over_tensor_parallel(param)


class _ExpertLinear(nn.Module):
    """One stacked weight [E_local, out, in] and its bias [E_local, out] (or none)."""

    def __init__(self, experts, out_features, in_features, etp_dim, stride, bias, dtype):
        super().__init__()
        self.weight = mark_expert_parallel(
            nn.Parameter(torch.empty(experts, out_features, in_features, dtype=dtype)),
            etp_dim,
            stride,
        )
        self.bias = None
        if bias:
            self.bias = mark_expert_parallel(
                nn.Parameter(torch.zeros(experts, out_features, dtype=dtype)), None
            )

    @torch.no_grad()
    def initialize(self, name: str, seed: int, std: float, first_expert: int) -> None:
        """Each local expert's shard of its full N(0, std) matrix; biases zero."""
        etp_dim = getattr(self.weight, "expert_tensor_partition_dim", None)
        etp, etp_rank = (
            state.get_expert_tensor_parallel_world_size(),
            state.get_expert_tensor_parallel_rank(),
        )
        for i, local in enumerate(self.weight):
            shape = list(local.shape)
            if etp_dim is not None:
                shape[etp_dim - 1] *= etp
            full = draw_full_normal(shape, f"{name}[{first_expert + i}]", seed, std)
            if etp_dim is not None:
                full = shard_tensor(full, etp_dim - 1, etp_rank, etp, self.weight.partition_stride)
            local.copy_(full)
        if self.bias is not None:
            self.bias.zero_()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (torch._grouped_mm's backward
    refuses broadcast gradients such as a sum's)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _bias_rows(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each row's expert's bias [N, out]."""
    return bias.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0)


class Experts(nn.Module):
    """This rank's experts (see the module doc)."""

    def __init__(self, config: ModelConfig, local_experts: range):
        super().__init__()
        self.config, self.local = config, local_experts
        etp = state.get_expert_tensor_parallel_world_size()
        width = config.moe_ffn_size // etp
        fc1_out = 2 * width if config.swiglu else width
        stride = 2 if config.swiglu else 1
        bias, dtype = config.add_bias_linear, config.params_dtype
        n, h = len(local_experts), config.hidden_size
        self.fc1 = _ExpertLinear(n, fc1_out, h, 1, stride, bias, dtype)
        self.fc2 = _ExpertLinear(n, h, width, 2, 1, bias, dtype)
        self.summed_over_tp = _summed_over_tp()

    def initialize(self, prefix: str, std: float, output_std: float) -> None:
        """fc1 ~ N(0, std), fc2 ~ N(0, output_std), by GPTModel name and global expert index."""
        self.fc1.initialize(f"{prefix}.fc1.weight", self.config.seed, std, self.local.start)
        self.fc2.initialize(f"{prefix}.fc2.weight", self.config.seed, output_std, self.local.start)

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's rows times its matrix: one grouped GEMM, or the loop."""
        if self.config.moe_grouped_gemm:
            offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets))
        rows = x.split(counts)
        return torch.cat([F.linear(r, w) for r, w in zip(rows, weight, strict=True)])

    def forward(self, x: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        """Rows [N, h] sorted by local expert (`counts` each), weights [N] -> outputs [N, h]."""
        fc1_weight, fc1_bias, fc2_weight, fc2_bias = (
            _tp_summed(p, self.summed_over_tp)
            for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        )
        weights = probs.unsqueeze(-1)
        hidden = self._matmul(x, fc1_weight, counts)
        if fc1_bias is not None:
            hidden = hidden + _bias_rows(fc1_bias, counts)
        hidden = (activation(hidden, self.config) * weights).to(x.dtype)
        out = self._matmul(hidden, fc2_weight, counts)
        if fc2_bias is not None:
            out = out + (_bias_rows(fc2_bias, counts) * weights).to(x.dtype)
        return out
