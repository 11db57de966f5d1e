"""One iteration and one evaluation pass on the torch backend.

PP > 1: the engine's pipeline schedule runs the micro-batches (`pipeline.Pipeline`), which divides
the gradients by the micro-batch count after the backward passes, so the MoE routers' auxiliary
losses start their backward at 1 (`losses.set_backward_scale`; `step.model_iteration` set 1 / m,
right where the loss itself is divided before backward, as at PP = 1). PP = 1:
each micro-batch's loss, divided by the number of micro-batches, goes backward; FSDP2 keeps the
gradients unsharded and local while they accumulate (`set_requires_gradient_sync(False)`) and
reduce-scatters them, averaged over the data-parallel ranks, in the last micro-batch's backward.
The gradient is then the mean over micro-batches and data-parallel ranks, as DeepSpeed's. The
optimizer (`ClippedAdamW`: the true global norm over DTensor shards and TP) steps unless the
judge withholds the update, then the LR schedule advances by the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from pretrain.model.moe import losses as moe_losses
from pretrain.training.backends.torch.fsdp import reshard
from pretrain.training.report.per_source import SourceLosses
from pretrain.training.step import dp_mean, micro_batch_loss

if TYPE_CHECKING:
    from pretrain.training.backends.torch.held import Held


def train_step(
    engine: Held,
    batches: Iterator[dict],
    num_microbatches: int,
    use_document_ids: bool,
    device: torch.device,
    judge: Callable[[float], bool] | None = None,
) -> float:
    """`Engine.train_step` on the torch backend."""
    if engine.pipe is not None:
        # the schedule back-propagates each micro-batch's loss unscaled and divides every
        # gradient by the micro-batch count afterwards: the MoE aux losses start at 1 likewise
        moe_losses.set_backward_scale(engine.loss_scale())
        micro_batches = [next(batches) for _ in range(num_microbatches)]
        mean = float(engine.pipe.train(micro_batches, use_document_ids))
    else:
        mean = _accumulate(engine.model, batches, num_microbatches, use_document_ids, device)
    if judge is None or judge(mean):
        engine.optimizer.step()
        engine.scheduler.step()
    engine.optimizer.zero_grad(set_to_none=True)
    return mean


def _accumulate(
    model: torch.nn.Module,
    batches: Iterator[dict],
    num_microbatches: int,
    use_document_ids: bool,
    device: torch.device,
) -> float:
    """Forward/backward of each micro-batch (PP = 1); the iteration's loss."""
    losses = []
    for i in range(num_microbatches):
        model.set_requires_gradient_sync(i == num_microbatches - 1)
        loss = micro_batch_loss(model, next(batches), use_document_ids, device)
        (loss / num_microbatches).backward()
        losses.append(loss.detach())
    return float(dp_mean(torch.stack(losses).mean()))


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
    """`Engine.evaluation_loss` on the torch backend."""
    model, pipe = engine.model, engine.pipe
    model.eval()
    try:
        if pipe is not None:  # each pass already averaged over micro-batches and DP
            passes = [
                pipe.evaluate(
                    [next(batches) for _ in range(num_microbatches)], use_document_ids, sources
                )
                for _ in range(eval_iters)
            ]
            return float(torch.stack(passes).mean())
        losses = [
            micro_batch_loss(model, next(batches), use_document_ids, device, sources)
            for _ in range(eval_iters * num_microbatches)
        ]
    finally:
        model.train()
        reshard(model)  # the sharded parameters are what checkpoints and the optimizer hold
    return float(dp_mean(torch.stack(losses).mean()))
