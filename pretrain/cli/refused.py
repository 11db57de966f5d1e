"""Flags of Megatron-LM's and Megatron-DeepSpeed's launch scripts that this project does not
implement, each with the one line that says so and what to use instead (`REFUSED_FLAGS`).

`refuse_unsupported(argv)` runs before argparse, so such a flag is refused by name with its fix
instead of argparse's "unrecognized arguments". The table of every launch-script flag and what it
does here is docs/COMPATIBILITY.md, "Flags of the launch scripts".
"""

from __future__ import annotations

from collections.abc import Sequence

from pretrain.errors import UserError

_MOE_DS = "Megatron-DeepSpeed's MoE flags are not implemented (Megatron-LM's are)"
_FSDP = "Megatron's own FSDP is not implemented (use --use-torch-fsdp2: torch's FSDP2; or ZeRO: --zero-stage 3)"
_FP8 = "FP8 training is not implemented (use --bf16)"
_KD = "knowledge distillation is not implemented (train the student without a teacher)"
_GPT_OSS = "gpt-oss's architecture is not implemented (GPT-2 and Llama-style models only)"
_MLA = "multi-latent attention (DeepSeek) is not implemented (use --group-query-attention)"
_DATA_EFFICIENCY = (
    "Megatron-DeepSpeed's data-efficiency library is not implemented (the data pipeline is "
    "Megatron-LM's, docs/TRAINING.md)"
)
_NOT_A_MODEL_FLAG = (
    "not implemented: it changes the model's math (GPT-2 and Llama-style models only)"
)

