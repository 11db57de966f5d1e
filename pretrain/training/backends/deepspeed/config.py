"""The DeepSpeed config dict, from the flags or from the user's (already checked) JSON.

Two choices here keep DeepSpeed's math equal to Megatron's at every layout:
- The optimizer is always ours (a client `torch.optim.AdamW`): a JSON optimizer would JIT-build
  `fused_adam` on CPU and bypass our parameter groups. The command line refuses a JSON optimizer.
- Gradient clipping at ZeRO-0 is done by our optimizer with the true global norm
  (`pretrain.training.schedules.optimizer`), so DeepSpeed's own clipping is switched off there: in a pipeline
  grid DeepSpeed's fp32 ZeRO-0 norm leaves out every stage but the first, and its fp16/bf16 ZeRO-0
  wrapper (`FP16_UnfusedOptimizer`, used for any non-fused client optimizer) drops the gradients of
  every TP rank but the first (it checks the TP mark on the gradient tensors, which carry none):
  measured 0.988 instead of 1.078 at TP 2 in bf16. The exception is bf16 in a pipeline, where
  DeepSpeed uses its `BF16_Optimizer`, whose norm is right (as at ZeRO >= 1).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
from collections.abc import Callable
from typing import Any

from pretrain.errors import UserError
from pretrain.parallel.config import ParallelConfig
from pretrain.training.backends.deepspeed.offload import zero_sections
from pretrain.training.precision import PrecisionConfig


def we_clip_gradients(parallel: ParallelConfig, precision: PrecisionConfig) -> bool:
    """True where our optimizer clips (ZeRO-0, except bf16 in a pipeline); else DeepSpeed does."""
    bf16_pipeline = precision.bf16 and parallel.pipeline_model_parallel_size > 1
    return parallel.zero_stage == 0 and not bf16_pipeline


def build_deepspeed_config(
    *,
    global_batch_size: int,
    micro_batch_size: int,
    num_microbatches: int,
    clip_grad: float,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    user_json: dict | None = None,
    sequence_parallel: bool = False,
) -> dict:
    """DeepSpeed's config for this run: the user's JSON (if any) with the flags' values set.

    `sequence_parallel`: each TP rank's activations differ (its sequence chunk), so the pipeline
    engine must send them whole instead of 1/TP of them, all-gathered on arrival."""
    ds = copy.deepcopy(user_json) if user_json is not None else {}
    ds["train_batch_size"] = global_batch_size
    ds["train_micro_batch_size_per_gpu"] = micro_batch_size
    ds["gradient_accumulation_steps"] = num_microbatches
    ds["gradient_clipping"] = 0.0 if we_clip_gradients(parallel, precision) else clip_grad
    ds.setdefault("steps_per_print", 2**31 - 1)  # our log line replaces DeepSpeed's
    ds.setdefault("wall_clock_breakdown", False)
    if sequence_parallel:
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)

    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = parallel.zero_stage
    if parallel.overlap_grad_reduce and parallel.zero_stage > 0:
        zero["overlap_comm"] = True  # ZeRO-0 reduces after backward (DeepSpeed has no overlap)
    zero_sections(zero, parallel)
    if parallel.offload_optimizer:
        # our AdamW steps the CPU-resident state (DeepSpeedCPUAdam: docs/TRAINING.md, "Offload")
        ds["zero_force_ds_cpu_optimizer"] = False

    if precision.bf16:
        ds["bf16"] = {"enabled": True}
    elif precision.fp16:
        fp16 = ds.setdefault("fp16", {})
        fp16["enabled"] = True
        if precision.loss_scale is not None:
            fp16["loss_scale"] = precision.loss_scale  # static
        else:
            fp16.setdefault("loss_scale", 0)  # dynamic
            fp16.setdefault(
                "initial_scale_power", int(round(math.log2(precision.initial_loss_scale)))
            )
            fp16.setdefault("loss_scale_window", precision.loss_scale_window)
            fp16.setdefault("hysteresis", precision.hysteresis)
            fp16.setdefault("min_loss_scale", precision.min_loss_scale)
    return ds


def load_user_config(path: str) -> dict:
    """The user's --deepspeed_config JSON (UserError naming the file and line if it is bad)."""
    if not os.path.isfile(path):
        raise UserError(
            f"--deepspeed_config {path}: no such file (fix the path or drop the flag to "
            f"build the config from the command line)"
        )
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: invalid JSON: {err.msg} (fix the file)") from None


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def json_batch_sizes(
    ds: dict | None,
    path: str | None,
    *,
    global_batch_size: int | None,
    micro_batch_size: int | None,
    data_parallel_size: int,
) -> tuple[int | None, int]:
    """(global batch or None, micro batch): the flags where given, else what the --deepspeed_config
    JSON makes of them as DeepSpeed does (two of train_batch_size, train_micro_batch_size_per_gpu
    and gradient_accumulation_steps give the third; one alone means 1 accumulation step). Without
    the JSON's batch keys the micro batch is 1 and the global batch None (micro x DP, Megatron's
    default). A flag given beside a JSON key that disagrees is refused by `check_user_config`."""
    ds = ds or {}
    for key in _BATCH_KEYS:
        value = ds.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise UserError(
                f"--deepspeed_config {path} sets {key}={json.dumps(value)}: must be a positive "
                f"integer (write the number, or drop the key and give the flag)"
            )
    gbs = global_batch_size if global_batch_size is not None else ds.get("train_batch_size")
    mbs = (
        micro_batch_size
        if micro_batch_size is not None
        else ds.get("train_micro_batch_size_per_gpu")
    )
    gas = ds.get("gradient_accumulation_steps")
    if mbs is None:
        if gbs is None or not any(key in ds for key in _BATCH_KEYS):
            mbs = 1
        else:
            per_step = (gas or 1) * data_parallel_size
            if gbs % per_step:
                raise UserError(
                    f"--deepspeed_config {path}: global batch {gbs} is not divisible by "
                    f"gradient_accumulation_steps {gas or 1} x data-parallel size "
                    f"{data_parallel_size} (give --micro-batch-size or make them divisible)"
                )
            mbs = gbs // per_step
    if gbs is None and any(key in ds for key in _BATCH_KEYS):
        gbs = mbs * (gas or 1) * data_parallel_size
    return gbs, mbs


