"""Megatron-LM command-line flags -> the configs of one training run (`RunConfig`).

`parse_args(argv)` is the only place that sees argparse. `FLAGS` is the one table of training
flags: each row gives the spellings, the argparse options and the config field the value fills
(`"section.field"`; model rows take their flag from `ModelConfig`'s field metadata, so the model's
field<->flag mapping exists once, in `pretrain/model/config.py`). Rows without a field are read by
the few resolvers below, which derive values from several flags (batch arithmetic, the LR
schedule in samples, GQA and RoPE spellings) and check what argparse cannot. Every failed check
raises `UserError` with one line naming the flag(s), the values and the fix, before any process
group exists.

Flag spellings are Megatron-LM's. Megatron-DeepSpeed's spellings are accepted as aliases
(`--num-key-value-heads`, `--normalization rmsnorm`, `--use-rotary-position-embeddings`,
`--zero-stage`, `--no-pipeline-parallel`), as are DeepSpeed's own (`--deepspeed`,
`--deepspeed_config`, `--local_rank`). Flags Megatron removed are refused with their new name.
The data, sample-count and tokenizer flags are owned by `pretrain.data.config` and
`pretrain.tokenizer` (the data tools share them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from pretrain.data.builder import check_splits_before_launch
from pretrain.data.config import (
    DataConfig,
    add_data_args,
    add_sample_count_args,
    train_valid_test_num_samples,
)
from pretrain.data.fingerprint import check_data
from pretrain.errors import UserError
from pretrain.launch import detect_launch_env
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer import TokenizerConfig, add_tokenizer_args, build_tokenizer
from pretrain.training.batch_schedule import BatchSchedule, parse_step_schedule
from pretrain.training.checkpointing import CheckpointConfig
from pretrain.training.deepspeed_config import (
    PrecisionConfig,
    check_user_config,
    load_user_config,
)
from pretrain.training.evaluator import EvalConfig
from pretrain.training.exit_signal import SIGNALS
from pretrain.training.logging import LoggingConfig
from pretrain.training.loop import TrainingConfig
from pretrain.training.lr_schedule import (
    DECAY_STYLES,
    WSD_DECAY_STYLES,
    LRScheduleConfig,
    check_wsd,
    spans_in_samples,
)
from pretrain.training.optimizer import OptimizerConfig
from pretrain.training.run import RunConfig
from pretrain.training.skip import iteration_spec
from pretrain.training.validation_sets import check_validation_sets

# Megatron removed these; say what replaced them instead of "unrecognized arguments".
DEPRECATED_FLAGS = {
    "--batch-size": "--micro-batch-size",
    "--warmup": "--lr-warmup-fraction",
    "--model-parallel-size": "--tensor-model-parallel-size",
}


@dataclass(frozen=True)
class Flag:
    """One row of the table: the flag's spellings, argparse options, and the field it fills."""

    names: tuple[str, ...]
    field: str | None
    options: dict


def _flag(*names: str, field: str | None = None, **options: Any) -> Flag:
    return Flag(names, field, options)


_MODEL_FLAGS = {f.name: f.metadata["flag"] for f in fields(ModelConfig)}


def _model(field_name: str, *aliases: str, **options: Any) -> Flag:
    """A row filling ModelConfig.`field_name`, spelled as the field's metadata says."""
    return Flag((_MODEL_FLAGS[field_name], *aliases), f"model.{field_name}", options)


def _normalization(value: str) -> str:
    table = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
    if value.lower() not in table:
        raise argparse.ArgumentTypeError(f"{value!r} is not LayerNorm or RMSNorm")
    return table[value.lower()]


