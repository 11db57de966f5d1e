"""One training iteration, one evaluation, and the loop that logs, evaluates, saves and exits.

The loss of an iteration is Megatron's: each micro-batch's masked mean over its tokens, averaged
over the micro-batches of every data-parallel rank. With a fixed micro-batch size the global
batch is cut into the same micro-batches at every layout, so the loss and the gradients do not
depend on TP/PP/DP/ZeRO.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pretrain.arguments import Config
from pretrain.model.pipeline import masked_mean_loss
from pretrain.parallel import state
from pretrain.training.checkpointing import TrainState, save_checkpoint
from pretrain.training.distributed import collective_device
from pretrain.training.engine import Engine
from pretrain.training.logging import (
    IterationStats,
    ScalarWriter,
    format_eval_line,
    format_iteration_line,
    logger,
)


class PipelineBatches:
    """Loader dicts -> DeepSpeed pipeline items ((tokens, position_ids[, mask]), (labels, loss_mask))."""

    def __init__(self, batches: Iterator[dict], use_mask: bool, device: torch.device):
        self.batches, self.use_mask, self.device = batches, use_mask, device

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.batches)
        inputs = (b["tokens"], b["position_ids"]) + (
            (b["attention_mask"],) if self.use_mask else ()
        )
        return (
            tuple(t.to(self.device) for t in inputs),
            (b["labels"].to(self.device), b["loss_mask"].to(self.device)),
        )


def _micro_batch_loss(
    engine: Engine, batch: dict, use_mask: bool, device: torch.device
) -> torch.Tensor:
    per_token = engine.ds(
        batch["tokens"].to(device),
        position_ids=batch["position_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device) if use_mask else None,
        labels=batch["labels"].to(device),
    )
    return masked_mean_loss(per_token, batch["loss_mask"].to(device))


def _dp_mean(value: torch.Tensor) -> torch.Tensor:
    group = state.get_data_parallel_group()
    if state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(value, group=group)
        value /= state.get_data_parallel_world_size()
    return value


def train_step(
    engine: Engine, batches, num_microbatches: int, use_mask: bool, device: torch.device
) -> float:
    """Forward/backward over the global batch and one optimizer step; returns the iteration's loss."""
    if engine.pipeline:
        return float(engine.ds.train_batch(data_iter=batches))
    losses = []
    for _ in range(num_microbatches):
        loss = _micro_batch_loss(engine, next(batches), use_mask, device)
        engine.ds.backward(loss)
        engine.ds.step()  # DeepSpeed steps the optimizer at the last micro-batch only
        losses.append(loss.detach())
    return float(_dp_mean(torch.stack(losses).mean()))


@torch.no_grad()
def evaluate(
    engine: Engine,
    batches,
    eval_iters: int,
    num_microbatches: int,
    use_mask: bool,
    device: torch.device,
) -> float:
    losses = []
    if engine.pipeline:
        for _ in range(eval_iters):
            losses.append(float(engine.ds.eval_batch(data_iter=batches)))
        return sum(losses) / len(losses)
    engine.ds.eval()
    try:
        for _ in range(eval_iters * num_microbatches):
            losses.append(_micro_batch_loss(engine, next(batches), use_mask, device))
    finally:
        engine.ds.train()
    return float(_dp_mean(torch.stack(losses).mean()))


@dataclass
class Throughput:
    tokens_per_iteration: int
    flops_per_iteration: float
    world_size: int
    peak_tflops: float | None


