"""tools/convert_from_megatron.py on MoE checkpoints saved at expert-parallel size 2, and on the
legacy GroupedMLP's weights (`--moe-use-legacy-grouped-gemm`), written by megatron-core 0.16.1.

One 4-rank gloo world builds megatron-core's GPTModel with MoE layers on CPU (the helpers and
patches of tests/test_convert_megatron_moe.py) at EP 2 and makes every weight distinct (each EP
rank's experts get their own noise; dense weights stay replicas across EP ranks, as in training),
runs megatron-core's forward and saves, as Megatron-LM's `--ckpt-format torch` lays it out
(megatron/training/checkpointing.py: the ranks with expert-data-parallel rank 0 write
`mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/model_optim_rng.pt` with args, checkpoint_version,
iteration, model; megatron.training is not installed, so the name is built here by that rule):
- `mixtral-tp2-ep2`: SequentialMLP (`local_experts.<e>`) at TP 2 x EP 2: `mp_rank_0T_00E`, the
  two-number name that means (tp, ep) because PP is 1;
- `deepseek-pp2-ep2-te`: the DeepSeek-like model (dense first layer, shared expert, expert bias)
  at PP 2 x EP 2 under Transformer Engine's grouped names (`linear_fc1.weight<e>`):
  `mp_rank_00_00P_00E`;
- `grouped-tp2-ep2`: the legacy GroupedMLP (`mlp.experts.weight1` / `weight2`) at TP 2 x EP 2 in
  the torch format, and the same model with `dist_checkpointing.save` (`grouped-tp2-ep2-dist`).
  GroupedMLP cannot run on CPU (its forward needs the `grouped_gemm` CUDA package and bf16), so
  only its availability assert is bypassed, to build it and take its state dicts; the reference
  logits come from megatron-core's GPTModel with SequentialMLP experts into which megatron-core
  itself loaded the GroupedMLP's torch_dist checkpoint (GroupedMLP's sharded_state_dict is
  written to be SequentialMLP's; it is the same key the reader already reads).
Converted (to TP 2), our logits equal megatron-core's within 1e-5 (fp32), and the HF export's too.
A folder missing one EP rank's file, a dense weight that differs between EP ranks, and expert TP
other than TP are refused in one line each.
"""

from __future__ import annotations

import os
import shutil
import zlib

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

GROUPED = dict(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
# (name, model, TP, PP, EP, experts: sequential | te | grouped)
RUNS = [
    ("mixtral-tp2-ep2", "mixtral", 2, 1, 2, "sequential"),
    ("deepseek-pp2-ep2-te", "deepseek", 1, 2, 2, "te"),
    ("grouped-tp2-ep2", "mixtral", 2, 1, 2, "grouped"),
]
# (folder, format, the run whose logits it must give, TP, PP, HF class)
CHECKPOINTS = [
    ("mixtral-tp2-ep2", "torch", "mixtral-tp2-ep2", 2, 1, transformers.MixtralForCausalLM),
    ("deepseek-pp2-ep2-te", "torch", "deepseek-pp2-ep2-te", 1, 2, transformers.Glm4MoeForCausalLM),
    ("grouped-tp2-ep2", "torch", "grouped-tp2-ep2", 2, 1, transformers.MixtralForCausalLM),
    ("grouped-tp2-ep2-dist", "torch_dist", "grouped-tp2-ep2", 2, 1, None),
]


def _perturb_experts(model) -> None:
    """Noise on the expert weights that differs per EP (and TP) rank: every global expert is
    distinct, so a wrong expert order changes the logits."""
    from megatron.core import parallel_state as ps

    ep, tp = ps.get_expert_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                seed = zlib.crc32(name.encode()) + 7919 * ep + 101 * tp
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)


def _save_torch(root: str, args, model, te_names: bool) -> None:
    """This rank's file as Megatron-LM's torch format writes it (expert-DP rank 0 only)."""
    from megatron.core import parallel_state as ps
    from test_convert_megatron_moe import _te_grouped_names

    if ps.get_expert_data_parallel_rank() != 0:
        return
    folder = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"  # get_checkpoint_name's rule
    if args.pipeline_model_parallel_size > 1:
        folder += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if args.expert_model_parallel_size > 1:
        folder += f"_{ps.get_expert_model_parallel_rank():03d}"
    path = os.path.join(root, f"iter_{ITERATION:07d}", folder)
    os.makedirs(path, exist_ok=True)
    state = model.state_dict_for_save_checkpoint()
    state = _te_grouped_names(state) if te_names else state
    checkpoint = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": state}
    torch.save(checkpoint, os.path.join(path, "model_optim_rng.pt"))


