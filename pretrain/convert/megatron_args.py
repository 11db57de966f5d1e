"""Megatron-LM's saved `args` (an argparse.Namespace in every checkpoint) -> our ModelConfig.

Nothing is guessed: every setting that decides the model's shape or computation is read from
`args`. Missing required keys, and settings our model does not implement (MLA, qk-l2-norm,
partial or interleaved RoPE, squared ReLU, uneven pipeline splits, ...), are listed together in
one UserError. A setting that older Megatron-LM versions did not have (e.g. `use_rope_scaling`)
counts as absent = the behaviour those versions had (its neutral value below).

Mixture of experts (`num_experts`): the `moe_*` args have our ModelConfig's names (megatron-core's
TransformerConfig fields); settings our MoE layer does not compute (a gated shared expert,
probabilities applied on the input, forced balancing, a latent projection, several
load-balancing losses at once) are refused with the others. The expert implementation (legacy
GroupedMLP, TE's grouped GEMM, SequentialMLP) changes only the tensor names, which the reader
handles. The token dispatcher does not change what is computed: `flex` becomes `alltoall`.
"""

from __future__ import annotations

import argparse

import torch

from pretrain.convert.hf_adapter import default_sizes_as_none
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig

REQUIRED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "max_position_embeddings",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
)

# settings our model does not implement: (args key, the value that means "not used")
NEUTRAL = (
    ("apply_residual_connection_post_layernorm", False),
    ("qk_l2_norm", False),
    ("apply_layernorm_1p", False),
    ("layernorm_zero_centered_gamma", False),
    ("multi_latent_attention", False),
    ("rotary_percent", 1.0),
    ("rotary_interleaved", False),
    ("rotary_seq_len_interpolation_factor", None),
    ("squared_relu", False),
    ("window_size", None),
    ("no_rope_freq", None),
    ("mtp_num_layers", None),
    ("softmax_type", "vanilla"),
    ("attention_output_gate", False),
    ("add_position_embedding", True),
    ("decoder_first_pipeline_num_layers", None),
    ("decoder_last_pipeline_num_layers", None),
    ("pipeline_model_parallel_layout", None),
    ("account_for_embedding_in_pipeline_split", False),
    ("account_for_loss_in_pipeline_split", False),
    ("heterogeneous_layers_config_path", None),
    ("moe_shared_expert_gate", False),
    ("moe_apply_probs_on_input", False),
    ("moe_router_force_load_balancing", False),
    ("moe_latent_size", None),
)
# MoE args copied as they are (megatron-core's names are ours), with their neutral value
MOE_FIELDS = (
    ("moe_router_topk", 2),
    ("moe_shared_expert_intermediate_size", None),
    ("moe_router_score_function", "softmax"),
    ("moe_router_pre_softmax", False),
    ("moe_router_topk_scaling_factor", None),
    ("moe_router_num_groups", None),
    ("moe_router_group_topk", None),
    ("moe_aux_loss_coeff", 0.0),
    ("moe_z_loss_coeff", None),
    ("moe_router_enable_expert_bias", False),
    ("moe_router_bias_update_rate", 1e-3),
    ("moe_expert_capacity_factor", None),
    ("moe_token_drop_policy", "probs"),
    ("moe_pad_expert_input_to_capacity", False),
    ("moe_grouped_gemm", False),
    ("moe_router_dtype", None),
)
# the norm epsilon's key: `norm_epsilon` up to core_v0.15, `layernorm_epsilon` on main (its flags
# come from TransformerConfig's fields; the flag is still --norm-epsilon)
EPSILON_KEYS = ("norm_epsilon", "layernorm_epsilon")
POSITION_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _value(args: argparse.Namespace, key: str, neutral=None):
    return getattr(args, key, neutral)


def _problems(args: argparse.Namespace) -> list[str]:
    """Everything in `args` that our model cannot express, as `key=value (why)` strings."""
    problems = [f"{key} missing" for key in REQUIRED if not hasattr(args, key)]
    if not any(hasattr(args, key) for key in EPSILON_KEYS):
        problems.append(f"{' (or '.join(EPSILON_KEYS)}) missing")
    for key, neutral in NEUTRAL:
        value = _value(args, key, neutral)
        if value != neutral:
            problems.append(f"{key}={value!r} (only {neutral!r} is supported)")
    if _value(args, "position_embedding_type") not in (None, *POSITION_TYPES):
        problems.append(
            f"position_embedding_type={args.position_embedding_type!r} (supported: "
            f"{', '.join(POSITION_TYPES)})"
        )
    if _value(args, "normalization") not in (None, *NORMALIZATIONS):
        problems.append(f"normalization={args.normalization!r} (supported: LayerNorm, RMSNorm)")
    problems += _moe_problems(args)
    if _value(args, "add_qkv_bias", False) and not _value(args, "add_bias_linear", True):
        problems.append(
            "add_qkv_bias=True with add_bias_linear=False (our biases are on every linear or none)"
        )
    return problems


