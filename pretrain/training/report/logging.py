"""What a training run prints and records: Megatron's log line, the start-up banner, scalars.

Only global rank 0 logs at INFO; other ranks log warnings and errors only. The iteration line is
Megatron-LM's, field for field (`iteration N/ M | consumed samples: ... | lm loss: 1.234567E+00 |
...`), so existing log parsers keep working; our throughput fields come after Megatron's. An MoE
run adds Megatron's router losses after `lm loss` (`load_balancing_loss: ...`, `z_loss: ...`:
averages over the interval, summed over MoE layers / MoE layers) and, after the throughput,
`expert token share min/max` (the smallest and largest share of routed tokens any expert of any
layer got; ideal 1/experts) and `dropped tokens` (fraction of assignments over capacity).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pretrain.model.moe.metrics import MoEMetrics

logger = logging.getLogger("pretrain")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What a run prints and records, and how often."""

    log_interval: int = 100
    """Print Megatron's iteration line every this many iterations (--log-interval)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (--tensorboard-dir)."""
    tensorboard_log_interval: int = 1
    """Write training scalars to TensorBoard/wandb every this many iterations
    (--tensorboard-log-interval)."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project, if wandb is installed (--wandb-project)."""
    wandb_exp_name: str | None = None
    """The wandb run name (--wandb-exp-name)."""
    wandb_save_dir: str | None = None
    """The folder wandb writes its local files to; None = wandb's default (--wandb-save-dir)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per device for MFU; None = the known-GPU table (--peak-tflops)."""
    metrics_file: str | None = None
    """Append one full-precision JSON line per iteration here (--metrics-file)."""
    logging_level: int | None = None
    """Python logging level of rank 0's lines: 10 (DEBUG) also prints each per-prefix notice
    behind the data pipeline's one-line summaries; None or above 20 keeps INFO (--logging-level)."""


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """The constants that turn an iteration's seconds into tokens/s, TFLOP/s and MFU."""

    tokens_per_iteration: int
    """Global batch x sequence length."""
    flops_per_iteration: float
    """Model FLOPs of one iteration (pretrain.training.report.flops)."""
    world_size: int
    """Devices sharing the work."""
    peak_tflops: float | None
    """Peak TFLOP/s of one device; None = no MFU (e.g. on CPU)."""

    def tflops_per_device(self, seconds_per_iteration: float) -> float:
        """Achieved model TFLOP/s per device."""
        return self.flops_per_iteration / (seconds_per_iteration * 1e12 * self.world_size)

    def mfu(self, seconds_per_iteration: float) -> float | None:
        """Model FLOPs utilisation, a fraction of the peak (None without a peak)."""
        if self.peak_tflops is None:
            return None
        return self.tflops_per_device(seconds_per_iteration) / self.peak_tflops


def rank0_level(logging_level: int | None) -> int:
    """The level of rank 0's lines: INFO, or lower with --logging-level (10: DEBUG). A higher
    value keeps INFO: Megatron prints its iteration lines whatever the level, so do we."""
    return logging.INFO if logging_level is None else min(logging.INFO, logging_level)


def setup_logging(rank: int, logging_level: int | None = None) -> None:
    """INFO (or `rank0_level(logging_level)`) from global rank 0 only; warnings and errors from
    every rank; DeepSpeed quiet."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(rank0_level(logging_level) if rank == 0 else logging.WARNING)
    # DeepSpeed's own INFO chatter would interleave with our lines on every rank.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


@dataclass
class IterationStats:
    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float  # per iteration, averaged over the log interval
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    loss_scale: float
    grad_norm: float | None
    skipped_iterations: int
    nan_iterations: int
    tokens_per_second: float
    tflops_per_device: float
    mfu: float | None  # fraction of peak, None when the peak is unknown
    source_tokens: dict[str, int] | None = None  # training tokens read per data source
    moe: MoEMetrics | None = None  # an MoE model's router statistics over the interval


def format_iteration_line(s: IterationStats) -> str:
    """Megatron-LM's training log line, field for field, then our throughput fields."""
    line = f" iteration {s.iteration:8d}/{s.train_iters:8d} |"
    line += f" consumed samples: {s.consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {s.elapsed_ms:.1f} |"
    line += f" throughput per GPU (TFLOP/s/GPU): {s.tflops_per_device:.3f} |"
    line += f" learning rate: {s.learning_rate:.6E} |"
    line += f" global batch size: {s.global_batch_size:5d} |"
    line += f" lm loss: {s.lm_loss:.6E} |"
    for name, value in (s.moe.total_losses if s.moe else {}).items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {s.loss_scale:.1f} |"
    if s.grad_norm is not None:
        line += f" grad norm: {s.grad_norm:.3f} |"
    line += f" number of skipped iterations: {s.skipped_iterations:3d} |"
    line += f" number of nan iterations: {s.nan_iterations:3d} |"
    line += f" tokens per second: {s.tokens_per_second:.1f} |"
    if s.mfu is not None:
        line += f" MFU: {100 * s.mfu:.2f}% |"
    if s.moe is not None:
        line += f" expert token share min/max: {min(s.moe.min_share):.4f}/"
        line += f"{max(s.moe.max_share):.4f} |"
        line += f" dropped tokens: {s.moe.dropped_fraction:.4f} |"
    for prefix, tokens in shown_sources(s.source_tokens).items():
        line += f" {SOURCE_FIELD}{prefix}: {tokens} |"
    return line


