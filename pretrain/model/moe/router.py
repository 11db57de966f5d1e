"""TopKRouter: which experts each token goes to, with which weight, and the losses that balance it.

`weight` [E, h] (and `bias` [E] with add_bias_linear) are replicated; at TP > 1 each TP rank
routes its own sequence chunk (`routes_sequence_chunks`: with or without sequence parallelism,
MoELayer gives it the chunk) and their gradients are summed over TP. The logits are computed in
--moe-router-dtype (fp32/fp64; default the activations' dtype).

In training (autograd on, not a recomputation) the router also
- attaches its load-balancing loss to the routing weights and its z-loss to the logits
  (`losses.attach`), over the scope --moe-router-load-balancing-type names: `aux_loss` the
  micro-batch (token counts summed over the TP ranks that share it), `seq_aux_loss` each sequence,
  `global_aux_loss` the tokens of every micro-batch so far in this iteration over the whole stage
  (TP x DP);
- counts routed tokens per expert into `local_tokens_per_expert` (the DeepSeek-V3 expert bias is
  updated from them once per iteration, `metrics.finish_iteration`) and into `stats` (the log).
Padding tokens (`padding_mask` True) count in neither and add nothing to the losses.

`expert_bias` [E] (fp32, a persistent buffer: it is part of the state dict and checkpoints) is
added to the scores only to pick the experts; the weights never see it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.moe import losses
from pretrain.model.moe.metrics import LOSS_NAMES, RouterStats
from pretrain.model.moe.routing import (
    aux_loss_scores,
    drop_over_capacity,
    expert_capacity,
    topk_routing,
)
from pretrain.parallel import state
from pretrain.parallel.layers import sum_grad_over_tensor_parallel
from pretrain.parallel.random import init_normal_, is_recomputing
from pretrain.parallel.token_exchange import all_reduce, group_size

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
FP32_BUFFERS = ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert")


def routes_sequence_chunks() -> bool:
    """Each TP rank routes its own chunk of the sequence (TP > 1), so the router's and its
    losses' sums run over the TP group."""
    return state.get_tensor_model_parallel_world_size() > 1


