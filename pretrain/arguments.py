"""Megatron-LM command-line flags -> typed, validated configuration.

`parse_args(argv)` is the only place that sees argparse: it returns a frozen `Config` of
dataclasses, after every check that can be made before a process group exists. Each failed
check raises `UserError` with one line naming the flag(s), the values and the fix.

Flag spellings are Megatron-LM's (core_v0.15). Megatron-DeepSpeed's spellings are accepted as
aliases (`--num-key-value-heads`, `--normalization rmsnorm`, `--use-rotary-position-embeddings`,
`--zero-stage`, `--no-pipeline-parallel`), as are DeepSpeed's own (`--deepspeed`,
`--deepspeed_config`, `--local_rank`). Flags Megatron removed are refused with their new name.

The data, sample-count and tokenizer flags are owned by `pretrain.data.config` and
`pretrain.tokenizer`; this module adds the model, parallelism, optimizer, checkpoint and logging
flags around them.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.data.config import DataConfig, add_data_args, add_sample_count_args
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.tokenizer import TokenizerConfig, add_tokenizer_args, build_tokenizer
from pretrain.training.distributed import LaunchEnv, detect_launch_env

# Megatron removed these; say what replaced them instead of "unrecognized arguments".
DEPRECATED_FLAGS = {
    "--batch-size": "--micro-batch-size",
    "--warmup": "--lr-warmup-fraction",
    "--model-parallel-size": "--tensor-model-parallel-size",
    "--checkpoint-activations": "--recompute-activations",
}


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    world_size: int
    zero_stage: int
    cpu_offload: bool
    distributed_backend: str | None  # None = nccl on GPU, gloo on CPU
    distributed_timeout_minutes: float


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int  # gradient accumulation steps per DP rank
    train_iters: int
    train_samples: int | None
    seq_length: int
    seed: int
    # LR schedule, in samples (Megatron's scheduler counts samples, not iterations)
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_samples: int
    lr_warmup_samples: int
    lr_warmup_init: float
    # AdamW
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    # precision
    bf16: bool
    fp16: bool
    loss_scale: float | None
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: int
    hysteresis: int
    # evaluation and stopping
    eval_interval: int
    eval_iters: int
    exit_interval: int | None
    exit_duration_in_mins: float | None
    deepspeed_config: dict | None  # the user's JSON, already checked against the flags


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    no_save_rng: bool
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: str | None
    tensorboard_log_interval: int
    wandb_project: str | None
    wandb_exp_name: str | None
    peak_tflops: float | None
    metrics_file: str | None


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    launch: LaunchEnv
    argv: tuple[str, ...]


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a UserError (one line, exit 2) rather than usage + SystemExit."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        raise UserError(f"{message} (see `pretrain_gpt.py --help`)")


def _normalization(value: str) -> str:
    table = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
    if value.lower() not in table:
        raise argparse.ArgumentTypeError(f"{value!r} is not LayerNorm or RMSNorm")
    return table[value.lower()]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,
        description="Pretrain a GPT (GPT-2 or Llama flavour) with Megatron-LM flags on "
        "tensor parallelism + DeepSpeed pipeline parallelism and ZeRO.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, help="transformer blocks (required)")
    g.add_argument("--hidden-size", type=int, help="model width (required)")
    g.add_argument(
        "--ffn-hidden-size", type=int, help="MLP width [4*hidden; with --swiglu int(8h/3/64)*64]"
    )
    g.add_argument("--num-attention-heads", type=int, help="attention heads (required)")
    g.add_argument("--kv-channels", type=int, help="per-head dimension [hidden / heads]")
    g.add_argument(
        "--group-query-attention", action="store_true", help="grouped-query attention (GQA)"
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value groups with --group-query-attention [1 = MQA]",
    )
    g.add_argument(
        "--num-key-value-heads",
        type=int,
        dest="num_key_value_heads",
        help="Megatron-DeepSpeed spelling of GQA: number of key/value heads",
    )
    g.add_argument("--max-position-embeddings", type=int, help="[--seq-length]")
    g.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
    )
    g.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Megatron-DeepSpeed spelling of --position-embedding-type rope",
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument(
        "--normalization", type=_normalization, default="LayerNorm", help="LayerNorm | RMSNorm"
    )
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (Llama)")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate LM head (default: tied to the input embedding)",
    )
    g.add_argument(
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="no biases in linear layers (Llama)",
    )
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this times TP [128]",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="recompute each block's activations in backward (saves memory)",
    )

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--no-pipeline-parallel",
        action="store_true",
        help="Megatron-DeepSpeed flag; PP=1 always runs without the pipeline engine",
    )
    g.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="ZeRO stage over data-parallel ranks [0, or the stage in --deepspeed_config]",
    )
    g.add_argument(
        "--cpu-offload", action="store_true", help="keep optimizer state in CPU memory (ZeRO >= 1)"
    )
    g.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="[nccl with GPUs, gloo without]",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="collectives that wait longer than this fail instead of hanging [10]",
    )
    g.add_argument(
        "--deepspeed",
        action="store_true",
        help="accepted for Megatron-DeepSpeed scripts (always on)",
    )
    g.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        dest="deepspeed_config",
        help="DeepSpeed JSON; must agree with the batch, precision and ZeRO flags",
    )
    g.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=None,
        help="set by the deepspeed launcher",
    )

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, help="peak learning rate (required)")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, help="[--train-iters]")
    g.add_argument("--lr-decay-samples", type=int, help="[--train-samples] (sample-based training)")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument(
        "--lr-warmup-fraction", type=float, help="warmup as a fraction of the decay span"
    )
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument(
        "--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0 = off)"
    )
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument(
        "--optimizer", choices=["adam"], default="adam", help="AdamW (decoupled weight decay)"
    )
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, help="static fp16 loss scale [dynamic]")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument(
        "--exit-interval", type=int, help="save (with --save) and exit after this iteration"
    )
    g.add_argument(
        "--exit-duration-in-mins", type=float, help="save and exit after this many minutes"
    )

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="checkpoint directory to write")
    g.add_argument("--save-interval", "--persistent-save-interval", dest="save_interval", type=int)
    g.add_argument("--load", help="checkpoint directory to resume from (its `latest`)")
    g.add_argument("--no-save-rng", action="store_true", help="do not save per-rank RNG states")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--finetune",
        action="store_true",
        help="load weights only: no optimizer, RNG or data position; iteration restarts at 0",
    )

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-exp-name")
    g.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s per device for MFU [a table of known GPUs; none on CPU]",
    )
    g.add_argument(
        "--metrics-file",
        help="append one JSON line per iteration (full-precision loss, grad norm, lr)",
    )
    g.add_argument(
        "--log-throughput", action="store_true", help="accepted for Megatron scripts (always on)"
    )

    add_sample_count_args(p)
    add_data_args(p)
    add_tokenizer_args(p)
    return p


def _refuse_deprecated(argv: Sequence[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in DEPRECATED_FLAGS:
            raise UserError(
                f"{flag} was removed from Megatron-LM; use {DEPRECATED_FLAGS[flag]} instead"
            )


def _require(ns: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(ns, name) is None:
            raise UserError(f"--{name.replace('_', '-')} is required")


def _model_config(ns: argparse.Namespace, vocab_size: int) -> ModelConfig:
    groups = None
    if ns.num_key_value_heads is not None:
        groups = ns.num_key_value_heads
    elif ns.group_query_attention:
        groups = ns.num_query_groups if ns.num_query_groups is not None else 1
    rope = ns.use_rotary_position_embeddings or ns.position_embedding_type == "rope"
    return ModelConfig(
        num_layers=ns.num_layers,
        hidden_size=ns.hidden_size,
        num_attention_heads=ns.num_attention_heads,
        num_query_groups=groups,
        ffn_hidden_size=ns.ffn_hidden_size,
        kv_channels=ns.kv_channels,
        seq_length=ns.seq_length,
        max_position_embeddings=ns.max_position_embeddings,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=ns.rotary_base,
        normalization=ns.normalization,
        norm_epsilon=ns.norm_epsilon,
        swiglu=ns.swiglu,
        add_bias_linear=ns.add_bias_linear,
        untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights,
        hidden_dropout=ns.hidden_dropout,
        attention_dropout=ns.attention_dropout,
        init_method_std=ns.init_method_std,
        recompute_activations=ns.recompute_activations,
        seed=ns.seed,
        params_dtype=torch.bfloat16 if ns.bf16 else (torch.float16 if ns.fp16 else torch.float32),
    )


def _lr_schedule_samples(ns: argparse.Namespace, gbs: int, train_samples: int) -> tuple[int, int]:
    """(decay_samples, warmup_samples) as Megatron's scheduler counts them."""
    iteration_based = ns.train_iters is not None
    if iteration_based and (ns.lr_decay_samples is not None or ns.lr_warmup_samples):
        raise UserError(
            "--lr-decay-samples/--lr-warmup-samples go with --train-samples; with --train-iters "
            "use --lr-decay-iters/--lr-warmup-iters"
        )
    if not iteration_based and (ns.lr_decay_iters is not None or ns.lr_warmup_iters):
        raise UserError(
            "--lr-decay-iters/--lr-warmup-iters go with --train-iters; with --train-samples "
            "use --lr-decay-samples/--lr-warmup-samples"
        )
    if iteration_based:
        decay = (ns.lr_decay_iters if ns.lr_decay_iters is not None else ns.train_iters) * gbs
        warmup_fixed = ns.lr_warmup_iters * gbs
    else:
        decay = ns.lr_decay_samples if ns.lr_decay_samples is not None else train_samples
        warmup_fixed = ns.lr_warmup_samples
    if ns.lr_warmup_fraction is not None:
        if warmup_fixed:
            raise UserError(
                "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive "
                "(keep one)"
            )
        warmup = int(ns.lr_warmup_fraction * decay)
    else:
        warmup = warmup_fixed
    if warmup > decay:
        raise UserError(
            f"warmup ({warmup} samples) is longer than the decay span ({decay} samples) "
            f"(shorten --lr-warmup-* or lengthen --lr-decay-*)"
        )
    return decay, warmup


