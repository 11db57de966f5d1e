"""The MoE flags fill ModelConfig's megatron-core-named fields (and the expert-parallel sizes
ParallelConfig's); `model_flags` writes them back; bad values are one line."""

from __future__ import annotations

import dataclasses

import pytest

from pretrain.cli import build_parser
from pretrain.cli.flags import section_values
from pretrain.cli.resolve import model_config
from pretrain.errors import UserError
from pretrain.model.config import model_flags
from pretrain.parallel.config import ParallelConfig

DENSE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
]
DEEPSEEK = [
    "--num-experts", "8",
    "--moe-layer-freq", "[0]*1+[1]*3",
    "--moe-ffn-hidden-size", "16",
    "--moe-shared-expert-intermediate-size", "32",
    "--moe-router-topk", "4",
    "--moe-router-score-function", "sigmoid",
    "--moe-router-pre-softmax",
    "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-num-groups", "4",
    "--moe-router-group-topk", "2",
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-aux-loss-coeff", "1e-4",
    "--moe-z-loss-coeff", "1e-3",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2",
    "--moe-router-dtype", "fp64",
    "--moe-expert-capacity-factor", "1.5",
    "--moe-token-drop-policy", "position",
    "--moe-pad-expert-input-to-capacity",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-grouped-gemm",
    "--disable-bias-linear",
]  # fmt: skip


def _config(argv: list[str], dense: list[str] = DENSE):
    namespace = build_parser().parse_args(dense + argv)
    return namespace, model_config(namespace, vocab_size=100)


def test_moe_flags_fill_megatron_core_fields_and_round_trip():
    namespace, config = _config(DEEPSEEK)
    assert config.num_moe_experts == 8 and config.moe_layer_freq == (0, 1, 1, 1)
    assert config.moe_layers == (False, True, True, True)
    assert (config.moe_ffn_hidden_size, config.moe_shared_expert_intermediate_size) == (16, 32)
    assert (config.moe_router_topk, config.moe_router_score_function) == (4, "sigmoid")
    assert config.moe_router_pre_softmax and config.moe_router_topk_scaling_factor == 2.5
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    assert config.moe_router_load_balancing_type == "seq_aux_loss"
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (1e-4, 1e-3)
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 1e-2
    assert config.moe_router_dtype == "fp64" and config.moe_expert_capacity_factor == 1.5
    assert config.moe_token_drop_policy == "position" and config.moe_pad_expert_input_to_capacity
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_grouped_gemm
    config.validate()
    rebuilt = _config(model_flags(config), dense=[])[1]
    assert rebuilt == config
    # a dense model: every MoE field at megatron-core's default, and no MoE flag written back
    dense = _config([])[1]
    assert not dense.is_moe and dense.moe_router_topk == 2 and dense.moe_aux_loss_coeff == 0.0
    assert dense.moe_token_dispatcher_type == "allgather" and dense.moe_router_dtype is None
    assert not any("moe" in flag or "expert" in flag for flag in model_flags(dense))


def test_expert_parallel_sizes_fill_parallel_config():
    namespace = build_parser().parse_args(
        DENSE
        + ["--tensor-model-parallel-size", "2"]
        + ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"]
    )
    parallel = ParallelConfig(**section_values(namespace, "parallel"), world_size=8)
    assert (parallel.expert_model_parallel_size, parallel.expert_tp) == (4, 1)
    assert ParallelConfig(world_size=8, tensor_model_parallel_size=2).expert_tp == 2  # = TP
    with pytest.raises(UserError, match="does not divide the 8 ranks of a pipeline stage"):
        ParallelConfig(world_size=8, expert_model_parallel_size=4, expert_tensor_parallel_size=4)


def test_a_bad_layer_freq_is_one_line():
    with pytest.raises(UserError, match=r"--moe-layer-freq '\[1\]\*x'") as error:
        build_parser().parse_args(DENSE + ["--moe-layer-freq", "[1]*x"])
    assert "\n" not in str(error.value)


def test_a_layer_pattern_read_back_from_json_is_the_same_config():
    from pretrain.checkpoint.format import json_safe, model_config_from_meta

    config = _config(DEEPSEEK)[1]
    assert model_config_from_meta(json_safe(dataclasses.asdict(config))) == config


@pytest.mark.parametrize(
    "layout, bf16, message",
    [
        (dict(expert_model_parallel_size=2), False, None),
        (dict(expert_model_parallel_size=4, zero_stage=2), False, None),
        (dict(expert_model_parallel_size=2, zero_stage=3), False, "use --zero-stage 0-2"),
        (
            dict(
                expert_model_parallel_size=2,
                zero_stage=1,
                tensor_model_parallel_size=2,
                expert_tensor_parallel_size=1,
            ),
            False,
            "use --zero-stage 0 or --expert-tensor-parallel-size 2",
        ),
        (
            dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, zero_stage=1),
            False,
            "--zero-stage 1 with --pipeline-model-parallel-size 2",
        ),
        (dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2), True, "--bf16 with"),
        (dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2), False, None),
        (dict(tensor_model_parallel_size=4, expert_tensor_parallel_size=2), False, "expert TP 1"),
        # the torch backend (FSDP2 over expert DP) trains what DeepSpeed's ZeRO refuses
        (dict(expert_model_parallel_size=2, use_torch_fsdp2=True), False, None),
        (dict(use_torch_fsdp2=True), False, None),
        (
            dict(
                expert_model_parallel_size=2,
                pipeline_model_parallel_size=2,
                tensor_model_parallel_size=2,
                expert_tensor_parallel_size=1,
                use_torch_fsdp2=True,
            ),
            True,
            None,
        ),
        (
            dict(tensor_model_parallel_size=4, expert_tensor_parallel_size=2, use_torch_fsdp2=True),
            False,
            "expert TP 1",
        ),
    ],
)
def test_expert_layouts_training_refuses_are_one_line(layout, bf16, message):
    from pretrain.cli.resolve import check_moe_training

    moe = _config(DEEPSEEK)[1]
    parallel = ParallelConfig(world_size=8, **layout)
    if message is None:
        check_moe_training(moe, parallel, bf16=bf16)
        return
    with pytest.raises(UserError, match=message) as error:
        check_moe_training(moe, parallel, bf16=bf16)
    assert "\n" not in str(error.value)
    dense = _config([])[1]
    for backend in ({}, {"use_torch_fsdp2": True}):
        with pytest.raises(UserError, match="drop --no-save-full-state") as error:
            check_moe_training(
                moe,
                ParallelConfig(world_size=8, expert_model_parallel_size=2, **backend),
                False,
                False,
            )
        assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="needs an MoE model"):
        check_moe_training(dense, ParallelConfig(world_size=8, expert_model_parallel_size=2))
