"""Signals from schedulers: --exit-signal-handler saves and resumes exactly (a dense model, and an
MoE model at EP 2); ranks die with their launcher. Real `deepspeed` launches of two ranks, real
signals."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest
from signal_fixtures import finish, job, kill_group, wait_for_iterations
from test_moe_training import MODELS as MOE
from training_fixtures import (
    deepspeed_cmd,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    start,
    train_flags,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERS = 20
GONE_WITHIN_SECONDS = 15


DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
# the dense GPT-2, and a DeepSeek-like MoE at EP 2: each rank saves and loads its own experts and
# the routers' state (whether the expert bias is 0 where it stops depends on the iteration:
# tests/test_moe_training.py resumes where it is not)
MODELS = {
    "gpt2": model_flags("gpt2") + DROPOUT,
    "moe_ep2": model_flags("llama") + MOE["deepseek"] + ["--expert-model-parallel-size", "2"],
}


def _flags(corpus: str, iters: int, metrics: Path, *extra: str, model: str = "gpt2") -> list[str]:
    return (
        MODELS[model]
        + train_flags(corpus, iters=iters)
        + layout_flags(1, 1, 1)  # two ranks: DP = 2, ZeRO-1
        + ["--metrics-file", str(metrics), *extra]
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_exit_signal_handler_saves_and_resumes_exactly(tmp_path, model):
    corpus = make_corpus(tmp_path / "corpus")
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--exit-signal-handler"]
    proc = start(deepspeed_cmd(2, _flags(corpus, ITERS, metrics, *save, model=model)))
    try:
        wait_for_iterations(proc, metrics, 2)
        job(proc.pid)[0][1].send_signal(signal.SIGTERM)  # one rank only: the ranks must agree
        output = finish(proc, 300)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert proc.returncode == 0, output[-6000:]
    stopped = int((ckpt / "latest").read_text().removeprefix("global_step"))
    assert 2 <= stopped < ITERS
    assert f"exiting after iteration {stopped}: SIGTERM received (--exit-signal-handler)" in output
    assert sorted(read_metrics(metrics)) == list(range(1, stopped + 1))

    reference = tmp_path / "reference.jsonl"
    runs = [
        _flags(corpus, ITERS, reference, model=model),
        _flags(corpus, ITERS, tmp_path / "resumed.jsonl", "--load", str(ckpt), model=model),
    ]
    result = run(multirun_cmd(2, runs, tmp_path / "runs.json"), timeout=400)
    assert result.returncode == 0, result.stdout[-6000:]
    assert f"loaded checkpoint {ckpt / f'global_step{stopped}'} at iteration {stopped}" in (
        result.stdout
    )
    # the resumed launch's own file starts after the step it loaded (a fresh start would write
    # iteration 1 on, with the uninterrupted losses)
    full, resumed = read_metrics(reference), read_metrics(tmp_path / "resumed.jsonl")
    assert sorted(full) == list(range(1, ITERS + 1))
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    assert [resumed[i]["lm-loss"] for i in resumed] == [full[i]["lm-loss"] for i in resumed]


def test_ranks_end_when_the_deepspeed_launcher_is_terminated(tmp_path):
    """The launcher processes die without taking the ranks along (SIGKILL: no handler of
    DeepSpeed's runs; a SIGTERM'd launcher that exits first leaves the same orphans): only the
    ranks' own watchdog can end them, and it must, within seconds."""
    corpus = make_corpus(tmp_path / "corpus")
    metrics = tmp_path / "m.jsonl"
    proc = start(deepspeed_cmd(2, _flags(corpus, 100000, metrics)))
    try:
        wait_for_iterations(proc, metrics, 1)
        ranks = job(proc.pid)[0]
        assert sorted(ranks) == [0, 1]
        everything = psutil.Process(proc.pid).children(recursive=True)  # launch.py and the ranks
        launchers = [p for p in everything if "deepspeed.launcher.launch" in " ".join(p.cmdline())]
        assert launchers, [p.cmdline()[:4] for p in everything]
        for launcher in [psutil.Process(proc.pid), *launchers]:
            launcher.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(everything, timeout=GONE_WITHIN_SECONDS)
        assert not alive, [p.cmdline()[:3] for p in alive]
        output = proc.communicate(timeout=30)[0]
    finally:
        kill_group(proc)
    killed = {proc.pid, *(p.pid for p in launchers)}
    # The watchdog ended the ranks: at least one says so. A rank may instead see its peer's
    # exit first (a failed collective) and end with that; either way every rank is gone (above).
    said = [
        (rank, pid)
        for rank in (0, 1)
        for pid in killed
        if f"error: rank {rank}: the launcher (pid {pid}) is gone" in output
    ]
    assert said, output[-4000:]
