"""`sbatch examples/slurm_train.sbatch` on a real two-node Slurm cluster (tests/slurm_cluster.py:
munged, slurmctld, slurmd n1 and n2 on this machine), the recipe file unchanged: only sbatch's own
flags and the environment size it.

- TP2 x DP2 over the two nodes (2 tasks per node, started by `srun` alone, gloo) trains the losses
  of one process of the same flags (1e-6 relative, as tests/test_training_equivalence.py).
- `scancel --signal=TERM` mid-run signals every task; with --exit-signal-handler the job commits a
  checkpoint and completes; the same submission again resumes from it (the recipe's --load is its
  --save) and trains the uninterrupted job's remaining losses bit for bit.

Skipped where `slurm-wlm` and `munge` are not installed (`.ci/run` installs them).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import slurm_cluster
from cluster_fixtures import (
    ITERS,
    assert_equals_one_process,
    finished,
    recipe_env,
    submit,
    wait_for_iterations,
)
from training_fixtures import PYTHON, REPO, read_metrics

pytestmark = pytest.mark.slurm


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left for its parent (pid 1) to reap."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _sleeps() -> list[psutil.Process]:
    """The running `sleep 317` tasks of the job the test below submits."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = p.info["cmdline"] or []
        if cmdline[-1:] == ["317"] and Path(cmdline[0]).name == "sleep":
            if p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


@pytest.mark.timeout(180)
def test_cluster_script_is_idempotent_and_leaves_nothing_running(cluster, tmp_path):
    """`up` twice starts each daemon once; `down` cancels the running job, then stops each
    daemon by its pid; a second `down` does nothing."""
    cli = [PYTHON, str(REPO / "tests" / "slurm_cluster.py")]
    root = tmp_path / "c"
    try:
        _up_twice_down_twice(cli, root)
    finally:
        slurm_cluster.down(root)


def _up_twice_down_twice(cli: list[str], root: Path) -> None:
    """The CLI: up, up (same pids), a running job, down (the job cancelled, each daemon stopped
    by its pid), down (nothing to stop)."""
    started = []
    for _ in range(2):
        out = subprocess.run(
            [*cli, "up", "--dir", str(root)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        started.append(slurm_cluster.status(root))
    first, second = started
    assert all(first.values()) and second == first
    wrap = ["sbatch", "-N", "2", "-o", "/dev/null", "--wrap", "srun sleep 317"]
    subprocess.run(wrap, env=slurm_cluster.env(root), check=True, timeout=30)
    deadline = time.monotonic() + 60
    while len(_sleeps()) < 2:  # a job step's task on each node
        assert time.monotonic() < deadline, "the job's tasks did not start"
        time.sleep(0.2)
    out = subprocess.run([*cli, "down", "--dir", str(root)], capture_output=True, text=True)
    assert [f"stopped {name} (pid {pid})" for name, pid in first.items()] == (
        out.stdout.splitlines()[:4]
    )
    assert all(_gone(pid) for pid in first.values())
    assert not _sleeps()  # the running job was cancelled first: no task outlives the cluster
    out = subprocess.run([*cli, "down", "--dir", str(root)], capture_output=True, text=True)
    assert out.returncode == 0 and "stopped" not in out.stdout


@pytest.mark.timeout(420)
def test_tp2_dp2_over_two_nodes_equals_one_process(two_nodes, one_process):
    _, output, got = two_nodes
    assert re.search(r"job \d+: 2 nodes \(n\[1-2\]\), 4 tasks, TP=2 PP=1, master n1:", output)
    assert "4 rank(s) via slurm, backend gloo" in output and "TP=2  PP=1  DP=2" in output
    assert "4 ranks on 2 nodes run the same code" in output
    assert "ranks 0-1 (n1), ranks 2-3 (n2)" in output
    assert_equals_one_process({i: m["lm-loss"] for i, m in got.items()}, one_process)


@pytest.mark.timeout(600)
def test_scancel_signal_term_saves_and_the_resubmission_resumes_exactly(
    cluster, recipe_corpus, two_nodes
):
    tmp, _, full = two_nodes
    save, first, second = tmp / "preempted", tmp / "first.jsonl", tmp / "second.jsonl"
    job = submit(cluster, tmp, recipe_env(recipe_corpus, save, first))
    wait_for_iterations(cluster, job, first, 2)
    subprocess.run(
        ["scancel", "--signal=TERM", job], env=slurm_cluster.env(cluster), check=True, timeout=30
    )
    output = finished(cluster, tmp, job)
    stopped = int((save / "latest").read_text().removeprefix("global_step"))
    assert 2 <= stopped < ITERS, output[-6000:]
    assert f"exiting after iteration {stopped}: SIGTERM received (--exit-signal-handler)" in output
    assert sorted(read_metrics(first)) == list(range(1, stopped + 1))

    again = submit(cluster, tmp, recipe_env(recipe_corpus, save, second))
    output = finished(cluster, tmp, again)
    assert f"loaded checkpoint {save / f'global_step{stopped}'}" in output, output[-6000:]
    resumed = read_metrics(second)
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    losses = [read_metrics(first)[i]["lm-loss"] for i in range(1, stopped + 1)]
    losses += [resumed[i]["lm-loss"] for i in range(stopped + 1, ITERS + 1)]
    assert losses == [full[i]["lm-loss"] for i in range(1, ITERS + 1)]
