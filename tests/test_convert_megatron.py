"""tools/convert_from_megatron.py on checkpoints that megatron-core itself writes.

One 4-rank gloo world (tests/megatron_oracle.py) builds megatron-core GPT models, GPT-2 style
(learned positions, LayerNorm, biases, tied, --openai-gelu) and Llama 3 style (RoPE theta 5e5 with
--use-rope-scaling, RMSNorm, SwiGLU, GQA with kv_channels != hidden/heads, no biases, untied), at
TP1/TP2 x PP1/PP2 (and one virtual-pipeline layout), with local-spec and Transformer-Engine-style
(fused) norm names, runs megatron-core's forward and saves each as Megatron-LM's torch format.
Each is converted to our checkpoint and to Hugging Face; our model's logits equal megatron-core's
within 1e-5 (fp32) and transformers' within 1e-4.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle

import megatron_oracle as oracle
import pytest
import torch
import torch.distributed as dist
import transformers
from convert_fixtures import load_tool
from distributed import run_on_ranks
from megatron_oracle import FLAVOURS, ITERATION, TOKENS

from pretrain.checkpoint import safe_load
from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.convert.verify import our_model
from pretrain.errors import UserError

convert_from_megatron = load_tool("convert_from_megatron")

# (flavour, TP, PP, virtual PP, fused norm names)
LAYOUTS = [
    (flavour, tp, pp, None, fused)
    for flavour in FLAVOURS
    for tp, pp, fused in ((1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True))
] + [("gpt2", 1, 2, 2, True)]


def _name(flavour, tp, pp, vp, fused) -> str:
    return f"{flavour}-tp{tp}-pp{pp}" + (f"-vp{vp}" if vp else "") + ("-te" if fused else "")


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """{name: (checkpoint directory, megatron-core's logits)} and the token batch."""
    root = tmp_path_factory.mktemp("megatron")
    runs = [(_name(*layout), str(root / _name(*layout)), *layout) for layout in LAYOUTS]
    results = run_on_ranks(_save, world_size=4, args=(runs,), timeout=900)
    merged = {}
    for result in results:
        merged.update(result)
    return {name: (root / name, merged[name]) for name, *_ in runs}, merged["tokens"]


def _save(rank, world_size, runs):
    from megatron_oracle import save_checkpoints

    return save_checkpoints(rank, world_size, runs)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[_name(*layout) for layout in LAYOUTS])
def test_logits_equal_megatron_core(megatron, tmp_path, capsys, layout):
    checkpoints, tokens = megatron
    source, expected = checkpoints[_name(*layout)]
    flavour, tp, pp, vp, fused = layout
    convert_from_megatron.main(
        [
            "--load",
            str(source),
            "--save",
            str(tmp_path / "ours"),
            "--target-tensor-parallel-size",
            "2",
            "--output-dir",
            str(tmp_path / "hf"),
        ]
    )
    out = capsys.readouterr().out
    assert f"torch format, TP={tp}, PP={pp}, iteration {ITERATION}" in out
    assert f"vocabulary {TOKENS}" in out  # the tokenizer in args: the padding row is dropped

    ours = read_checkpoint(str(tmp_path / "ours"))
    assert ours.config.openai_gelu == FLAVOURS[flavour]["openai_gelu"]
    assert ours.config.use_rope_scaling == FLAVOURS[flavour]["use_rope_scaling"]
    assert ours.config.vocab_size == TOKENS
    with torch.no_grad():
        logits = our_model(ours.state_dict, ours.config)(tokens)
    torch.testing.assert_close(logits[..., :TOKENS], expected[..., :TOKENS], rtol=0, atol=1e-5)

    if (tp, pp) == (1, 1):  # the variant is visible in these logits: without it they differ
        plain = dataclasses.replace(ours.config, openai_gelu=False, use_rope_scaling=False)
        with torch.no_grad():
            other = our_model(ours.state_dict, plain)(tokens)
        assert (other - logits)[..., :TOKENS].abs().max() > 1e-4

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    with torch.no_grad():
        hf_logits = hf.float().eval()(tokens).logits
    torch.testing.assert_close(hf_logits, expected[..., :TOKENS], rtol=0, atol=1e-4)


def _rewrite_args(source, target, **changes) -> None:
    """Copy a checkpoint with some keys of its saved args changed (or deleted with None)."""
    for folder in sorted(os.listdir(source / f"iter_{ITERATION:07d}")):
        path = source / f"iter_{ITERATION:07d}" / folder / "model_optim_rng.pt"
        checkpoint = safe_load.load(str(path), megatron=True)
        args = vars(checkpoint["args"]).copy()
        args.pop("attention_backend")  # the loader's inert stand-in cannot be pickled back
        for key, value in changes.items():
            if value is None:
                args.pop(key)
            else:
                args[key] = value
        checkpoint["args"] = argparse.Namespace(**args)
        (target / f"iter_{ITERATION:07d}" / folder).mkdir(parents=True)
        torch.save(checkpoint, target / f"iter_{ITERATION:07d}" / folder / "model_optim_rng.pt")
    (target / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


@pytest.mark.slow
def test_unsupported_and_missing_args_are_listed_in_one_error(megatron, tmp_path):
    source = megatron[0][_name("llama", 1, 2, None, False)][0]
    _rewrite_args(
        source, tmp_path / "bad", qk_l2_norm=True, moe_shared_expert_gate=True, normalization=None
    )
    with pytest.raises(UserError) as err:
        convert_from_megatron.main(["--load", str(tmp_path / "bad"), "--save", str(tmp_path / "o")])
    message = str(err.value)
    for part in ("normalization missing", "qk_l2_norm=True", "moe_shared_expert_gate=True"):
        assert part in message, message
    assert not (tmp_path / "o").exists()


# torch_dist: (flavour, TP, PP) on one 2-rank world
DIST_LAYOUTS = [("llama", 2, 1), ("gpt2", 1, 2)]


def _save_dist(rank, world_size, root):
    """megatron-core builds, runs and saves each layout with dist_checkpointing.save, the way
    Megatron-LM's checkpointing does for --ckpt-format torch_dist: {'args', 'checkpoint_version',
    'iteration', 'model' (or model0..): the model's sharded_state_dict} in iter_<N>/, then the
    tracker file. Ranks are made non-daemonic (torchrun's are) because the torch_dist writer
    forks its file writers; torch.cuda.synchronize (before copying tensors to host) is a no-op."""
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    multiprocessing.current_process().daemon = False
    oracle._cpu_shims()
    torch.cuda.synchronize = lambda *a, **k: None
    tokens = torch.randint(
        0, oracle.VOCAB, (oracle.BATCH, oracle.SEQ), generator=torch.Generator().manual_seed(11)
    )
    logits = {}
    for flavour, tp, pp in DIST_LAYOUTS:
        name = f"dist-{flavour}-tp{tp}-pp{pp}"
        ps.initialize_model_parallel(tp, pp)
        stage = ps.get_pipeline_model_parallel_rank()
        model = oracle._build(flavour, stage == 0, stage == pp - 1, None)
        oracle._perturb(model, stage, tied_copy=model.post_process and not model.pre_process)
        result = oracle._forward([model], tokens)
        args = oracle.megatron_args(flavour, tp, pp, None)
        args.ckpt_format = "torch_dist"
        group = ps.get_data_parallel_group(with_context_parallel=True)
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": ITERATION,
            "model": model.sharded_state_dict(metadata={"dp_cp_group": group}),
        }
        step = os.path.join(root, name, f"iter_{ITERATION:07d}")
        if rank == 0:
            os.makedirs(step)
        dist.barrier()
        dist_checkpointing.save(state, step)
        oracle.finish_model([os.path.join(root, name)], result, logits, name)
    return {"tokens": tokens, **logits}


@pytest.fixture(scope="module")
def megatron_dist(tmp_path_factory):
    """{name: (torch_dist checkpoint directory, megatron-core's logits)} and the tokens."""
    root = tmp_path_factory.mktemp("megatron_dist")
    merged = oracle.saved_on_ranks(_save_dist, root, world_size=2)
    return {name: (root / name, merged[name]) for name in merged if name != "tokens"}, merged[
        "tokens"
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout", DIST_LAYOUTS, ids=[f"{f}-tp{t}-pp{p}" for f, t, p in DIST_LAYOUTS]
)
@pytest.mark.slow
def test_torch_dist_logits_equal_megatron_core(megatron_dist, tmp_path, capsys, layout):
    flavour, tp, pp = layout
    checkpoints, tokens = megatron_dist
    source, expected = checkpoints[f"dist-{flavour}-tp{tp}-pp{pp}"]
    assert (source / f"iter_{ITERATION:07d}" / ".metadata").is_file()
    assert list((source / f"iter_{ITERATION:07d}").glob("__*.distcp"))
    convert_from_megatron.main(["--load", str(source), "--save", str(tmp_path / "ours")])
    out = capsys.readouterr().out
    assert f"torch_dist format, TP={tp}, PP={pp}, iteration {ITERATION}" in out
    ours = read_checkpoint(str(tmp_path / "ours"))
    assert ours.config.vocab_size == TOKENS
    with torch.no_grad():
        logits = our_model(ours.state_dict, ours.config)(tokens)
    torch.testing.assert_close(logits[..., :TOKENS], expected[..., :TOKENS], rtol=0, atol=1e-5)


def test_torch_dist_without_common_pt_is_refused(tmp_path):
    step = tmp_path / "iter_0000010"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(UserError, match=r"\.metadata: unreadable"):  # no common.pt: the index
        convert_from_megatron.main(["--load", str(tmp_path), "--output-dir", str(tmp_path / "o")])


class _RunsACommand:
    """What a doctored .metadata could carry: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_torch_dist_metadata_carrying_code_is_refused(tmp_path):
    """torch's own reader would pickle.load .metadata; ours refuses the global and runs nothing."""
    from pretrain.convert import megatron_dist

    step = tmp_path / "iter_0000010"
    step.mkdir()
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    with pytest.raises(UserError, match=r"\.metadata: refused: it names posix\.system"):
        megatron_dist.read_model_tensors(str(step), num_layers=2)
    assert not marker.exists()


@pytest.mark.slow
def test_missing_rank_file_and_unknown_tensors(megatron, tmp_path):
    source = megatron[0][_name("gpt2", 2, 2, None, True)][0]
    _rewrite_args(source, tmp_path / "incomplete")
    (
        tmp_path / "incomplete" / f"iter_{ITERATION:07d}" / "mp_rank_01_001" / "model_optim_rng.pt"
    ).unlink()
    with pytest.raises(UserError, match=r"model_optim_rng.pt is missing in mp_rank_01_001"):
        convert_from_megatron.main(
            ["--load", str(tmp_path / "incomplete"), "--save", str(tmp_path / "o")]
        )

    _rewrite_args(megatron[0][_name("gpt2", 1, 1, None, False)][0], tmp_path / "extra")
    path = tmp_path / "extra" / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    checkpoint = safe_load.load(str(path), megatron=True)
    checkpoint["model"]["decoder.layers.0.self_attention.linear_q_down_proj.weight"] = torch.ones(8)
    torch.save(checkpoint, path)
    with pytest.raises(
        UserError, match=r"does not have: decoder.layers.0.self_attention.linear_q_down_proj"
    ):
        convert_from_megatron.main(
            ["--load", str(tmp_path / "extra"), "--save", str(tmp_path / "o")]
        )
