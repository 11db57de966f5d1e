"""`pretrain(config)`: process group -> engine -> checkpoint -> data -> loop -> final save.

`RunConfig` (`run_config.py`) bundles every component's config for one run; this module is the
only one that sees all of them, and hands each component the part it needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from typing import TYPE_CHECKING

import torch

from pretrain.checkpoint.integrity import Choice
from pretrain.data.checks import data_fingerprints, tokens_seen
from pretrain.errors import UserError
from pretrain.parallel import state
from pretrain.parallel.config import ParallelConfig
from pretrain.training.checkpoints.checkpointing import Checkpointer
from pretrain.training.checkpoints.resume import (
    check_before_launch,
    load_checkpoint,
    restore_rng_state,
)
from pretrain.training.checkpoints.resume_changes import check_tokenizer, data_changes
from pretrain.training.checkpoints.save_lock import hold_save_lock
from pretrain.training.data_feed import data_iterators, rank_batches
from pretrain.training.distributed import (
    choose_backend,
    exit_with_launcher,
    init_distributed,
    prepare_process_environment,
)
from pretrain.training.loop.exit_signal import ExitSignal
from pretrain.training.loop.loop import TrainingConfig, train
from pretrain.training.loop.spikes import checkpoint_rewinder
from pretrain.training.rank_agreement import check_ranks_agree
from pretrain.training.report.evaluator import Evaluator
from pretrain.training.report.flops import flops_per_iteration, peak_tflops_per_device
from pretrain.training.report.logging import (
    MetricsLogger,
    ScalarWriter,
    Throughput,
    banner,
    logger,
    setup_logging,
)
from pretrain.training.run_config import Prepared, RunConfig
from pretrain.training.state import TrainState
from pretrain.training.step import moe_collector

if TYPE_CHECKING:
    from pretrain.training.engine import Engine


def _prepared(cfg: RunConfig) -> Prepared:
    """`cfg.prepared` if made for `cfg`'s tokenizer and data (a config replaced since gets its
    own), else a new one."""
    p = cfg.prepared
    if p is not None and p.tokenizer_config == cfg.tokenizer and p.data_config == cfg.data:
        return p
    return Prepared.build(cfg.tokenizer, cfg.data)


def _run_record(cfg: RunConfig, prepared: Prepared) -> dict:
    """How the run was configured, for checkpoint metadata (everything but model and layout)."""
    files = prepared.files
    return {
        "tokenizer_fingerprint": prepared.tokenizer_fingerprint,
        "data": dataclasses.asdict(cfg.data),
        "training": dataclasses.asdict(cfg.training),
        "schedule": dataclasses.asdict(cfg.schedule),
        "optimizer": dataclasses.asdict(cfg.optimizer),
        "precision": dataclasses.asdict(cfg.precision),
        "evaluation": dataclasses.asdict(cfg.evaluation),
        "argv": list(cfg.argv),
        "data_fingerprints": data_fingerprints(cfg.data, files),
    }


def _tokens_seen_counter(cfg: RunConfig, train_dataset):
    """consumed samples -> {prefix: tokens trained on}, recorded in checkpoints (and model
    cards); only for Megatron's sequential sampler, whose order the blend index gives."""
    if cfg.data.dataloader_type != "single":
        return None
    return functools.partial(tokens_seen, train_dataset, seq_length=cfg.training.seq_length)


def _start_batch_schedule(t: TrainingConfig, consumed: int) -> None:
    """Check the batches still to come against this run's DP size (a resume may change it) and
    say where in the schedule the run starts."""
    schedule = t.batch_schedule
    samples = t.train_samples if t.train_samples is not None else consumed
    schedule.check_divisible(consumed, samples)
    kind = "ramp-up" if schedule.rampup is not None else "step schedule"
    logger.info(
        f"batch-size {kind}: global batch {schedule.global_batch_size_at(consumed)} at "
        f"{consumed} consumed samples, {schedule.global_batch_size} at the end "
        f"({t.train_iters} iterations for {t.train_samples} samples)"
    )


def _resume_notes(cfg: RunConfig, meta: dict, record: dict) -> list[str]:
    """Refuse a checkpoint trained with another tokenizer; the lines saying what else this run
    changes (another tokenizer allowed by --allow-tokenizer-mismatch, other data). `record`:
    this run's `_run_record` (its tokenizer and data fingerprints)."""
    load = cfg.checkpoint.load
    given = record["tokenizer_fingerprint"]
    notes = [check_tokenizer(meta, given, cfg.data.allow_tokenizer_mismatch, load)]
    if not cfg.checkpoint.finetune:  # --finetune restarts the data at 0 anyway
        notes.append(data_changes(meta, cfg.data, record["data_fingerprints"], load))
    return [n for n in notes if n]


def _pipeline_line(par: ParallelConfig) -> str | None:
    """The banner's pipeline line: the schedule and model chunks per rank (None at PP 1)."""
    if par.pipeline_model_parallel_size == 1:
        return None
    chunks = par.virtual_pipeline_stages
    return f"{par.pipeline_schedule}, {chunks} model chunk{'s' if chunks > 1 else ''} per rank"


