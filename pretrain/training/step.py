"""What every backend's iteration shares: one micro-batch's loss and the data-parallel mean.

The loss of an iteration is Megatron's: each micro-batch's masked mean over its tokens, averaged
over the micro-batches of every data-parallel rank. With a fixed micro-batch size the global
batch is cut into the same micro-batches at every layout, so the loss and the gradients do not
depend on TP/PP/DP/ZeRO or on the backend. The backends run the micro-batches
(`Engine.train_step`, `Engine.evaluation_loss`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pretrain.model.loss import masked_mean_loss
from pretrain.model.moe import losses as moe_losses
from pretrain.model.moe import metrics as moe_metrics
from pretrain.parallel import state
from pretrain.training.report.per_source import SourceLosses

if TYPE_CHECKING:
    from pretrain.training.engine import Engine


@contextlib.contextmanager
def model_iteration(
    engine: Engine, num_microbatches: int, applied: Callable[[], bool] = lambda: True
):
    """Around one training iteration (`Engine.train_step`): the MoE routers' auxiliary losses get
    the gradient scale every backend gives the loss (the fp16 loss scale over the micro-batches);
    after it, the expert biases are updated from the iteration's token counts if `applied()`
    (the step's update was made: a withheld one changes no model state)."""
    moe_losses.set_backward_scale(engine.loss_scale() / num_microbatches)
    yield
    for part in engine.model_parts():
        moe_metrics.finish_iteration(part, applied())


def moe_collector(engine: Engine, config) -> Callable[[], moe_metrics.MoEMetrics] | None:
    """For an MoE model (built from `config`): the log line's `moe_metrics.collect` over the
    engine's model parts (a collective); None for a dense one."""
    if not config.is_moe:
        return None
    parts = torch.nn.ModuleList(engine.model_parts())
    return lambda: moe_metrics.collect(parts, config)


def micro_batch_loss(
    forward: Callable[..., torch.Tensor],
    batch: dict,
    use_document_ids: bool,
    device: torch.device,
    sources: SourceLosses | None = None,
) -> torch.Tensor:
    """The masked mean loss of one loader dict through `forward` (the model's call, returning
    per-token losses [b, s] given labels); with `sources`, the per-token losses are also added
    per blend source."""
    per_token = forward(
        batch["tokens"].to(device),
        position_ids=batch["position_ids"].to(device),
        document_ids=batch["document_ids"].to(device) if use_document_ids else None,
        labels=batch["labels"].to(device),
    )
    if sources is not None:
        sources.add(per_token, batch["loss_mask"].to(device), batch["dataset_id"])
    return masked_mean_loss(per_token, batch["loss_mask"].to(device))


def dp_mean(value: torch.Tensor) -> torch.Tensor:
    """`value` averaged over the data-parallel ranks (in place)."""
    if state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(value, group=state.get_data_parallel_group())
        value /= state.get_data_parallel_world_size()
    return value
