"""The parsed namespace -> the configs of one run: the values several flags derive together (batch
arithmetic, the LR schedule in samples, GQA, RoPE and recompute spellings, precision with the
DeepSpeed JSON) and the checks argparse cannot make. Every failed check raises `UserError` with
one line naming the flag(s), the values and the fix, before any process group exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

from pretrain.cli.flags import section_values
from pretrain.data.builder import check_splits_before_launch
from pretrain.data.config import DataConfig, train_valid_test_num_samples
from pretrain.data.files.fingerprint import PrefixFiles
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.training.precision import PrecisionConfig
from pretrain.training.schedules.batch_schedule import BatchSchedule, parse_step_schedule
from pretrain.training.schedules.lr_schedule import LRScheduleConfig, check_wsd, spans_in_samples

# flag -> (namespace dest, smallest value, what the flag means): integers whose smaller values
# would otherwise end mid-run in a ZeroDivisionError, a DeepSpeed assertion or an empty
# evaluation, or (a negative interval) silently act every iteration
_LOWER_BOUNDS = {
    "--micro-batch-size": ("micro_batch_size", 1, "samples per micro-batch per data-parallel rank"),
    "--log-interval": ("logging__log_interval", 1, "iterations between log lines"),
    "--tensorboard-log-interval": (
        "logging__tensorboard_log_interval",
        1,
        "iterations between TensorBoard/wandb points",
    ),
    "--exit-interval": (
        "training__exit_interval",
        0,
        "iterations; 0 = no exit interval, as in Megatron",
    ),
    "--make-vocab-size-divisible-by": (
        "model__make_vocab_size_divisible_by",
        1,
        "the vocabulary is padded to a multiple of it",
    ),
    "--eval-iters": ("eval_iters", 0, "0 turns evaluation off"),
    "--seed": ("seed", 0, "numpy refuses negative seeds"),
    "--moe-ffn-hidden-size": ("model__moe_ffn_hidden_size", 1, "each expert's MLP width"),
}
SEED_LIMIT = 2**31 - 1
"""The largest --seed: numpy seeds with < 2**32, and the data and RNG code adds offsets to it."""

# flag -> (namespace dest, smallest value, what the flag means): floats that must be finite and
# at least the smallest value; nan passed every comparison and ended in the optimizer's
# traceback, a negative --clip-grad silently turned clipping off, and a negative --lr was
# reported as a --min-lr error
_FLOAT_BOUNDS = {
    "--lr": ("schedule__lr", 0.0, "the peak learning rate"),
    "--min-lr": ("schedule__min_lr", 0.0, "the learning rate at the end of the decay"),
    "--lr-warmup-init": ("schedule__warmup_init", 0.0, "the warmup's first learning rate"),
    "--weight-decay": ("optimizer__weight_decay", 0.0, "AdamW's decoupled weight decay"),
    "--clip-grad": ("optimizer__clip_grad", 0.0, "0 turns gradient clipping off"),
}


def check_flag_bounds(ns: argparse.Namespace) -> None:
    """Refuse (one line naming the flag, the value and the bound) an integer flag below its lower
    bound (`_LOWER_BOUNDS`), a --seed above `SEED_LIMIT`, and a float flag that is not finite or
    below its bound (`_FLOAT_BOUNDS`); unset flags pass."""
    for flag, (dest, least, meaning) in _LOWER_BOUNDS.items():
        value = getattr(ns, dest)
        if value is not None and value < least:
            raise UserError(f"{flag} {value}: must be >= {least} ({meaning})")
    if ns.seed is not None and ns.seed > SEED_LIMIT:
        raise UserError(
            f"--seed {ns.seed}: must be <= {SEED_LIMIT} (numpy seeds with less than 2**32, "
            f"after the per-stage and per-segment offsets)"
        )
    for flag, (dest, least, meaning) in _FLOAT_BOUNDS.items():
        value = getattr(ns, dest)
        if value is not None and not (math.isfinite(value) and value >= least):
            raise UserError(f"{flag} {value}: must be a finite number >= {least:g} ({meaning})")


def _query_groups(ns: argparse.Namespace) -> int | None:
    """GQA from Megatron's or Megatron-DeepSpeed's spelling; two spellings must agree."""
    megatron = None
    if ns.group_query_attention:
        megatron = ns.num_query_groups if ns.num_query_groups is not None else 1
    elif ns.num_query_groups is not None and ns.num_key_value_heads is None:
        raise UserError(
            f"--num-query-groups {ns.num_query_groups} has no effect without "
            f"--group-query-attention (add it, as Megatron requires)"
        )
    deepspeed = ns.num_key_value_heads
    if megatron is not None and deepspeed is not None and megatron != deepspeed:
        raise UserError(
            f"--num-key-value-heads {deepspeed} disagrees with --group-query-attention "
            f"--num-query-groups {megatron} (give one spelling, or the same number)"
        )
    return deepspeed if deepspeed is not None else megatron


def _position_embedding_type(ns: argparse.Namespace) -> str:
    """--position-embedding-type, or rope from Megatron-DeepSpeed's flag; they must agree."""
    if ns.use_rotary_position_embeddings:
        if ns.position_embedding_type not in (None, "rope"):
            raise UserError(
                f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                f"{ns.position_embedding_type} (drop one)"
            )
        return "rope"
    return ns.position_embedding_type or "learned_absolute"