def pretrain(cfg: RunConfig) -> TrainState:
    """Run one training job as configured; returns where it stopped."""
    choice = (
        check_before_launch(cfg.checkpoint, cfg.model, cfg.parallel, cfg.precision.name)
        if cfg.checkpoint.load
        else None
    )
    t = cfg.training
    exit_signal = ExitSignal(t.exit_signal) if t.exit_signal_handler else None
    prepared = _prepared(cfg)
    record = _run_record(cfg, prepared)  # fingerprints hash files: once, for the notes and saves
    notes = [] if choice is None else _resume_notes(cfg, choice.meta, record)
    exit_with_launcher(cfg.launch.rank, exit_signal.count if exit_signal is not None else None)
    prepare_process_environment(cfg.launch)
    setup_logging(cfg.launch.rank, cfg.logging.logging_level)
    if choice is not None and choice.note:
        logger.warning(f"WARNING: --load {cfg.checkpoint.load}: {choice.note}")
    for note in notes:  # rank 0: one line each
        logger.info(note)
    backend = choose_backend(cfg.parallel.distributed_backend)
    owns_process_group = not torch.distributed.is_initialized()
    device = init_distributed(cfg.launch, backend, cfg.parallel.distributed_timeout_minutes)
    try:
        check_ranks_agree(cfg.launch, cfg.argv, record["data_fingerprints"])
        save_lock = hold_save_lock(cfg.checkpoint.save)  # every rank: a refusal before any write
        try:
            return _train(
                cfg, choice, prepared, record, backend, owns_process_group, device, exit_signal
            )
        finally:
            if save_lock is not None:
                save_lock.release()
    except UserError:  # raised on every rank alike (the ranks agree first)
        if owns_process_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # a live gloo group can abort the exit
        raise


def _train(
    cfg: RunConfig,
    choice: Choice | None,
    prepared: Prepared,
    record: dict,
    backend: str,
    owns_process_group: bool,
    device: torch.device,
    exit_signal: ExitSignal | None,
) -> TrainState:
    """`pretrain` after the process group exists and --save is locked."""
    _quiet_deepspeed_startup()
    engine = _build_engine(cfg, backend)
    train_state, rng = (
        load_checkpoint(cfg.checkpoint, engine, choice, cfg.parallel)
        if cfg.checkpoint.load
        else (TrainState(), None)
    )
    train_batches, valid_sets, test_batches, train_dataset, mixture = data_iterators(
        data=cfg.data,
        training=cfg.training,
        evaluation=cfg.evaluation,
        tokenizer=prepared.tokenizer,
        files=prepared.files,
        train_state=train_state,
    )
    if rng is not None:  # last: creating the loaders above draws from the torch generator
        restore_rng_state(rng)
    t = cfg.training
    if t.batch_schedule is not None:
        _start_batch_schedule(t, train_state.consumed_train_samples)
    flops = flops_per_iteration(cfg.model, t.global_batch_size, engine.padded_vocab_size)
    logger.info(_banner(cfg, engine, backend, device, flops))
    if train_state.iteration >= t.train_iters:
        logger.info(_nothing_to_do(train_state, t))
    writer = _scalar_writer(cfg)
    metrics = _metrics_logger(cfg, engine, writer, flops)
    evaluator = _evaluator(cfg, valid_sets, test_batches, device, metrics)
    checkpointer = _checkpointer(cfg, record, train_dataset)
    train_batches_again = functools.partial(
        rank_batches, cfg.data, t.micro_batch_size, train_dataset
    )
    try:
        with exit_signal or contextlib.nullcontext():
            completed = train(
                t,
                engine,
                train_state,
                train_batches,
                metrics=metrics,
                evaluator=evaluator,
                checkpointer=checkpointer,
                use_document_ids=_uses_document_ids(cfg),
                device=device,
                exit_signal=exit_signal,
                mixture=mixture,
                rewinder=checkpoint_rewinder(
                    cfg.checkpoint, cfg.model, cfg.parallel, engine, train_batches_again
                ),
            )
        if completed:
            evaluator.evaluate_at_end(engine, train_state)
    finally:
        writer.close()
    _finish(cfg, engine, train_state, owns_process_group)
    return train_state


def _nothing_to_do(train_state: TrainState, t: TrainingConfig) -> str:
    """The line for a checkpoint already at or past --train-iters (a requeued finished run)."""
    return (
        f"checkpoint is at iteration {train_state.iteration} >= --train-iters "
        f"{t.train_iters}: nothing to do (and nothing saved)"
    )


def _checkpointer(cfg: RunConfig, record: dict, train_dataset) -> Checkpointer:
    """The run's `Checkpointer`: what it saves beside the backend's files (`record`: the run's
    `_run_record`) and the tokens seen per source."""
    return Checkpointer(
        cfg.checkpoint,
        model=cfg.model,
        parallel=cfg.parallel,
        tokenizer=cfg.tokenizer.record(),
        run_record=record,
        tokens_seen=_tokens_seen_counter(cfg, train_dataset),
    )


