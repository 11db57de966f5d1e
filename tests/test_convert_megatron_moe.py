"""tools/convert_from_megatron.py on MoE checkpoints that megatron-core 0.16.1 itself writes.

One 2-rank gloo world builds megatron-core GPTModels with MoE layers on CPU (the local spec:
SequentialMLP experts; patches as tests/test_moe_megatron.py: `torch.cuda.current_device` ->
"cpu", `moe_utils.te_general_gemm = None`, plus tests/megatron_oracle.py's CPU shims), makes every
weight distinct (the expert bias included), runs megatron-core's forward and saves:
- `--ckpt-format torch`: SequentialMLP's `local_experts.<e>` names, and the same renamed as
  Transformer Engine's grouped GEMM saves them (`linear_fc1.weight<e>`, which megatron-core cannot
  build without TE, as megatron_oracle.py does for TE's fused norms);
- `--ckpt-format torch_dist` with megatron-core's own `dist_checkpointing.save`: one stacked key
  per expert weight (SequentialMLP and TEGroupedMLP write the same one), dense and MoE layers
  each saved for their own layers.
Three models: Mixtral-like (softmax top-2 of 4, every layer MoE), the same with --qk-layernorm
(Qwen3-MoE-like) and DeepSeek-like (a dense first layer, sigmoid top-2 with 2 groups, scaling,
expert bias, shared expert). Converted to our checkpoint and to Hugging Face, our logits equal
megatron-core's within 1e-5 and transformers' (Mixtral, Qwen3-MoE, GLM-4.5) within 1e-5.
Expert parallelism and the legacy GroupedMLP: tests/test_convert_megatron_moe_ep.py.
"""

from __future__ import annotations

import io
import os

import megatron_oracle as oracle
import pytest
import torch
import torch.distributed as dist
import transformers
from convert_fixtures import load_tool
from megatron_oracle import ITERATION, TOKENS

from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.convert.verify import our_model
from pretrain.errors import UserError

convert_from_megatron = load_tool("convert_from_megatron")

MOE = {
    "mixtral": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24),
    "qwen3": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, qk_layernorm=True),
    "deepseek": dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1, 1, 1],
        moe_router_score_function="sigmoid",
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.0,
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=32,
        moe_router_dtype="fp32",
    ),
}
# (name, model, TP, PP, format, TE grouped-GEMM names)
CHECKPOINTS = [
    ("mixtral-tp2-torch-te", "mixtral", 2, 1, "torch", True),
    ("deepseek-pp2-torch", "deepseek", 1, 2, "torch", False),
    ("qwen3-pp2-dist", "qwen3", 1, 2, "torch_dist", False),
    ("deepseek-tp2-dist", "deepseek", 2, 1, "torch_dist", False),
]
HF_CLASS = {
    "mixtral": transformers.MixtralForCausalLM,
    "qwen3": transformers.Qwen3MoeForCausalLM,
    "deepseek": transformers.Glm4MoeForCausalLM,
}


def _args(model: str, tp: int, pp: int, ckpt_format: str):
    args = oracle.megatron_args("llama", tp, pp, None)
    fields = dict(MOE[model])
    args.num_experts = fields.pop("num_moe_experts")
    vars(args).update(fields)
    args.use_rope_scaling = False
    args.sequence_parallel = False  # megatron-core's torch norms refuse it (it changes no value)
    args.expert_tensor_parallel_size = tp
    args.ckpt_format = ckpt_format
    return args


def _build(model: str, pre: bool, post: bool, **extra):
    """megatron-core's GPTModel (local spec) of the Llama-style body with MoE layers; `extra`:
    more TransformerConfig fields (expert parallelism, the legacy GroupedMLP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron_oracle import FLAVOURS, SEQ, VOCAB

    f = FLAVOURS["llama"]
    tp = ps.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"],
        num_attention_heads=f["num_attention_heads"], num_query_groups=f["num_query_groups"],
        ffn_hidden_size=f["ffn_hidden_size"], kv_channels=f["kv_channels"],
        normalization="RMSNorm", layernorm_epsilon=f["norm_epsilon"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        moe_token_dispatcher_type="allgather", **MOE[model], **extra,
    )  # fmt: skip
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre,
        post_process=post, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", rotary_base=f["rotary_base"],
    ).eval()  # fmt: skip


def _perturb_expert_bias(model) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("router.expert_bias"):  # replicated: the same noise on every rank
                generator = torch.Generator().manual_seed(len(name))
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)


def _te_grouped_names(state: dict) -> dict:
    """SequentialMLP's `experts.local_experts.<e>.linear_fcK.weight` as TEGroupedMLP's state dict
    names them: `experts.linear_fcK.weight<e>` (plus TE's `_extra_state`)."""
    out = {}
    for name, value in state.items():
        head, sep, tail = name.partition(".experts.local_experts.")
        if not sep:
            out[name] = value
            continue
        expert, linear, kind = tail.split(".", 2)
        out[f"{head}.experts.{linear}.{kind}{expert}"] = value
        out[f"{head}.experts.{linear}._extra_state"] = io.BytesIO(b"te-fp8-meta")
    return out


def _save_torch(root: str, args, model, te_names: bool) -> None:
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() == 0:
        tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        folder = f"mp_rank_{tp:02d}" + (
            f"_{pp:03d}" if args.pipeline_model_parallel_size > 1 else ""
        )
        path = os.path.join(root, f"iter_{ITERATION:07d}", folder)
        os.makedirs(path, exist_ok=True)
        state = model.state_dict_for_save_checkpoint()
        state = _te_grouped_names(state) if te_names else state
        checkpoint = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": ITERATION,
            "model": state,
        }
        torch.save(checkpoint, os.path.join(path, "model_optim_rng.pt"))