def _tokens_to_samples(tokens: int, seq_length: int) -> float:
    """Megatron-DeepSpeed counts these spans in tokens; without curriculum learning every
    sample has --seq-length tokens, so the same schedule in samples is tokens / seq_length."""
    samples = tokens / seq_length
    return int(samples) if samples.is_integer() else samples


def _recompute(ns: argparse.Namespace) -> dict:
    """The recompute fields: the flags, or Megatron's aliases: --recompute-activations =
    selective; Megatron-DeepSpeed's --checkpoint-activations = full, uniform [, 1 layer]."""
    granularity = ns.model__recompute_granularity
    method, layers = ns.model__recompute_method, ns.model__recompute_num_layers
    if ns.activations_checkpoint_method is not None:  # the older spelling of --recompute-method
        if method not in (None, ns.activations_checkpoint_method):
            raise UserError(
                f"--activations-checkpoint-method {ns.activations_checkpoint_method} contradicts "
                f"--recompute-method {method} (drop one)"
            )
        method = ns.activations_checkpoint_method
    for alias, implies in (
        ("--recompute-activations", "selective"),
        ("--checkpoint-activations", "full"),
    ):
        if not getattr(ns, alias.lstrip("-").replace("-", "_")):
            continue
        if granularity not in (None, implies):
            raise UserError(
                f"{alias} (= --recompute-granularity {implies}) contradicts "
                f"--recompute-granularity {granularity} (drop one)"
            )
        granularity = implies
        if implies == "full":
            method = method or "uniform"
            layers = 1 if layers is None else layers
    return {
        "recompute_granularity": granularity,
        "recompute_method": method,
        "recompute_num_layers": layers,
    }


def _rotary_base(ns: argparse.Namespace) -> int:
    """--rotary-base, or Megatron-DeepSpeed's --rotary-position-embeddings-theta; they must agree."""
    theta, base = ns.rotary_position_embeddings_theta, ns.model__rotary_base
    if theta is None:
        return base
    if base != theta and base != ModelConfig.rotary_base:
        raise UserError(
            f"--rotary-position-embeddings-theta {theta} disagrees with --rotary-base {base} "
            f"(give one spelling)"
        )
    return theta


