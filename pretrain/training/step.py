"""One training iteration and one evaluation pass over the global batch.

The loss of an iteration is Megatron's: each micro-batch's masked mean over its tokens, averaged
over the micro-batches of every data-parallel rank. With a fixed micro-batch size the global
batch is cut into the same micro-batches at every layout, so the loss and the gradients do not
depend on TP/PP/DP/ZeRO.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from pretrain.model.loss import masked_mean_loss
from pretrain.model.moe import losses as moe_losses
from pretrain.model.moe import metrics as moe_metrics
from pretrain.parallel import state
from pretrain.training.per_source import SourceLosses

if TYPE_CHECKING:  # imports deepspeed, which must wait for the launch environment
    from pretrain.training.engine import Engine


class PipelineBatches:
    """Loader dicts -> DeepSpeed pipeline items ((tokens, position_ids[, document_ids]),
    (labels, loss_mask[, dataset_id])).

    `dataset_ids`: also hand the last stage each sample's blend source (a blended validation
    set's per-source sums, `PipelineLoss.observer`)."""

    def __init__(
        self,
        batches: Iterator[dict],
        use_document_ids: bool,
        device: torch.device,
        dataset_ids: bool = False,
    ):
        self.batches, self.use_document_ids, self.device = batches, use_document_ids, device
        self.dataset_ids = dataset_ids

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)
        inputs = (batch["tokens"], batch["position_ids"]) + (
            (batch["document_ids"],) if self.use_document_ids else ()
        )
        labels = (batch["labels"], batch["loss_mask"]) + (
            (batch["dataset_id"],) if self.dataset_ids else ()
        )
        return tuple(x.to(self.device) for x in inputs), tuple(x.to(self.device) for x in labels)


def _micro_batch_loss(
    engine: Engine,
    batch: dict,
    use_document_ids: bool,
    device: torch.device,
    sources: SourceLosses | None = None,
) -> torch.Tensor:
    per_token = engine.ds(
        batch["tokens"].to(device),
        position_ids=batch["position_ids"].to(device),
        document_ids=batch["document_ids"].to(device) if use_document_ids else None,
        labels=batch["labels"].to(device),
    )
    if sources is not None:
        sources.add(per_token, batch["loss_mask"].to(device), batch["dataset_id"])
    return masked_mean_loss(per_token, batch["loss_mask"].to(device))


def _dp_mean(value: torch.Tensor) -> torch.Tensor:
    if state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(value, group=state.get_data_parallel_group())
        value /= state.get_data_parallel_world_size()
    return value


def train_step(
    engine: Engine,
    batches,
    num_microbatches: int,
    use_document_ids: bool,
    device: torch.device,
    judge: Callable[[float], bool] | None = None,
) -> float:
    """Forward/backward over the global batch and one optimizer step; returns the iteration's loss.

    `judge(loss)` (called on every rank before the optimizer step) returning False withholds the
    update (`Engine.withheld_update`). MoE: the routers' auxiliary losses get the gradient scale
    DeepSpeed gives the loss, and the expert biases are updated after the iteration."""
    moe_losses.set_backward_scale(engine.loss_scale() / num_microbatches)
    loss = _train_step(engine, batches, num_microbatches, use_document_ids, device, judge)
    moe_metrics.finish_iteration(engine.ds.module)
    return loss


def _train_step(engine, batches, num_microbatches, use_document_ids, device, judge) -> float:
    if engine.pipeline:
        if judge is None:
            return float(engine.ds.train_batch(data_iter=batches))
        return engine.pipeline_train_batch(batches, judge)
    counters, losses = engine.step_counters(), []
    for i in range(num_microbatches):
        # Say where the iteration ends: DeepSpeed's own count (micro steps modulo the
        # accumulation steps) is off once a batch-size schedule has changed the count.
        last = i == num_microbatches - 1
        engine.ds.set_gradient_accumulation_boundary(last)
        loss = _micro_batch_loss(engine, next(batches), use_document_ids, device)
        engine.ds.backward(loss)
        losses.append(loss.detach())
        if not last:
            engine.ds.step()  # DeepSpeed steps the optimizer at the last micro-batch only
    mean = float(_dp_mean(torch.stack(losses).mean()))
    apply = judge is None or judge(mean)
    with contextlib.nullcontext() if apply else engine.withheld_update(counters):
        engine.ds.step()
    return mean


@torch.no_grad()
def evaluation_loss(
    engine: Engine,
    batches,
    eval_iters: int,
    num_microbatches: int,
    use_document_ids: bool,
    device: torch.device,
    sources: SourceLosses | None = None,
) -> float:
    """Mean loss over `eval_iters` global batches, without gradients or optimizer steps.

    With `sources`, each micro-batch's per-token losses are also summed per blend source (on the
    last pipeline stage, whose loss function sees them; the batches must then carry the samples'
    dataset ids, `PipelineBatches(dataset_ids=True)`); the caller reduces them."""
    if engine.pipeline:
        return _pipeline_evaluation_loss(engine, batches, eval_iters, num_microbatches, sources)
    engine.ds.eval()
    try:
        losses = [
            _micro_batch_loss(engine, next(batches), use_document_ids, device, sources)
            for _ in range(eval_iters * num_microbatches)
        ]
    finally:
        engine.ds.train()
    return float(_dp_mean(torch.stack(losses).mean()))


def _pipeline_evaluation_loss(
    engine: Engine, batches, eval_iters: int, num_microbatches: int, sources: SourceLosses | None
) -> float:
    """DeepSpeed's eval_batch returns only each batch's mean loss; the per-source sums come from
    the last stage's loss function, which sees every micro-batch's per-token losses."""
    loss_fn = engine.ds.module.loss_fn
    loss_fn.observer = None if sources is None else sources.add
    try:
        losses = [
            float(engine.ds.eval_batch(data_iter=batches, num_micro_batches=num_microbatches))
            for _ in range(eval_iters)
        ]
    finally:
        loss_fn.observer = None
    return sum(losses) / len(losses)