def _single(value):
    """Megatron-LM main allows a list of load-balancing types (and coefficients); one is ours."""
    return value[0] if isinstance(value, list | tuple) and len(value) == 1 else value


def _moe_problems(args: argparse.Namespace) -> list[str]:
    if _value(args, "num_experts") is None:
        return []
    kinds = _value(args, "moe_router_load_balancing_type", "aux_loss")
    if isinstance(_single(kinds), list | tuple):
        return [f"moe_router_load_balancing_type={kinds!r} (one loss type is supported)"]
    return []


def moe_fields(args: argparse.Namespace) -> dict:
    """Our ModelConfig's MoE fields from Megatron's args ({} for a dense model)."""
    if _value(args, "num_experts") is None:
        return {}
    dispatcher = _value(args, "moe_token_dispatcher_type", "allgather")
    freq = _value(args, "moe_layer_freq", 1)
    return {key: _single(_value(args, key, neutral)) for key, neutral in MOE_FIELDS} | dict(
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=_value(args, "moe_ffn_hidden_size") or args.ffn_hidden_size,
        moe_layer_freq=freq if isinstance(freq, int) else tuple(freq),
        moe_router_load_balancing_type=_single(
            _value(args, "moe_router_load_balancing_type", "aux_loss")
        ),
        moe_token_dispatcher_type="allgather" if dispatcher == "allgather" else "alltoall",
        # MoE under TP as Megatron trains it, with sequence parallelism; it changes no value
        sequence_parallel=args.tensor_model_parallel_size > 1,
    )


def _norm_epsilon(args: argparse.Namespace) -> float:
    return next(getattr(args, key) for key in EPSILON_KEYS if hasattr(args, key))


def _query_groups(args: argparse.Namespace) -> int | None:
    return args.num_query_groups if _value(args, "group_query_attention", False) else None


def model_config_from_args(
    args: argparse.Namespace, source: str, vocab_size: int | None = None
) -> ModelConfig:
    """Our ModelConfig for the model Megatron's `args` describe; `vocab_size` the true tokenizer
    size if known (Megatron saves only the padded size; without it every padded row is kept)."""
    problems = _problems(args)
    if problems:
        raise UserError(
            f"{source}: this Megatron-LM model cannot be converted: {'; '.join(problems)}"
        )
    dtype = _value(args, "params_dtype", torch.float32)
    config = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size or args.padded_vocab_size,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        num_query_groups=_query_groups(args),
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=_value(args, "kv_channels"),
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        position_embedding_type=args.position_embedding_type,
        rotary_base=_value(args, "rotary_base", 10000),
        use_rope_scaling=bool(_value(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(_value(args, "rope_scaling_factor", 8.0)),
        normalization=args.normalization,
        norm_epsilon=_norm_epsilon(args),
        swiglu=bool(args.swiglu),
        openai_gelu=bool(_value(args, "openai_gelu", False)) and not args.swiglu,
        add_bias_linear=bool(args.add_bias_linear),
        untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
        hidden_dropout=_value(args, "hidden_dropout", 0.1),
        attention_dropout=_value(args, "attention_dropout", 0.1),
        init_method_std=_value(args, "init_method_std", 0.02),
        params_dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
        qk_layernorm=bool(_value(args, "qk_layernorm", False)),
        **moe_fields(args),
    )
    if vocab_size is not None and vocab_size > args.padded_vocab_size:
        raise UserError(
            f"vocabulary size {vocab_size} is larger than the checkpoint's padded vocabulary "
            f"({args.padded_vocab_size}); give the tokenizer's size with --vocab-size"
        )
    config.validate(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        etp=_value(args, "expert_tensor_parallel_size") or args.tensor_model_parallel_size,
    )
    return default_sizes_as_none(config)
