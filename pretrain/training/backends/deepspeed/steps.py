"""One iteration and one evaluation pass on DeepSpeed's engine (PP = 1) or pipeline engine.

PP = 1: each micro-batch's loss goes through `ds.backward`; DeepSpeed accumulates and steps the
optimizer at the last micro-batch, the boundary said explicitly (its own count is off once a
batch-size schedule has changed the count). PP > 1: DeepSpeed's `train_batch` / `eval_batch` pull
the micro-batches as pipeline items (`PipelineBatches`); the last stage's `PipelineLoss` computes
the same masked mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from deepspeed.runtime.pipe.schedule import OptimizerStep

from pretrain.training.report.per_source import SourceLosses
from pretrain.training.step import dp_mean, micro_batch_loss

if TYPE_CHECKING:
    from pretrain.training.backends.deepspeed.held import Held


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


def train_step(
    engine: Held,
    batches: Iterator[dict],
    num_microbatches: int,
    use_document_ids: bool,
    device: torch.device,
    judge: Callable[[float], bool] | None = None,
) -> float:
    """`Engine.train_step` on DeepSpeed."""
    ds = engine.ds
    if engine.pipeline:
        items = PipelineBatches(batches, use_document_ids, device)
        if judge is None:
            return float(ds.train_batch(data_iter=items))
        return _judged_pipeline_batch(engine, items, judge)
    counters, losses = engine.step_counters(), []
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        ds.set_gradient_accumulation_boundary(last)
        loss = micro_batch_loss(ds, next(batches), use_document_ids, device)
        ds.backward(loss)
        losses.append(loss.detach())
        if not last:
            ds.step()  # DeepSpeed steps the optimizer at the last micro-batch only
    mean = float(dp_mean(torch.stack(losses).mean()))
    apply = judge is None or judge(mean)
    with contextlib.nullcontext() if apply else engine.withheld_update(counters):
        ds.step()
    return mean


def _judged_pipeline_batch(
    engine: Held, items: PipelineBatches, judge: Callable[[float], bool]
) -> float:
    """DeepSpeed's pipeline `train_batch`, asking `judge(loss)` on every rank at the optimizer
    step (the schedule's last instruction, after every backward) and withholding the update
    when it says False; returns the iteration's loss."""
    ds, counters = engine.ds, engine.step_counters()
    step = type(ds)._INSTRUCTION_MAP[OptimizerStep]

    def judged_step(ds_engine, **kwargs):
        if judge(_pipeline_loss(ds)):
            return step(ds_engine, **kwargs)
        with engine.withheld_update(counters):
            return step(ds_engine, **kwargs)

    ds._INSTRUCTION_MAP = {**type(ds)._INSTRUCTION_MAP, OptimizerStep: judged_step}
    try:
        return float(ds.train_batch(data_iter=items))
    finally:
        del ds._INSTRUCTION_MAP


def _pipeline_loss(ds) -> float:
    """The loss `train_batch` will return, before it returns: the last stage's micro-batch mean,
    averaged over data-parallel ranks, broadcast to the other stages (DeepSpeed's arithmetic, so
    the same value)."""
    if ds.is_last_stage():
        loss = ds._scale_loss_by_gas(ds.total_loss).clone().detach().float()
        if ds.is_data_parallel:
            torch.distributed.all_reduce(loss, group=ds.mpu.get_data_parallel_group())
            loss /= ds.dp_world_size
    else:
        loss = torch.zeros((), dtype=torch.float32, device=ds.device)
    group = ds.grid.get_pipe_parallel_group()
    torch.distributed.broadcast(loss, src=ds._loss_stage_global_rank(), group=group)
    return float(loss)


@torch.no_grad()
def evaluation_loss(
    engine: Held,
    batches: Iterator[dict],
    eval_iters: int,
    num_microbatches: int,
    use_document_ids: bool,
    device: torch.device,
    sources: SourceLosses | None = None,
) -> float:
    """`Engine.evaluation_loss` on DeepSpeed. Under the pipeline engine the per-source sums come
    from the last stage's loss function, which sees every micro-batch's per-token losses
    (`eval_batch` returns only each batch's mean)."""
    ds = engine.ds
    if engine.pipeline:
        items = PipelineBatches(batches, use_document_ids, device, dataset_ids=sources is not None)
        loss_fn = ds.module.loss_fn
        loss_fn.observer = None if sources is None else sources.add
        try:
            losses = [
                float(ds.eval_batch(data_iter=items, num_micro_batches=num_microbatches))
                for _ in range(eval_iters)
            ]
        finally:
            loss_fn.observer = None
        return sum(losses) / len(losses)
    ds.eval()
    try:
        losses = [
            micro_batch_loss(ds, next(batches), use_document_ids, device, sources)
            for _ in range(eval_iters * num_microbatches)
        ]
    finally:
        ds.train()
    return float(dp_mean(torch.stack(losses).mean()))