def _save_dist(root: str, args, model) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group(with_context_parallel=True)
    state = {
        "args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
        "model": model.sharded_state_dict(metadata={"dp_cp_group": group}),
    }  # fmt: skip
    step = os.path.join(root, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(step)
    dist.barrier()
    dist_checkpointing.save(state, step)


def _save_all(rank, world_size, root):
    """Every CHECKPOINTS entry, written as Megatron-LM writes it; megatron-core's logits."""
    import multiprocessing
    import warnings

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    warnings.filterwarnings("ignore")
    multiprocessing.current_process().daemon = False  # the torch_dist writer forks
    oracle._cpu_shims()
    torch.cuda.synchronize = lambda *a, **k: None
    moe_utils.te_general_gemm = None
    tokens = torch.randint(
        0, oracle.VOCAB, (oracle.BATCH, oracle.SEQ), generator=torch.Generator().manual_seed(11)
    )
    logits = {}
    for name, model_name, tp, pp, ckpt_format, te_names in CHECKPOINTS:
        ps.initialize_model_parallel(tp, pp, expert_tensor_parallel_size=tp)
        torch.manual_seed(100)
        stage = ps.get_pipeline_model_parallel_rank()
        model = _build(model_name, stage == 0, stage == pp - 1)
        oracle._perturb(model, stage, tied_copy=False)
        _perturb_expert_bias(model)
        result = oracle._forward([model], tokens)
        args = _args(model_name, tp, pp, ckpt_format)
        folder = os.path.join(root, name)
        if ckpt_format == "torch":
            _save_torch(folder, args, model, te_names)
        else:
            _save_dist(folder, args, model)
        oracle.finish_model([folder], result, logits, name)
    return {"tokens": tokens, **logits}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_moe")
    return root, oracle.saved_on_ranks(_save_all, root, world_size=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_moe_logits_equal_megatron_core(saved, tmp_path, capsys, checkpoint):
    name, model, tp, pp, ckpt_format, _ = checkpoint
    root, results = saved
    tokens, expected = results["tokens"], results[name]
    iteration_dir = root / name / f"iter_{ITERATION:07d}"
    if ckpt_format == "torch_dist":
        assert list(iteration_dir.glob("__*.distcp"))
    convert_from_megatron.main(
        ["--load", str(root / name), "--save", str(tmp_path / "ours"), "--output-dir",
         str(tmp_path / "hf"), "--target-tensor-parallel-size", "2"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert f"{ckpt_format} format, TP={tp}, PP={pp}, iteration {ITERATION}" in out
    ours = read_checkpoint(str(tmp_path / "ours"))
    assert ours.config.num_moe_experts == 4 and ours.config.vocab_size == TOKENS
    if model == "deepseek":
        assert ours.config.moe_layers == (False, True, True, True)
        assert ours.state_dict["layers.1.mlp.router.expert_bias"].abs().max() > 0.05
    with torch.no_grad():
        logits = our_model(ours.state_dict, ours.config)(tokens)
    torch.testing.assert_close(logits[..., :TOKENS], expected[..., :TOKENS], rtol=0, atol=1e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is HF_CLASS[model]
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    torch.testing.assert_close(hf_logits, expected[..., :TOKENS], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_moe_settings_we_cannot_compute_are_refused(saved, tmp_path):
    """A gated shared expert and probabilities applied on the input are named in the one error
    (legacy GroupedMLP weights are read: tests/test_convert_megatron_moe_ep.py)."""
    root, _ = saved
    source = root / "mixtral-tp2-torch-te" / f"iter_{ITERATION:07d}"
    bad = tmp_path / "bad" / f"iter_{ITERATION:07d}"
    for rank in ("mp_rank_00", "mp_rank_01"):
        checkpoint = torch.load(source / rank / "model_optim_rng.pt", weights_only=False)
        checkpoint["args"].moe_shared_expert_gate = True
        checkpoint["args"].moe_apply_probs_on_input = True
        (bad / rank).mkdir(parents=True)
        torch.save(checkpoint, bad / rank / "model_optim_rng.pt")
    with pytest.raises(UserError, match="moe_shared_expert_gate=True.*moe_apply_probs_on_input"):
        convert_from_megatron.main(["--load", str(bad), "--save", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
