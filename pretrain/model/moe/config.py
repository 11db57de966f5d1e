"""The rules of the mixture-of-experts fields of `ModelConfig` (megatron-core's names and checks).

`moe_problems(config, tp, ep, etp)` lists every broken rule as one phrase naming the flag and the
fix; `ModelConfig.validate` joins them into its one UserError. `moe_layer_pattern` reads
--moe-layer-freq: an int N (layers 0, N, 2N, ... are MoE, Megatron's 1:N) or a list of 0/1 per
layer, given on the command line as Megatron writes it (`"([1]*3+[0])*2"`, `"[1,0,1,1]"`).
This module does not import `ModelConfig` (which imports it).
"""

from __future__ import annotations

import ast

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("allgather", "alltoall")
ROUTER_DTYPES = (None, "fp32", "fp64")
GROUPED_GEMM_ALIGNMENT_BYTES = 16
"""torch._grouped_mm needs every row stride to be a multiple of 16 bytes."""


def parse_layer_freq(text: str) -> int | tuple[int, ...]:
    """--moe-layer-freq's value: an int, or a list expression of 0/1 built from list literals,
    `+` and `*` (Megatron evaluates the same strings with Python's eval)."""
    try:
        value = _list_expression(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, TypeError, ValueError) as error:
        raise ValueError(
            f"--moe-layer-freq {text!r}: expected an int or a list of 0/1 such as "
            f"'([1]*3+[0])*2' ({error})"
        ) from None
    return value if isinstance(value, int) else tuple(value)


def _list_expression(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_int(element) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"{ast.unparse(node)!r} is not an int, a list, + or *")


def _int(node: ast.AST) -> int:
    value = _list_expression(node)
    if not isinstance(value, int):
        raise ValueError("list elements must be ints")
    return value


