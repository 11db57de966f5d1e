"""Shared pieces of the signal tests (a launch starts with `training_fixtures.start`, in its own
session): find its ranks and their DataLoader workers, wait for logged iterations, collect the
output under a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
from training_fixtures import read_metrics


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
