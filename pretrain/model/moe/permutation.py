"""Tokens sorted by expert, and back.

`permute` lists the (token, expert) pairs of a routing map expert by expert, each expert's
tokens in token order (megatron-core's order), and gathers their rows; `unpermute` adds every
row back onto its token (a token routed to k experts receives the sum of its k rows). Autograd
flows through both (index_select / index_add), so unpermute(permute(x)) = k x and the gradient
comes back the same way.
"""

from __future__ import annotations

import torch


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N, h], their token indices [N]) for the N pairs of `routing_map` [T, E] (bool),
    expert-major."""
    experts_by_token = routing_map.T
    token_ids = torch.arange(routing_map.shape[0], device=tokens.device)
    sorted_indices = token_ids.expand(routing_map.shape[1], -1).masked_select(experts_by_token)
    return tokens.index_select(0, sorted_indices), sorted_indices


def permute_probs(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """The weights [N] of `permute`'s pairs, in its order."""
    return probs.T.masked_select(routing_map.T)


def unpermute(rows: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens, h]: each token the sum of its rows."""
    out = rows.new_zeros((num_tokens, *rows.shape[1:]))
    return out.index_add(0, sorted_indices, rows)


def sort_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """`x` cut into consecutive chunks of `sizes` rows, concatenated in `order`."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order])
