"""`parse_args(argv)`: Megatron-LM flags (and the launcher's environment) -> a validated `RunConfig`.

The only place that sees the whole command line: it refuses removed flags, parses with the
`FLAGS` table, resolves the values several flags make together (`pretrain.cli.resolve`) and runs
every check before launch, in a fixed order, so the first problem is reported in one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

import torch

from pretrain.cli.accelerate_env import check_accelerate_env
from pretrain.cli.checkpoint_args import fill_from_checkpoint, force_from_checkpoint, saved_model
from pretrain.cli.flags import DEPRECATED_FLAGS, build_parser, section_values
from pretrain.cli.refused import refuse_unsupported
from pretrain.cli.resolve import (
    batch_schedule,
    check_data_files,
    check_data_splits,
    check_flag_bounds,
    check_moe_training,
    lr_schedule,
    model_config,
    precision_config,
)
from pretrain.cli.script_flags import check_position_embedding, check_script_flags
from pretrain.data.checks import check_data
from pretrain.data.config import DataConfig
from pretrain.errors import UserError
from pretrain.launch import detect_launch_env
from pretrain.parallel.config import ParallelConfig, check_world_divisible
from pretrain.tokenizer import TokenizerConfig, build_tokenizer
from pretrain.training.backends.deepspeed.config import (
    check_user_config,
    json_batch_sizes,
    load_user_config,
)
from pretrain.training.backends.deepspeed.offload import check_nvme_checkpoints, resolve_offload
from pretrain.training.backends.torch.flags import check_deepspeed_only, resolve_torch_flags
from pretrain.training.backends.torch.pipeline_flags import resolve_pipeline_flags
from pretrain.training.checkpoints import scheduler_resume
from pretrain.training.checkpoints.checkpointing import CheckpointConfig
from pretrain.training.loop.loop import TrainingConfig
from pretrain.training.loop.manual_gc import ManualGCConfig
from pretrain.training.loop.spikes import SpikeConfig
from pretrain.training.report.evaluator import EvalConfig
from pretrain.training.report.logging import LoggingConfig
from pretrain.training.report.validation_sets import check_validation_sets
from pretrain.training.run_config import Prepared, RunConfig
from pretrain.training.schedules.optimizer import OptimizerConfig


def _refuse_deprecated(argv: Sequence[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in DEPRECATED_FLAGS:
            raise UserError(
                f"{flag} was removed from Megatron-LM; use {DEPRECATED_FLAGS[flag]} instead"
            )


def _require(ns: argparse.Namespace, **dests_by_flag: str) -> None:
    for flag, dest in dests_by_flag.items():
        if getattr(ns, dest) is None:
            raise UserError(f"{flag} is required")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_REQUIRED = {
    "--num-layers": "model__num_layers",
    "--hidden-size": "model__hidden_size",
    "--num-attention-heads": "model__num_attention_heads",
    "--seq-length": "seq_length",
    "--lr": "schedule__lr",
}
"""The flags every run gives (or --use-checkpoint-args fills), by their namespace dests."""


def parse_args(argv: Sequence[str], env: dict | None = None) -> RunConfig:
    """Flags (and the launcher's environment) -> a validated `RunConfig`, or one UserError."""
    argv = list(argv)
    _refuse_deprecated(argv)
    refuse_unsupported(argv)
    ns = build_parser().parse_args(argv)
    launch = detect_launch_env(env, ns.local_rank)
    say = _say if launch.rank == 0 else (lambda _line: None)
    saved = saved_model(ns, say) if ns.checkpoint__use_checkpoint_args else None
    if saved is not None:
        fill_from_checkpoint(ns, saved, say)
    _require(ns, **_REQUIRED)
    check_flag_bounds(ns)
    dp = _data_parallel_size(ns, launch.world_size)  # the layout check, first
    _check_run_flags(ns)
    torch_offload = _backend_offload(ns)
    ds_json = load_user_config(ns.deepspeed_config) if ns.deepspeed_config else None
    batches = _batches(ns, ds_json, dp, launch.world_size)
    gbs = batches.global_batch_size
    precision = _precision(ns, ds_json)
    if ns.schedule__min_lr > ns.schedule__lr:
        raise UserError(
            f"--min-lr {ns.schedule__min_lr} is larger than --lr {ns.schedule__lr} (lower --min-lr)"
        )
    zero = _zero_stage(ns, ds_json, gbs, dp, precision)
    parallel = _parallel(ns, launch.world_size, zero, ds_json, torch_offload)
    checkpoint, spikes, manual_gc = _checkpoint_and_guards(ns, parallel)
    train_iters, train_samples = _run_length(ns, batches)
    schedule = lr_schedule(ns, gbs, train_samples)
    tokenizer, built_tokenizer, model = _tokenizer_and_model(ns, saved, say, parallel)
    pipeline = _pipeline(ns, model.num_layers, parallel, batches, train_samples)
    data, prepared = _data(ns, batches, tokenizer, built_tokenizer, train_iters, launch.rank)
    evaluation = _evaluation(ns, data)
    cfg = RunConfig(
        model=model,
        parallel=dataclasses.replace(parallel, **pipeline),
        training=_training_config(ns, batches, dp, train_iters, spikes, manual_gc),
        schedule=schedule,
        optimizer=OptimizerConfig(**section_values(ns, "optimizer")),
        precision=precision,
        evaluation=evaluation,
        data=data,
        tokenizer=tokenizer,
        checkpoint=checkpoint,
        logging=LoggingConfig(**section_values(ns, "logging")),
        launch=launch,
        deepspeed_json=ds_json,
        argv=tuple(argv),
        prepared=prepared,
    )
    check_accelerate_env(os.environ if env is None else env, cfg)
    return cfg


def _data_parallel_size(ns: argparse.Namespace, world_size: int) -> int:
    """The data-parallel size of TP x PP over `world_size` ranks, after the layout checks."""
    tp, pp = ns.parallel__tensor_model_parallel_size, ns.parallel__pipeline_model_parallel_size
    check_world_divisible(world_size, tp, pp)
    if ns.no_pipeline_parallel and pp > 1:
        raise UserError(
            f"--no-pipeline-parallel contradicts --pipeline-model-parallel-size {pp} (drop one)"
        )
    return world_size // (tp * pp)


def _check_run_flags(ns: argparse.Namespace) -> None:
    """Exactly one run length (--train-iters or --train-samples); RoPE over whole heads only."""
    if (ns.train_iters is None) == (ns.train_samples is None):
        raise UserError("give exactly one of --train-iters and --train-samples")
    if ns.rotary_percent != 1.0:
        raise UserError(
            f"--rotary-percent {ns.rotary_percent}: only 1.0 is implemented (RoPE rotates every "
            f"dimension of a head; drop the flag)"
        )


def _backend_offload(ns: argparse.Namespace) -> dict | None:
    """The torch backend's offload fields from its flags (None on DeepSpeed, whose offload is
    resolved with the ZeRO stage); each backend refuses the flags only the other one has."""
    if not ns.parallel__use_torch_fsdp2:
        check_deepspeed_only(async_save=ns.checkpoint__async_save, ckpt_format=ns.ckpt_format)
        return None
    return resolve_torch_flags(
        zero_stage=ns.zero_stage,
        use_distributed_optimizer=ns.use_distributed_optimizer,
        deepspeed_config=ns.deepspeed_config,
        cpu_offload=ns.cpu_offload,
        offload_optimizer=ns.parallel__offload_optimizer,
        offload_param=ns.parallel__offload_param,
        fp16=ns.precision__fp16,
        ckpt_format=ns.ckpt_format,
    )


def _batches(ns: argparse.Namespace, ds_json: dict | None, dp: int, world_size: int):
    """The batch-size schedule, the batch sizes taken from --deepspeed_config's JSON where the
    flags leave them out (`ns.micro_batch_size` and `ns.global_batch_size` set to the result)."""
    json_gbs, ns.micro_batch_size = json_batch_sizes(
        ds_json,
        ns.deepspeed_config,
        global_batch_size=ns.global_batch_size,
        micro_batch_size=ns.micro_batch_size,
        data_parallel_size=dp,
    )
    if ns.step_batch_size_schedule is None:  # the schedule sets the global batch itself
        ns.global_batch_size = json_gbs
    return batch_schedule(ns, dp, world_size)


def _precision(ns: argparse.Namespace, ds_json: dict | None):
    """The PrecisionConfig: one of bf16 and fp16, and fp16 only with a GPU."""
    precision = precision_config(ns, ds_json)
    if precision.bf16 and precision.fp16:
        raise UserError("--bf16 and --fp16 are exclusive (keep one)")
    if precision.fp16 and not torch.cuda.is_available():
        raise UserError(
            "--fp16 needs a GPU (DeepSpeed has no fp16 on CPU); use --bf16 or fp32 on CPU"
        )
    return precision


def _zero_stage(ns: argparse.Namespace, ds_json: dict | None, gbs: int, dp: int, precision) -> int:
    """The ZeRO stage of --zero-stage / --use-distributed-optimizer / the JSON (checked against
    the flags), at most 1 with pipeline parallelism (DeepSpeed's pipeline engine)."""
    pp = ns.parallel__pipeline_model_parallel_size
    if ds_json is not None:
        zero = check_user_config(
            ds_json,
            ns.deepspeed_config,
            global_batch_size=gbs,
            micro_batch_size=ns.micro_batch_size,
            data_parallel_size=dp,
            precision=precision,
            clip_grad=ns.optimizer__clip_grad,
            zero_stage_flag=ns.zero_stage,
            overlap_grad_reduce=ns.parallel__overlap_grad_reduce,
        )
    else:
        zero = ns.zero_stage if ns.zero_stage is not None else 0
    if ns.use_distributed_optimizer:
        if ns.zero_stage == 0:
            raise UserError(
                "--use-distributed-optimizer shards the optimizer state (ZeRO-1) but --zero-stage "
                "is 0 (drop one)"
            )
        zero = max(zero, 1)
    if pp > 1 and zero > 1:
        raise UserError(
            f"--zero-stage {zero} with --pipeline-model-parallel-size {pp}: DeepSpeed's pipeline "
            f"engine supports ZeRO 0 and 1 only (use --zero-stage 1, or PP=1 for ZeRO-2/3)"
        )
    return zero


def _parallel(
    ns: argparse.Namespace,
    world_size: int,
    zero: int,
    ds_json: dict | None,
    torch_offload: dict | None,
) -> ParallelConfig:
    """The ParallelConfig: the layout flags, ZeRO stage `zero` and the backend's offload
    (`torch_offload` on the torch backend, else DeepSpeed's, resolved here)."""
    offload = (
        torch_offload
        if ns.parallel__use_torch_fsdp2
        else resolve_offload(
            cpu_offload=ns.cpu_offload,
            optimizer=ns.parallel__offload_optimizer,
            param=ns.parallel__offload_param,
            nvme_path=ns.parallel__offload_nvme_path,
            zero_stage=zero,
            user_json=ds_json,
            json_path=ns.deepspeed_config,
        )
    )
    return ParallelConfig(
        **(section_values(ns, "parallel") | offload), world_size=world_size, zero_stage=zero
    )


def _checkpoint_and_guards(
    ns: argparse.Namespace, parallel: ParallelConfig
) -> tuple[CheckpointConfig, SpikeConfig, ManualGCConfig]:
    """The checkpoint, spike and manual-GC configs, checked together: what --save needs, what
    --finetune and the scheduler-resume flags need, what NVMe offload allows."""
    checkpoint = CheckpointConfig(**section_values(ns, "checkpoint"))
    check_nvme_checkpoints(parallel, save=checkpoint.save, load=checkpoint.load)
    spikes = SpikeConfig(**section_values(ns, "spikes"))
    manual_gc = ManualGCConfig(**section_values(ns, "manual_gc"))
    if problems := spikes.problems(save=checkpoint.save) + manual_gc.problems():
        raise UserError("; ".join(problems))
    if checkpoint.save is not None and checkpoint.save_interval is None:
        if not ns.training__exit_interval:  # 0: no exit interval, as in Megatron
            raise UserError(
                "--save needs --save-interval (or --exit-interval to save once at exit)"
            )
    if checkpoint.save_total_limit is not None and (
        checkpoint.save_total_limit < 1 or checkpoint.save is None
    ):
        raise UserError(
            f"--save-total-limit {checkpoint.save_total_limit}: needs --save and a value >= 1 "
            f"(the number of newest checkpoints to keep)"
        )
    if checkpoint.finetune and checkpoint.load is None:
        raise UserError("--finetune needs --load (the checkpoint to start from)")
    scheduler_resume.check_flags(
        checkpoint.override_opt_param_scheduler, checkpoint.use_checkpoint_opt_param_scheduler
    )
    return checkpoint, spikes, manual_gc


def _run_length(ns: argparse.Namespace, batches) -> tuple[int, int]:
    """(train iterations, train samples), from whichever of the two the flags give."""
    train_iters = (
        ns.train_iters if ns.train_iters is not None else batches.train_iters(ns.train_samples)
    )
    train_samples = (
        ns.train_samples
        if ns.train_samples is not None
        else train_iters * batches.global_batch_size
    )
    return train_iters, train_samples


def _pipeline(
    ns: argparse.Namespace,
    num_layers: int,
    parallel: ParallelConfig,
    batches,
    train_samples: int,
) -> dict:
    """The pipeline schedule's ParallelConfig fields (schedule, virtual stages), checked
    against the model's `num_layers`, the layout, the backend and the batches."""
    return resolve_pipeline_flags(
        schedule=ns.pipeline_schedule,
        layers_per_chunk=ns.num_layers_per_virtual_pipeline_stage,
        chunks=ns.num_virtual_stages_per_pipeline_rank,
        num_layers=num_layers,
        pp=parallel.pipeline_model_parallel_size,
        torch_backend=ns.parallel__use_torch_fsdp2,
        batches=batches,
        train_samples=train_samples,
    )


def _tokenizer_and_model(ns: argparse.Namespace, saved, say, parallel: ParallelConfig):
    """(TokenizerConfig, the built tokenizer, ModelConfig): the model sized by the tokenizer's
    true vocabulary, forced to the checkpoint's shape (`saved`, --use-checkpoint-args), and
    checked against the layout `parallel`."""
    if ns.tokenizer_type is None:  # Megatron's pretrain_gpt.py: args_defaults
        ns.tokenizer_type = "GPT2BPETokenizer"
    tokenizer = TokenizerConfig.from_args(ns)
    # building the tokenizer checks its files and gives the true vocabulary size; `pretrain`
    # trains with this one (Prepared), so a process builds it once
    built_tokenizer = build_tokenizer(tokenizer)
    model = model_config(ns, built_tokenizer.vocab_size)
    if saved is not None:
        model = force_from_checkpoint(model, saved, say)
    check_position_embedding(ns, model.position_embedding_type)
    check_script_flags(ns)
    model.validate(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.expert_model_parallel_size,
        parallel.expert_tp,
    )
    check_moe_training(
        model,
        parallel,
        bf16=bool(ns.precision__bf16),
        full_state=not ns.checkpoint__no_save_full_state,
    )
    return tokenizer, built_tokenizer, model


def _data(
    ns: argparse.Namespace,
    batches,
    tokenizer: TokenizerConfig,
    built_tokenizer,
    train_iters: int,
    rank: int,
) -> tuple[DataConfig, Prepared]:
    """The DataConfig and what was read to check it (`Prepared`): its files exist, were made by
    this tokenizer within its vocabulary, and the splits give every set it needs."""
    data = DataConfig.from_args(ns)
    if data.data_schedule is not None and batches.varies:
        raise UserError(
            "--data-schedule starts its phases at iterations, which a varying batch size "
            "(--rampup-batch-size / --step-batch-size-schedule) moves: use a constant "
            "--global-batch-size with it"
        )
    prepared = Prepared.build(tokenizer, data, built_tokenizer)  # its files: read here, reused
    check_data_files(data)
    # data fingerprints: made by this tokenizer, largest token id inside its vocabulary
    check_data(
        data,
        tokenizer,
        built_tokenizer,
        built_tokenizer.vocab_size,
        prepared.files,
        fingerprint=prepared.tokenizer_fingerprint,
    )
    check_data_splits(data, ns, train_iters, batches.global_batch_size, rank, prepared.files)
    return data, prepared


def _evaluation(ns: argparse.Namespace, data: DataConfig) -> EvalConfig:
    """The EvalConfig, its validation sets checked against the data."""
    evaluation = EvalConfig(
        **section_values(ns, "evaluation"), eval_interval=ns.eval_interval, eval_iters=ns.eval_iters
    )
    check_validation_sets(
        evaluation.multiple_validation_sets, evaluation.validation_set_names, data
    )
    return evaluation


def _training_config(
    ns: argparse.Namespace,
    batches,
    dp: int,
    train_iters: int,
    spikes: SpikeConfig,
    manual_gc: ManualGCConfig,
) -> TrainingConfig:
    """The TrainingConfig: the loop's flags, the batch sizes and schedule, the run length."""
    mbs, gbs = ns.micro_batch_size, batches.global_batch_size
    return TrainingConfig(
        **section_values(ns, "training"),
        micro_batch_size=mbs,
        global_batch_size=gbs,
        num_microbatches=gbs // (mbs * dp),
        batch_schedule=batches if batches.varies else None,
        train_iters=train_iters,
        train_samples=ns.train_samples,
        seq_length=ns.seq_length,
        seed=ns.seed,
        spikes=spikes,
        manual_gc=manual_gc,
    )