def model_config(ns: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The model flags, their aliases resolved, for a tokenizer of `vocab_size` ids."""
    dtype = torch.bfloat16 if ns.precision__bf16 else None
    dtype = torch.float16 if ns.precision__fp16 else dtype
    return ModelConfig(
        **{**section_values(ns, "model"), **_recompute(ns), "rotary_base": _rotary_base(ns)},
        num_query_groups=_query_groups(ns),
        position_embedding_type=_position_embedding_type(ns),
        vocab_size=vocab_size,
        seq_length=ns.seq_length,
        seed=ns.seed,
        params_dtype=dtype or torch.float32,
    )


def check_moe_training(
    model: ModelConfig, parallel: ParallelConfig, bf16: bool = False, full_state: bool = True
) -> None:
    """The expert layouts pretrain_gpt.py trains at (the MoE layer itself runs at any): expert TP
    1 or TP; at EP > 1 with the full-state checkpoint (`full_state`: it is what resumes an EP > 1
    checkpoint, on either backend); on DeepSpeed at EP > 1 ZeRO 0-2 (ZeRO 1-2 with expert TP = TP
    and PP 1: backends/deepspeed/experts.py), not its bf16 pipeline optimizer. The torch backend
    (FSDP2, backends/torch/experts.py) trains every other layout."""
    ep, etp, tp = (
        parallel.expert_model_parallel_size,
        parallel.expert_tp,
        parallel.tensor_model_parallel_size,
    )
    if not model.is_moe:
        if ep > 1:
            raise UserError(f"--expert-model-parallel-size {ep} needs an MoE model (--num-experts)")
        return
    if etp not in (1, tp):
        raise UserError(
            f"--expert-tensor-parallel-size {etp}: training runs at expert TP 1 or "
            f"--tensor-model-parallel-size ({tp}) for now (the MoE layer itself runs at any: "
            f"docs/MOE.md)"
        )
    if ep > 1 and not full_state:
        files = (
            "the torch backend resumes an EP > 1 checkpoint"
            if parallel.backend == "torch"
            else "DeepSpeed's files hold data-parallel rank 0's experts only, the checkpoint resumes"
        )
        raise UserError(
            f"--no-save-full-state with --expert-model-parallel-size {ep}: {files} through its "
            f"layout-independent state; drop --no-save-full-state"
        )
    if parallel.backend == "torch":  # FSDP2 shards the experts over expert DP: any layout
        return
    if ep > 1:
        _check_deepspeed_experts(parallel, bf16)


def _check_deepspeed_experts(parallel: ParallelConfig, bf16: bool) -> None:
    """The DeepSpeed layouts at EP > 1: ZeRO 0-2; ZeRO 1-2 only with expert TP = TP and PP 1;
    not the bf16 pipeline optimizer. One UserError naming the flags and the fix."""
    ep, etp, tp = (
        parallel.expert_model_parallel_size,
        parallel.expert_tp,
        parallel.tensor_model_parallel_size,
    )
    if parallel.zero_stage == 3:
        raise UserError(
            f"--zero-stage 3 with --expert-model-parallel-size {ep}: ZeRO-3 partitions every "
            f"parameter over the whole data-parallel group, whose ranks hold different experts "
            f"at EP > 1; use --zero-stage 0-2 (docs/MOE.md)"
        )
    if parallel.zero_stage > 0 and etp != tp:
        raise UserError(
            f"--zero-stage {parallel.zero_stage} with --expert-model-parallel-size {ep} and "
            f"--expert-tensor-parallel-size {etp} under --tensor-model-parallel-size {tp}: "
            f"DeepSpeed's ZeRO counts the expert gradient norm over the data-parallel group, "
            f"which holds every expert only when expert TP = TP; use --zero-stage 0 or "
            f"--expert-tensor-parallel-size {tp}"
        )
    if parallel.zero_stage > 0 and parallel.pipeline_model_parallel_size > 1:
        raise UserError(
            f"--zero-stage {parallel.zero_stage} with --pipeline-model-parallel-size "
            f"{parallel.pipeline_model_parallel_size} and --expert-model-parallel-size {ep}: "
            f"DeepSpeed's ZeRO takes its expert groups per stage (a stage without MoE layers "
            f"has none) and hangs; use --zero-stage 0"
        )
    if bf16 and parallel.pipeline_model_parallel_size > 1 and parallel.zero_stage == 0:
        raise UserError(
            f"--bf16 with --pipeline-model-parallel-size {parallel.pipeline_model_parallel_size} "
            f"and --expert-model-parallel-size {ep}: DeepSpeed's bf16 pipeline optimizer reduces "
            f"every gradient over the data-parallel group; use --fp16 or fp32, or "
            f"--expert-model-parallel-size 1"
        )


def lr_schedule(ns: argparse.Namespace, gbs: int, train_samples: int) -> LRScheduleConfig:
    """The LR schedule in samples: Megatron's iteration/sample spans, or Megatron-DeepSpeed's
    token spans, checked against each other and against the decay span."""
    spans = spans_in_samples(
        train_iters=ns.train_iters,
        train_samples=train_samples,
        global_batch_size=gbs,
        decay_iters=ns.lr_decay_iters,
        decay_samples=ns.lr_decay_samples,
        warmup_iters=ns.lr_warmup_iters,
        warmup_samples=ns.lr_warmup_samples,
        warmup_fraction=ns.lr_warmup_fraction,
        wsd_decay_iters=ns.lr_wsd_decay_iters,
        wsd_decay_samples=ns.lr_wsd_decay_samples,
    )
    decay, warmup = spans.decay, spans.warmup
    if ns.lr_decay_tokens is not None:  # Megatron-DeepSpeed: tokens override iterations/samples
        decay = _tokens_to_samples(ns.lr_decay_tokens, ns.seq_length)
    if ns.lr_warmup_tokens is not None:
        if ns.lr_warmup_iters or ns.lr_warmup_samples or ns.lr_warmup_fraction is not None:
            raise UserError(
                "--lr-warmup-tokens and --lr-warmup-iters/-samples/-fraction are exclusive "
                "(keep one)"
            )
        warmup = _tokens_to_samples(ns.lr_warmup_tokens, ns.seq_length)
    if warmup > decay:
        raise UserError(
            f"warmup ({warmup} samples) is longer than the decay span ({decay} samples) "
            f"(shorten --lr-warmup-* or lengthen --lr-decay-*)"
        )
    spans = dataclasses.replace(spans, decay=decay, warmup=warmup)
    check_wsd(ns.schedule__decay_style, spans)
    return LRScheduleConfig(
        **section_values(ns, "schedule"),
        decay_samples=spans.decay,
        warmup_samples=spans.warmup,
        wsd_decay_samples=spans.wsd if ns.schedule__decay_style == "WSD" else None,
    )


def batch_schedule(ns: argparse.Namespace, dp: int, world_size: int) -> BatchSchedule:
    """The batch-size schedule of --global-batch-size / --rampup-batch-size /
    --step-batch-size-schedule, checked against the layout and the run length."""
    mbs, tp, pp = (
        ns.micro_batch_size,
        ns.parallel__tensor_model_parallel_size,
        ns.parallel__pipeline_model_parallel_size,
    )
    steps = None
    if ns.step_batch_size_schedule is not None:
        if ns.global_batch_size is not None:
            raise UserError(
                "--step-batch-size-schedule and --global-batch-size are exclusive (the schedule's "
                "last entry is the final global batch; drop --global-batch-size)"
            )
        steps = parse_step_schedule(ns.step_batch_size_schedule, ns.seq_length)
        gbs = steps[-1][1]
    else:
        gbs = ns.global_batch_size if ns.global_batch_size is not None else mbs * dp
    if gbs % (mbs * dp):
        raise UserError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {dp} = {mbs * dp} (with world {world_size} = TP {tp} x "
            f"PP {pp} x DP {dp}; use a global batch that is a multiple of {mbs * dp})"
        )
    rampup = tuple(ns.rampup_batch_size) if ns.rampup_batch_size is not None else None
    schedule = BatchSchedule(
        micro_batch_size=mbs,
        data_parallel_size=dp,
        global_batch_size=gbs,
        rampup=rampup,
        steps=steps,
    )
    if schedule.varies and ns.train_samples is None:
        flag = "--rampup-batch-size" if rampup else "--step-batch-size-schedule"
        raise UserError(
            f"{flag} needs sample-based training: use --train-samples (and --lr-*-samples) "
            f"instead of --train-iters"
        )
    if schedule.varies and ns.checkpoint__load is None:
        schedule.check_divisible(0, ns.train_samples)  # a resume checks from its own position
    return schedule


# Megatron's fp16 loss-scale defaults, and the DeepSpeed JSON keys that can set them instead.
_LOSS_SCALE_DEFAULTS = {
    "initial_loss_scale": ("initial_scale_power", 2.0**32),
    "min_loss_scale": ("min_loss_scale", 1.0),
    "loss_scale_window": ("loss_scale_window", 1000),
    "hysteresis": ("hysteresis", 2),
}


def precision_config(ns: argparse.Namespace, ds_json: dict | None) -> PrecisionConfig:
    """Precision flags; an fp16 loss-scale flag not given takes the --deepspeed_config value
    (what DeepSpeed would use in a Megatron-DeepSpeed run), else Megatron's default. A flag that
    is given and disagrees with the JSON is refused later (check_user_config)."""
    values = section_values(ns, "precision")
    fp16_json = (ds_json or {}).get("fp16", {}) if values["fp16"] else {}
    for name, (key, default) in _LOSS_SCALE_DEFAULTS.items():
        if values[name] is None:
            if key not in fp16_json:
                values[name] = default
            elif key == "initial_scale_power":
                values[name] = 2.0 ** fp16_json[key]
            else:
                values[name] = type(default)(fp16_json[key])
    if values["loss_scale"] is None and fp16_json.get("loss_scale"):  # 0 = dynamic
        values["loss_scale"] = float(fp16_json["loss_scale"])
    return PrecisionConfig(**values)


def check_data_files(data: DataConfig) -> None:
    """Refuse a data prefix whose .bin or .idx does not exist, naming the file."""
    blends = [data.blend] if data.blend is not None else list(data.blend_per_split or [])
    prefixes = [prefix for blend in blends if blend is not None for prefix in blend[0]]
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise UserError(
                    f"data prefix {prefix}: {prefix + ext} does not exist (run "
                    f"tools/preprocess_data.py, or fix --data-path)"
                )


def check_data_splits(
    data: DataConfig, ns, train_iters: int, gbs: int, rank: int, files: PrefixFiles
) -> None:
    """An empty train split is refused here, before launch; a missing validation split while
    --eval-iters > 0 is said once (by rank 0). `files` opens the `.idx` files (kept for the run)."""
    counts = train_valid_test_num_samples(
        train_iters, ns.train_samples, ns.eval_interval, ns.eval_iters, gbs
    )

    def warn(msg: str) -> None:
        print(f"warning: {msg}", file=sys.stderr, flush=True)

    check_splits_before_launch(data, counts, ns.eval_iters, warn if rank == 0 else None, files)
