"""Every flag of Megatron-LM's and Megatron-DeepSpeed's launch scripts has an effect here, a
documented no-op, or a one-line refusal naming it and what to use instead.

tests/fixtures/launch_script_flags.txt lists the flags of those scripts (its header names the
scripts and commits). Each is a pretrain_gpt.py flag (`--help` lists it), a refused one
(`pretrain.cli.refused.REFUSED_FLAGS`), or another tool's option in the same script
(`OTHER_TOOLS`), and docs/COMPATIBILITY.md's table names every one. The flags with an effect are
checked by what they do: `--overlap-grad-reduce` in the DeepSpeed config and in a real ZeRO-1
run, `--use-checkpoint-args` on a real saved checkpoint, the size-1-only parallelisms, the
aliases and `--wandb-save-dir`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    logged_losses,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

from pretrain.cli import build_parser, parse_args
from pretrain.cli.refused import REFUSED_FLAGS
from pretrain.errors import UserError
from pretrain.training.backends.deepspeed.config import build_deepspeed_config
from pretrain.training.report.logging import ScalarWriter

pytestmark = [pytest.mark.timeout(600)]

FIXTURE = Path(__file__).parent / "fixtures" / "launch_script_flags.txt"
ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TWO_RANKS = {**ONE_RANK, "WORLD_SIZE": "2"}

# options of the other commands in those scripts (and of the scripts themselves), not
# pretrain_gpt.py's
OTHER_TOOLS = {
    **dict.fromkeys(
        ("--input", "--output-prefix", "--workers", "--append-eod", "--dataset-impl"),
        "tools/preprocess_data.py",
    ),
    **dict.fromkeys(
        (
            "--capture-range",
            "--capture-range-end",
            "--cuda-graph-trace",
            "--cpuctxsw",
            "--cuda-memory-usage",
            "--trace",
            "--sample",
        ),
        "nsys profile",
    ),  # fmt: skip
    **dict.fromkeys(("--container-workdir", "--overcommit"), "srun"),
    **dict.fromkeys(("--format", "--query-gpu"), "nvidia-smi"),
    **dict.fromkeys(
        (
            "--data",
            "--tokenizer",
            "--checkpoint-path",
            "--tensorboard-logs-path",
            "--distributed-config-file",
        ),
        "examples/gptoss/02_train.sh's own options",
    ),  # fmt: skip
}


def script_flags() -> list[str]:
    lines = FIXTURE.read_text().splitlines()
    return [line.split()[0] for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return make_corpus(tmp_path_factory.mktemp("flags") / "corpus")


def tiny(corpus: str, *extra: str) -> list[str]:
    """A tiny valid command line."""
    return model_flags("gpt2") + train_flags(corpus, iters=4) + list(extra)


def test_every_script_flag_is_ours_refused_or_another_tools():
    ours = set(build_parser()._option_string_actions)
    unknown = [
        f
        for f in script_flags()
        if f not in ours and f not in REFUSED_FLAGS and f not in OTHER_TOOLS
    ]  # fmt: skip
    assert not unknown, f"launch-script flags without an entry: {unknown}"
    assert not set(REFUSED_FLAGS) & ours, "a refused flag is also in the parser"


def test_compatibility_table_names_every_script_flag():
    text = (REPO / "docs" / "COMPATIBILITY.md").read_text()
    section = text[text.index("## Flags of the launch scripts") :]
    rows = set(re.findall(r"^\| `(--[^`]+)`", section, re.MULTILINE))
    missing = [f for f in script_flags() if f not in rows]
    assert not missing, f"docs/COMPATIBILITY.md's launch-script table lacks {missing}"


def test_every_refused_flag_is_one_line_naming_it(corpus):
    for flag in REFUSED_FLAGS:
        with pytest.raises(UserError) as err:
            parse_args(tiny(corpus, flag, "1"), env=ONE_RANK)
        line = str(err.value)
        assert line.startswith(f"{flag}: ") and "\n" not in line, line
        assert "unrecognized" not in line


def test_a_refused_flag_exits_2_with_one_line(corpus):
    cmd = [PYTHON, str(REPO / "pretrain_gpt.py"), *tiny(corpus, "--moe-loss-coeff", "0.01")]
    proc = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and errors == [
        "error: --moe-loss-coeff: Megatron-DeepSpeed's MoE flags are not implemented "
        "(Megatron-LM's are); use --moe-aux-loss-coeff"
    ], proc.stderr
    assert "Traceback" not in proc.stderr  # fmt: skip


SIZE_ONE = [
    ("--context-parallel-size", "there is no context parallelism"),
    ("--ds-sequence-parallel-size", "there is no DeepSpeed-Ulysses sequence parallelism"),
]


@pytest.mark.parametrize("flag,words", SIZE_ONE)
def test_a_parallelism_we_lack_is_accepted_at_1_and_refused_above(corpus, flag, words):
    plain = dataclasses.replace(parse_args(tiny(corpus), env=ONE_RANK), argv=())
    at_one = dataclasses.replace(parse_args(tiny(corpus, flag, "1"), env=ONE_RANK), argv=())
    assert at_one == plain
    with pytest.raises(
        UserError, match=re.escape(f"{flag} 2: only 1 is accepted (") + ".*" + words
    ):
        parse_args(tiny(corpus, flag, "2"), env=ONE_RANK)


@pytest.mark.parametrize("value", ["zarr", "torch_dcp", "fsdp_dtensor"])
def test_ckpt_format_accepts_torch_and_torch_dist_only(corpus, value):
    parse_args(tiny(corpus, "--ckpt-format", "torch"), env=ONE_RANK)
    with pytest.raises(UserError, match=re.escape(f"--ckpt-format {value}: checkpoints here are")):
        parse_args(tiny(corpus, "--ckpt-format", value), env=ONE_RANK)


def _ds_config(cfg) -> dict:
    t = cfg.training
    return build_deepspeed_config(
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        num_microbatches=t.num_microbatches,
        clip_grad=cfg.optimizer.clip_grad,
        parallel=cfg.parallel,
        precision=cfg.precision,
        user_json=cfg.deepspeed_json,
    )


def test_overlap_grad_reduce_is_deepspeeds_overlap_comm(corpus, tmp_path):
    flag = "--overlap-grad-reduce"
    zero1 = _ds_config(parse_args(tiny(corpus, "--zero-stage", "1", flag), env=TWO_RANKS))
    assert zero1["zero_optimization"] == {"stage": 1, "overlap_comm": True}
    plain = _ds_config(parse_args(tiny(corpus, "--zero-stage", "1"), env=TWO_RANKS))
    assert "overlap_comm" not in plain["zero_optimization"]  # DeepSpeed's default: off at 1-2
    zero0 = _ds_config(parse_args(tiny(corpus, flag), env=TWO_RANKS))
    assert "overlap_comm" not in zero0["zero_optimization"]  # ZeRO-0 reduces after backward
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": False}}))
    with pytest.raises(UserError, match=re.escape(
        "sets zero_optimization.overlap_comm=false but --overlap-grad-reduce is given")):  # fmt: skip
        parse_args(tiny(corpus, "--deepspeed_config", str(ds_json), flag), env=TWO_RANKS)


@pytest.mark.slow
def test_overlap_grad_reduce_trains_the_same_losses(corpus, tmp_path):
    """DP 2, ZeRO-1 on CPU: overlap_comm changes when the reduction runs, not what it sums."""
    runs, metrics = [], {}
    for name, extra in (("plain", []), ("overlap", ["--overlap-grad-reduce"])):
        metrics[name] = tmp_path / f"{name}.jsonl"
        runs.append(tiny(corpus, "--zero-stage", "1", "--metrics-file", str(metrics[name]), *extra))
    result = run(multirun_cmd(2, runs, tmp_path / "runs.json"), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:]
    plain, overlap = (read_metrics(metrics[n]) for n in ("plain", "overlap"))
    assert sorted(plain) == [1, 2, 3, 4]
    for it in plain:
        assert overlap[it]["lm-loss"] == pytest.approx(plain[it]["lm-loss"], rel=1e-6)
        assert overlap[it]["grad-norm"] == pytest.approx(plain[it]["grad-norm"], rel=1e-6)


def test_megatron_deepspeed_aliases(corpus):
    theta = parse_args(tiny(corpus, "--rotary-position-embeddings-theta", "500000"), env=ONE_RANK)
    assert theta.model.rotary_base == 500000
    with pytest.raises(UserError, match="--rotary-position-embeddings-theta 500000 disagrees"):
        parse_args(tiny(corpus, "--rotary-position-embeddings-theta", "500000",
                        "--rotary-base", "20000"), env=ONE_RANK)  # fmt: skip
    block = parse_args(tiny(corpus, "--checkpoint-activations",
                            "--activations-checkpoint-method", "block"), env=ONE_RANK)  # fmt: skip
    assert (block.model.recompute_granularity, block.model.recompute_method) == ("full", "block")
    with pytest.raises(UserError, match="--activations-checkpoint-method block contradicts"):
        parse_args(tiny(corpus, "--checkpoint-activations", "--activations-checkpoint-method",
                        "block", "--recompute-method", "uniform"), env=ONE_RANK)  # fmt: skip


def test_no_position_embedding_describes_a_rope_model(corpus):
    rope = ["--position-embedding-type", "rope"]
    with_flag = parse_args(tiny(corpus, *rope, "--no-position-embedding"), env=ONE_RANK)
    assert with_flag.model == parse_args(tiny(corpus, *rope), env=ONE_RANK).model
    with pytest.raises(UserError, match="--no-position-embedding with --position-embedding-type "
                                        "learned_absolute: a model without position"):  # fmt: skip
        parse_args(tiny(corpus, "--no-position-embedding"), env=ONE_RANK)


def test_wandb_save_dir_is_wandbs_dir(monkeypatch, tmp_path):
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    ScalarWriter(0, None, "proj", "exp", None, {}, wandb_dir=str(tmp_path))
    assert calls == [{"project": "proj", "name": "exp", "config": {}, "dir": str(tmp_path)}]


# --use-checkpoint-args on a real checkpoint: a Llama-style model trained 2 iterations
LLAMA = {
    "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
    "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
    "ffn_hidden_size": 64, "num_query_groups": 2, "untie_embeddings_and_output_weights": True,
    "add_bias_linear": False, "make_vocab_size_divisible_by": 64, "hidden_dropout": 0.0,
}  # fmt: skip


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("ckpt_args")
    ckpt = tmp / "ckpt"
    flags = model_flags("llama") + train_flags(corpus, iters=2)
    cmd = [
        PYTHON,
        str(REPO / "pretrain_gpt.py"),
        *flags,
        "--save",
        str(ckpt),
        "--save-interval",
        "2",
    ]
    result = run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return ckpt, train_flags(corpus, iters=3)


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(llama_checkpoint, capsys):
    ckpt, train = llama_checkpoint
    cfg = parse_args(train + ["--load", str(ckpt), "--use-checkpoint-args"], env=ONE_RANK)
    assert {k: getattr(cfg.model, k) for k in LLAMA} == LLAMA
    assert cfg.training.seq_length == 16 and cfg.checkpoint.use_checkpoint_args
    said = capsys.readouterr().err
    assert "--use-checkpoint-args: --num-layers 2 from the checkpoint" in said
    assert "--use-checkpoint-args: normalization=RMSNorm from the checkpoint (--normalization; the " \
           "command line gave LayerNorm)" in said  # fmt: skip


def test_use_checkpoint_args_follows_megatrons_rules(llama_checkpoint, capsys):
    """Sizes given on the command line stay (Megatron sets them only where None); the other model
    flags are overridden by the checkpoint, one line each."""
    ckpt, train = llama_checkpoint
    given = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--normalization", "LayerNorm", "--hidden-dropout", "0.2"]  # fmt: skip
    cfg = parse_args(train + given + ["--load", str(ckpt), "--use-checkpoint-args"], env=ONE_RANK)
    assert cfg.model.num_layers == 4  # the command line's, as Megatron: check_before_launch refuses
    assert (cfg.model.normalization, cfg.model.hidden_dropout) == ("RMSNorm", 0.0)
    said = capsys.readouterr().err.splitlines()
    assert [line for line in said if "hidden_dropout" in line] == [
        "--use-checkpoint-args: hidden_dropout=0.0 from the checkpoint (--hidden-dropout; the "
        "command line gave 0.2)"
    ]
    assert not [line for line in said if "--num-layers" in line]


def test_use_checkpoint_args_needs_load_and_says_when_there_is_no_checkpoint(
    corpus, tmp_path, capsys
):
    with pytest.raises(UserError, match=re.escape("--use-checkpoint-args needs --load")):
        parse_args(tiny(corpus, "--use-checkpoint-args"), env=ONE_RANK)
    empty = tmp_path / "none"
    requeue = ("--load", str(empty), "--save", str(empty), "--save-interval", "1")  # first launch
    cfg = parse_args(tiny(corpus, *requeue, "--use-checkpoint-args"), env=ONE_RANK)
    assert cfg.model.num_layers == 2
    assert f"no checkpoint in --load {empty} yet; using the command line's model flags" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
def test_use_checkpoint_args_resumes_without_model_flags(llama_checkpoint):
    ckpt, train = llama_checkpoint
    # one more iteration than saved: the decay span (the training length) grows, so say which
    # schedule the resume follows, as Megatron asks
    cmd = [PYTHON, str(REPO / "pretrain_gpt.py"), *train, "--load", str(ckpt),
           "--use-checkpoint-args", "--override-opt_param-scheduler"]  # fmt: skip
    result = run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "loaded checkpoint" in result.stdout and sorted(logged_losses(result.stdout)) == [3]