def moe_scalars(m: MoEMetrics) -> dict[str, float]:
    """The dashboards' MoE scalars: Megatron's loss names (total) and `moe/<name>_layer_<i>` per
    MoE layer, and the token shares and dropped fraction."""
    scalars = dict(m.total_losses)
    for name, values in m.losses.items():
        scalars.update({f"moe/{name}_layer_{i}": v for i, v in enumerate(values)})
    for i, (low, high) in enumerate(zip(m.min_share, m.max_share, strict=True)):
        scalars[f"moe/min_share_layer_{i}"], scalars[f"moe/max_share_layer_{i}"] = low, high
    scalars["moe/min_share"], scalars["moe/max_share"] = min(m.min_share), max(m.max_share)
    scalars["moe/dropped_fraction"] = m.dropped_fraction
    return scalars


SOURCE_FIELD = "consumed tokens "  # iteration-line field of one data source: "consumed tokens P"
MAX_SOURCES_SHOWN = 32  # more sources: their counts are in the checkpoints' data_mixture only


def shown_sources(source_tokens: dict[str, int] | None) -> dict[str, int]:
    """The per-source token counts the log line and dashboards show: all of them for blends of
    up to MAX_SOURCES_SHOWN sources, none for larger ones (a line per iteration of thousands)."""
    if not source_tokens or len(source_tokens) > MAX_SOURCES_SHOWN:
        return {}
    return source_tokens


def format_eval_line(iteration: int, loss: float, where: str = "", suffix: str = "") -> str:
    """Megatron-LM's evaluation block: loss and perplexity between two rules one longer than
    the line; `where` is "", " on validation set" or " on test set"; `suffix` names one of
    several validation sets ("-<name>": " validation-<name> loss at ...")."""
    ppl = math.exp(min(20.0, loss))
    text = (
        f" validation{suffix} loss at iteration {iteration}{where} | lm loss value: {loss:.6E} | "
        f"lm loss PPL: {ppl:.6E} | "
    )
    bar = "-" * (len(text) + 1)
    return f"{bar}\n{text}\n{bar}"


class ScalarWriter:
    """TensorBoard (`--tensorboard-dir`), wandb (`--wandb-project`, if installed) and a JSON-lines file.

    The JSON-lines file (`--metrics-file`) holds full-precision loss, grad norm and lr per iteration,
    for scripts and tests that compare runs (the log line rounds the grad norm, as Megatron's does).
    """

    def __init__(
        self,
        rank: int,
        tensorboard_dir: str | None,
        wandb_project: str | None,
        wandb_exp_name: str | None,
        metrics_file: str | None,
        run_config: dict,
        wandb_dir: str | None = None,
    ):
        self.active = rank == 0
        self.tb = self.wandb = self.metrics = None
        if not self.active:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                logger.warning(
                    "--wandb-project given but wandb is not installed (pip install wandb); skipping"
                )
            else:
                self.wandb = wandb.init(
                    project=wandb_project, name=wandb_exp_name, config=run_config, dir=wandb_dir
                )
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.metrics = open(metrics_file, "a", buffering=1)

    def write(self, step: int, scalars: dict[str, float], *, dashboards: bool = True) -> None:
        """Record `scalars` at `step` in the metrics file, and in TensorBoard/wandb if
        `dashboards` (the caller's --tensorboard-log-interval decision)."""
        if not self.active:
            return
        if self.metrics is not None:
            self.metrics.write(json.dumps({"iteration": step, **scalars}) + "\n")
        if not dashboards:
            return
        if self.tb is not None:
            for key, value in scalars.items():
                if value is not None:
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in scalars.items() if v is not None}, step=step)

    def close(self) -> None:
        """Flush and close every sink."""
        if self.tb is not None:
            self.tb.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.wandb is not None:
            self.wandb.finish()


