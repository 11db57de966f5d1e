"""The one table of training flags (`FLAGS`) and the pretrain_gpt.py parser built from it.

Each row gives the spellings, the argparse options and the config field the value fills
(`"section.field"`; model rows take their flag from `ModelConfig`'s field metadata, so the model's
field<->flag mapping exists once, in `pretrain/model/config.py`). Rows without a field are read by
the resolvers (`pretrain.cli.resolve`), which derive values from several flags. The data,
sample-count and tokenizer flags are owned by `pretrain.data.config` and `pretrain.tokenizer`
(the data tools share them). A group is one of Megatron-LM's argument groups (`network size`,
`regularization`, `training`, ...; `pretrain.flag_help.MEGATRON_GROUPS`) or one only this project
has; a row's `help` is one line, and `--help` appends its default and picks its metavar.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from pretrain.data.config import add_data_args, add_sample_count_args
from pretrain.errors import UserError
from pretrain.flag_help import HelpFormatter, add_megatron_groups, argument_group
from pretrain.model.config import ModelConfig
from pretrain.model.moe.config import parse_layer_freq
from pretrain.tokenizer import add_tokenizer_args
from pretrain.training.backends.torch.pipeline_flags import SCHEDULE_CHOICES
from pretrain.training.loop.exit_signal import SIGNALS
from pretrain.training.loop.skip import iteration_spec
from pretrain.training.loop.spikes import POLICIES
from pretrain.training.schedules.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES

# Megatron-LM's choices for --dist-ckpt-strictness (key mismatches in a torch_dist load)
DIST_CKPT_STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)

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


def _layer_freq(value: str) -> int | tuple[int, ...]:
    try:
        return parse_layer_freq(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _normalization(value: str) -> str:
    table = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
    if value.lower() not in table:
        raise argparse.ArgumentTypeError(f"{value!r} is not LayerNorm or RMSNorm")
    return table[value.lower()]


# fmt: off
FLAGS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    ("network size", (
        _model("num_layers", type=int, help="number of transformer layers (required)"),
        _model("hidden_size", type=int, help="model width: the size of each layer's input and output (required)"),
        _model("ffn_hidden_size", type=int, help="MLP hidden size [default: 4 x --hidden-size; with --swiglu int(8h/3/64)*64]"),
        _model("num_attention_heads", type=int, help="attention heads per layer (required)"),
        _model("kv_channels", type=int, help="dimension of each attention head [default: --hidden-size / --num-attention-heads]"),
        _flag("--group-query-attention", action="store_true", help="grouped-query attention (GQA): the heads share --num-query-groups key/value heads"),
        _flag("--num-query-groups", type=int, help="key/value heads with --group-query-attention (1 = multi-query attention) [default: 1]"),
        _flag("--num-key-value-heads", type=int, help="Megatron-DeepSpeed spelling of GQA: number of key/value heads [default: --num-attention-heads]"),
        _model("max_position_embeddings", type=int, help="positions the model is built for, in tokens [default: --seq-length]"),
        _flag("--position-embedding-type", choices=["learned_absolute", "rope"], help="learned absolute positions (GPT-2) or rotary embeddings (Llama) [default: learned_absolute]"),
        _flag("--use-rotary-position-embeddings", action="store_true", help="Megatron-DeepSpeed spelling of --position-embedding-type rope"),
        _model("rotary_base", type=int, default=10000, help="RoPE base period (theta)"),
        _flag("--rotary-percent", type=float, default=1.0, help="accepted with 1.0 only (RoPE rotates every dimension of a head, Megatron's default); other values are refused"),
        _model("use_rope_scaling", action="store_true", help="Llama 3.x RoPE frequency scaling"),
        _model("rope_scaling_factor", type=float, default=8.0, help="Llama 3.x RoPE scaling factor"),
        # not Megatron flags (it fixes these at Llama 3.1's values); they express other HF configs
        _model("rope_scaling_low_freq_factor", type=float, default=1.0, help="Llama 3.x RoPE low-frequency factor"),
        _model("rope_scaling_high_freq_factor", type=float, default=4.0, help="Llama 3.x RoPE high-frequency factor"),
        _model("rope_scaling_original_max_position_embeddings", type=int, default=8192, help="Llama 3.x: the context length (tokens) the RoPE frequencies were made for"),
        _model("normalization", type=_normalization, default="LayerNorm", metavar="{LayerNorm,RMSNorm}", help="normalization layer (either spelling case)"),
        _model("norm_epsilon", type=float, default=1e-5, help="epsilon of every LayerNorm/RMSNorm"),
        _model("qk_layernorm", action="store_true", help="a --normalization norm over each query and key head before RoPE (Qwen3)"),
        _model("swiglu", action="store_true", help="gated SiLU MLP (Llama)"),
        _model("openai_gelu", action="store_true", help="tanh-approximate GELU (OpenAI GPT-2, HF gelu_new)"),
        _model("untie_embeddings_and_output_weights", action="store_true", help="separate LM head (default: tied to the input embedding)"),
        _model("add_bias_linear", action="store_false", help="no biases in linear layers (Llama)"),
        _model("make_vocab_size_divisible_by", type=int, default=128, help="pad the vocabulary to a multiple of this times the tensor-parallel size"),
        _flag("--rotary-position-embeddings-theta", type=int, metavar="N", help="Megatron-DeepSpeed spelling of --rotary-base"),
        _flag("--no-position-embedding", action="store_true", help="accepted with --position-embedding-type rope only (a RoPE model has no learned position table); refused with learned_absolute"),
    )),
    ("regularization", (
        _model("attention_dropout", type=float, default=0.1, help="dropout probability on the attention probabilities"),
        _model("hidden_dropout", type=float, default=0.1, help="dropout probability on the embeddings and on each attention and MLP output"),
        _flag("--weight-decay", field="optimizer.weight_decay", type=float, default=0.01, help="AdamW (decoupled) weight decay of the matrices; biases and norm weights have none"),
        _flag("--clip-grad", field="optimizer.clip_grad", type=float, default=1.0, help="global gradient-norm clip (0 = off)"),
        _flag("--adam-beta1", field="optimizer.adam_beta1", type=float, default=0.9, help="Adam decay rate of the gradient average"),
        _flag("--adam-beta2", field="optimizer.adam_beta2", type=float, default=0.999, help="Adam decay rate of the squared-gradient average"),
        _flag("--adam-eps", field="optimizer.adam_eps", type=float, default=1e-8, help="Adam epsilon, added to the denominator"),
    )),
    ("initialization", (
        _model("init_method_std", type=float, default=0.02, help="standard deviation of the normal distribution the weights are drawn from"),
    )),
    ("distributed", (
        _flag("--tensor-model-parallel-size", field="parallel.tensor_model_parallel_size", type=int, default=1, help="tensor-parallel size: ranks that split each layer's weights"),
        _flag("--pipeline-model-parallel-size", field="parallel.pipeline_model_parallel_size", type=int, default=1, help="pipeline-parallel size: stages the layers are split into"),
        _model("sequence_parallel", action="store_true", help="norms and dropout on sequence chunks over TP ranks (all-gather/reduce-scatter around the TP linears); no-op at TP 1"),
        _flag("--no-pipeline-parallel", action="store_true", help="accepted (Megatron-DeepSpeed): PP=1 always runs without the pipeline engine; refused with PP > 1"),
        _flag("--use-torch-fsdp2", field="parallel.use_torch_fsdp2", action="store_true", help="the torch-native backend: FSDP2 (fully_shard per transformer layer, then the root) shards parameters, gradients and optimizer state over the data-parallel ranks, with DCP checkpoints (--ckpt-format torch_dist, --async-save); instead of DeepSpeed, whose ZeRO flags it refuses (docs/TRAINING.md, \"Which backend\")"),
        _flag("--zero-stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage over data-parallel ranks [default: 0, or the stage in --deepspeed_config]"),
        _flag("--use-distributed-optimizer", action="store_true", help="shard the optimizer state over data-parallel ranks: ZeRO-1 unless --zero-stage says more"),
        _flag("--cpu-offload", action="store_true", help="ZeRO-Offload: optimizer state and step in CPU memory (ZeRO >= 1); the same as --offload-optimizer cpu"),
        _flag("--offload-optimizer", field="parallel.offload_optimizer", choices=["cpu", "nvme"], help="ZeRO-Offload/ZeRO-Infinity: optimizer state in CPU memory (ZeRO >= 1) or in --offload-nvme-path (ZeRO-3; refused with --save/--load: its checkpoints do not resume) [default: device memory, or the --deepspeed_config JSON's]"),
        _flag("--offload-param", field="parallel.offload_param", choices=["cpu", "nvme"], help="ZeRO-3 parameter offload: partitioned parameters in CPU memory or in --offload-nvme-path [default: device memory, or the --deepspeed_config JSON's]"),
        _flag("--offload-nvme-path", field="parallel.offload_nvme_path", metavar="DIR", help="existing writable folder (fast local disk) the nvme offload swaps to: DeepSpeed's nvme_path"),
        _flag("--distributed-backend", field="parallel.distributed_backend", choices=["nccl", "gloo"], help="torch.distributed backend [default: nccl with GPUs, gloo without]"),
        _flag("--distributed-timeout-minutes", field="parallel.distributed_timeout_minutes", type=float, default=10.0, help="minutes after which a waiting collective fails instead of hanging"),
        _flag("--deepspeed", action="store_true", help="accepted for Megatron-DeepSpeed scripts (always on)"),
        _flag("--deepspeed_config", "--deepspeed-config", help="DeepSpeed JSON; must agree with the batch, precision and ZeRO flags [default: built from the flags]"),
        _flag("--local_rank", "--local-rank", type=int, help="set by the deepspeed launcher"),
        _flag("--context-parallel-size", type=int, default=1, metavar="N", help="accepted with 1 only: there is no context parallelism (TP, PP and DP exist; >1 is refused)"),
        _flag("--ds-sequence-parallel-size", type=int, default=1, metavar="N", help="accepted with 1 only: there is no DeepSpeed-Ulysses sequence parallelism (use --sequence-parallel with TP; >1 is refused)"),
        _flag("--num-layers-per-virtual-pipeline-stage", type=int, metavar="N", help="interleaved pipeline (--use-torch-fsdp2): N layers per model chunk, (layers / PP) / N chunks per pipeline rank, chunk c of rank r holding the layers of virtual stage c x PP + r (Megatron's); N = layers / PP (one chunk) on either backend"),
        _flag("--num-virtual-stages-per-pipeline-rank", type=int, metavar="V", help="interleaved pipeline (--use-torch-fsdp2): V model chunks per pipeline rank (exclusive with --num-layers-per-virtual-pipeline-stage); 1 on either backend"),
        _flag("--pipeline-schedule", choices=list(SCHEDULE_CHOICES), help="pipeline schedule (torch.distributed.pipelining); all but 1f1b need --use-torch-fsdp2, zbv-zero-bubble 2 model chunks per rank [default: 1f1b, interleaved-1f1b with more than one model chunk per rank] (docs/TRAINING.md, \"Which schedule\")"),
        _flag("--overlap-grad-reduce", field="parallel.overlap_grad_reduce", action="store_true", help="overlap the gradient reduce-scatter with the backward pass: DeepSpeed's zero_optimization.overlap_comm (ZeRO 1-2; ZeRO-3 overlaps by default; ZeRO-0 has no overlap)"),
        _flag("--overlap-param-gather", action="store_true", help="accepted: ZeRO-3 already prefetches parameters during the forward pass; ZeRO-1/2 gather the updated parameters after the step (DeepSpeed has no overlap for it)"),
        _flag("--DDP-impl", choices=["local", "torch"], help="accepted: DeepSpeed's engine does the data-parallel gradient reduction"),
        _flag("--no-scatter-gather-tensors-in-pipeline", action="store_true", help="accepted: DeepSpeed's pipeline engine decides how activations are sent between stages"),
        _flag("--use-nccl-ub", action="store_true", help="accepted: no NCCL user buffers are registered (communication speed only)"),
    )),
    ("learning rate", (
        _flag("--lr", field="schedule.lr", type=float, help="peak learning rate (required)"),
        _flag("--min-lr", field="schedule.min_lr", type=float, default=0.0, help="learning rate at the end of the decay"),
        _flag("--lr-decay-style", field="schedule.decay_style", choices=list(DECAY_STYLES), default="linear", help="shape of the decay from --lr to --min-lr after warmup"),
        _flag("--lr-decay-iters", type=int, help="iteration at which the decay to --min-lr ends (warmup included) [default: --train-iters]"),
        _flag("--lr-decay-samples", type=int, help="sample at which the decay to --min-lr ends (warmup included; sample-based training) [default: --train-samples]"),
        _flag("--lr-wsd-decay-style", field="schedule.wsd_decay_style", choices=list(WSD_DECAY_STYLES), default="exponential", help="shape of the WSD anneal"),
        _flag("--lr-wsd-decay-iters", type=int, help="WSD: iterations of the final anneal (with --train-iters)"),
        _flag("--lr-wsd-decay-samples", type=int, help="WSD: samples of the final anneal (with --train-samples)"),
        _flag("--lr-warmup-iters", type=int, default=0, help="iterations of linear warmup from --lr-warmup-init to --lr"),
        _flag("--lr-warmup-samples", type=int, default=0, help="samples of linear warmup (sample-based training)"),
        _flag("--lr-warmup-fraction", type=float, help="warmup as a fraction of the decay span"),
        _flag("--lr-warmup-init", field="schedule.warmup_init", type=float, default=0.0, help="learning rate the warmup starts from"),
        _flag("--lr-decay-tokens", type=int, help="Megatron-DeepSpeed: decay over this many tokens (= tokens / --seq-length samples; replaces --lr-decay-iters/-samples)"),
        _flag("--lr-warmup-tokens", type=int, help="Megatron-DeepSpeed: warm up over this many tokens (= tokens / --seq-length samples)"),
        _flag("--override-opt_param-scheduler", field="checkpoint.override_opt_param_scheduler", action="store_true", help="on resume, use this run's LR schedule flags where they differ from the checkpoint's (from the checkpoint's position); without it or --use-checkpoint-opt_param-scheduler a difference is refused"),
        _flag("--use-checkpoint-opt_param-scheduler", field="checkpoint.use_checkpoint_opt_param_scheduler", action="store_true", help="on resume, use the checkpoint's LR schedule (--lr, --min-lr, warmup, decay span and style) over this run's flags"),
    )),
    ("training", (
        _flag("--train-tokens", field="training.train_tokens", type=int, help="Megatron-DeepSpeed: also stop once this many tokens were trained on (samples x --seq-length)"),
        _flag("--optimizer", choices=["adam"], default="adam", help="accepted: adam, the only choice (AdamW, decoupled weight decay)"),
        _flag("--recompute-activations", action="store_true", help="= --recompute-granularity selective (Megatron's spelling)"),
        _flag("--checkpoint-activations", action="store_true", help="Megatron-DeepSpeed's spelling of --recompute-granularity full --recompute-method uniform [--recompute-num-layers 1]"),
        _model("recompute_granularity", choices=["full", "selective"], help="recompute in backward: selective = the attention core of every layer; full = whole layers (needs --recompute-method, --recompute-num-layers)"),
        _model("recompute_method", choices=["uniform", "block"], help="full recompute: uniform = every chunk of N layers; block = the first N layers of each pipeline stage"),
        _model("recompute_num_layers", type=int, help="the N of --recompute-method: layers per recomputed chunk (uniform) or per stage (block)"),
        _flag("--exit-interval", field="training.exit_interval", type=int, help="save (with --save) and exit after this iteration"),
        _flag("--iterations-to-skip", field="training.iterations_to_skip", type=iteration_spec, nargs="+", action="extend", metavar="N|A-B", help="1-indexed iterations (N or A-B) whose batches are read and dropped without a step"),
        _flag("--exit-duration-in-mins", field="training.exit_duration_in_mins", type=float, help="save and exit after this many minutes"),
        _flag("--exit-signal-handler", field="training.exit_signal_handler", action="store_true", help="on --exit-signal every rank finishes its iteration, saves (with --save) and exits 0"),
        _flag("--exit-signal", field="training.exit_signal", choices=list(SIGNALS), default="SIGTERM", help="the signal --exit-signal-handler waits for"),
        _flag("--check-for-nan-in-loss-and-grad", field="training.check_for_nan_in_loss_and_grad", action="store_true", default=True, help="accepted: on by default (Megatron-LM main): a NaN/Inf loss or grad norm stops every rank at that iteration, before any save, exit 2"),
        _flag("--no-check-for-nan-in-loss-and-grad", field="training.check_for_nan_in_loss_and_grad", action="store_false", default=True, help="train on past a NaN/Inf loss or grad norm; saves of non-finite weights are still refused (one warning each)"),
        _flag("--manual-gc", field="manual_gc.enabled", action="store_true", help="Python's garbage collector off during the loop and run at the same points on every rank (no straggler waits for a rank's collection): at the start, every --manual-gc-interval iterations, around evaluations"),
        _flag("--manual-gc-interval", field="manual_gc.interval", type=int, default=0, metavar="N", help="with --manual-gc: collect after every N-th iteration (0: only at the start and around evaluations)"),
        _flag("--no-manual-gc-eval", field="manual_gc.at_evaluation", action="store_false", default=True, help="with --manual-gc: no collection before and after evaluations"),
        _flag("--rampup-batch-size", nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"), help="grow the global batch from START by INCREMENT up to --global-batch-size over SAMPLES samples (needs --train-samples)"),
        _flag("--step-batch-size-schedule", metavar="'THRESHOLD:BATCH ...'", help="Megatron-LM main's batch schedule, thresholds in tokens with K/M/B/T suffixes, e.g. '0:256 2B:512' (instead of --global-batch-size; needs --train-samples)"),
        _flag("--activations-checkpoint-method", choices=["uniform", "block"], help="older Megatron / Megatron-DeepSpeed spelling of --recompute-method (with --checkpoint-activations)"),
        _flag("--recompute-modules", nargs="+", metavar="MODULE", help="accepted with core_attn only (selective recompute is the attention core, Megatron's default); other modules are refused"),
    )),
    ("mixed precision", (
        _flag("--bf16", field="precision.bf16", action="store_true", help="train in bfloat16 (DeepSpeed's bf16 mode)"),
        _flag("--fp16", field="precision.fp16", action="store_true", help="train in float16 with loss scaling (DeepSpeed's fp16 mode; needs a GPU)"),
        _flag("--loss-scale", field="precision.loss_scale", type=float, help="static fp16 loss scale [default: dynamic]"),
        _flag("--initial-loss-scale", field="precision.initial_loss_scale", type=float, help="first dynamic fp16 loss scale [default: 2^32, or 2^initial_scale_power from --deepspeed_config]"),
        _flag("--min-loss-scale", field="precision.min_loss_scale", type=float, help="smallest dynamic fp16 loss scale [default: 1, or the --deepspeed_config fp16 value]"),
        _flag("--loss-scale-window", field="precision.loss_scale_window", type=int, help="iterations without overflow before the dynamic fp16 loss scale grows [default: 1000, or the --deepspeed_config fp16 value]"),
        _flag("--hysteresis", field="precision.hysteresis", type=int, help="overflows tolerated before the dynamic fp16 loss scale shrinks [default: 2, or the --deepspeed_config fp16 value]"),
    )),
    ("loss spikes", (
        _flag("--check-for-spiky-loss", field="spikes.check_for_spiky_loss", action="store_true", help="detect loss spikes: a loss above mean + K x sigma of the trailing window; what happens is --spiky-loss-policy"),
        _flag("--spiky-loss-policy", field="spikes.policy", choices=list(POLICIES), default="warn", help="warn: one line, train on; skip: withhold the update and record the batch as skipped (as --iterations-to-skip); rewind: reload the last checkpoint in --save and skip the batch when it comes again"),
        _flag("--spiky-loss-window", field="spikes.window", type=int, default=128, help="trailing iterations the mean and sigma come from"),
        _flag("--spiky-loss-factor", field="spikes.factor", type=float, default=6.0, help="K: a spike exceeds mean + K x sigma"),
        _flag("--spiky-loss-min-window", field="spikes.min_fill", type=int, help="losses the window must hold before detection starts [default: half the window]"),
    )),
    ("checkpointing", (
        _flag("--save", field="checkpoint.save", help="checkpoint directory to write"),
        _flag("--save-interval", "--persistent-save-interval", field="checkpoint.save_interval", type=int, help="iterations between checkpoints (needs --save)"),
        _flag("--load", field="checkpoint.load", help="checkpoint directory to resume from (its `latest`), or one of its global_step<N> folders (that step)"),
        _flag("--no-save-rng", field="checkpoint.no_save_rng", action="store_true", help="do not save per-rank RNG states"),
        _flag("--no-save-full-state", field="checkpoint.no_save_full_state", action="store_true", help="do not save the layout-independent full_state_*.pt files (fp32 weights + Adam moments again, 12 bytes per parameter): smaller, faster saves, but the checkpoint resumes only at its own TP/PP/DP/ZeRO layout and tools/reshard_checkpoint.py cannot read it (docs/CHECKPOINTS.md)"),
        _flag("--no-load-optim", field="checkpoint.no_load_optim", action="store_true", help="do not load the optimizer state (Adam moments) from --load"),
        _flag("--no-load-rng", field="checkpoint.no_load_rng", action="store_true", help="do not load the RNG states from --load"),
        _flag("--save-total-limit", "--save-keep-last", "--most-recent-k", field="checkpoint.save_total_limit", type=int, help="keep only the newest N complete checkpoints (older ones are deleted after a newer one is committed; never the one `latest` names)"),
        _flag("--finetune", field="checkpoint.finetune", action="store_true", help="load weights only: no optimizer, RNG or data position; iteration restarts at 0"),
        _flag("--use-checkpoint-args", field="checkpoint.use_checkpoint_args", action="store_true", help="take the model flags from the --load checkpoint, as Megatron does: shape flags not given on the command line (layers, hidden, FFN, heads, kv-channels, seq-length, positions) are filled in; the others (GQA groups, RoPE, norm, SwiGLU, biases, tied head, dropouts, vocabulary padding) are overridden, one line each"),
        _flag("--ckpt-format", metavar="FORMAT", help="accepted with the format the backend writes: torch (DeepSpeed's per-rank torch.save files plus pretrain_meta.json) or, with --use-torch-fsdp2, torch_dist (torch.distributed.checkpoint folders); zarr/torch_dcp/fsdp_dtensor are refused"),
        _flag("--async-save", field="checkpoint.async_save", action="store_true", help="--use-torch-fsdp2: stage each checkpoint in memory and write it in the background while training goes on; committed (`latest`) once every rank's write has finished"),
        _flag("--auto-detect-ckpt-format", action="store_true", help="accepted: --load always detects the format (a Megatron-LM checkpoint is refused with the converter to use)"),
        _flag("--dist-ckpt-strictness", choices=list(DIST_CKPT_STRICTNESS), metavar="MODE", help="accepted with Megatron's modes, which do not change a load here: a torch_dist checkpoint (--use-torch-fsdp2) loads as Megatron's default assume_ok_unexpected does, whatever MODE (a tensor the run needs that the checkpoint lacks is refused in one line; entries the run does not need are not read)"),
    )),
    ("moe", (
        _flag("--expert-model-parallel-size", field="parallel.expert_model_parallel_size", type=int, default=1, metavar="N", help="experts split over this many ranks of each stage's TP x DP ranks (Megatron's order: expert TP, EP, expert DP); > 1 trains at ZeRO 0-2 (docs/MOE.md)"),
        _flag("--expert-tensor-parallel-size", field="parallel.expert_tensor_parallel_size", type=int, metavar="N", help="expert TP: ranks that split each expert's weights [default: --tensor-model-parallel-size]"),
        _model("num_moe_experts", type=int, metavar="N", help="experts per MoE layer [default: none, a dense model]"),
        _model("moe_layer_freq", type=_layer_freq, default=1, metavar="N|LIST", help="MoE layers: every N-th layer from layer 0, or a list of 0/1 per layer such as '([1]*3+[0])*2'"),
        _model("moe_ffn_hidden_size", type=int, help="each expert's MLP width [default: --ffn-hidden-size]"),
        _model("moe_shared_expert_intermediate_size", type=int, help="width of the shared expert(s) every token also goes through [default: none]"),
        _model("moe_router_topk", type=int, default=2, help="experts each token is routed to"),
        _model("moe_router_score_function", default="softmax", metavar="{softmax,sigmoid}", help="router scores"),
        _model("moe_router_pre_softmax", action="store_true", help="softmax over all experts before the top-k (needed for top-1 with softmax)"),
        _model("moe_router_topk_scaling_factor", type=float, help="multiply the routing weights by this (DeepSeek's routed scaling factor)"),
        _model("moe_router_num_groups", type=int, help="expert groups for group-limited routing"),
        _model("moe_router_group_topk", type=int, help="groups each token may use (group-limited routing)"),
        _model("moe_router_load_balancing_type", default="aux_loss", metavar="{aux_loss,seq_aux_loss,global_aux_loss,none}", help="scope of the load-balancing loss: micro-batch, sequence, or every micro-batch of the iteration over all data-parallel ranks"),
        _model("moe_aux_loss_coeff", type=float, default=0.0, help="weight of the load-balancing loss"),
        _model("moe_z_loss_coeff", type=float, help="weight of the router z-loss [default: none]"),
        _model("moe_router_enable_expert_bias", action="store_true", help="DeepSeek-V3 aux-loss-free balancing: a per-expert bias that only picks experts, updated once per iteration (needs sigmoid scores)"),
        _model("moe_router_bias_update_rate", type=float, default=1e-3, help="step of the expert-bias update"),
        _model("moe_router_dtype", metavar="{fp32,fp64}", help="router logits and weights in this precision [default: the activations']"),
        _model("moe_expert_capacity_factor", type=float, help="expert capacity = this x tokens x topk / experts, per rank; tokens over it are dropped [default: dropless]"),
        _model("moe_token_drop_policy", default="probs", metavar="{probs,position}", help="over capacity, keep the highest-weight tokens or the first ones"),
        _model("moe_pad_expert_input_to_capacity", action="store_true", help="every expert takes exactly its capacity (weight-0 padding; needs --moe-expert-capacity-factor)"),
        _model("moe_token_dispatcher_type", default="allgather", metavar="{allgather,alltoall}", help="how tokens reach the experts of other EP ranks"),
        _model("moe_grouped_gemm", action="store_true", help="each rank's experts as one grouped GEMM (torch._grouped_mm) instead of a loop; same math"),
        _flag("--moe-permute-fusion", action="store_true", help="accepted: no fused permutation kernel (same math)"),
    )),
    ("logging", (
        _flag("--log-interval", field="logging.log_interval", type=int, default=100, help="iterations between training log lines"),
        _flag("--tensorboard-dir", field="logging.tensorboard_dir", help="write TensorBoard event files into this directory"),
        _flag("--tensorboard-log-interval", field="logging.tensorboard_log_interval", type=int, default=1, help="write training scalars to TensorBoard/wandb every N iterations"),
        _flag("--wandb-project", field="logging.wandb_project", metavar="NAME", help="also log to this Weights & Biases project"),
        _flag("--wandb-exp-name", field="logging.wandb_exp_name", metavar="NAME", help="Weights & Biases run name"),
        _flag("--peak-tflops", field="logging.peak_tflops", type=float, help="peak TFLOP/s per device for MFU [default: a table of known GPUs; none on CPU]"),
        _flag("--metrics-file", field="logging.metrics_file", help="append one JSON line per iteration (full-precision loss, grad norm, lr)"),
        _flag("--log-throughput", action="store_true", help="accepted for Megatron scripts (always on)"),
        _flag("--log-validation-ppl-to-tensorboard", action="store_true", help="no-op: validation and test perplexity are always written"),
        _flag("--moe-per-layer-logging", action="store_true", help="no-op: each MoE layer's router losses and token shares are always written to the dashboards at log iterations (moe/<loss>_layer_<i>; docs/MOE.md)"),
        _flag("--log-timers-to-tensorboard", action="store_true", help="accepted: there are no per-phase timers; iteration-time is always written"),
        _flag("--log-batch-size-to-tensorboard", action="store_true", help="accepted: not written (the global batch size is in every log line)"),
        _flag("--log-optimizer-states-to-tensorboard", action="store_true", help="accepted: optimizer-state norms are not written"),
        _flag("--tensorboard-queue-size", type=int, help="accepted: TensorBoard's own queue size is used (events are flushed when the run ends)"),
        _flag("--log-memory-to-tensorboard", action="store_true", help="accepted: memory use is not written"),
        _flag("--log-num-zeros-in-grad", action="store_true", help="accepted: the count of zero gradients is not computed"),
        _flag("--log-params-norm", action="store_true", help="accepted: the parameter norm is not computed (the grad norm is in every log line)"),
        _flag("--logging-level", field="logging.logging_level", type=int, metavar="N", help="Python logging level of rank 0's lines: 10 (DEBUG) also prints each per-prefix notice behind the data pipeline's one-line summaries; above 20 keeps INFO (Megatron's lines always print)"),
        _flag("--timing-log-level", type=int, choices=[0, 1, 2], help="accepted: there are no per-phase timers"),
        _flag("--profile", action="store_true", help="accepted: no profiler ranges are opened (run under nsys or torch.profiler yourself)"),
        _flag("--profile-step-start", type=int, metavar="N", help="accepted: see --profile"),
        _flag("--profile-step-end", type=int, metavar="N", help="accepted: see --profile"),
        _flag("--profile-ranks", type=int, nargs="+", metavar="RANK", help="accepted: see --profile"),
        _flag("--wandb-save-dir", field="logging.wandb_save_dir", metavar="PATH", help="folder for wandb's local files [wandb's default]"),
    )),
    ("validation", (
        _flag("--multiple-validation-sets", field="evaluation.multiple_validation_sets", action="store_true", help="evaluate each --valid-data-path prefix as its own validation set (unblended; --eval-iters global batches of each), one 'validation-<name> loss' block per set"),
        _flag("--validation-set-names", field="evaluation.validation_set_names", nargs="+", metavar="NAME", help="with --multiple-validation-sets: one name per --valid-data-path prefix for its log lines and scalars [default: 0 1 ...]"),
    )),
    ("Megatron script compatibility (accepted; the behaviour is fixed here)", (
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
        _flag("--use-flash-attn-v2", action="store_true", help="no-op: attention is torch SDPA, which picks flash attention on GPUs by itself (Megatron-DeepSpeed flag)"),
        _flag("--use-flash-attn-triton", action="store_true", help="no-op: attention is torch SDPA, which picks flash attention on GPUs by itself (Megatron-DeepSpeed flag)"),
        _flag("--transformer-impl", choices=["local", "transformer_engine"], help="accepted: the layers are this project's own (torch), neither Transformer Engine nor Megatron's local ones"),
        _flag("--cross-entropy-loss-fusion", action="store_true", help="no-op: no fused cross-entropy kernel; same numerics"),
        _flag("--attention-softmax-in-fp32", action="store_true", help="accepted: it configures Megatron's fused softmax, which does not exist here (attention is torch SDPA)"),
        _flag("--rope-type", choices=["rope"], help="accepted with rope only (YaRN is not implemented)"),
        _flag("--empty-unused-memory-level", type=int, choices=[0, 1, 2], help="accepted: the CUDA cache is never emptied by the loop (memory only, no effect on the math)"),
        _flag("--init-model-with-meta-device", action="store_true", help="accepted: every full weight is drawn from the seeded generator, then sharded (the layout-independent init)"),
        _flag("--enable-experimental", action="store_true", help="accepted: there are no experimental features to enable"),
        _flag("--cuda-graph-impl", choices=["none", "local", "transformer_engine"], help="accepted: no CUDA graphs are captured (speed only)"),
        _flag("--no-load-lr-state", action="store_true", help="accepted: Megatron-DeepSpeed defines it but never reads it; the LR schedule on --load follows --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler"),
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
    """The pretrain_gpt.py parser: the table's rows, then the sample-count, data and tokenizer
    flags their modules own, each in its Megatron-LM group (`pretrain.flag_help`)."""
    parser = _Parser(
        prog="pretrain_gpt.py",
        usage="%(prog)s [-h] FLAG ...",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
        description="Pretrain a GPT (GPT-2 or Llama flavour) with Megatron-LM flags on tensor "
        "parallelism + DeepSpeed pipeline parallelism and ZeRO. The flags are in Megatron-LM's "
        "groups; a help line ends with the flag's default (docs/TRAINING.md explains them).",
    )
    add_megatron_groups(parser)
    for title, rows in FLAGS:
        group = argument_group(parser, title)
        for row in rows:
            group.add_argument(*row.names, dest=flag_dest(row), **row.options)
    add_sample_count_args(parser)
    # unset, not 1: a --deepspeed_config JSON may supply it (pretrain.cli.parse resolves it)
    parser.set_defaults(micro_batch_size=None)
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
