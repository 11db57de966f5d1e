"""Shared pieces of the signal tests (a launch starts with `training_fixtures.start`, in its own
session): find its ranks and their DataLoader workers, wait for logged iterations, collect the
output under a hard timeout; run the SIGKILL-in-a-save trials of tests/checkpoint_kill_trials.py
and check that a trial resumed from the step `latest` named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
from training_fixtures import PYTHON, REPO, read_metrics, run
from training_fixtures import test_env as clean_env


def _runs_script(process: psutil.Process) -> bool:
    try:
        cmdline = process.cmdline()
    except psutil.NoSuchProcess:
        return False
    if "deepspeed.launcher.launch" in cmdline:
        return False  # the per-node launcher (its arguments name the script too)
    return any(a.endswith("pretrain_gpt.py") for a in cmdline)


def job(pid: int) -> tuple[dict[int, psutil.Process], list[psutil.Process]]:
    """(rank -> its pretrain_gpt.py process, the ranks' DataLoader worker processes) under `pid`.
    A worker is a fork of its rank: its parent has the same command line."""
    ranks, workers = {}, []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if not _runs_script(child):
                continue
            parent = child.parent()
            if parent is not None and parent.cmdline() == child.cmdline():
                workers.append(child)
                continue
            env = child.environ()
            ranks[int(env.get("RANK", env.get("SLURM_PROCID", -1)))] = child
        except psutil.NoSuchProcess:
            continue
    return ranks, workers


def wait_for_iterations(proc: subprocess.Popen, metrics: Path, count: int) -> None:
    """Return once `metrics` holds `count` iterations; fail (killing the group) if the run ends
    or 300 s pass first."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(read_metrics(metrics)) >= count:
            return
        time.sleep(0.05)
    kill_group(proc)
    raise AssertionError(f"no {count} iterations before the end:\n{proc.communicate()[0][-6000:]}")


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The launch's whole output once every process holding its stdout has ended."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError(proc.communicate()[0][-6000:]) from None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launch's process group, should anything be left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_kill_trials(tmp_path: Path, flags: list[str], world: int, trials: list[dict]):
    """Run `trials` (tests/checkpoint_kill_trials.py's spec; `flags` train 2 iterations and save
    every one) after the reference run of one iteration per resume trial; returns (each trial's
    record, the reference's metrics), both phases having ended with status 0 on every rank."""
    final = 2 + sum(t["kind"] == "resume" for t in trials)
    spec = {
        "flags": flags + ["--lr-decay-iters", str(final)],  # one schedule for every --train-iters
        "world": world,
        "save": str(tmp_path / "ckpt"),
        "metrics": str(tmp_path / "m.jsonl"),
        "reference": {"save": str(tmp_path / "ref"), "iters": final, "metrics": str(tmp_path / "ref.jsonl")},
        "trials": trials,
    }  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = run(
        [PYTHON, str(REPO / "tests" / "checkpoint_kill_trials.py"), str(tmp_path / "spec.json")],
        timeout=850,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stdout[-6000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    phases = [r for r in lines if "phase" in r]
    assert [p["status"] for p in phases] == [[0] * world] * 2, phases
    done = [r for r in lines if "trial" in r]
    assert len(done) == len(trials)
    return done, read_metrics(tmp_path / "ref.jsonl")


def check_kill_trial(t: dict, reference: dict, committed: set[str]) -> dict:
    """A "resume" trial loaded the step `latest` named (on every rank), every file of the step
    `latest` names after it loads, the armed rank died of the SIGKILL, `latest` moved on only if
    the kill came after the save's commit point (an event in `committed`), and the launch's own
    metrics file starts after the step it loaded with the uninterrupted run's loss (a fresh start
    would write iteration 1, with another loss). Returns the trial without its output tail."""
    context = {k: v for k, v in t.items() if k != "tail"}
    before = int(t["latest_before"].removeprefix("global_step"))
    assert t["loaded"] == before, (context, t["tail"])
    assert not t["traceback"] and t["every_file_loads"], (context, t["tail"])
    killed = t["event"] is not None
    assert t["status"][t["rank"] if killed else 0] == (-9 if killed else 0), context
    saved = t["event"] in committed or not killed
    assert t["latest_after"] == f"global_step{before + saved}", context
    metrics = read_metrics(t["metrics"])
    assert sorted(metrics) == [before + 1], context
    assert metrics[before + 1]["lm-loss"] == reference[before + 1]["lm-loss"], context
    return context