def _load_deepspeed_json(path: str) -> dict:
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


def _check_deepspeed_json(
    ds: dict, path: str, ns: argparse.Namespace, gbs: int, mbs: int, dp: int
) -> int:
    """Compare the user's DeepSpeed JSON with the flags; return the ZeRO stage to use."""

    def mismatch(key: str, json_value: Any, flag: str, flag_value: Any) -> UserError:
        return UserError(
            f"--deepspeed_config {path} sets {key}={json_value} but {flag} is {flag_value} "
            f"(make them agree, or drop the key from the JSON)"
        )

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
    for key, flag in (("bf16", "--bf16"), ("fp16", "--fp16")):
        enabled = bool(ds.get(key, {}).get("enabled", False))
        if enabled != getattr(ns, key):
            raise mismatch(
                f"{key}.enabled",
                str(enabled).lower(),
                flag,
                "given" if getattr(ns, key) else "not given",
            )
    if "gradient_clipping" in ds and float(ds["gradient_clipping"]) != ns.clip_grad:
        raise mismatch("gradient_clipping", ds["gradient_clipping"], "--clip-grad", ns.clip_grad)
    for section, flags in (
        ("optimizer", "--lr/--adam-*/--weight-decay"),
        ("scheduler", "--lr-decay-style/--lr-warmup-*"),
    ):
        if section in ds:
            raise UserError(
                f'--deepspeed_config {path} has an "{section}" section; the optimizer and LR '
                f"schedule come from {flags} (remove the section)"
            )
    json_stage = ds.get("zero_optimization", {}).get("stage")
    if json_stage is not None and ns.zero_stage is not None and json_stage != ns.zero_stage:
        raise mismatch("zero_optimization.stage", json_stage, "--zero-stage", ns.zero_stage)
    return ns.zero_stage if ns.zero_stage is not None else (json_stage or 0)