def moe_layer_pattern(freq: int | tuple[int, ...], num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE layers (Megatron: int N -> layer i when i % N == 0)."""
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(num_layers))
    return tuple(bool(x) for x in freq)


def moe_problems(config, tp: int, ep: int, etp: int) -> list[str]:
    """Every broken MoE rule of `config` (a ModelConfig with num_moe_experts set) at tensor-parallel
    size `tp`, expert-parallel size `ep` and expert tensor-parallel size `etp`."""
    return [
        *_router_problems(config),
        *_capacity_problems(config),
        *_layout_problems(config, tp, ep, etp),
        *_kernel_problems(config, etp),
    ]


def _choice(flag: str, value, choices) -> list[str]:
    if value in choices:
        return []
    shown = ", ".join(str(c) for c in choices if c is not None)
    return [f"{flag} {value!r} is not implemented (choose {shown})"]


def _router_problems(c) -> list[str]:
    experts, topk = c.num_moe_experts, c.moe_router_topk
    problems = _choice("--moe-router-score-function", c.moe_router_score_function, SCORE_FUNCTIONS)
    problems += _choice(
        "--moe-router-load-balancing-type", c.moe_router_load_balancing_type, LOAD_BALANCING_TYPES
    )
    problems += _choice("--moe-router-dtype", c.moe_router_dtype, ROUTER_DTYPES)
    if experts < 1:
        return problems + [f"--num-experts must be >= 1 (got {experts})"]
    if not 1 <= topk <= experts:
        problems.append(f"--moe-router-topk {topk} must be between 1 and --num-experts {experts}")
    if topk == 1 and c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax:
        problems.append(
            "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax "
            "over one selected logit is 1 and has no gradient)"
        )
    if c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid":
        problems.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    for flag, value in (
        ("--moe-aux-loss-coeff", c.moe_aux_loss_coeff),
        ("--moe-z-loss-coeff", c.moe_z_loss_coeff),
        ("--moe-router-bias-update-rate", c.moe_router_bias_update_rate),
    ):
        if value is not None and value < 0:
            problems.append(f"{flag} must be >= 0 (got {value})")
    if c.moe_router_topk_scaling_factor is not None and c.moe_router_topk_scaling_factor <= 0:
        problems.append("--moe-router-topk-scaling-factor must be > 0")
    return problems + _group_problems(c)


def _group_problems(c) -> list[str]:
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    if not group_topk:
        return []
    if not groups:
        return ["--moe-router-group-topk needs --moe-router-num-groups"]
    if c.num_moe_experts % groups != 0 or not 1 <= group_topk <= groups:
        return [
            f"--moe-router-num-groups {groups} must divide --num-experts {c.num_moe_experts} and "
            f"be >= --moe-router-group-topk {group_topk} >= 1"
        ]
    if group_topk * (c.num_moe_experts // groups) < c.moe_router_topk:
        return [
            f"--moe-router-group-topk {group_topk} groups of {c.num_moe_experts // groups} "
            f"experts cannot hold --moe-router-topk {c.moe_router_topk} experts"
        ]
    return []


def _capacity_problems(c) -> list[str]:
    problems = _choice("--moe-token-drop-policy", c.moe_token_drop_policy, DROP_POLICIES)
    factor = c.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        problems.append(
            f"--moe-expert-capacity-factor must be > 0 (got {factor}; drop the flag for dropless "
            f"routing)"
        )
    if c.moe_pad_expert_input_to_capacity and factor is None:
        problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    return problems


def _layout_problems(c, tp: int, ep: int, etp: int) -> list[str]:
    problems = _choice("--moe-token-dispatcher-type", c.moe_token_dispatcher_type, DISPATCHERS)
    freq = c.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        problems.append(f"--moe-layer-freq must be >= 1 (got {freq})")
    if not isinstance(freq, int) and (len(freq) != c.num_layers or set(freq) - {0, 1}):
        problems.append(
            f"--moe-layer-freq as a list needs one 0/1 per layer ({c.num_layers}), got {list(freq)}"
        )
    if tp > 1 and not c.sequence_parallel and c.seq_length % tp != 0:
        problems.append(
            f"MoE with --tensor-model-parallel-size {tp} routes each TP rank's chunk of "
            f"--seq-length {c.seq_length}, which {tp} does not divide (use a multiple of {tp})"
        )
    if c.num_moe_experts % ep != 0:
        problems.append(
            f"--num-experts {c.num_moe_experts} is not divisible by --expert-model-parallel-size "
            f"{ep} (each EP rank holds the same number of experts)"
        )
    if c.moe_ffn_size % etp != 0:
        problems.append(
            f"--moe-ffn-hidden-size {c.moe_ffn_size} is not divisible by "
            f"--expert-tensor-parallel-size {etp}"
        )
    if etp > 1 and c.add_bias_linear:
        problems.append(
            f"expert biases need --expert-tensor-parallel-size 1 (got {etp}; or add "
            f"--disable-bias-linear), as in Megatron"
        )
    return problems + _shared_expert_problems(c, tp)


def _shared_expert_problems(c, tp: int) -> list[str]:
    size = c.moe_shared_expert_intermediate_size
    if size is None:
        return []
    if size < 1 or size % tp != 0:
        return [
            f"--moe-shared-expert-intermediate-size {size} must be >= 1 and divisible by "
            f"--tensor-model-parallel-size {tp}"
        ]
    if c.add_bias_linear:
        return ["shared experts have no biases (add --disable-bias-linear), as in Megatron"]
    return []


def _kernel_problems(c, etp: int) -> list[str]:
    problems = []
    if c.moe_grouped_gemm:
        itemsize = c.params_dtype.itemsize
        multiple = GROUPED_GEMM_ALIGNMENT_BYTES // itemsize
        if c.hidden_size % multiple or (c.moe_ffn_size // etp) % multiple:
            problems.append(
                f"--moe-grouped-gemm needs --hidden-size ({c.hidden_size}) and "
                f"--moe-ffn-hidden-size / --expert-tensor-parallel-size ({c.moe_ffn_size // etp}) "
                f"to be multiples of {multiple} (16-byte rows); drop --moe-grouped-gemm or resize"
            )
    if c.moe_router_load_balancing_type == "global_aux_loss" and c.recompute_granularity == "full":
        problems.append(
            "--moe-router-load-balancing-type global_aux_loss with --recompute-granularity full "
            "is not implemented (the recomputed layer would see a later token average)"
        )
    return problems