def check_user_config(
    ds: dict,
    path: str,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    precision: PrecisionConfig,
    clip_grad: float,
    zero_stage_flag: int | None,
    overlap_grad_reduce: bool = False,
) -> int:
    """Compare the user's DeepSpeed JSON with the flags (one UserError naming the disagreement);
    return the ZeRO stage to use (--zero-stage, else the JSON's, else 0)."""
    mismatch = functools.partial(_mismatch, path)
    _check_batch(ds, mismatch, global_batch_size, micro_batch_size, data_parallel_size)
    _check_precision(ds, mismatch, precision)
    if "gradient_clipping" in ds and float(ds["gradient_clipping"]) != clip_grad:
        raise mismatch("gradient_clipping", ds["gradient_clipping"], "--clip-grad", clip_grad)
    for section, flags in (
        ("optimizer", "--lr/--adam-*/--weight-decay"),
        ("scheduler", "--lr-decay-style/--lr-warmup-*"),
    ):
        if section in ds:
            raise UserError(
                f'--deepspeed_config {path} has an "{section}" section; the optimizer and LR '
                f"schedule come from {flags} (remove the section)"
            )
    json_overlap = ds.get("zero_optimization", {}).get("overlap_comm")
    if overlap_grad_reduce and json_overlap is False:
        raise mismatch("zero_optimization.overlap_comm", "false", "--overlap-grad-reduce", "given")
    json_stage = ds.get("zero_optimization", {}).get("stage")
    if json_stage is not None and zero_stage_flag is not None and json_stage != zero_stage_flag:
        raise mismatch("zero_optimization.stage", json_stage, "--zero-stage", zero_stage_flag)
    return zero_stage_flag if zero_stage_flag is not None else (json_stage or 0)


def _mismatch(path: str, key: str, json_value: Any, flag: str, flag_value: Any) -> UserError:
    """The one line for a JSON key that disagrees with a flag."""
    return UserError(
        f"--deepspeed_config {path} sets {key}={json_value} but {flag} is {flag_value} "
        f"(make them agree, or drop the key from the JSON)"
    )


def _check_batch(ds: dict, mismatch: Callable, gbs: int, mbs: int, dp: int) -> None:
    """The JSON's batch keys against --global-batch-size, --micro-batch-size and the DP size."""
    if "train_batch_size" in ds and ds["train_batch_size"] != gbs:
        raise mismatch("train_batch_size", ds["train_batch_size"], "--global-batch-size", gbs)
    if "train_micro_batch_size_per_gpu" in ds and ds["train_micro_batch_size_per_gpu"] != mbs:
        raise mismatch(
            "train_micro_batch_size_per_gpu",
            ds["train_micro_batch_size_per_gpu"],
            "--micro-batch-size",
            mbs,
        )
    gas = gbs // (mbs * dp)
    if "gradient_accumulation_steps" in ds and ds["gradient_accumulation_steps"] != gas:
        raise mismatch(
            "gradient_accumulation_steps",
            ds["gradient_accumulation_steps"],
            "--global-batch-size/(--micro-batch-size x data-parallel size)",
            gas,
        )


def _check_precision(ds: dict, mismatch: Callable, precision: PrecisionConfig) -> None:
    """The JSON's bf16/fp16 sections against --bf16/--fp16 and the loss-scale flags."""
    for key, flag in (("bf16", "--bf16"), ("fp16", "--fp16")):
        enabled = bool(ds.get(key, {}).get("enabled", False))
        given = getattr(precision, key)
        if enabled != given:
            raise mismatch(
                f"{key}.enabled", str(enabled).lower(), flag, "given" if given else "not given"
            )
    fp16_json = ds.get("fp16", {})
    for key, flag, value in (
        ("loss_scale", "--loss-scale", precision.loss_scale or 0),  # 0 = dynamic in DeepSpeed
        ("initial_scale_power", "--initial-loss-scale", math.log2(precision.initial_loss_scale)),
        ("loss_scale_window", "--loss-scale-window", precision.loss_scale_window),
        ("hysteresis", "--hysteresis", precision.hysteresis),
        ("min_loss_scale", "--min-loss-scale", precision.min_loss_scale),
    ):
        if precision.fp16 and key in fp16_json and float(fp16_json[key]) != float(value):
            shown = precision.initial_loss_scale if key == "initial_scale_power" else value
            raise mismatch(f"fp16.{key}", fp16_json[key], flag, shown)