def _check_data_files(data: DataConfig) -> None:
    blends = [data.blend] if data.blend is not None else list(data.blend_per_split or [])
    prefixes = [prefix for blend in blends if blend is not None for prefix in blend[0]]
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise UserError(
                    f"data prefix {prefix}: {prefix + ext} does not exist (run "
                    f"tools/preprocess_data.py, or fix --data-path)"
                )


def parse_args(argv: Sequence[str], env: dict | None = None) -> Config:
    argv = list(argv)
    _refuse_deprecated(argv)
    ns = build_parser().parse_args(argv)
    _require(
        ns,
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "micro_batch_size",
        "seq_length",
        "lr",
    )
    launch = detect_launch_env(env, ns.local_rank)

    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    world = launch.world_size
    if tp < 1 or pp < 1:
        raise UserError(
            "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1"
        )
    if world % (tp * pp):
        raise UserError(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp} (launch a multiple of {tp * pp} "
            f"ranks, or change TP/PP)"
        )
    dp = world // (tp * pp)
    if ns.no_pipeline_parallel and pp > 1:
        raise UserError(
            f"--no-pipeline-parallel contradicts --pipeline-model-parallel-size {pp} (drop one)"
        )

    mbs = ns.micro_batch_size
    gbs = ns.global_batch_size if ns.global_batch_size is not None else mbs * dp
    if gbs % (mbs * dp):
        raise UserError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel "
            f"size {dp} = {mbs * dp} (with world {world} = TP {tp} x PP {pp} x DP {dp}; use a "
            f"global batch that is a multiple of {mbs * dp})"
        )
    if (ns.train_iters is None) == (ns.train_samples is None):
        raise UserError("give exactly one of --train-iters and --train-samples")
    if ns.bf16 and ns.fp16:
        raise UserError("--bf16 and --fp16 are exclusive (keep one)")
    if ns.fp16 and not torch.cuda.is_available():
        raise UserError(
            "--fp16 needs a GPU (DeepSpeed has no fp16 on CPU); use --bf16 or fp32 on CPU"
        )
    if ns.min_lr > ns.lr:
        raise UserError(f"--min-lr {ns.min_lr} is larger than --lr {ns.lr} (lower --min-lr)")

    ds_json = None
    if ns.deepspeed_config:
        ds_json = _load_deepspeed_json(ns.deepspeed_config)
        zero = _check_deepspeed_json(ds_json, ns.deepspeed_config, ns, gbs, mbs, dp)
    else:
        zero = ns.zero_stage if ns.zero_stage is not None else 0
    if pp > 1 and zero > 1:
        raise UserError(
            f"--zero-stage {zero} with --pipeline-model-parallel-size {pp}: DeepSpeed's pipeline engine "
            f"supports ZeRO 0 and 1 only (use --zero-stage 1, or PP=1 for ZeRO-2/3)"
        )
    if ns.cpu_offload and zero == 0:
        raise UserError("--cpu-offload needs ZeRO (add --zero-stage 1, 2 or 3)")
    if ns.save is not None and ns.save_interval is None and ns.exit_interval is None:
        raise UserError("--save needs --save-interval (or --exit-interval to save once at exit)")
    if ns.finetune and ns.load is None:
        raise UserError("--finetune needs --load (the checkpoint to start from)")

    train_iters = ns.train_iters if ns.train_iters is not None else ns.train_samples // gbs
    train_samples = ns.train_samples if ns.train_samples is not None else train_iters * gbs
    decay, warmup = _lr_schedule_samples(ns, gbs, train_samples)

    tok = TokenizerConfig.from_args(ns)
    model = _model_config(
        ns, build_tokenizer(tok).vocab_size
    )  # building it checks the tokenizer files
    model.validate(tp, pp)
    data = DataConfig.from_args(ns)
    _check_data_files(data)

    return Config(
        model=model,
        parallel=ParallelConfig(
            tp,
            pp,
            dp,
            world,
            zero,
            ns.cpu_offload,
            ns.distributed_backend,
            ns.distributed_timeout_minutes,
        ),
        training=TrainingConfig(
            micro_batch_size=mbs,
            global_batch_size=gbs,
            num_microbatches=gbs // (mbs * dp),
            train_iters=train_iters,
            train_samples=ns.train_samples,
            seq_length=ns.seq_length,
            seed=ns.seed,
            lr=ns.lr,
            min_lr=ns.min_lr,
            lr_decay_style=ns.lr_decay_style,
            lr_decay_samples=decay,
            lr_warmup_samples=warmup,
            lr_warmup_init=ns.lr_warmup_init,
            weight_decay=ns.weight_decay,
            adam_beta1=ns.adam_beta1,
            adam_beta2=ns.adam_beta2,
            adam_eps=ns.adam_eps,
            clip_grad=ns.clip_grad,
            bf16=ns.bf16,
            fp16=ns.fp16,
            loss_scale=ns.loss_scale,
            initial_loss_scale=ns.initial_loss_scale,
            min_loss_scale=ns.min_loss_scale,
            loss_scale_window=ns.loss_scale_window,
            hysteresis=ns.hysteresis,
            eval_interval=ns.eval_interval,
            eval_iters=ns.eval_iters,
            exit_interval=ns.exit_interval,
            exit_duration_in_mins=ns.exit_duration_in_mins,
            deepspeed_config=ds_json,
        ),
        data=data,
        tokenizer=tok,
        checkpoint=CheckpointConfig(
            ns.save,
            ns.load,
            ns.save_interval,
            ns.no_save_rng,
            ns.no_load_optim,
            ns.no_load_rng,
            ns.finetune,
        ),
        logging=LoggingConfig(
            ns.log_interval,
            ns.tensorboard_dir,
            ns.tensorboard_log_interval,
            ns.wandb_project,
            ns.wandb_exp_name,
            ns.peak_tflops,
            ns.metrics_file,
        ),
        launch=launch,
        argv=tuple(argv),
    )