def _sequential_from_dist(step: str):
    """megatron-core's SequentialMLP GPTModel loaded by megatron-core from a torch_dist folder."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from test_convert_megatron_moe import _build

    model = _build("mixtral", True, True, expert_model_parallel_size=2)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    sharded = {"model": model.sharded_state_dict(metadata={"dp_cp_group": group})}
    model.load_state_dict(dist_checkpointing.load(sharded, step)["model"])
    return model


def _save_all(rank, world_size, root):
    """Every RUNS entry saved as Megatron-LM saves it; megatron-core's logits."""
    import multiprocessing
    import warnings

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import grouped_gemm_util, moe_utils
    from test_convert_megatron_moe import _args, _build, _perturb_expert_bias, _save_dist

    warnings.filterwarnings("ignore")
    multiprocessing.current_process().daemon = False  # the torch_dist writer forks
    oracle._cpu_shims()
    torch.cuda.synchronize = lambda *a, **k: None
    moe_utils.te_general_gemm = None
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None  # build GroupedMLP only
    tokens = torch.randint(
        0, oracle.VOCAB, (oracle.BATCH, oracle.SEQ), generator=torch.Generator().manual_seed(11)
    )
    logits = {}
    for name, model_name, tp, pp, ep, experts in RUNS:
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        torch.manual_seed(100)
        stage = ps.get_pipeline_model_parallel_rank()
        extra = dict(expert_model_parallel_size=ep, **(GROUPED if experts == "grouped" else {}))
        model = _build(model_name, stage == 0, stage == pp - 1, **extra)
        oracle._perturb(model, stage, tied_copy=False)
        _perturb_experts(model)
        _perturb_expert_bias(model)
        args = _args(model_name, tp, pp, "torch")
        args.expert_model_parallel_size = ep
        vars(args).update(GROUPED if experts == "grouped" else {})
        _save_torch(os.path.join(root, name), args, model, experts == "te")
        if experts == "grouped":
            args = _args(model_name, tp, pp, "torch_dist")
            vars(args).update(GROUPED, expert_model_parallel_size=ep)
            _save_dist(os.path.join(root, f"{name}-dist"), args, model)
            dist.barrier()
            model = _sequential_from_dist(
                os.path.join(root, f"{name}-dist", f"iter_{ITERATION:07d}")
            )
        result = oracle._forward([model], tokens)
        folders = (name, f"{name}-dist") if experts == "grouped" else (name,)
        oracle.finish_model([os.path.join(root, f) for f in folders], result, logits, name)
    return {"tokens": tokens, **logits}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_moe_ep")
    return root, oracle.saved_on_ranks(_save_all, root, world_size=4)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_ep_and_grouped_logits_equal_megatron_core(saved, tmp_path, capsys, checkpoint):
    folder, ckpt_format, run, tp, pp, hf_class = checkpoint
    root, results = saved
    tokens, expected = results["tokens"], results[run]
    step = root / folder / f"iter_{ITERATION:07d}"
    if ckpt_format == "torch":
        names = sorted(p.name for p in step.iterdir())
        assert len(names) == 4 and all(n.endswith(("_000", "_001")) for n in names), names
    argv = ["--load", str(root / folder), "--save", str(tmp_path / "ours")]
    argv += ["--target-tensor-parallel-size", "2"]
    argv += ["--output-dir", str(tmp_path / "hf")] if hf_class else []
    convert_from_megatron.main(argv)
    out = capsys.readouterr().out
    assert f"{ckpt_format} format, TP={tp}, PP={pp}, EP=2, iteration {ITERATION}" in out
    ours = read_checkpoint(str(tmp_path / "ours"))
    assert ours.config.num_moe_experts == 4 and ours.config.vocab_size == TOKENS
    with torch.no_grad():
        logits = our_model(ours.state_dict, ours.config)(tokens)
    torch.testing.assert_close(logits[..., :TOKENS], expected[..., :TOKENS], rtol=0, atol=1e-5)
    if hf_class is None:
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is hf_class
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, expected[..., :TOKENS], rtol=0, atol=1e-5)


def _copy(source, target, **args) -> None:
    """A copy of a torch-format checkpoint, with `args` changed in every rank's file."""
    shutil.copytree(source, target)
    for path in target.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        checkpoint = torch.load(path, weights_only=False)  # our own test files
        vars(checkpoint["args"]).update(args)
        torch.save(checkpoint, path)


@pytest.mark.slow
def test_damaged_ep_checkpoints_are_refused(saved, tmp_path):
    """One EP rank's file missing; a dense weight that differs between EP ranks; expert TP other
    than TP: each one line naming the file and the fix, nothing written."""
    root, _ = saved
    out = str(tmp_path / "out")
    _copy(root / "mixtral-tp2-ep2", tmp_path / "missing")
    (
        tmp_path / "missing" / f"iter_{ITERATION:07d}" / "mp_rank_01_001" / "model_optim_rng.pt"
    ).unlink()
    with pytest.raises(
        UserError, match=r"EP=2, but model_optim_rng.pt is missing in mp_rank_01_001"
    ):
        convert_from_megatron.main(["--load", str(tmp_path / "missing"), "--save", out])

    _copy(root / "mixtral-tp2-ep2", tmp_path / "mixed")
    path = tmp_path / "mixed" / f"iter_{ITERATION:07d}" / "mp_rank_00_001" / "model_optim_rng.pt"
    checkpoint = torch.load(path, weights_only=False)  # our own test files
    checkpoint["model"]["decoder.layers.1.mlp.router.weight"] += 1
    torch.save(checkpoint, path)
    with pytest.raises(
        UserError,
        match=r"mp_rank_00_001/model_optim_rng.pt: layers.1.mlp.router"
        r".weight differs from its copy in .*mp_rank_00_000/model_optim_rng.pt",
    ):
        convert_from_megatron.main(["--load", str(tmp_path / "mixed"), "--save", out])

    _copy(root / "mixtral-tp2-ep2", tmp_path / "etp", expert_tensor_parallel_size=1)
    with pytest.raises(UserError, match=r"expert_tensor_parallel_size=1 differs from tensor_"):
        convert_from_megatron.main(["--load", str(tmp_path / "etp"), "--save", out])
    assert not os.path.exists(out)
