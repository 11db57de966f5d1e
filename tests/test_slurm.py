"""`sbatch examples/slurm_train.sbatch` on a real two-node Slurm cluster (tests/slurm_cluster.py:
munged, slurmctld, slurmd n1 and n2 on this machine), the recipe file unchanged: only sbatch's own
flags and the environment size it.

- TP2 x DP2 over the two nodes (2 tasks per node, started by `srun` alone, gloo) trains the losses
  of one process of the same flags (1e-6 relative, as tests/test_training_equivalence.py).
- The time limit's `#SBATCH --signal=B:TERM@60` (sent here at once with `scancel --batch
  --signal=TERM`, which is how Slurm delivers it: to the batch shell only) mid-run: the recipe
  forwards it to every task (`scancel --signal=TERM`), the ranks commit a checkpoint and exit 0,
  the recipe requeues the job, and the job's second start resumes from the checkpoint (the
  recipe's --load is its --save): its losses and the first start's are the uninterrupted job's,
  bit for bit, and its iterations follow on (nothing trained twice, one metrics file).

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
    job_info,
    metric_lines,
    recipe_env,
    slurm,
    submit,
    wait_for_iterations,
)
from training_fixtures import PYTHON, REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


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
def test_b_term_saves_the_job_requeues_itself_and_resumes_exactly(
    cluster, recipe_corpus, two_nodes, tmp_path
):
    full = two_nodes[2]
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    job = submit(cluster, tmp_path, recipe_env(recipe_corpus, save, metrics))
    wait_for_iterations(cluster, job, metrics, 2)
    slurm(cluster, "scancel", "--batch", "--signal=TERM", job)  # what B:TERM@60 does
    output = finished(cluster, tmp_path, job)
    assert job_info(cluster, job)["Restarts"] == "1", output[-6000:]
    stopped = int(re.search(r"exiting after iteration (\d+): SIGTERM received", output)[1])
    assert 2 <= stopped < ITERS, output[-6000:]
    for line in (
        "recipe: SIGTERM to the batch shell: forwarding it to the tasks",
        f"saved checkpoint at iteration {stopped:8d} to {save / f'global_step{stopped}'}",
        f"recipe: step ended (status 0); requeueing job {job} (restart 1): it resumes from",
        f"loaded checkpoint {save / f'global_step{stopped}'} at iteration {stopped}",
    ):
        assert line in output, (line, output[-6000:])
    restart = rf"job {job}: 2 nodes \(n\[1-2\]\), 4 tasks, TP=2 PP=1, master n1:\d+, restart 1"
    assert re.search(restart, output), output[-6000:]
    lines = metric_lines(metrics)  # both starts: the second did not begin at 1
    assert [it for it, _ in lines] == list(range(1, ITERS + 1))
    assert [loss for _, loss in lines] == [full[it]["lm-loss"] for it in range(1, ITERS + 1)]
