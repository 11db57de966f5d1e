"""Top-k routing and expert capacity: pure functions on [tokens, experts] tensors.

Megatron-core's semantics (docs/MOE.md states them):
- softmax scores: with `pre_softmax`, top-k of softmax(logits) over all experts; otherwise top-k
  of the logits, then a softmax over the k selected ones (the weights sum to 1).
- sigmoid scores: top-k of sigmoid(logits) (+ the expert bias, which only picks: the weights are
  the unbiased scores), then normalised to sum to 1 when k > 1.
- group-limited routing: experts form `num_groups` equal groups; a group's score is the sum of its
  top (k / group_topk) scores; each token picks `group_topk` groups, then its top k experts within.
- a scaling factor multiplies the weights.
- capacity (per rank, per expert): ceil(tokens x k / experts x factor). Over capacity, "probs"
  keeps the highest-weight tokens, "position" the first ones (token order). With padding, every
  expert takes exactly `capacity` tokens: the extra ones get weight 0.
Tokens are rows in Megatron's order (sequence-major: position p of sample b is row p * batch + b).
"""

from __future__ import annotations

import math

import torch


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the top-k experts among each token's best `group_topk` groups."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.repeat_interleave(experts // num_groups, dim=1)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, E], zero off the selected experts; routing map [T, E] bool) from logits."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            weights, indices = _topk(scores, topk, num_groups, group_topk)
        else:
            selected, indices = _topk(logits, topk, num_groups, group_topk)
            weights = torch.softmax(selected, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            indices = _topk(scores + expert_bias, topk, num_groups, group_topk)[1]
            weights = scores.gather(1, indices)
        else:
            weights, indices = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        weights = weights * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Tokens each expert takes from one rank: ceil(num_tokens x topk / num_experts x factor)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_over_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity: int,
    policy: str = "probs",
    pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, map) with at most `capacity` tokens per expert (`pad`: exactly `capacity`, or
    every token when there are fewer; padding entries get weight 0)."""
    num_tokens = probs.shape[0]
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    elif policy == "probs":
        rows = probs.topk(capacity, dim=0, sorted=False).indices
        keep = torch.zeros_like(routing_map).scatter(0, rows, True)
    else:  # "position": the first `capacity` routed tokens, then (padding) the first others
        routed_first = routing_map.cumsum(0) <= capacity
        keep = routing_map & routed_first
        if pad:
            free = capacity - keep.sum(0, keepdim=True)
            keep |= ~routing_map & ((~routing_map).cumsum(0) <= free)
    final_map = keep if pad else routing_map & keep
    return probs * final_map, final_map


def aux_loss_scores(
    logits: torch.Tensor, topk: int, score_function: str, padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map [T, E], scores [T, E]) the load-balancing losses use: plain top-k of the
    normalised scores (softmax, or sigmoid divided by its sum), whatever the routing options;
    padding tokens (`padding_mask` True) are zero rows."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        routing_map, scores = routing_map & valid, scores * valid
    return routing_map, scores
