"""Checkpoints resume exactly, survive a kill -9 during a save, and survive a rank killed under torchrun.

Dropout is on (0.1) so the per-rank RNG states in the checkpoint matter; losses are compared bit
for bit (JSON floats round-trip exactly).
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    multirun_outputs,
    read_metrics,
    run,
    torchrun_cmd,
    train_flags,
)
from training_fixtures import test_env as clean_env  # (a plain name: pytest would collect test_env)

from pretrain.checkpoint.format import META_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERS = 6
STOP_AT = 3
RESUME_LAYOUTS = {"pp1_zero2": (1, 1, 2, 2), "pp2_zero1": (1, 2, 1, 1)}
ELASTIC_ITERS = 30
ELASTIC_LAYOUT = (1, 1, 2, 2)


def _flags(corpus, layout, iters, metrics, *extra):
    tp, pp, _, zero = layout
    dropout = [
        "--attention-dropout",
        "0.1",
        "--hidden-dropout",
        "0.1",
    ]  # after model_flags: overrides 0
    return (
        model_flags("gpt2")
        + dropout
        + train_flags(corpus, iters=iters)
        + layout_flags(tp, pp, zero)
        + ["--metrics-file", str(metrics), *extra]
    )


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """One launch: uninterrupted runs, runs stopped by --exit-interval, then the runs that resume
    them (their output is what the fixture returns; each run builds its own engine)."""
    tmp = tmp_path_factory.mktemp("resume")
    corpus = make_corpus(tmp / "corpus")
    first, second = [], []
    for name, layout in RESUME_LAYOUTS.items():
        first.append(_flags(corpus, layout, ITERS, tmp / f"{name}_full.jsonl"))
        stop = [
            "--save",
            str(tmp / f"ckpt_{name}"),
            "--save-interval",
            "100",
            "--exit-interval",
            str(STOP_AT),
        ]
        first.append(_flags(corpus, layout, ITERS, tmp / f"{name}_first.jsonl", *stop))
        second.append(
            _flags(
                corpus,
                layout,
                ITERS,
                tmp / f"{name}_resumed.jsonl",
                "--load",
                str(tmp / f"ckpt_{name}"),
            )
        )
    first.append(_flags(corpus, ELASTIC_LAYOUT, ELASTIC_ITERS, tmp / "elastic_reference.jsonl"))
    result = run(multirun_cmd(2, first + second, tmp / "runs.json"), timeout=400)
    assert result.returncode == 0, result.stdout[-8000:]
    return tmp, corpus, "".join(multirun_outputs(result.stdout)[len(first) :])


@pytest.mark.parametrize("name", sorted(RESUME_LAYOUTS))
def test_resume_is_bit_exact(world2, name):
    tmp, _, _ = world2
    full = read_metrics(tmp / f"{name}_full.jsonl")
    first = read_metrics(tmp / f"{name}_first.jsonl")
    # the resumed run's own file starts after the step it loaded (a fresh start would write
    # iterations 1..ITERS, with the uninterrupted losses)
    resumed = read_metrics(tmp / f"{name}_resumed.jsonl")
    assert sorted(full) == list(range(1, ITERS + 1))
    assert (sorted(first), sorted(resumed)) == (
        list(range(1, STOP_AT + 1)),
        list(range(STOP_AT + 1, ITERS + 1)),
    )
    resumed.update(first)
    for it in range(1, ITERS + 1):
        assert resumed[it]["lm-loss"] == full[it]["lm-loss"], (it, resumed[it], full[it])
        assert resumed[it]["grad-norm"] == full[it]["grad-norm"]
        assert resumed[it]["learning-rate"] == full[it]["learning-rate"]
    # the stopped run saved at --exit-interval and nothing later
    assert (tmp / f"ckpt_{name}" / "latest").read_text() == f"global_step{STOP_AT}"


def test_resume_banner_and_log(world2):
    _, _, output = world2
    assert f"at iteration {STOP_AT} ({STOP_AT * 8} samples consumed)" in output


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    ckpt = tmp_path / "ckpt"
    flags = _flags(
        corpus, (1, 1, 1, 0), 4, tmp_path / "m.jsonl", "--save", str(ckpt), "--save-interval", "2"
    )
    crashed = run(
        [PYTHON, str(REPO / "pretrain_gpt.py"), *flags],
        timeout=120,
        env=clean_env(PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT="4"),
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-4000:]
    # the interrupted save had written its files, into a temporary folder never renamed into place
    assert [p.name.split(".tmp-")[0] for p in ckpt.iterdir() if ".tmp-" in p.name] == [
        ".global_step4"
    ]
    assert not (ckpt / "global_step4").exists()
    assert (ckpt / "latest").read_text() == "global_step2"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not [p for p in ckpt.iterdir() if ".tmp." in p.name]
    first = read_metrics(tmp_path / "m.jsonl")
    (tmp_path / "m.jsonl").unlink()
    resumed = run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags, "--load", str(ckpt)], timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert (
        "loaded checkpoint" in resumed.stdout
        and "at iteration 2 (16 samples consumed)" in resumed.stdout
    )
    again = read_metrics(tmp_path / "m.jsonl")
    assert sorted(again) == [3, 4]
    assert [again[i]["lm-loss"] for i in (3, 4)] == [first[i]["lm-loss"] for i in (3, 4)]
    assert (ckpt / "latest").read_text() == "global_step4"
    # another TP from a checkpoint without the layout-independent state (an older version's):
    # refused before any process group work, naming the converters. (With it, another layout
    # resumes: tests/test_reshard_resume.py.)
    step = ckpt / "global_step4"
    meta = json.loads((step / META_FILE).read_text())
    for shard in step.glob("full_state_*.pt"):
        shard.unlink()
        del meta["files"][shard.name]
    (step / META_FILE).write_text(json.dumps(meta))
    world2 = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29998",
    }
    other = run(
        [
            PYTHON,
            str(REPO / "pretrain_gpt.py"),
            *flags,
            "--load",
            str(ckpt),
            "--tensor-model-parallel-size",
            "2",
        ],
        timeout=60,
        env=clean_env(**world2),
    )
    assert other.returncode == 2, other.stdout[-3000:]
    assert "--tensor-model-parallel-size 1, this run uses 2" in other.stdout
    assert "tools/convert_from_hf.py --target-tensor-parallel-size T" in other.stdout


def _worker_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_elastic_restart_after_kill_9(world2, tmp_path):
    ref_dir, corpus, _ = world2
    reference = read_metrics(ref_dir / "elastic_reference.jsonl")
    metrics = tmp_path / "m.jsonl"
    ckpt = tmp_path / "ckpt"
    flags = _flags(
        corpus,
        ELASTIC_LAYOUT,
        ELASTIC_ITERS,
        metrics,
        "--save",
        str(ckpt),
        "--save-interval",
        "4",
        "--load",
        str(ckpt),
        "--distributed-timeout-minutes",
        "1",
    )
    cmd = torchrun_cmd(2, flags, "--standalone", "--max-restarts", "1", "--monitor-interval", "0.5")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        killed = None
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            done = read_metrics(metrics) if metrics.exists() else {}
            if len(done) >= 6:  # past the first checkpoint, well before the end
                workers = _worker_pids(proc.pid)
                assert len(workers) == 2, workers
                killed = workers[1]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        assert killed is not None, "the run ended before a rank could be killed"
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-8000:]
    loaded = set(re.findall(r"loaded checkpoint \S+ at iteration (\d+)", out))
    assert len(loaded) == 1, out[-8000:]
    # the restarted group (same argv, same metrics file) appended from the loaded step on: the
    # file's iterations are 1..L of the killed group, then K+1..N (a fresh start: 1..N again)
    k = int(loaded.pop())
    written = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    lost = len(written) - (ELASTIC_ITERS - k)
    assert written == list(range(1, lost + 1)) + list(range(k + 1, ELASTIC_ITERS + 1)), written
    assert lost >= k
    final = read_metrics(metrics)  # the restarted group's values replace the lost ones
    assert sorted(final) == list(range(1, ELASTIC_ITERS + 1))
    assert [final[i]["lm-loss"] for i in final] == [reference[i]["lm-loss"] for i in final]