class TopKRouter(nn.Module):
    """Gating + top-k routing (+ capacity) + auxiliary losses for one MoE layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        experts = config.num_moe_experts
        self.sequence_parallel = routes_sequence_chunks()
        self.weight = nn.Parameter(
            torch.empty(experts, config.hidden_size, dtype=config.params_dtype)
        )
        self.bias = (
            nn.Parameter(torch.empty(experts, dtype=config.params_dtype))
            if config.add_bias_linear
            else None
        )
        for param in self.parameters():
            param.sequence_parallel = self.sequence_parallel
        biased = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(experts) if biased else None)
        counts = torch.zeros(experts) if biased else None
        self.register_buffer("local_tokens_per_expert", counts, persistent=False)
        global_counts = torch.zeros(experts) if self._coeff("global_aux_loss") else None
        self.register_buffer("global_tokens_per_expert", global_counts, persistent=False)
        self.global_steps = 0
        self.stats = RouterStats(experts)

    def initialize(self, prefix: str, std: float) -> None:
        """weight (and bias: Megatron draws it too) ~ N(0, std), by GPTModel name."""
        init_normal_(self.weight, f"{prefix}.weight", self.config.seed, std)
        if self.bias is not None:
            init_normal_(self.bias, f"{prefix}.bias", self.config.seed, std)

    def _keep_fp32(self) -> None:
        """The expert bias and token counts stay fp32 when the module is cast to bf16/fp16 (a
        1e-3 bias step or a count above 256 would vanish in bf16), as megatron-core keeps them."""
        for name in FP32_BUFFERS:
            buffer = getattr(self, name)
            if buffer is not None and buffer.dtype != torch.float32:
                setattr(self, name, buffer.float())

    def _load_from_state_dict(self, *args, **kwargs):
        self._keep_fp32()  # load the saved fp32 bias into an fp32 buffer
        return super()._load_from_state_dict(*args, **kwargs)

    def _coeff(self, kind: str) -> float:
        config = self.config
        return config.moe_aux_loss_coeff if config.moe_router_load_balancing_type == kind else 0.0

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T, E] router logits in the router dtype."""
        dtype = ROUTER_DTYPES[self.config.moe_router_dtype] or tokens.dtype
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight = sum_grad_over_tensor_parallel(weight)
            bias = None if bias is None else sum_grad_over_tensor_parallel(bias)
        return F.linear(
            tokens.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        )

    def forward(
        self,
        tokens: torch.Tensor,
        seq_length: int,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, E], routing map [T, E] bool) for tokens [T, h] in sequence-major order
        (`seq_length` rows of the local sequence chunk per sample); `padding_mask` [T] marks
        padding tokens."""
        config = self.config
        self._keep_fp32()
        training = self.training and torch.is_grad_enabled()
        recording = training and not is_recomputing()
        logits = self.logits(tokens)
        if training and config.moe_z_loss_coeff:
            logits = self._attach_z_loss(logits, padding_mask, recording)
        probs, chosen = topk_routing(
            logits,
            config.moe_router_topk,
            score_function=config.moe_router_score_function,
            pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        probs, routing_map = self._apply_capacity(probs, chosen)
        if training and config.moe_aux_loss_coeff > 0:
            probs = self._attach_aux_loss(probs, logits, seq_length, padding_mask, recording)
        if recording:
            self._count(chosen, routing_map, padding_mask)
        return probs, routing_map

    def _apply_capacity(self, probs, routing_map):
        factor = self.config.moe_expert_capacity_factor
        if factor is None:
            return probs, routing_map
        capacity = expert_capacity(
            probs.shape[0], self.config.num_moe_experts, self.config.moe_router_topk, factor
        )
        return drop_over_capacity(
            probs,
            routing_map,
            capacity,
            self.config.moe_token_drop_policy,
            self.config.moe_pad_expert_input_to_capacity,
        )

    def _count(self, chosen, routing_map, padding_mask) -> None:
        valid = None if padding_mask is None else (~padding_mask).unsqueeze(-1)
        routed = chosen if valid is None else chosen & valid
        kept = routing_map & routed
        if self.expert_bias is not None:
            self.local_tokens_per_expert += kept.sum(0)
        self.stats.add_routing(routed.sum(0), (routed & ~kept).sum())

    def _attach_z_loss(self, logits, padding_mask, recording):
        tp = state.get_tensor_model_parallel_world_size()
        coeff = self.config.moe_z_loss_coeff / tp
        loss = losses.z_loss(logits, coeff, padding_mask)
        if recording:
            self.stats.add_loss("z_loss", loss.detach() / coeff)
        return losses.attach(logits, loss)

    def _attach_aux_loss(self, probs, logits, seq_length, padding_mask, recording):
        kind = self.config.moe_router_load_balancing_type
        coeff = self._coeff(kind)
        if coeff == 0:
            return probs
        topk, experts = self.config.moe_router_topk, self.config.num_moe_experts
        routing_map, scores = aux_loss_scores(
            logits, topk, self.config.moe_router_score_function, padding_mask
        )
        if kind == "seq_aux_loss":  # each sample's tokens are a column block of E experts
            batch = routing_map.shape[0] // seq_length
            routing_map = routing_map.reshape(seq_length, batch * experts)
            scores = scores.reshape(seq_length, batch * experts)
        group = state.get_tensor_model_parallel_group()
        if kind == "global_aux_loss":
            group = state.get_tensor_and_data_parallel_group()
        counts = all_reduce(routing_map.sum(0).to(scores.dtype), group)
        if padding_mask is not None:
            total = counts.sum() / (topk * (routing_map.shape[1] // experts))
        else:
            total = routing_map.shape[0] * group_size(group)
        if kind == "global_aux_loss":
            counts = self._global_average(counts)
        loss = losses.switch_load_balancing_loss(scores, counts, total, topk, experts, coeff)
        if kind == "seq_aux_loss":
            loss = loss / (routing_map.shape[1] // experts)
        if recording:
            self.stats.add_loss(LOSS_NAMES[kind], loss.detach() / coeff)
        return losses.attach(probs, loss)

    def _global_average(self, counts: torch.Tensor) -> torch.Tensor:
        """The stage's token counts per expert averaged over this iteration's micro-batches (never
        recomputed: the config refuses global_aux_loss with full recompute)."""
        with torch.no_grad():
            self.global_tokens_per_expert += counts
            self.global_steps += 1
        return self.global_tokens_per_expert / self.global_steps

    def finish_iteration(self) -> None:
        """Forget this iteration's global-aux-loss counts (the expert bias: metrics)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.global_steps = 0
