"""MoELayer: the MLP of a mixture-of-experts transformer layer (megatron-core's MoELayer).

    hidden [b, s, h] (under sequence parallelism this TP rank's [b, s/tp, h] chunk)
      -> tokens in Megatron's sequence-major order -> router (weights, routing map)
      -> dispatcher -> this rank's experts -> dispatcher combine -> [b, s, h]
      (+ shared experts: a TP-parallel MLP every token goes through)

At TP > 1 without sequence parallelism `hidden` is the whole [b, s, h] on every TP rank: the
layer routes this rank's sequence chunk only (scatter_to_sequence_parallel_region: its backward
all-gathers the input gradient) and all-gathers the routed output (its backward keeps this
rank's chunk: the consumer is replicated), so each token goes through its experts once per TP
group and the router, dispatcher and experts compute exactly what they compute under sequence
parallelism (the shared experts take the whole `hidden`, as a dense MLP does).

State-dict names under `layers.<i>.mlp.` (E experts, f = --moe-ffn-hidden-size, g = the shared
experts' width; shapes at EP = ETP = TP = 1; see experts.py for the EP/ETP split attributes):
    router.weight                [E, h]        replicated
    router.bias                  [E]           add_bias_linear only
    router.expert_bias           [E]           buffer, --moe-router-enable-expert-bias only
    experts.fc1.weight           [E, 2f or f, h]
    experts.fc1.bias             [E, 2f or f]  add_bias_linear only
    experts.fc2.weight           [E, h, f]
    experts.fc2.bias             [E, h]        add_bias_linear only
    shared_experts.fc1.weight    [2g or g, h]  as a dense layer's mlp.fc1 (TP-split rows)
    shared_experts.fc2.weight    [h, g]        as a dense layer's mlp.fc2 (TP-split columns)
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.mlp import MLP, uses_sequence_parallel
from pretrain.model.moe.dispatcher import build_dispatcher
from pretrain.model.moe.experts import Experts
from pretrain.model.moe.router import TopKRouter, routes_sequence_chunks
from pretrain.parallel import state
from pretrain.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


def local_experts(num_experts: int) -> range:
    """The global indices of the experts this EP rank holds."""
    per_rank = num_experts // state.get_expert_model_parallel_world_size()
    first = state.get_expert_model_parallel_rank() * per_rank
    return range(first, first + per_rank)


class MoELayer(nn.Module):
    """Router, dispatcher, this rank's experts and the optional shared experts (module doc)."""

    def __init__(self, config: ModelConfig, layer_number: int):
        super().__init__()
        self.router = TopKRouter(config)
        self.router.layer_number = layer_number
        experts = local_experts(config.num_moe_experts)
        self.experts = Experts(config, experts)
        self.dispatcher = build_dispatcher(
            config.moe_token_dispatcher_type, experts, config.num_moe_experts
        )
        self.takes_chunk = routes_sequence_chunks() and not uses_sequence_parallel(config)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = MLP(config, config.moe_shared_expert_intermediate_size)

    def initialize(self, prefix: str, std: float, output_std: float) -> None:
        """Every weight from its layout-independent draw (std; output_std for fc2s)."""
        self.router.initialize(f"{prefix}.router", std)
        self.experts.initialize(f"{prefix}.experts", std, output_std)
        if self.shared_experts is not None:
            self.shared_experts.initialize(f"{prefix}.shared_experts", std, output_std)

    def forward(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]; `padding_mask` [b, s] (True = padding, as `hidden`: this
        rank's chunk under sequence parallelism) keeps padding tokens out of the router's losses
        and counts."""
        if not self.takes_chunk:
            out = self._routed(hidden, padding_mask)
        else:  # the whole sequence on every TP rank: route this rank's chunk (module doc)
            if padding_mask is not None:
                padding_mask = scatter_to_sequence_parallel_region(padding_mask)
            out = self._routed(scatter_to_sequence_parallel_region(hidden), padding_mask)
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out

    def _routed(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Router, dispatcher and experts on [b, s, h] (s: the tokens this rank routes)."""
        batch, seq, width = hidden.shape
        tokens = hidden.transpose(0, 1).reshape(seq * batch, width)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).reshape(-1)
        probs, routing_map = self.router(tokens, seq, padding_mask)
        rows, weights, counts, handle = self.dispatcher.dispatch(tokens, probs, routing_map)
        rows = self.experts(rows, counts, weights)
        return self.dispatcher.combine(rows, handle).view(seq, batch, width).transpose(0, 1)
