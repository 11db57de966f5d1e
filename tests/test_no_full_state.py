"""`--no-save-full-state`: checkpoints without the layout-independent state resume exactly at their
own layout, and a resume at another layout is refused in one line that names the flag.

Real `pretrain_gpt.py` runs of a tiny GPT on one process (ZeRO-1, dropout on so that the RNG
states in the checkpoint matter); losses are compared bit for bit with the uninterrupted run.
The refusals happen before any process group exists, so one process with WORLD_SIZE=2 shows them.
"""

import json

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env  # (a plain name: pytest would collect test_env)

from pretrain.checkpoint.format import META_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ITERS, STOP_AT = 4, 2
WORLD2 = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29997",
}


def _flags(corpus, metrics, *extra):
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]  # overrides model_flags' 0
    return (
        model_flags("gpt2")
        + dropout
        + train_flags(corpus, iters=ITERS)
        + layout_flags(1, 1, 1)
        + ["--metrics-file", str(metrics), *extra]
    )


def _pretrain(flags, timeout=180, env=None):
    return run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=timeout, env=env)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An uninterrupted run, and the same run stopped at STOP_AT with --no-save-full-state."""
    tmp = tmp_path_factory.mktemp("no_full_state")
    corpus = make_corpus(tmp / "corpus")
    ckpt = tmp / "ckpt"
    full = _pretrain(_flags(corpus, tmp / "full.jsonl"))
    assert full.returncode == 0, full.stdout[-4000:]
    stop = ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", str(STOP_AT)]
    stopped = _pretrain(_flags(corpus, tmp / "resumed.jsonl", *stop, "--no-save-full-state"))
    assert stopped.returncode == 0, stopped.stdout[-4000:]
    return tmp, corpus, ckpt


def test_no_full_state_file_is_written(saved):
    _, _, ckpt = saved
    step = ckpt / f"global_step{STOP_AT}"
    names = sorted(p.name for p in step.iterdir())
    assert not [n for n in names if n.startswith("full_state_")], names
    assert "mp_rank_00_model_states.pt" in names  # DeepSpeed's own files are all there
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in names
    meta = json.loads((step / META_FILE).read_text())
    assert meta["full_state"] is False
    assert not [n for n in meta["files"] if n.startswith("full_state_")]


def test_same_layout_resume_matches_the_uninterrupted_run(saved):
    tmp, corpus, ckpt = saved
    resumed = _pretrain(_flags(corpus, tmp / "resumed.jsonl", "--load", str(ckpt)))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"at iteration {STOP_AT} ({STOP_AT * 8} samples consumed)" in resumed.stdout
    full, again = read_metrics(tmp / "full.jsonl"), read_metrics(tmp / "resumed.jsonl")
    assert sorted(again) == sorted(full) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        for key in ("lm-loss", "grad-norm", "learning-rate"):
            assert again[it][key] == full[it][key], (it, key, again[it], full[it])


def _refusal(output: str) -> str:
    assert "Traceback" not in output, output[-4000:]
    lines = [line for line in output.splitlines() if "--no-save-full-state" in line]
    assert len(lines) == 1, output[-4000:]
    return lines[0]


def test_another_tensor_parallel_size_is_refused_naming_the_flag(saved):
    tmp, corpus, ckpt = saved
    flags = _flags(corpus, tmp / "tp2.jsonl", "--load", str(ckpt))
    other = _pretrain(
        flags + ["--tensor-model-parallel-size", "2"], timeout=90, env=clean_env(**WORLD2)
    )
    assert other.returncode == 2, other.stdout[-4000:]
    line = _refusal(other.stdout)
    assert "--tensor-model-parallel-size 1, this run uses 2" in line
    assert "saved with --no-save-full-state" in line
    assert "resume it at its own layout" in line
    assert not (tmp / "tp2.jsonl").exists()  # refused before any training


def test_another_data_parallel_size_is_refused_naming_the_flag(saved):
    tmp, corpus, ckpt = saved
    other = _pretrain(
        _flags(corpus, tmp / "dp2.jsonl", "--load", str(ckpt)), timeout=90, env=clean_env(**WORLD2)
    )
    assert other.returncode == 2, other.stdout[-4000:]
    line = _refusal(other.stdout)
    assert "split over 1 data-parallel ranks, this run has 2" in line
    assert "saved with --no-save-full-state" in line


@pytest.mark.parametrize("zero", [0, 3])
def test_another_zero_stage_is_refused_naming_the_flag(saved, zero):
    """DeepSpeed's own load cannot cross these stages (its files differ): without the full
    state it is one line naming the flag, not a "damaged checkpoint" from inside DeepSpeed."""
    tmp, corpus, ckpt = saved
    flags = _flags(corpus, tmp / f"zero{zero}.jsonl", "--load", str(ckpt))
    other = _pretrain(flags + ["--zero-stage", str(zero)], timeout=90)
    assert other.returncode == 2, other.stdout[-4000:]
    line = _refusal(other.stdout)
    assert f"--zero-stage 1, this run uses {zero}" in line
    assert "damaged" not in line
    assert ("--no-load-optim" in line) == (zero == 0)  # 0 <-> 1: the weights alone would load
    assert not (tmp / f"zero{zero}.jsonl").exists()
