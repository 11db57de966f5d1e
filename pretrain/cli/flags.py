"""The one table of training flags (`FLAGS`) and the pretrain_gpt.py parser built from it.

Each row gives the spellings, the argparse options and the config field the value fills
(`"section.field"`; model rows take their flag from `ModelConfig`'s field metadata, so the model's
field<->flag mapping exists once, in `pretrain/model/config.py`). Rows without a field are read by
the resolvers (`pretrain.cli.resolve`), which derive values from several flags. The data,
sample-count and tokenizer flags are owned by `pretrain.data.config` and `pretrain.tokenizer`
(the data tools share them).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from pretrain.data.config import add_data_args, add_sample_count_args
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.tokenizer import add_tokenizer_args
from pretrain.training.exit_signal import SIGNALS
from pretrain.training.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES
from pretrain.training.skip import iteration_spec
from pretrain.training.spikes import POLICIES

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
        _flag("--override-opt_param-scheduler", field="checkpoint.override_opt_param_scheduler", action="store_true", help="on resume, use this run's LR schedule flags where they differ from the checkpoint's (from the checkpoint's position); without it or --use-checkpoint-opt_param-scheduler a difference is refused"),
        _flag("--use-checkpoint-opt_param-scheduler", field="checkpoint.use_checkpoint_opt_param_scheduler", action="store_true", help="on resume, use the checkpoint's LR schedule (--lr, --min-lr, warmup, decay span and style) over this run's flags"),
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
        _flag("--check-for-nan-in-loss-and-grad", field="training.check_for_nan_in_loss_and_grad", action="store_true", default=True, help="accepted: on by default (Megatron-LM main): a NaN/Inf loss or grad norm stops every rank at that iteration, before any save, exit 2"),
        _flag("--no-check-for-nan-in-loss-and-grad", field="training.check_for_nan_in_loss_and_grad", action="store_false", default=True, help="train on past a NaN/Inf loss or grad norm; saves of non-finite weights are still refused (one warning each)"),
    )),
    ("loss spikes", (
        _flag("--check-for-spiky-loss", field="spikes.check_for_spiky_loss", action="store_true", help="detect loss spikes: a loss above mean + K x sigma of the trailing window; what happens is --spiky-loss-policy"),
        _flag("--spiky-loss-policy", field="spikes.policy", choices=list(POLICIES), default="warn", help="warn: one line, train on; skip: withhold the update and record the batch as skipped (as --iterations-to-skip); rewind: reload the last checkpoint in --save and skip the batch when it comes again [warn]"),
        _flag("--spiky-loss-window", field="spikes.window", type=int, default=128, help="trailing iterations the mean and sigma come from [128]"),
        _flag("--spiky-loss-factor", field="spikes.factor", type=float, default=6.0, help="K: a spike exceeds mean + K x sigma [6]"),
        _flag("--spiky-loss-min-window", field="spikes.min_fill", type=int, help="losses the window must hold before detection starts [half the window]"),
    )),
    ("batch-size schedule", (
        _flag("--rampup-batch-size", nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"), help="grow the global batch from START by INCREMENT up to --global-batch-size over SAMPLES samples (needs --train-samples)"),
        _flag("--step-batch-size-schedule", metavar="'THRESHOLD:BATCH ...'", help="Megatron-LM main's batch schedule, thresholds in tokens with K/M/B/T suffixes, e.g. '0:256 2B:512' (instead of --global-batch-size; needs --train-samples)"),
    )),
    ("checkpointing", (
        _flag("--save", field="checkpoint.save", help="checkpoint directory to write"),
        _flag("--save-interval", "--persistent-save-interval", field="checkpoint.save_interval", type=int),
        _flag("--load", field="checkpoint.load", help="checkpoint directory to resume from (its `latest`), or one of its global_step<N> folders (that step)"),
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


def flag_dest(row: Flag) -> str:
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
            group.add_argument(*row.names, dest=flag_dest(row), **row.options)
    add_sample_count_args(parser)
    add_data_args(parser)
    add_tokenizer_args(parser)
    return parser


def section_values(ns: argparse.Namespace, section: str) -> dict:
    """{field: value} of every table row that fills a field of `section` directly."""
    return {
        row.field.split(".", 1)[1]: getattr(ns, flag_dest(row))
        for _, rows in FLAGS
        for row in rows
        if row.field is not None and row.field.split(".", 1)[0] == section
    }
