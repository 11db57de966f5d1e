"""What MoE layers report per iteration, and their once-per-iteration expert-bias update.

Each router keeps a `RouterStats` for the current iteration (training forwards only): its
auxiliary losses divided by their coefficients (Megatron's logged values: `load_balancing_loss`,
`seq_load_balancing_loss`, `global_load_balancing_loss`, `z_loss`), the tokens routed to each
expert and the (token, expert) assignments dropped over capacity, padding excluded.

`collect(model, config)` turns them into one `MoEMetrics` on every rank (averaged over the
micro-batches since the last call: call it at every log line) and starts over; it is collective
(all ranks call it together, like the log line's own reductions). `finish_iteration(model)`
updates the expert biases from the iteration's token counts summed over the pipeline stage's
TP x DP ranks (so the update is the global batch's, at any DP size) and resets the
global-aux-loss counts; the training step calls it once per iteration, after the last backward
(Megatron does it in finalize_model_grads); an iteration whose update is withheld (a loss spike,
`pretrain.training.loop.spikes`) leaves the biases as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.parallel import state
from pretrain.parallel.token_exchange import all_reduce


class RouterStats:
    """One router's accumulators since the last `collect`, on the router's device (no host
    synchronisation per micro-batch)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.losses: dict[str, torch.Tensor] = {}
        self.micro_batches: dict[str, int] = {}
        self.tokens_per_expert: torch.Tensor | float = 0.0
        self.dropped: torch.Tensor | float = 0.0

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        """One micro-batch's loss (divided by its coefficient)."""
        self.losses[name] = self.losses.get(name, 0.0) + value.detach().double()
        self.micro_batches[name] = self.micro_batches.get(name, 0) + 1

    def add_routing(self, tokens_per_expert: torch.Tensor, dropped: torch.Tensor) -> None:
        """One micro-batch's routed tokens per expert and dropped assignments."""
        self.tokens_per_expert = self.tokens_per_expert + tokens_per_expert.double()
        self.dropped = self.dropped + dropped.double()


@dataclass(frozen=True, kw_only=True)
class MoEMetrics:
    """One iteration's MoE statistics, the same on every rank. Per-layer tuples are indexed by
    MoE layer (the model's MoE layers in order)."""

    losses: dict[str, tuple[float, ...]]
    """Loss name -> per MoE layer, the mean over micro-batches of the loss / its coefficient
    (summed over the TP ranks that share a sequence, averaged over DP)."""
    total_losses: dict[str, float]
    """Loss name -> sum over MoE layers / number of MoE layers (Megatron's logged value, e.g.
    `load_balancing_loss`)."""
    min_share: tuple[float, ...]
    """Per MoE layer, the smallest share of routed tokens any expert got (ideal 1 / experts)."""
    max_share: tuple[float, ...]
    """Per MoE layer, the largest share of routed tokens any expert got."""
    dropped_fraction: float
    """Dropped (token, expert) assignments / routed ones, over every MoE layer."""


def routers(model: torch.nn.Module) -> list:
    """This stage's MoE routers in layer order (modules with a `RouterStats`)."""
    return [m for m in model.modules() if isinstance(getattr(m, "stats", None), RouterStats)]


LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
"""--moe-router-load-balancing-type -> the name its loss is logged under (Megatron's)."""


def loss_names(config) -> list[str]:
    """The losses a model's routers report (the same on every pipeline stage)."""
    names = []
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type in LOSS_NAMES:
        names.append(LOSS_NAMES[config.moe_router_load_balancing_type])
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def _divisor(name: str) -> int:
    """After summing `name` over the stage's TP x DP ranks: what to divide by to get Megatron's
    value (partial losses add up over the ranks that share their scope, the rest is averaged):
    the micro-batch and sequence losses are split over TP, the global one over the stage."""
    tp, dp = state.get_tensor_model_parallel_world_size(), state.get_data_parallel_world_size()
    if name == LOSS_NAMES["global_aux_loss"]:
        return 1
    return dp if name in LOSS_NAMES.values() else tp * dp


def collect(model: torch.nn.Module, config) -> MoEMetrics:
    """This iteration's `MoEMetrics` from `model` (this stage's part of a model built from
    `config`), the same on every rank; starts the next iteration's statistics. Collective over
    the world (every rank calls it at the same point)."""
    names = loss_names(config)
    moe_index = {
        layer: i for i, layer in enumerate(i for i, m in enumerate(config.moe_layers) if m)
    }
    count = len(moe_index)
    losses = torch.zeros(len(names), count, dtype=torch.float64)
    tokens = torch.zeros(count, config.num_moe_experts, dtype=torch.float64)
    dropped = torch.zeros(1, dtype=torch.float64)
    for router in routers(model):
        layer, stats = moe_index[router.layer_number], router.stats
        for i, name in enumerate(names):
            if name in stats.losses:
                losses[i, layer] = stats.losses[name].item() / stats.micro_batches[name]
        tokens[layer] = torch.as_tensor(stats.tokens_per_expert).cpu()
        dropped += torch.as_tensor(stats.dropped).cpu()
        stats.reset()
    flat = all_reduce(
        torch.cat([losses.flatten(), tokens.flatten(), dropped]),
        state.get_tensor_and_data_parallel_group(),
    )
    flat = all_reduce(flat, state.get_pipeline_model_parallel_group())
    losses = flat[: losses.numel()].view_as(losses)
    tokens = flat[losses.numel() : -1].view_as(tokens)
    for i, name in enumerate(names):
        losses[i] /= _divisor(name)
    share = tokens / tokens.sum(-1, keepdim=True).clamp(min=1)
    return MoEMetrics(
        losses={name: tuple(losses[i].tolist()) for i, name in enumerate(names)},
        total_losses={name: losses[i].sum().item() / count for i, name in enumerate(names)},
        min_share=tuple(share.min(-1).values.tolist()),
        max_share=tuple(share.max(-1).values.tolist()),
        dropped_fraction=flat[-1].item() / max(tokens.sum().item(), 1.0),
    )


@torch.no_grad()
def finish_iteration(model: torch.nn.Module, applied: bool = True) -> None:
    """After an iteration's backward: if `applied` (its update was made; the same on every rank)
    update every expert bias from the iteration's kept tokens per expert summed over the stage's
    TP x DP ranks (bias += rate x sign(mean count - count), DeepSeek-V3's rule, Megatron's); zero
    the counts, reset the global-aux-loss counts."""
    local = routers(model)
    biased = [r for r in local if r.expert_bias is not None]
    if biased and applied:
        counts = torch.stack([r.local_tokens_per_expert for r in biased])
        counts = all_reduce(counts, state.get_tensor_and_data_parallel_group())
        offset = counts.mean(dim=-1, keepdim=True) - counts
        steps = torch.sign(offset) * biased[0].config.moe_router_bias_update_rate
        for router, step in zip(biased, steps, strict=True):
            router.expert_bias += step
    for router in biased:
        router.local_tokens_per_expert.zero_()
    for router in local:
        router.finish_iteration()
