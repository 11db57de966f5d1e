"""Mixture-of-experts models to and from Hugging Face: `MixtralForCausalLM`, `Qwen3MoeForCausalLM`
(--qk-layernorm, dense layers anywhere, renormalised or pre-softmax weights) and
`Glm4MoeForCausalLM` (DeepSeek-V3's sigmoid router with expert bias, group-limited routing,
scaling and shared experts, dense first layers), compared with transformers' own classes on the
same tokens (fp32).

In one process: our GPTModel with random weights (random norms and expert bias too) exported
through the adapter and transformers' `save_pretrained` files equals transformers' logits; models
transformers initialised itself, saved in its per-expert file layout, import to ours with equal
logits; each router option changes transformers' logits (so the mapping of each one is checked);
what cannot be expressed is refused by name. On checkpoints of real training runs (one 4-rank
launch, EP = 1; the GLM-like model with --qk-layernorm): TP 2 x PP 2 with whole experts per TP
rank and TP 2 x DP 2 with experts split over TP merge to the DP 4 run's weights, export with
equal logits, and import back at TP 2 x PP 2 bit for bit; one --finetune iteration from the
import logs the original's loss.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from convert_fixtures import launch_runs, layout_flags, load_tool, model_flags, train_flags
from training_fixtures import make_corpus, read_metrics

from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.convert.hf_adapter import hf_flavour, to_hf_config, to_hf_state_dict
from pretrain.convert.hf_folder import SpecialTokens, build_hf_model, read_hf_folder
from pretrain.convert.state_dict import pad_vocab, trim_vocab
from pretrain.errors import UserError
from pretrain.model import GPTModel, ModelConfig
from pretrain.model.config import model_flags as flags_of_config

convert_to_hf = load_tool("convert_to_hf")
convert_from_hf = load_tool("convert_from_hf")

TOL = 1e-5
LLAMA_BODY = ModelConfig(
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=100,
    seq_length=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    ffn_hidden_size=48,
    init_method_std=0.2,  # routing far from ties
)
MIXTRAL = dataclasses.replace(
    LLAMA_BODY, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16
)
GLM = dataclasses.replace(
    MIXTRAL,
    moe_layer_freq=(0, 1, 1),
    moe_router_score_function="sigmoid",
    moe_shared_expert_intermediate_size=32,
    moe_router_enable_expert_bias=True,
    moe_router_dtype="fp32",
)
GLM_GROUPED = dataclasses.replace(
    GLM,
    moe_router_topk=4,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    untie_embeddings_and_output_weights=False,
    qk_layernorm=True,
)
QWEN3 = dataclasses.replace(MIXTRAL, qk_layernorm=True, moe_layer_freq=(1, 0, 1))
QWEN3_UNNORMALISED = dataclasses.replace(QWEN3, moe_layer_freq=1, moe_router_pre_softmax=True)
CONFIGS = {
    "mixtral": MIXTRAL,
    "glm": GLM,
    "glm-grouped-scaled-tied-qknorm": GLM_GROUPED,
    "qwen3-dense-middle": QWEN3,
    "qwen3-pre-softmax": QWEN3_UNNORMALISED,
}
HF_CLASS = {
    "mixtral": transformers.MixtralForCausalLM,
    "glm4_moe": transformers.Glm4MoeForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
}


def _our_model(config: ModelConfig, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    model = GPTModel(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("router.expert_bias"):  # a trained bias, so that it changes the picks
                tensor.copy_(torch.randn_like(tensor) * 0.1)
            if name.endswith("norm.weight"):  # distinct norms (q_norm vs k_norm included)
                tensor.add_(torch.randn_like(tensor) * 0.2)
    return model


def _tokens(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))


def _max_diff(ours: GPTModel, hf, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(tokens, gather_logits=True) - hf(tokens).logits).abs().max().item()


@pytest.mark.parametrize("name", CONFIGS)
def test_ours_equals_transformers_and_its_files_import_back(name, tmp_path):
    config = CONFIGS[name]
    ours = _our_model(config)
    weights = trim_vocab(ours.state_dict(), config.vocab_size)
    hf = build_hf_model(weights, config, SpecialTokens(None, None, None), torch.float32)
    assert type(hf) is HF_CLASS[hf_flavour(config)]
    assert _max_diff(ours, hf, _tokens(config)) <= TOL
    hf.save_pretrained(tmp_path)  # transformers writes its per-expert file layout
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert _max_diff(ours, loaded, _tokens(config)) <= TOL

    config_back, weights_back = read_hf_folder(str(tmp_path), seq_length=config.seq_length)
    assert hf_flavour(config_back) == hf_flavour(config)
    for field in ("num_moe_experts", "moe_router_topk", "moe_layers", "moe_ffn_size"):
        assert getattr(config_back, field) == getattr(config, field), field
    assert weights_back.keys() == weights.keys()
    for key, tensor in weights.items():
        assert torch.equal(weights_back[key], tensor), key


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_transformers_models_import_with_equal_logits(name, tmp_path):
    """Models initialised by transformers (its own init, a random GLM correction bias), saved
    by it, read from the files by the import."""
    common = dict(
        vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )  # fmt: skip
    if name == "mixtral":
        hf_config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=6, **common)
    elif name == "qwen3_moe":
        hf_config = transformers.Qwen3MoeConfig(
            intermediate_size=40, moe_intermediate_size=8, num_experts=6, norm_topk_prob=True,
            mlp_only_layers=[1], **common,
        )  # fmt: skip
    else:
        common["rope_parameters"] |= {"partial_rotary_factor": 1.0}
        hf_config = transformers.Glm4MoeConfig(
            intermediate_size=40, moe_intermediate_size=8, n_routed_experts=8,
            n_shared_experts=2, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=1.8, num_nextn_predict_layers=0, **common,
        )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    for module in hf.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    hf.save_pretrained(tmp_path)

    config, weights = read_hf_folder(str(tmp_path))
    assert config.num_moe_experts == (8 if name == "glm4_moe" else 6)
    if name == "qwen3_moe":
        assert config.moe_layers == (True, False, True) and config.qk_layernorm
    if name == "glm4_moe":
        assert config.moe_layers == (False, True, True)
        assert config.moe_shared_expert_intermediate_size == 16
        assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    ours = GPTModel(config).eval()
    ours.load_state_dict(pad_vocab(weights, config.padded_vocab_size()), strict=True)
    assert _max_diff(ours, hf, _tokens(config)) <= TOL


@pytest.mark.parametrize(
    "change",
    [
        {"e_score_correction_bias": 0.0},
        {"routed_scaling_factor": 1.0},
        {"n_group": 1, "topk_group": 1},
        {"n_shared_experts": None},
    ],
    ids=["expert-bias", "scaling", "group-routing", "shared-expert"],
)
def test_each_router_option_changes_transformers_logits(change):
    """Each GLM option the mapping sets moves transformers' logits far beyond the tolerance, so
    the equality above checks each one."""
    config = GLM_GROUPED
    ours = _our_model(config)
    weights = trim_vocab(ours.state_dict(), config.vocab_size)
    hf_weights = to_hf_state_dict(weights, config)
    variant = to_hf_config(config)
    for key, value in change.items():
        if key == "e_score_correction_bias":
            hf_weights = {
                k: (torch.zeros_like(v) if k.endswith(key) else v) for k, v in hf_weights.items()
            }
        elif key == "n_shared_experts":
            hf_weights = {
                k: (torch.zeros_like(v) if ".shared_experts.down_proj" in k else v)
                for k, v in hf_weights.items()
            }
        else:
            setattr(variant, key, value)
    model = transformers.AutoModelForCausalLM.from_config(variant).eval()
    model.load_state_dict(hf_weights, strict=True)
    assert _max_diff(ours, model, _tokens(config)) > 1e-3


@pytest.mark.parametrize(
    "config, refusal",
    [
        (dataclasses.replace(MIXTRAL, moe_expert_capacity_factor=1.0), "drops no tokens"),
        (dataclasses.replace(MIXTRAL, moe_router_pre_softmax=True), "pre-softmax"),
        (dataclasses.replace(MIXTRAL, moe_layer_freq=2), "every layer"),
        (dataclasses.replace(GLM, moe_layer_freq=(1, 0, 1)), "dense layers first"),
        (dataclasses.replace(GLM, moe_shared_expert_intermediate_size=24), "multiple of"),
        (
            dataclasses.replace(GLM, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=1),
            "top 2",
        ),
        (dataclasses.replace(MIXTRAL, normalization="LayerNorm"), "needs RMSNorm"),
    ],
    ids=["capacity", "pre-softmax", "every-other-layer", "dense-after-moe", "shared-width",
         "group-top-4", "layernorm"],
)  # fmt: skip
def test_inexpressible_moe_models_are_refused(config, refusal):
    with pytest.raises(UserError, match=refusal) as err:
        hf_flavour(config)
    message = str(err.value)
    assert all(name in message for name in ("Mixtral", "Qwen3Moe", "Glm4Moe"))
    assert "\n" not in message


@pytest.mark.parametrize(
    "hf_config, refusal",
    [
        (transformers.OlmoeConfig(num_hidden_layers=1), "olmoe.*q_norm/k_norm"),
        (transformers.DeepseekV3Config(num_hidden_layers=1), "deepseek_v3.*multi-latent"),
        (transformers.Qwen2MoeConfig(num_hidden_layers=1), "shared_expert_gate"),
        (transformers.Glm4MoeConfig(num_hidden_layers=1), "partial_rotary_factor=0.5"),
        (transformers.MixtralConfig(num_hidden_layers=1, sliding_window=32), "sliding_window"),
        (transformers.MixtralConfig(num_hidden_layers=1, num_experts_per_tok=1), "weight 1"),
    ],
    ids=["olmoe", "deepseek-v3", "qwen2-moe", "glm-partial-rope", "mixtral-window", "top-1"],
)
def test_hf_moe_models_we_cannot_run_are_refused_by_name(tmp_path, hf_config, refusal):
    hf_config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match=refusal) as err:
        convert_from_hf.main(["--load", str(tmp_path), "--save", str(tmp_path / "out")])
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- real checkpoints

TRAINED = {
    "mixtral": ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm"],
    "glm": ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
            "--moe-layer-freq", "[0,1]", "--moe-router-score-function", "sigmoid",
            "--moe-shared-expert-intermediate-size", "32", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "0.05", "--moe-router-topk-scaling-factor", "1.5",
            "--qk-layernorm",
            "--moe-token-dispatcher-type", "alltoall"],
}  # fmt: skip
# name -> (TP, PP, ZeRO, expert TP) at 4 ranks: DP 4; TP 2 x PP 2 with whole experts on each TP
# rank; TP 2 x DP 2 with the experts split over TP
# odd: the expert bias moves by +-rate each iteration, so an odd number of steps cannot cancel
TRAINED_ITERATIONS = 3
TRAINED_LAYOUTS = {"dp4": (1, 1, 1, 1), "tp2pp2": (2, 2, 0, 1), "tp2dp2": (2, 1, 2, 2)}


def _trained_argv(model: str, layout, corpus: str, save) -> list[str]:
    tp, pp, zero, etp = layout
    return (
        model_flags("llama")
        + TRAINED[model]
        + train_flags(corpus, iters=TRAINED_ITERATIONS)
        + layout_flags(tp, pp, zero)
        + ["--sequence-parallel", "--expert-tensor-parallel-size", str(etp)]
        + ["--save", str(save), "--save-interval", str(TRAINED_ITERATIONS)]
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_convert")
    corpus = make_corpus(root / "corpus")
    paths, runs = {}, []
    for model in TRAINED:
        for name, layout in TRAINED_LAYOUTS.items():
            paths[model, name] = root / f"{model}_{name}"
            runs.append(_trained_argv(model, layout, corpus, paths[model, name]))
    launch_runs(runs, root, timeout=600)
    return corpus, paths


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", TRAINED)
def test_moe_checkpoints_merge_and_export_with_equal_logits(trained, tmp_path, capsys, model):
    """Every layout merges to the DP 4 run's weights (expert shards of TP 2 joined, whole experts
    under TP taken once, MoE and dense layers placed by the pattern, the trained expert bias);
    each export is transformers' class with our logits."""
    _, paths = trained
    reference = read_checkpoint(str(paths[model, "dp4"]))
    for name in ("tp2pp2", "tp2dp2"):
        merged = read_checkpoint(str(paths[model, name]))
        assert merged.state_dict.keys() == reference.state_dict.keys()
        for key, tensor in reference.state_dict.items():
            torch.testing.assert_close(merged.state_dict[key], tensor, rtol=0, atol=1e-5, msg=key)
        out = tmp_path / name
        convert_to_hf.main(
            ["--load", str(paths[model, name]), "--output-dir", str(out), "--verify"]
        )
        assert "max abs logit difference" in capsys.readouterr().out
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        assert type(hf) is HF_CLASS[hf_flavour(merged.config)]
        ours = GPTModel(merged.config).eval()
        ours.load_state_dict(pad_vocab(merged.state_dict, merged.config.padded_vocab_size()))
        assert _max_diff(ours, hf, _tokens(merged.config)) <= TOL
    bias = reference.state_dict.get("layers.1.mlp.router.expert_bias")
    assert (bias is not None and bias.abs().max() > 0.01) == (model == "glm")  # it was trained


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_round_trip_through_hf_is_identical_and_finetunes_at_the_same_loss(trained, tmp_path):
    """ours -> HF -> ours at TP 2 x PP 2 (experts split over TP) and TP 2 (whole experts) gives
    bit-identical weights; one --finetune iteration from the TP 2 x PP 2 import (DeepSpeed's
    strict load of the expert shards and the expert bias) logs the loss of one from the original
    checkpoint."""
    corpus, paths = trained
    runs, metrics = [], {}
    for model in TRAINED:
        source = str(paths[model, "dp4"])
        original = read_checkpoint(source)
        hf = tmp_path / f"{model}_hf"
        convert_to_hf.main(["--load", source, "--output-dir", str(hf)])
        for target, (tp, pp, etp) in {"tp2pp2": (2, 2, 2), "tp2": (2, 1, 1)}.items():
            back = tmp_path / f"{model}_{target}"
            convert_from_hf.main(
                ["--load", str(hf), "--save", str(back), "--target-tensor-parallel-size", str(tp),
                 "--target-pipeline-parallel-size", str(pp),
                 "--target-expert-tensor-parallel-size", str(etp)]
            )  # fmt: skip
            imported = read_checkpoint(str(back))
            assert imported.state_dict.keys() == original.state_dict.keys()
            for key, tensor in original.state_dict.items():
                assert torch.equal(imported.state_dict[key], tensor), key
        metrics[model, "imported"] = tmp_path / f"{model}_imported.jsonl"
        runs.append(
            flags_of_config(imported.config)
            + train_flags(corpus, iters=1)
            + layout_flags(2, 2, 0)
            + ["--expert-tensor-parallel-size", "2"]
            + ["--load", str(tmp_path / f"{model}_tp2pp2"), "--finetune"]
            + ["--metrics-file", str(metrics[model, "imported"])]
        )
        metrics[model, "original"] = tmp_path / f"{model}_original.jsonl"
        runs.append(
            model_flags("llama")
            + TRAINED[model]
            + train_flags(corpus, iters=1)
            + layout_flags(1, 1, 1)  # as saved: DeepSpeed's own load keeps the expert bias
            + ["--load", source, "--finetune", "--metrics-file", str(metrics[model, "original"])]
        )
    launch_runs(runs, tmp_path, timeout=600)
    for model in TRAINED:
        expected = read_metrics(metrics[model, "original"])[1]["lm-loss"]
        got = read_metrics(metrics[model, "imported"])[1]["lm-loss"]
        assert abs(got - expected) <= 1e-5 * abs(expected), (model, got, expected)


def test_an_imported_moe_checkpoint_with_a_layer_list_reads_back(tmp_path):
    """The metadata check of training's --load accepts a layer pattern stored as a JSON list
    (it raised a TypeError on the tuple type), and the printed flags keep it one argument."""
    from pretrain.checkpoint.format import read_meta
    from pretrain.convert.checkpoint_writer import write_checkpoint

    weights = trim_vocab(_our_model(GLM).state_dict(), GLM.vocab_size)
    write_checkpoint(str(tmp_path / "ck"), weights, GLM)
    meta = read_meta(str(tmp_path / "ck" / "global_step0"))
    assert meta["model"]["moe_layer_freq"] == [0, 1, 1]
    flags = flags_of_config(GLM)
    assert flags[flags.index("--moe-layer-freq") + 1] == "[0,1,1]"
