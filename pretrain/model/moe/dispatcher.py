"""Token dispatchers: bring each (token, expert) pair to the rank holding the expert, and the
expert outputs back (megatron-core's two dispatchers, --moe-token-dispatcher-type).

Both work on this rank's tokens [T, h] (its sequence chunk under sequence parallelism), their
weights [T, E] and routing map [T, E]; `dispatch` returns the rows for this rank's local experts
sorted by expert, their weights, the row count per local expert and a handle for `combine`, which
returns [T, h]: each token the sum of its experts' (weighted) outputs.

- allgather: every rank of the ETP x EP group gathers all their tokens, weights and maps, keeps
  the pairs of its local experts, and after the experts scatters the outputs back with a
  reduce-scatter (summing the partial outputs of the expert-TP ranks and of the other experts).
- alltoall: each rank sorts its pairs by expert and sends each EP rank the rows of its experts
  (all-to-all with uneven splits), the expert-TP ranks gather each other's rows, the rows are
  sorted by local expert; combine reverses each step (reduce-scatter over expert TP).
The collectives are pretrain.parallel.token_exchange's (autograd-aware, uneven splits on gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.model.moe.permutation import permute, permute_probs, sort_chunks, unpermute
from pretrain.parallel import state
from pretrain.parallel.token_exchange import (
    all_to_all_tokens,
    gather_tokens,
    reduce_scatter_tokens,
)


@dataclass(frozen=True)
class _Handle:
    sorted_indices: torch.Tensor
    num_tokens: int
    input_splits: list[int] | None = None  # alltoall: rows sent to each EP rank
    output_splits: list[int] | None = None  # alltoall: rows received from each EP rank
    tp_sizes: list[int] | None = None  # alltoall: rows of each expert-TP rank
    chunk_sizes: list[int] | None = None  # alltoall: rows per (source rank, local expert)


class AllGatherDispatcher:
    """Gather everything over ETP x EP, keep the local experts' pairs (see the module doc)."""

    def __init__(self, local_experts: range):
        self.local = local_experts
        self.group = state.get_expert_tensor_and_model_parallel_group()

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """(rows, weights, rows per local expert, handle) for this rank's local experts."""
        with torch.no_grad():
            routing_map = gather_tokens(routing_map.to(torch.uint8), self.group).bool()
        probs, tokens = gather_tokens(probs, self.group), gather_tokens(tokens, self.group)
        local_map = routing_map[:, self.local.start : self.local.stop]
        rows, sorted_indices = permute(tokens, local_map)
        weights = permute_probs(probs[:, self.local.start : self.local.stop], local_map)
        counts = local_map.sum(0).tolist()
        return rows, weights, counts, _Handle(sorted_indices, tokens.shape[0])

    def combine(self, rows: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """[T, h] for this rank's tokens from its local experts' output rows."""
        return reduce_scatter_tokens(
            unpermute(rows, handle.sorted_indices, handle.num_tokens), self.group
        )


class AllToAllDispatcher:
    """All-to-all over EP, gather over expert TP, sort by local expert (see the module doc)."""

    def __init__(self, local_experts: range, num_experts: int):
        self.local, self.num_experts = local_experts, num_experts
        self.ep = state.get_expert_model_parallel_world_size()
        self.etp = state.get_expert_tensor_parallel_world_size()
        self.etp_rank = state.get_expert_tensor_parallel_rank()

    def _splits(self, routing_map: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """(rows this rank sends to each EP rank, [ep, etp, local experts] rows every rank of
        the ETP x EP group sends to this rank's experts)."""
        counts = routing_map.sum(0)
        per_ep_rank = counts.view(self.ep, -1).sum(1).tolist()
        with torch.no_grad():
            everyone = gather_tokens(
                counts.unsqueeze(0), state.get_expert_tensor_and_model_parallel_group()
            ).view(self.ep, self.etp, self.num_experts)
        return per_ep_rank, everyone[:, :, self.local.start : self.local.stop]

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """(rows, weights, rows per local expert, handle) for this rank's local experts."""
        rows, sorted_indices = permute(tokens, routing_map)
        weights = permute_probs(probs, routing_map)
        input_splits, incoming = self._splits(routing_map)
        output_splits = incoming[:, self.etp_rank].sum(-1).tolist()
        ep_group = state.get_expert_model_parallel_group()
        rows = all_to_all_tokens(rows, ep_group, output_splits, input_splits)
        weights = all_to_all_tokens(weights, ep_group, output_splits, input_splits)
        tp_sizes = incoming.sum((0, 2)).tolist()
        etp_group = state.get_expert_tensor_parallel_group()
        rows, weights = (
            gather_tokens(rows, etp_group, tp_sizes),
            gather_tokens(weights, etp_group, tp_sizes),
        )
        chunk_sizes = incoming.transpose(0, 1).flatten().tolist()  # [etp][ep][local expert]
        sources, experts = len(chunk_sizes) // len(self.local), len(self.local)
        by_expert = [s * experts + e for e in range(experts) for s in range(sources)]
        rows = sort_chunks(rows, chunk_sizes, by_expert)
        weights = sort_chunks(weights, chunk_sizes, by_expert)
        handle = _Handle(
            sorted_indices, tokens.shape[0], input_splits, output_splits, tp_sizes, chunk_sizes
        )
        return rows, weights, incoming.sum((0, 1)).tolist(), handle

    def combine(self, rows: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """[T, h] for this rank's tokens: every step of `dispatch` reversed."""
        experts = len(self.local)
        sources = len(handle.chunk_sizes) // experts
        sorted_sizes = [
            handle.chunk_sizes[s * experts + e] for e in range(experts) for s in range(sources)
        ]
        by_source = [e * sources + s for s in range(sources) for e in range(experts)]
        rows = sort_chunks(rows, sorted_sizes, by_source)
        rows = reduce_scatter_tokens(
            rows, state.get_expert_tensor_parallel_group(), handle.tp_sizes
        )
        rows = all_to_all_tokens(
            rows, state.get_expert_model_parallel_group(), handle.input_splits, handle.output_splits
        )
        return unpermute(rows, handle.sorted_indices, handle.num_tokens)


def build_dispatcher(kind: str, local_experts: range, num_experts: int):
    """The --moe-token-dispatcher-type `kind` for this rank's `local_experts`."""
    if kind == "allgather":
        return AllGatherDispatcher(local_experts)
    return AllToAllDispatcher(local_experts, num_experts)