def _all_ranks_agree(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def train(
    cfg: Config,
    engine: Engine,
    ts: TrainState,
    train_batches,
    valid_batches,
    writer: ScalarWriter,
    throughput: Throughput,
    use_mask: bool,
    device: torch.device,
) -> TrainState:
    t, log_cfg, ck = cfg.training, cfg.logging, cfg.checkpoint
    start = time.monotonic()
    interval_loss, interval_iters, interval_time, nan_iters = 0.0, 0, 0.0, 0
    skipped_before = engine.ds.skipped_steps
    last_saved = None
    while ts.iteration < t.train_iters:
        lr = engine.scheduler.get_lr()[0]
        t0 = time.perf_counter()
        loss = train_step(engine, train_batches, t.num_microbatches, use_mask, device)
        elapsed = time.perf_counter() - t0
        ts.iteration += 1
        ts.consumed_train_samples += t.global_batch_size
        grad_norm = engine.ds.get_global_grad_norm()
        grad_norm = None if grad_norm is None else float(grad_norm)
        loss_scale = float(getattr(engine.ds.optimizer, "cur_scale", 1.0)) if t.fp16 else 1.0
        if math.isfinite(loss):
            interval_loss += loss
        else:
            nan_iters += 1
        interval_iters += 1
        interval_time += elapsed
        tflops = throughput.flops_per_iteration / (elapsed * 1e12 * throughput.world_size)
        writer.write(
            ts.iteration,
            {
                "lm-loss": loss,
                "grad-norm": grad_norm,
                "learning-rate": lr,
                "loss-scale": loss_scale,
                "iteration-time": elapsed,
                "tokens-per-second": throughput.tokens_per_iteration / elapsed,
                "tflops-per-device": tflops,
                "consumed-samples": ts.consumed_train_samples,
            },
        )
        if ts.iteration % log_cfg.log_interval == 0:
            per_iter = interval_time / interval_iters
            tflops = throughput.flops_per_iteration / (per_iter * 1e12 * throughput.world_size)
            logger.info(
                format_iteration_line(
                    IterationStats(
                        iteration=ts.iteration,
                        train_iters=t.train_iters,
                        consumed_samples=ts.consumed_train_samples,
                        elapsed_ms=per_iter * 1000,
                        learning_rate=lr,
                        global_batch_size=t.global_batch_size,
                        lm_loss=interval_loss / max(1, interval_iters - nan_iters),
                        loss_scale=loss_scale,
                        grad_norm=grad_norm,
                        skipped_iterations=engine.ds.skipped_steps - skipped_before,
                        nan_iterations=nan_iters,
                        tokens_per_second=throughput.tokens_per_iteration / per_iter,
                        tflops_per_device=tflops,
                        mfu=None
                        if throughput.peak_tflops is None
                        else tflops / throughput.peak_tflops,
                    )
                )
            )
            interval_loss, interval_iters, interval_time, nan_iters = 0.0, 0, 0.0, 0
            skipped_before = engine.ds.skipped_steps
        if valid_batches is not None and ts.iteration % t.eval_interval == 0:
            valid_loss = evaluate(
                engine, valid_batches, t.eval_iters, t.num_microbatches, use_mask, device
            )
            ts.consumed_valid_samples += t.eval_iters * t.global_batch_size
            writer.write(
                ts.iteration,
                {"validation-loss": valid_loss, "validation-ppl": math.exp(min(20.0, valid_loss))},
            )
            logger.info(format_eval_line(ts.iteration, valid_loss))

        if ck.save and ck.save_interval and ts.iteration % ck.save_interval == 0:
            save_checkpoint(cfg, engine, ts)
            last_saved = ts.iteration
        stop = t.exit_interval is not None and ts.iteration % t.exit_interval == 0
        if t.exit_duration_in_mins is not None:
            stop = stop or _all_ranks_agree(
                (time.monotonic() - start) / 60 > t.exit_duration_in_mins
            )
        if stop:
            if ck.save and last_saved != ts.iteration:
                save_checkpoint(cfg, engine, ts)
            logger.info(
                f"exiting after iteration {ts.iteration} (--exit-interval / --exit-duration-in-mins)"
            )
            return ts
    if ck.save and last_saved != ts.iteration:
        save_checkpoint(cfg, engine, ts)
    return ts