# fmt: off
FLAGS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    ("model", (
        _model("num_layers", type=int, help="transformer blocks (required)"),
        _model("hidden_size", type=int, help="model width (required)"),
        _model("ffn_hidden_size", type=int, help="MLP width [4*hidden; with --swiglu int(8h/3/64)*64]"),
        _model("num_attention_heads", type=int, help="attention heads (required)"),
        _model("kv_channels", type=int, help="per-head dimension [hidden / heads]"),
        _flag("--group-query-attention", action="store_true", help="grouped-query attention (GQA)"),
        _flag("--num-query-groups", type=int, help="key/value groups with --group-query-attention [1 = MQA]"),
        _flag("--num-key-value-heads", type=int, help="Megatron-DeepSpeed spelling of GQA: number of key/value heads"),
        _model("max_position_embeddings", type=int, help="[--seq-length]"),
        _flag("--position-embedding-type", choices=["learned_absolute", "rope"], help="[learned_absolute]"),
        _flag("--use-rotary-position-embeddings", action="store_true", help="Megatron-DeepSpeed spelling of --position-embedding-type rope"),
        _model("rotary_base", type=int, default=10000),
        _flag("--rotary-percent", type=float, default=1.0, help="accepted with 1.0 only (RoPE rotates every dimension of a head, Megatron's default); other values are refused"),
        _model("use_rope_scaling", action="store_true", help="Llama 3.x RoPE frequency scaling"),
        _model("rope_scaling_factor", type=float, default=8.0, help="Llama 3.x scaling factor [8]"),
        # not Megatron flags (it fixes these at Llama 3.1's values); they express other HF configs
        _model("rope_scaling_low_freq_factor", type=float, default=1.0, help="Llama 3.x [1]"),
        _model("rope_scaling_high_freq_factor", type=float, default=4.0, help="Llama 3.x [4]"),
        _model("rope_scaling_original_max_position_embeddings", type=int, default=8192, help="Llama 3.x [8192]"),
        _model("normalization", type=_normalization, default="LayerNorm", help="LayerNorm | RMSNorm"),
        _model("norm_epsilon", type=float, default=1e-5),
        _model("swiglu", action="store_true", help="gated SiLU MLP (Llama)"),
        _model("openai_gelu", action="store_true", help="tanh-approximate GELU (OpenAI GPT-2, HF gelu_new)"),
        _model("untie_embeddings_and_output_weights", action="store_true", help="separate LM head (default: tied to the input embedding)"),
        _model("add_bias_linear", action="store_false", help="no biases in linear layers (Llama)"),
        _model("attention_dropout", type=float, default=0.1),
        _model("hidden_dropout", type=float, default=0.1),
        _model("init_method_std", type=float, default=0.02),
        _model("make_vocab_size_divisible_by", type=int, default=128, help="pad the vocabulary to a multiple of this times TP [128]"),
        _flag("--recompute-activations", action="store_true", help="= --recompute-granularity selective (Megatron's spelling)"),
        _flag("--checkpoint-activations", action="store_true", help="Megatron-DeepSpeed's spelling of --recompute-granularity full --recompute-method uniform [--recompute-num-layers 1]"),
        _model("recompute_granularity", choices=["full", "selective"], help="recompute in backward: selective = the attention core of every layer; full = whole layers (needs --recompute-method, --recompute-num-layers)"),
        _model("recompute_method", choices=["uniform", "block"], help="full recompute: uniform = every chunk of N layers; block = the first N layers of each pipeline stage"),
        _model("recompute_num_layers", type=int, help="N of --recompute-method"),
    )),
    ("parallelism", (
        _flag("--tensor-model-parallel-size", field="parallel.tensor_model_parallel_size", type=int, default=1),
        _flag("--pipeline-model-parallel-size", field="parallel.pipeline_model_parallel_size", type=int, default=1),
        _model("sequence_parallel", action="store_true", help="norms and dropout on sequence chunks over TP ranks (all-gather/reduce-scatter around the TP linears); no-op at TP 1"),
        _flag("--no-pipeline-parallel", action="store_true", help="accepted (Megatron-DeepSpeed): PP=1 always runs without the pipeline engine; refused with PP > 1"),
        _flag("--zero-stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage over data-parallel ranks [0, or the stage in --deepspeed_config]"),
        _flag("--cpu-offload", field="parallel.cpu_offload", action="store_true", help="keep optimizer state in CPU memory (ZeRO >= 1)"),
        _flag("--distributed-backend", field="parallel.distributed_backend", choices=["nccl", "gloo"], help="[nccl with GPUs, gloo without]"),
        _flag("--distributed-timeout-minutes", field="parallel.distributed_timeout_minutes", type=float, default=10.0, help="collectives that wait longer than this fail instead of hanging [10]"),
        _flag("--deepspeed", action="store_true", help="accepted for Megatron-DeepSpeed scripts (always on)"),
        _flag("--deepspeed_config", "--deepspeed-config", help="DeepSpeed JSON; must agree with the batch, precision and ZeRO flags"),
        _flag("--local_rank", "--local-rank", type=int, help="set by the deepspeed launcher"),
    )),
    ("optimizer and schedule", (
        _flag("--lr", field="schedule.lr", type=float, help="peak learning rate (required)"),
        _flag("--min-lr", field="schedule.min_lr", type=float, default=0.0),
        _flag("--lr-decay-style", field="schedule.decay_style", choices=list(DECAY_STYLES), default="linear"),
        _flag("--lr-decay-iters", type=int, help="[--train-iters]"),
        _flag("--lr-decay-samples", type=int, help="[--train-samples] (sample-based training)"),
        _flag("--lr-wsd-decay-style", field="schedule.wsd_decay_style", choices=list(WSD_DECAY_STYLES), default="exponential", help="shape of the WSD anneal [exponential]"),
        _flag("--lr-wsd-decay-iters", type=int, help="WSD: iterations of the final anneal (with --train-iters)"),
        _flag("--lr-wsd-decay-samples", type=int, help="WSD: samples of the final anneal (with --train-samples)"),
        _flag("--lr-warmup-iters", type=int, default=0),
        _flag("--lr-warmup-samples", type=int, default=0),
        _flag("--lr-warmup-fraction", type=float, help="warmup as a fraction of the decay span"),
        _flag("--lr-warmup-init", field="schedule.warmup_init", type=float, default=0.0),
        _flag("--lr-decay-tokens", type=int, help="Megatron-DeepSpeed: decay over this many tokens (= tokens / --seq-length samples; replaces --lr-decay-iters/-samples)"),
        _flag("--lr-warmup-tokens", type=int, help="Megatron-DeepSpeed: warm up over this many tokens (= tokens / --seq-length samples)"),
        _flag("--train-tokens", field="training.train_tokens", type=int, help="Megatron-DeepSpeed: also stop once this many tokens were trained on (samples x --seq-length)"),
        _flag("--override-opt_param-scheduler", action="store_true", help="accepted: the LR schedule always comes from the flags, a checkpoint gives only its position"),
        _flag("--weight-decay", field="optimizer.weight_decay", type=float, default=0.01),
        _flag("--clip-grad", field="optimizer.clip_grad", type=float, default=1.0, help="global gradient-norm clip (0 = off)"),
        _flag("--adam-beta1", field="optimizer.adam_beta1", type=float, default=0.9),
        _flag("--adam-beta2", field="optimizer.adam_beta2", type=float, default=0.999),
        _flag("--adam-eps", field="optimizer.adam_eps", type=float, default=1e-8),
        _flag("--optimizer", choices=["adam"], default="adam", help="accepted: adam, the only choice (AdamW, decoupled weight decay)"),
        _flag("--bf16", field="precision.bf16", action="store_true"),
        _flag("--fp16", field="precision.fp16", action="store_true"),
        _flag("--loss-scale", field="precision.loss_scale", type=float, help="static fp16 loss scale [dynamic]"),
        _flag("--initial-loss-scale", field="precision.initial_loss_scale", type=float, help="first dynamic fp16 loss scale [2^32, or 2^initial_scale_power from --deepspeed_config]"),
        _flag("--min-loss-scale", field="precision.min_loss_scale", type=float, help="[1, or the --deepspeed_config fp16 value]"),
        _flag("--loss-scale-window", field="precision.loss_scale_window", type=int, help="[1000, or the --deepspeed_config fp16 value]"),
        _flag("--hysteresis", field="precision.hysteresis", type=int, help="[2, or the --deepspeed_config fp16 value]"),
        _flag("--exit-interval", field="training.exit_interval", type=int, help="save (with --save) and exit after this iteration"),
        _flag("--iterations-to-skip", field="training.iterations_to_skip", type=iteration_spec, nargs="+", action="extend", help="1-indexed iterations (N or A-B) whose batches are read and dropped without a step"),
        _flag("--exit-duration-in-mins", field="training.exit_duration_in_mins", type=float, help="save and exit after this many minutes"),
        _flag("--exit-signal-handler", field="training.exit_signal_handler", action="store_true", help="on --exit-signal every rank finishes its iteration, saves (with --save) and exits 0"),
        _flag("--exit-signal", field="training.exit_signal", choices=list(SIGNALS), default="SIGTERM", help="the signal --exit-signal-handler waits for [SIGTERM]"),
    )),
    ("batch-size schedule", (
        _flag("--rampup-batch-size", nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"), help="grow the global batch from START by INCREMENT up to --global-batch-size over SAMPLES samples (needs --train-samples)"),
        _flag("--step-batch-size-schedule", metavar="'THRESHOLD:BATCH ...'", help="Megatron-LM main's batch schedule, thresholds in tokens with K/M/B/T suffixes, e.g. '0:256 2B:512' (instead of --global-batch-size; needs --train-samples)"),
    )),
    ("checkpointing", (
        _flag("--save", field="checkpoint.save", help="checkpoint directory to write"),
        _flag("--save-interval", "--persistent-save-interval", field="checkpoint.save_interval", type=int),
        _flag("--load", field="checkpoint.load", help="checkpoint directory to resume from (its `latest`)"),
        _flag("--no-save-rng", field="checkpoint.no_save_rng", action="store_true", help="do not save per-rank RNG states"),
        _flag("--no-save-full-state", field="checkpoint.no_save_full_state", action="store_true", help="do not save the layout-independent full_state_*.pt files (fp32 weights + Adam moments again, 12 bytes per parameter): smaller, faster saves, but the checkpoint resumes only at its own TP/PP/DP/ZeRO layout and tools/reshard_checkpoint.py cannot read it (docs/CHECKPOINTS.md)"),
        _flag("--no-load-optim", field="checkpoint.no_load_optim", action="store_true"),
        _flag("--no-load-rng", field="checkpoint.no_load_rng", action="store_true"),
        _flag("--save-total-limit", "--save-keep-last", "--most-recent-k", field="checkpoint.save_total_limit", type=int, help="keep only the newest N complete checkpoints (older ones are deleted after a newer one is committed; never the one `latest` names)"),
        _flag("--finetune", field="checkpoint.finetune", action="store_true", help="load weights only: no optimizer, RNG or data position; iteration restarts at 0"),
    )),
    ("logging", (
        _flag("--log-interval", field="logging.log_interval", type=int, default=100),
        _flag("--tensorboard-dir", field="logging.tensorboard_dir"),
        _flag("--tensorboard-log-interval", field="logging.tensorboard_log_interval", type=int, default=1, help="write training scalars to TensorBoard/wandb every N iterations [1]"),
        _flag("--wandb-project", field="logging.wandb_project"),
        _flag("--wandb-exp-name", field="logging.wandb_exp_name"),
        _flag("--peak-tflops", field="logging.peak_tflops", type=float, help="peak TFLOP/s per device for MFU [a table of known GPUs; none on CPU]"),
        _flag("--metrics-file", field="logging.metrics_file", help="append one JSON line per iteration (full-precision loss, grad norm, lr)"),
        _flag("--log-throughput", action="store_true", help="accepted for Megatron scripts (always on)"),
        _flag("--log-validation-ppl-to-tensorboard", action="store_true", help="no-op: validation and test perplexity are always written"),
        _flag("--log-timers-to-tensorboard", action="store_true", help="accepted: there are no per-phase timers; iteration-time is always written"),
        _flag("--log-batch-size-to-tensorboard", action="store_true", help="accepted: not written (the global batch size is in every log line)"),
        _flag("--log-optimizer-states-to-tensorboard", action="store_true", help="accepted: optimizer-state norms are not written"),
        _flag("--tensorboard-queue-size", type=int, help="accepted: TensorBoard's own queue size is used (events are flushed when the run ends)"),
    )),
    ("evaluation", (
        _flag("--multiple-validation-sets", field="evaluation.multiple_validation_sets", action="store_true", help="evaluate each --valid-data-path prefix as its own validation set (unblended; --eval-iters global batches of each), one 'validation-<name> loss' block per set"),
        _flag("--validation-set-names", field="evaluation.validation_set_names", nargs="+", metavar="NAME", help="with --multiple-validation-sets: one name per --valid-data-path prefix for its log lines and scalars [0 1 ...]"),
    )),
    ("Megatron script compatibility (accepted; the behaviour is fixed here)", (
        _flag("--use-distributed-optimizer", action="store_true", help="shard the optimizer state over data-parallel ranks: ZeRO-1 unless --zero-stage says more"),
        _flag("--use-flash-attn", action="store_true", help="no-op: attention is torch SDPA, which picks flash attention on GPUs by itself"),
        _flag("--use-mcore-models", action="store_true", help="no-op: the model is always this project's megatron-core-style GPT"),
        _flag("--data-impl", choices=["mmap"], help="no-op: the mmap .bin/.idx format is the only one (Megatron-DeepSpeed scripts pass mmap)"),
        _flag("--no-masked-softmax-fusion", action="store_true", help="no-op: no fused softmax kernel (SDPA); same numerics"),
        _flag("--no-bias-gelu-fusion", action="store_true", help="no-op: no fused bias+GeLU kernel; same numerics"),
        _flag("--no-bias-swiglu-fusion", action="store_true", help="no-op: no fused bias+SwiGLU kernel; same numerics"),
        _flag("--no-bias-dropout-fusion", action="store_true", help="no-op: no fused bias+dropout kernel; same numerics"),
        _flag("--no-rope-fusion", action="store_true", help="no-op: no fused RoPE kernel; same numerics"),
        _flag("--no-gradient-accumulation-fusion", action="store_true", help="no-op: gradients accumulate in the parameters' .grad (no fused wgrad kernel)"),
        _flag("--no-persist-layer-norm", action="store_true", help="no-op: torch LayerNorm/RMSNorm"),
        _flag("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], help="accepted: attention is torch SDPA, which picks its kernel by itself"),
        _flag("--no-query-key-layer-scaling", action="store_true", help="no-op: attention scores are never scaled by the layer number (Megatron-DeepSpeed flag)"),
        _flag("--deepspeed-activation-checkpointing", action="store_true", help="no-op: --recompute-activations uses this project's checkpointing, which replays the RNG states"),
        _flag("--no-async-tensor-model-parallel-allreduce", action="store_true", help="no-op: tensor-parallel all-reduces are synchronous"),
        _flag("--no-mmap-bin-files", action="store_true", help="no-op: .bin files are always memory-mapped"),
    )),
)
# fmt: on


def _dest(row: Flag) -> str:
    """Where argparse stores the row's value: the field path, or the flag's own name."""
    if row.field is not None:
        return row.field.replace(".", "__")
    return row.names[0].lstrip("-").replace("-", "_")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a UserError (one line, exit 2) rather than usage + SystemExit."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        raise UserError(f"{message} (see `pretrain_gpt.py --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The pretrain_gpt.py parser: the table's groups, then the sample-count, data and
    tokenizer flags their modules own."""
    parser = _Parser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,
        description="Pretrain a GPT (GPT-2 or Llama flavour) with Megatron-LM flags on "
        "tensor parallelism + DeepSpeed pipeline parallelism and ZeRO.",
    )
    for title, rows in FLAGS:
        group = parser.add_argument_group(title)
        for row in rows:
            group.add_argument(*row.names, dest=_dest(row), **row.options)
    add_sample_count_args(parser)
    add_data_args(parser)
    add_tokenizer_args(parser)
    return parser


def _section(ns: argparse.Namespace, section: str) -> dict:
    """{field: value} of every table row that fills a field of `section` directly."""
    return {
        row.field.split(".", 1)[1]: getattr(ns, _dest(row))
        for _, rows in FLAGS
        for row in rows
        if row.field is not None and row.field.split(".", 1)[0] == section
    }


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


def _model_config(ns: argparse.Namespace, vocab_size: int) -> ModelConfig:
    dtype = torch.bfloat16 if ns.precision__bf16 else None
    dtype = torch.float16 if ns.precision__fp16 else dtype
    return ModelConfig(
        **{**_section(ns, "model"), **_recompute(ns)},
        num_query_groups=_query_groups(ns),
        position_embedding_type=_position_embedding_type(ns),
        vocab_size=vocab_size,
        seq_length=ns.seq_length,
        seed=ns.seed,
        params_dtype=dtype or torch.float32,
    )


def _lr_schedule(ns: argparse.Namespace, gbs: int, train_samples: int) -> LRScheduleConfig:
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
        **_section(ns, "schedule"),
        decay_samples=spans.decay,
        warmup_samples=spans.warmup,
        wsd_decay_samples=spans.wsd if ns.schedule__decay_style == "WSD" else None,
    )


def _batch_schedule(ns: argparse.Namespace, dp: int, world_size: int) -> BatchSchedule:
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


def _precision(ns: argparse.Namespace, ds_json: dict | None) -> PrecisionConfig:
    """Precision flags; an fp16 loss-scale flag not given takes the --deepspeed_config value
    (what DeepSpeed would use in a Megatron-DeepSpeed run), else Megatron's default. A flag that
    is given and disagrees with the JSON is refused later (check_user_config)."""
    values = _section(ns, "precision")
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


def _check_data_splits(data: DataConfig, ns, train_iters: int, gbs: int, rank: int) -> None:
    """An empty train split is refused here, before launch; a missing validation split while
    --eval-iters > 0 is said once (by rank 0)."""
    counts = train_valid_test_num_samples(
        train_iters, ns.train_samples, ns.eval_interval, ns.eval_iters, gbs
    )

    def warn(msg: str) -> None:
        print(f"warning: {msg}", file=sys.stderr, flush=True)

    check_splits_before_launch(data, counts, ns.eval_iters, warn if rank == 0 else None)


def parse_args(argv: Sequence[str], env: dict | None = None) -> RunConfig:
    """Flags (and the launcher's environment) -> a validated `RunConfig`, or one UserError."""
    argv = list(argv)
    _refuse_deprecated(argv)
    ns = build_parser().parse_args(argv)
    _require(
        ns,
        **{
            "--num-layers": "model__num_layers",
            "--hidden-size": "model__hidden_size",
            "--num-attention-heads": "model__num_attention_heads",
            "--micro-batch-size": "micro_batch_size",
            "--seq-length": "seq_length",
            "--lr": "schedule__lr",
        },
    )
    launch = detect_launch_env(env, ns.local_rank)
    parallel_flags = _section(ns, "parallel")
    ParallelConfig(**parallel_flags, world_size=launch.world_size)  # the layout check, first
    tp, pp = ns.parallel__tensor_model_parallel_size, ns.parallel__pipeline_model_parallel_size
    dp = launch.world_size // (tp * pp)
    if ns.no_pipeline_parallel and pp > 1:
        raise UserError(
            f"--no-pipeline-parallel contradicts --pipeline-model-parallel-size {pp} (drop one)"
        )

    mbs = ns.micro_batch_size
    if (ns.train_iters is None) == (ns.train_samples is None):
        raise UserError("give exactly one of --train-iters and --train-samples")
    if ns.rotary_percent != 1.0:
        raise UserError(
            f"--rotary-percent {ns.rotary_percent}: only 1.0 is implemented (RoPE rotates every "
            f"dimension of a head; drop the flag)"
        )
    batches = _batch_schedule(ns, dp, launch.world_size)
    gbs = batches.global_batch_size
    ds_json = load_user_config(ns.deepspeed_config) if ns.deepspeed_config else None
    precision = _precision(ns, ds_json)
    if precision.bf16 and precision.fp16:
        raise UserError("--bf16 and --fp16 are exclusive (keep one)")
    if precision.fp16 and not torch.cuda.is_available():
        raise UserError(
            "--fp16 needs a GPU (DeepSpeed has no fp16 on CPU); use --bf16 or fp32 on CPU"
        )
    if ns.schedule__min_lr > ns.schedule__lr:
        raise UserError(
            f"--min-lr {ns.schedule__min_lr} is larger than --lr {ns.schedule__lr} (lower --min-lr)"
        )

    if ds_json is not None:
        zero = check_user_config(
            ds_json,
            ns.deepspeed_config,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            data_parallel_size=dp,
            precision=precision,
            clip_grad=ns.optimizer__clip_grad,
            zero_stage_flag=ns.zero_stage,
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
    parallel = ParallelConfig(**parallel_flags, world_size=launch.world_size, zero_stage=zero)
    if parallel.cpu_offload and zero == 0:
        raise UserError("--cpu-offload needs ZeRO (add --zero-stage 1, 2 or 3)")
    checkpoint = CheckpointConfig(**_section(ns, "checkpoint"))
    if checkpoint.save is not None and checkpoint.save_interval is None:
        if ns.training__exit_interval is None:
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

    train_iters = (
        ns.train_iters if ns.train_iters is not None else batches.train_iters(ns.train_samples)
    )
    train_samples = ns.train_samples if ns.train_samples is not None else train_iters * gbs
    schedule = _lr_schedule(ns, gbs, train_samples)

    if ns.tokenizer_type is None:  # Megatron's pretrain_gpt.py: args_defaults
        ns.tokenizer_type = "GPT2BPETokenizer"
    tokenizer = TokenizerConfig.from_args(ns)
    # building the tokenizer checks its files and gives the true vocabulary size
    built_tokenizer = build_tokenizer(tokenizer)
    model = _model_config(ns, built_tokenizer.vocab_size)
    model.validate(tp, pp)
    data = DataConfig.from_args(ns)
    _check_data_files(data)
    # data fingerprints: made by this tokenizer, largest token id inside its vocabulary
    check_data(data, tokenizer, built_tokenizer, built_tokenizer.vocab_size)
    _check_data_splits(data, ns, train_iters, gbs, launch.rank)
    evaluation = EvalConfig(
        **_section(ns, "evaluation"), eval_interval=ns.eval_interval, eval_iters=ns.eval_iters
    )
    check_validation_sets(
        evaluation.multiple_validation_sets, evaluation.validation_set_names, data
    )

    return RunConfig(
        model=model,
        parallel=parallel,
        training=TrainingConfig(
            **_section(ns, "training"),
            micro_batch_size=mbs,
            global_batch_size=gbs,
            num_microbatches=gbs // (mbs * dp),
            batch_schedule=batches if batches.varies else None,
            train_iters=train_iters,
            train_samples=ns.train_samples,
            seq_length=ns.seq_length,
            seed=ns.seed,
        ),
        schedule=schedule,
        optimizer=OptimizerConfig(**_section(ns, "optimizer")),
        precision=precision,
        evaluation=evaluation,
        data=data,
        tokenizer=tokenizer,
        checkpoint=checkpoint,
        logging=LoggingConfig(**_section(ns, "logging")),
        launch=launch,
        deepspeed_json=ds_json,
        argv=tuple(argv),
    )


def data_tool_parser(description: str, *, tokenizer: bool = True) -> argparse.ArgumentParser:
    """A data tool's parser (build_data_cache, plan_blend, explain_batch): training's own data and
    sample-count flags (and tokenizer flags), so a tool takes a run's command line as it is."""
    # allow_abbrev=False: a training flag must never be taken for an abbreviation of a tool's own
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_data_args(parser)
    add_sample_count_args(parser)
    if tokenizer:
        add_tokenizer_args(parser)
    return parser


def parse_data_tool_args(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The tool's flags; the rest of the command line must be pretrain_gpt.py flags: a typo of a
    data flag (say --splt) would otherwise plan, explain or cache other data, silently."""
    ns, rest = parser.parse_known_args(argv)
    _, unknown = build_parser().parse_known_args(rest)
    if unknown:
        raise UserError(
            f"unrecognized argument(s): {' '.join(unknown)} (neither a data flag nor a "
            "pretrain_gpt.py flag; see --help)"
        )
    return ns