def banner(
    *,
    tp: int,
    pp: int,
    dp: int,
    sharding: str,
    world: int,
    launcher: str,
    backend: str,
    device: str,
    params_total: int,
    tokens_per_iteration: int,
    global_batch: int,
    micro_batch: int,
    num_microbatches: int,
    precision: str,
    save: str | None,
    load: str | None,
    flops_per_iteration: float,
    threads: int,
    offload: str | None = None,
    pipeline: str | None = None,
) -> str:
    """The start-up summary: ranks, layout (`sharding`: "ZeRO-<stage>" or "FSDP2"), the pipeline
    schedule (`pipeline`, a line at PP > 1), parameters, batch, FLOPs, checkpoint folders, and
    what is offloaded (`offload`, a line only when something is)."""
    lines = [
        "=" * 78,
        f" pretrain_gpt.py  |  {world} rank(s) via {launcher}, backend {backend}, device {device}, "
        f"{threads} thread(s)/rank",
        f" layout           |  TP={tp}  PP={pp}  DP={dp}  {sharding}  ({precision})",
        *([f" pipeline         |  {pipeline}"] if pipeline else []),
        *([f" offload          |  {offload}"] if offload else []),
        f" parameters       |  {params_total:,} ({params_total / 1e6:.2f} M)",
        f" batch            |  global {global_batch} = micro {micro_batch} x {num_microbatches} micro-batches "
        f"x DP {dp}; {tokens_per_iteration:,} tokens/iteration",
        f" FLOPs/iteration  |  {flops_per_iteration:.4g} (Megatron formula, docs/TRAINING.md)",
        f" checkpoints      |  save: {save or '(none)'}  load: {load or '(none)'}",
        "=" * 78,
    ]
    return "\n".join(lines)