def _quiet_deepspeed_startup() -> None:
    """Silence two harmless warnings DeepSpeed causes at start-up."""
    # DeepSpeed broadcasts the tied embedding through autograd once at start-up; harmless.
    warnings.filterwarnings(
        "ignore", message="c10d::broadcast_: an autograd kernel was not registered"
    )
    # DeepSpeed's pipeline engine partitions activations with a torch collective torch has renamed.
    warnings.filterwarnings(
        "ignore", message=".*all_gather_into_tensor` is deprecated", category=FutureWarning
    )


def _build_engine(cfg: RunConfig, backend: str) -> Engine:
    """The run's engine, of the backend its `ParallelConfig` names."""
    # DeepSpeed picks its accelerator when first imported: only after the environment is set.
    from pretrain.training.backends.factory import build_engine

    par, t = cfg.parallel, cfg.training
    return build_engine(
        model_config=cfg.model,
        parallel=par,
        optimizer_config=cfg.optimizer,
        schedule=cfg.schedule,
        precision=cfg.precision,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        num_microbatches=t.num_microbatches,
        seed=t.seed,
        backend=backend,
        timeout_minutes=par.distributed_timeout_minutes,
        user_json=cfg.deepspeed_json,
    )


def _uses_document_ids(cfg: RunConfig) -> bool:
    """Causal attention needs no input; document ids (O(S) per sample) only when documents are
    kept apart (--reset-attention-mask)."""
    return cfg.data.reset_attention_mask


def _banner(cfg: RunConfig, engine: Engine, backend: str, device: torch.device, flops) -> str:
    """The start-up banner: layout, batch, precision, checkpoints, FLOPs, offload, pipeline."""
    par, t = cfg.parallel, cfg.training
    return banner(
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        dp=par.data_parallel_size,
        sharding="FSDP2" if par.backend == "torch" else f"ZeRO-{par.zero_stage}",
        world=par.world_size,
        launcher=cfg.launch.launcher,
        backend=backend,
        device=str(device),
        params_total=engine.params_total,
        tokens_per_iteration=t.global_batch_size * t.seq_length,
        global_batch=t.global_batch_size,
        micro_batch=t.micro_batch_size,
        num_microbatches=t.num_microbatches,
        precision=cfg.precision.name,
        save=cfg.checkpoint.save,
        load=cfg.checkpoint.load,
        flops_per_iteration=flops,
        threads=torch.get_num_threads(),
        offload=engine.offload,
        pipeline=_pipeline_line(par),
    )


def _scalar_writer(cfg: RunConfig) -> ScalarWriter:
    """Where the scalars go: TensorBoard, W&B, the metrics file (rank 0)."""
    log = cfg.logging
    return ScalarWriter(
        cfg.launch.rank,
        log.tensorboard_dir,
        log.wandb_project,
        log.wandb_exp_name,
        log.metrics_file,
        {"argv": list(cfg.argv)},
        wandb_dir=log.wandb_save_dir,
    )


def _metrics_logger(cfg: RunConfig, engine: Engine, writer: ScalarWriter, flops) -> MetricsLogger:
    """The loop's metrics: Megatron's line, throughput against the peak, MoE figures."""
    t = cfg.training
    return MetricsLogger(
        cfg.logging,
        writer,
        Throughput(
            tokens_per_iteration=t.global_batch_size * t.seq_length,
            flops_per_iteration=flops,
            world_size=cfg.parallel.world_size,
            peak_tflops=peak_tflops_per_device(cfg.logging.peak_tflops),
        ),
        train_iters=t.train_iters,
        global_batch_size=t.global_batch_size,
        skipped_steps_at_start=engine.skipped_steps,
        moe=moe_collector(engine, cfg.model),
    )


def _evaluator(
    cfg: RunConfig, valid_sets, test_batches, device: torch.device, metrics: MetricsLogger
) -> Evaluator:
    """The evaluator over the run's validation sets and test batches."""
    t, data = cfg.training, cfg.data
    evaluator = Evaluator(
        cfg.evaluation,
        valid_sets,
        test_batches,
        global_batch_size=t.global_batch_size,
        num_microbatches=t.num_microbatches,
        use_document_ids=_uses_document_ids(cfg),
        device=device,
        metrics=metrics,
    )
    evaluator.note_missing_data(
        f"--split {data.split}" if data.blend is not None else "the per-split data paths"
    )
    return evaluator


def _finish(
    cfg: RunConfig, engine: Engine, train_state: TrainState, owns_process_group: bool
) -> None:
    """Tear down the engine and the groups together, then say where the run stopped."""
    torch.distributed.barrier()
    engine.destroy()
    state.destroy_model_parallel()
    if owns_process_group:  # a caller that brought its own group may run again in this process
        torch.distributed.destroy_process_group()
    logger.info(
        f"done: {train_state.iteration} iterations, {train_state.consumed_train_samples} samples"
        + (
            f"; checkpoints in {os.path.abspath(cfg.checkpoint.save)}"
            if cfg.checkpoint.save
            else ""
        )
    )
