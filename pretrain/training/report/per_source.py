"""Validation loss per data source of a blend (any TP/PP/DP layout).

A blended validation batch carries `dataset_id` [b]: the position, in the blend, of the source
each sample was drawn from. Per source we sum the per-token losses of its unmasked tokens and count
those tokens, over every micro-batch of the pass and every data-parallel rank. The per-source loss
is that sum over that count: a token-weighted mean. Megatron's total ("lm loss value") is a
different number: the mean, over micro-batches, of each micro-batch's masked mean. The two agree
only when every micro-batch has the same number of unmasked tokens; the token-weighted total
(sum of all sums over all counts) is logged beside the per-source losses so that the relation is
checkable.

At PP > 1 only the rank holding the last stage computes losses (its loss function adds each
micro-batch here); `reduce` sums over its data-parallel ranks and over the ranks of the pipeline
(the others add nothing), so that every stage, global rank 0 (which logs them) included, has the
sums, whichever rank the last stage is on (the torch backend's V-shaped schedule puts it on the
first).
"""

from __future__ import annotations

import math

import torch

from pretrain.parallel import state


class SourceLosses:
    """Accumulates (loss sum, token count) per blend source over one evaluation pass."""

    def __init__(self, names: list[str], device: torch.device):
        self.names = names
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.tokens = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(
        self, per_token_loss: torch.Tensor, loss_mask: torch.Tensor, dataset_id: torch.Tensor
    ) -> None:
        """Add one micro-batch: per-token losses and mask [b, s], source positions [b]."""
        mask = loss_mask.to(torch.float64)
        per_sample_sum = (per_token_loss.detach().to(torch.float64) * mask).sum(dim=1)
        ids = dataset_id.to(self.sums.device)
        self.sums.index_add_(0, ids, per_sample_sum.to(self.sums.device))
        self.tokens.index_add_(0, ids, mask.sum(dim=1).to(self.sums.device))

    def reduce(self) -> None:
        """Sum over the data-parallel ranks (each saw its own samples of the global batches)
        and over the pipeline's ranks (only the one holding the last stage saw losses)."""
        both = torch.stack([self.sums, self.tokens])
        if state.get_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(both, group=state.get_data_parallel_group())
        if state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(both, group=state.get_pipeline_model_parallel_group())
        self.sums, self.tokens = both[0].clone(), both[1].clone()

    def losses(self) -> dict[str, float]:
        """{source: token-weighted mean loss} for sources with tokens in this pass."""
        return {
            name: float(s / n)
            for name, s, n in zip(self.names, self.sums.tolist(), self.tokens.tolist(), strict=True)
            if n > 0
        }

    def token_weighted_total(self) -> float:
        """Sum of all sources' loss sums over all their tokens."""
        return float(self.sums.sum() / self.tokens.sum().clamp(min=1.0))

    def token_counts(self) -> dict[str, int]:
        """{source: unmasked tokens evaluated}."""
        return {n: int(c) for n, c in zip(self.names, self.tokens.tolist(), strict=True)}


def source_names(dataset) -> list[str] | None:
    """The prefixes of a blended dataset's sources, in `dataset_id` order; None if not a blend."""
    sources = getattr(dataset, "datasets", None)
    if not sources or len(sources) < 2:
        return None
    return [d.dataset_path for d in sources]


def format_source_lines(iteration: int, where: str, sources: SourceLosses) -> str:
    """The lines printed after Megatron's validation block: one per source, then the
    token-weighted total."""
    counts = sources.token_counts()
    lines = [
        f" validation loss at iteration {iteration}{where} | source {name} | "
        f"lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20.0, loss)):.6E} | "
        f"tokens: {counts[name]}"
        for name, loss in sources.losses().items()
    ]
    lines.append(
        f" validation loss at iteration {iteration}{where} | all sources, token-weighted | "
        f"lm loss value: {sources.token_weighted_total():.6E}"
    )
    return "\n".join(lines)
