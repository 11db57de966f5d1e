"""Signals from schedulers: --exit-signal-handler saves and resumes exactly; ranks die with their
launcher. Real `deepspeed` launches of two ranks, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from training_fixtures import (
    REPO,
    deepspeed_cmd,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERS = 20
GONE_WITHIN_SECONDS = 15


def _flags(corpus: str, iters: int, metrics: Path, *extra: str) -> list[str]:
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    return (
        model_flags("gpt2")
        + dropout
        + train_flags(corpus, iters=iters)
        + layout_flags(1, 1, 1)  # two ranks: DP = 2, ZeRO-1
        + ["--metrics-file", str(metrics), *extra]
    )


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _ranks(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """rank -> the pretrain_gpt.py process under this launcher."""
    found = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "deepspeed.launcher.launch" in cmdline:
            continue  # the per-node launcher (its arguments name the script too)
        if any(a.endswith("pretrain_gpt.py") for a in cmdline):
            found[int(child.environ()["RANK"])] = child
    return found


def _wait_for_iterations(proc: subprocess.Popen, metrics: Path, count: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(read_metrics(metrics)) >= count:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {count} iterations before the end:\n{proc.communicate()[0][-6000:]}")


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(proc.communicate()[0][-6000:]) from None


def test_exit_signal_handler_saves_and_resumes_exactly(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--exit-signal-handler"]
    proc = _start(deepspeed_cmd(2, _flags(corpus, ITERS, metrics, *save)))
    try:
        _wait_for_iterations(proc, metrics, 2)
        _ranks(proc)[1].send_signal(signal.SIGTERM)  # one rank only: the ranks must agree
        output = _finish(proc, 300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-6000:]
    stopped = int((ckpt / "latest").read_text().removeprefix("global_step"))
    assert 2 <= stopped < ITERS
    assert f"exiting after iteration {stopped}: SIGTERM received (--exit-signal-handler)" in output
    assert sorted(read_metrics(metrics)) == list(range(1, stopped + 1))

    reference = tmp_path / "reference.jsonl"
    runs = [
        _flags(corpus, ITERS, reference),
        _flags(corpus, ITERS, tmp_path / "resumed.jsonl", "--load", str(ckpt)),
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
    proc = _start(deepspeed_cmd(2, _flags(corpus, 100000, metrics)))
    try:
        _wait_for_iterations(proc, metrics, 1)
        ranks = _ranks(proc)
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
        try:  # the launcher's whole process group, should anything be left
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
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