class MetricsLogger:
    """Owns the log-interval bookkeeping: records every iteration's scalars, prints Megatron's
    iteration line every `log_interval` iterations (averages over the interval) and the
    validation block after each evaluation."""

    def __init__(
        self,
        config: LoggingConfig,
        writer: ScalarWriter,
        throughput: Throughput,
        *,
        train_iters: int,
        global_batch_size: int,
        skipped_steps_at_start: int,
        moe: Callable[[], MoEMetrics] | None = None,
    ):
        """`moe`: an MoE model's `pretrain.model.moe.metrics.collect` (a collective: every rank
        records every iteration, so every rank calls it at the same log iterations)."""
        self.config, self.writer, self.throughput = config, writer, throughput
        self.moe = moe
        self.train_iters, self.global_batch_size = train_iters, global_batch_size
        self._skipped_before = skipped_steps_at_start
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._loss_sum, self._iterations, self._seconds, self._nan_iterations = 0.0, 0, 0.0, 0
        self._batch_scale = 0.0  # sum over the interval of (iteration's batch / global batch)

    def _interval_loss(self) -> float:
        """The mean finite loss of the interval; NaN when no iteration of it was finite (what
        Megatron prints then, `lm loss: NAN`), never a number."""
        finite = self._iterations - self._nan_iterations
        return self._loss_sum / finite if finite else math.nan

    def record_iteration(
        self,
        *,
        iteration: int,
        consumed_samples: int,
        loss: float,
        seconds: float,
        learning_rate: float,
        grad_norm: float | None,
        loss_scale: float,
        skipped_steps: int,
        global_batch_size: int | None = None,
        source_tokens: dict[str, int] | None = None,
    ) -> None:
        """Account one finished iteration; print the interval's line when it is due.

        `global_batch_size` is the iteration's batch when a batch-size schedule varies it
        (default: the run's global batch); throughput scales with it. `source_tokens`: the
        training tokens read so far per data source (`consumed-tokens/<prefix>` scalars and
        `consumed tokens <prefix>` fields, up to MAX_SOURCES_SHOWN sources)."""
        batch = self.global_batch_size if global_batch_size is None else global_batch_size
        scale = batch / self.global_batch_size
        self._accumulate(loss, seconds, scale)
        scalars = {
            "lm-loss": loss,
            "grad-norm": grad_norm,
            "learning-rate": learning_rate,
            "loss-scale": loss_scale,
            "iteration-time": seconds,
            "tokens-per-second": self.throughput.tokens_per_iteration * scale / seconds,
            "tflops-per-device": self.throughput.tflops_per_device(seconds / scale),
            "consumed-samples": consumed_samples,
            "global-batch-size": batch,
        }
        for prefix, tokens in shown_sources(source_tokens).items():
            scalars[f"consumed-tokens/{prefix}"] = tokens
        log_line = iteration % self.config.log_interval == 0
        moe = self.moe() if log_line and self.moe is not None else None
        if moe is not None:
            scalars.update(moe_scalars(moe))
        dashboards = iteration % self.config.tensorboard_log_interval == 0
        self.writer.write(iteration, scalars, dashboards=dashboards or moe is not None)
        if log_line:
            self._log_interval(
                iteration=iteration,
                consumed_samples=consumed_samples,
                learning_rate=learning_rate,
                global_batch_size=batch,
                loss_scale=loss_scale,
                grad_norm=grad_norm,
                skipped_steps=skipped_steps,
                source_tokens=source_tokens,
                moe=moe,
            )

    def _accumulate(self, loss: float, seconds: float, scale: float) -> None:
        """Add one iteration to the interval's sums (a non-finite loss is counted, not summed);
        `scale`: its batch over the run's global batch."""
        self._batch_scale += scale
        if math.isfinite(loss):
            self._loss_sum += loss
        else:
            self._nan_iterations += 1
        self._iterations += 1
        self._seconds += seconds

    def _log_interval(
        self,
        *,
        iteration: int,
        consumed_samples: int,
        learning_rate: float,
        global_batch_size: int,
        loss_scale: float,
        grad_norm: float | None,
        skipped_steps: int,
        source_tokens: dict[str, int] | None,
        moe: MoEMetrics | None,
    ) -> None:
        """Print the interval's Megatron line (its means and throughput) and start the next."""
        per_iteration = self._seconds / self._iterations
        # seconds per iteration of the run's global batch: throughput over batches that vary
        per_full_batch = self._seconds / self._batch_scale
        stats = IterationStats(
            iteration=iteration,
            train_iters=self.train_iters,
            consumed_samples=consumed_samples,
            elapsed_ms=per_iteration * 1000,
            learning_rate=learning_rate,
            global_batch_size=global_batch_size,
            lm_loss=self._interval_loss(),
            loss_scale=loss_scale,
            grad_norm=grad_norm,
            skipped_iterations=skipped_steps - self._skipped_before,
            nan_iterations=self._nan_iterations,
            tokens_per_second=self.throughput.tokens_per_iteration / per_full_batch,
            tflops_per_device=self.throughput.tflops_per_device(per_full_batch),
            mfu=self.throughput.mfu(per_full_batch),
            source_tokens=source_tokens,
            moe=moe,
        )
        logger.info(format_iteration_line(stats))
        self._skipped_before = skipped_steps
        self._reset_interval()

    def log_validation(
        self,
        iteration: int,
        loss: float,
        where: str = "",
        split: str = "validation",
        suffix: str = "",
    ) -> None:
        """Record and print one evaluation's loss and perplexity (`split`: validation or test;
        `suffix`: "-<name>" of one of several validation sets, in the scalars'
        `validation-<name>-loss` and the line)."""
        self.writer.write(
            iteration,
            {f"{split}{suffix}-loss": loss, f"{split}{suffix}-ppl": math.exp(min(20.0, loss))},
        )
        logger.info(format_eval_line(iteration, loss, where, suffix))

    def log_validation_sources(self, iteration: int, sources, where: str = "") -> None:
        """After Megatron's validation block: each blend source's token-weighted loss
        (`validation-loss/<prefix>` scalars) and the token-weighted total over all sources."""
        from pretrain.training.report.per_source import format_source_lines

        scalars = {f"validation-loss/{name}": v for name, v in sources.losses().items()}
        scalars["validation-loss/token-weighted"] = sources.token_weighted_total()
        self.writer.write(iteration, scalars)
        logger.info(format_source_lines(iteration, where, sources))