REFUSED_FLAGS: dict[str, str] = {
    # mixture of experts: what Megatron-LM's MoE flags (pretrain/cli/flags.py, docs/MOE.md) lack
    "--moe-flex-dispatcher-backend": (
        "the flex dispatcher (DeepEP/HybridEP) is not implemented (use "
        "--moe-token-dispatcher-type alltoall)"
    ),
    "--moe-router-force-load-balancing": (
        "not implemented: routing always follows the router (drop the flag)"
    ),
    # Megatron-DeepSpeed's MoE flags: the Megatron-LM flag that does it, or what is missing
    "--moe-expert-parallel-size": _MOE_DS + "; use --expert-model-parallel-size",
    "--moe-train-capacity-factor": _MOE_DS + "; use --moe-expert-capacity-factor",
    "--moe-loss-coeff": _MOE_DS + "; use --moe-aux-loss-coeff",
    "--disable-moe-token-dropping": (
        _MOE_DS + "; routing is dropless unless --moe-expert-capacity-factor is given"
    ),
    "--create-moe-param-group": _MOE_DS + " (drop the flag)",
    **dict.fromkeys(
        ("--moe-eval-capacity-factor", "--moe-min-capacity"),
        _MOE_DS + "; the capacity is --moe-expert-capacity-factor's, in training and evaluation",
    ),
    **dict.fromkeys(
        ("--mlp-type", "--mos", "--num-experts-teacher"),
        "Megatron-DeepSpeed's residual MoE, mixture of students and MoE distillation are not "
        "implemented",
    ),
    # FSDP and other data-parallel schemes
    **dict.fromkeys(
        (
            "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy",
            "--outer-dp-sharding-strategy",
            "--fsdp-double-buffer",
            "--fsdp-manual-registration",
            "--fsdp-db-use-persist-buf-on-alloc-fail",
            "--megatron-fsdp-grad-comm-dtype",
            "--megatron-fsdp-main-grads-dtype",
            "--megatron-fsdp-main-params-dtype",
            "--megatron-fsdp-max-pool-double-buffer",
        ),  # fmt: skip
        _FSDP,
    ),
    "--num-distributed-optimizer-instances": (
        "not implemented: ZeRO shards over all data-parallel ranks (drop the flag)"
    ),
    # precision
    **dict.fromkeys(
        ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"),
        _FP8,
    ),
    "--grad-reduce-in-bf16": (
        "not implemented: DeepSpeed picks the gradient reduction dtype (set "
        '"communication_data_type" in --deepspeed_config)'
    ),
    "--accumulate-allreduce-grads-in-fp32": (
        "not implemented: DeepSpeed picks the gradient accumulation dtype (set "
        '"data_types": {"grad_accum_dtype": "fp32"} in --deepspeed_config)'
    ),
    "--disable-bf16-reduced-precision-matmul": (
        "not implemented: torch's default bf16 matmul reductions are used (drop the flag)"
    ),
    "--use-precision-aware-optimizer": (
        "not implemented: Adam keeps fp32 master weights and moments (drop the flag)"
    ),
    # model architectures this project does not build
    **dict.fromkeys(
        (
            "--enable-gpt-oss",
            "--softmax-type",
            "--window-size",
            "--window-attn-skip-freq",
            "--quick-geglu",
            "--glu-linear-offset",
            "--activation-func-clamp-value",
            "--export-force-local-attention",
        ),  # fmt: skip
        _GPT_OSS,
    ),
    **dict.fromkeys(
        (
            "--multi-latent-attention",
            "--q-lora-rank",
            "--kv-lora-rank",
            "--qk-head-dim",
            "--qk-pos-emb-head-dim",
            "--v-head-dim",
        ),  # fmt: skip
        _MLA,
    ),
    "--mtp-num-layers": "multi-token prediction is not implemented (drop the MTP flags)",
    "--mtp-loss-scaling-factor": "multi-token prediction is not implemented (drop the MTP flags)",
    "--apply-layernorm-1p": _NOT_A_MODEL_FLAG,
    **dict.fromkeys(
        ("--rotary-scaling-factor", "--mscale", "--mscale-all-dim"),
        "YaRN RoPE scaling is not implemented (Llama 3 scaling is --use-rope-scaling)",
    ),
    # training procedures
    "--calculate-per-token-loss": (
        "not implemented: the loss is each micro-batch's token mean, averaged (Megatron's default)"
    ),
    "--decoupled-lr": "not implemented: one learning rate for all parameters (drop the flag)",
    "--decoupled-min-lr": "not implemented: one learning rate for all parameters (drop the flag)",
    "--sft": "supervised fine-tuning data is not implemented (pretraining data only)",
    "--modelopt-enabled": "NVIDIA ModelOpt is not supported",
    "--export-te-mcore-model": "NVIDIA ModelOpt is not supported",
    **dict.fromkeys(
        (
            "--kd",
            "--kd-beta-ce",
            "--load-teacher",
            "--num-layers-teacher",
            "--hidden-size-teacher",
            "--num-attention-heads-teacher",
        ),
        _KD,
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "--random-ltd",
            "--data-efficiency-curriculum-learning",
            "--train-doc-idx-path",
            "--train-sample-idx-path",
            "--train-shuffle-idx-path",
        ),
        _DATA_EFFICIENCY,
    ),  # fmt: skip
    # DeepSpeed features other than ZeRO and the pipeline engine
    **dict.fromkeys(
        (
            "--ds-sequence-parallel-fpdt",
            "--ds-sequence-parallel-fpdt-chunk-size",
            "--ds-sequence-parallel-fpdt-offloading",
        ),
        "DeepSpeed FPDT long-sequence training is not implemented",
    ),  # fmt: skip
    **dict.fromkeys(
        ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"),
        "Megatron-DeepSpeed's ZB-H1 pipeline is not implemented; torch's zero-bubble schedules "
        "run on the torch backend (--use-torch-fsdp2 --pipeline-schedule interleaved-zero-bubble, "
        "or zbv-zero-bubble with --num-virtual-stages-per-pipeline-rank 2)",
    ),
    "--cpu-optimizer": "use --cpu-offload (ZeRO >= 1: optimizer state and step in CPU memory)",
    "--checkpoint-in-cpu": (
        "not implemented: recomputed activations stay on the device (--recompute-granularity)"
    ),
    "--universal-checkpoint": (
        "not needed: a checkpoint of this project resumes at any TP/PP/DP/ZeRO layout from its "
        "full state (docs/CHECKPOINTS.md); DeepSpeed universal checkpoints are not read"
    ),
    "--reset-iteration": (
        "use --finetune (weights only; iteration, data position and optimizer restart)"
    ),
    # debugging
    "--record-memory-history": "not implemented (use torch.cuda.memory._record_memory_history)",
    "--memory-snapshot-path": "not implemented (use torch.cuda.memory._dump_snapshot)",
}


def refuse_unsupported(argv: Sequence[str]) -> None:
    """Raise one UserError naming the first flag of `argv` in `REFUSED_FLAGS`, with its fix."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in REFUSED_FLAGS:
            raise UserError(f"{flag}: {REFUSED_FLAGS[flag]}")
