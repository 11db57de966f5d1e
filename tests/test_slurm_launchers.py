"""`sbatch examples/slurm_multi_node.sbatch` on the real two-node Slurm cluster: `srun` starts
examples/multi_node_torchrun.sh or multi_node_deepspeed.sh once per node, and the launcher starts
that node's two ranks (TP2 x DP2 over the nodes). Each job costs start-up time, so a job proves
several things:

- deepspeed (`--num_nodes 2 --node_rank N --master_addr`): the losses of the uninterrupted `srun`
  job (tests/test_slurm.py), bit for bit, and so one process's within 1e-6.
- torchrun (`--nnodes 2 --rdzv-backend c10d --rdzv-endpoint` on the first node), and a node lost
  mid-run (SIGKILL to every process of its task on n2): the job fails, the checkpoint `latest`
  names is intact, and the job requeued (`scontrol requeue`, what Slurm does after a node failure
  with `--requeue`) resumes from it and ends with the `srun` job's losses, bit for bit; the lost
  start's losses were those too.
- nodes that disagree (n2's environment names another data path): every rank stops with one line
  naming the difference, within a minute, no traceback.

The time limit's B:TERM, forwarded by the same recipe code (examples/slurm_preemptible.sh), is
tested on examples/slurm_train.sbatch (tests/test_slurm.py). Skipped where `slurm-wlm` and
`munge` are not installed (`.ci/run` installs them).
"""

from __future__ import annotations

import signal
import time
from datetime import datetime

import psutil
import pytest
import slurm_cluster
from cluster_fixtures import (
    ITERS,
    assert_equals_one_process,
    finished,
    metric_lines,
    recipe_env,
    slurm,
    submit,
    wait_ended,
    wait_for_iterations,
)
from training_fixtures import make_corpus

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RECIPE = "examples/slurm_multi_node.sbatch"


def _launcher_env(launcher: str, corpus: str, tmp, **more: str) -> dict:
    """The per-node recipe's variables: `launcher` starting 2 ranks on each node (`more` adds
    or replaces variables)."""
    variables = {"LAUNCHER": launcher, "NPROC_PER_NODE": "2", "HOSTFILE": str(tmp / "hostfile")}
    return recipe_env(corpus, tmp / "ckpt", tmp / "m.jsonl", **{**variables, **more})


@pytest.mark.timeout(400)
def test_deepspeed_per_node_equals_srun_and_one_process(
    cluster, recipe_corpus, two_nodes, one_process, tmp_path
):
    full = two_nodes[2]
    job = submit(cluster, tmp_path, _launcher_env("deepspeed", recipe_corpus, tmp_path), RECIPE, 1)
    output = finished(cluster, tmp_path, job, tasks="2")
    assert f"job {job}: 2 nodes (n[1-2]) x 2 ranks, deepspeed, TP=2 PP=1, master n1:" in output
    assert "4 rank(s) via deepspeed" in output and "ranks 0-1 (n1), ranks 2-3 (n2)" in output
    lines = metric_lines(tmp_path / "m.jsonl")
    assert [it for it, _ in lines] == list(range(1, ITERS + 1))
    assert [loss for _, loss in lines] == [full[it]["lm-loss"] for it in range(1, ITERS + 1)]
    assert_equals_one_process(dict(lines), one_process)


def _tasks_on(job: str, node: str) -> list[psutil.Process]:
    """Every process of the job's step tasks on `node` (launcher, ranks, workers)."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("SLURM_JOB_ID") == job and env.get("SLURMD_NODENAME") == node:
            if "SLURM_STEP_ID" in env:
                found.append(p)
    return found


@pytest.mark.timeout(600)
def test_torchrun_per_node_survives_a_lost_node_and_the_requeue_resumes_exactly(
    cluster, recipe_corpus, two_nodes, tmp_path
):
    full = two_nodes[2]
    variables = _launcher_env("torchrun", recipe_corpus, tmp_path, SAVE_INTERVAL="4")
    job = submit(cluster, tmp_path, variables, RECIPE, 1)
    wait_for_iterations(cluster, job, tmp_path / "m.jsonl", 6)
    lost = _tasks_on(job, "n2")
    assert any("pretrain_gpt.py" in " ".join(p.cmdline()) for p in lost), lost
    for p in lost:
        p.send_signal(signal.SIGKILL)
    info = wait_ended(cluster, job)
    assert info["JobState"] == "FAILED", info
    latest = (tmp_path / "ckpt" / "latest").read_text()
    committed = int(latest.removeprefix("global_step"))
    assert committed >= 4 and committed % 4 == 0, latest

    deadline = time.monotonic() + 120  # Slurm has cleaned up after the failed start
    while not slurm_cluster.nodes_idle(cluster):
        assert time.monotonic() < deadline, slurm(cluster, "sinfo", "-N")
        time.sleep(0.5)
    slurm(cluster, "scontrol", "requeue", job)
    output = finished(cluster, tmp_path, job, tasks="2")
    assert "torchrun, TP=2 PP=1" in output and ", restart 1" in output, output[-6000:]
    assert "4 rank(s) via torchrun" in output and "4 ranks on 2 nodes run the same" in output
    assert f"loaded checkpoint {tmp_path / 'ckpt' / latest}" in output, output[-6000:]
    lines = metric_lines(tmp_path / "m.jsonl")  # the lost start's 1..m, the requeued start's
    lost_start = len(lines) - (ITERS - committed)
    assert lost_start >= 6 and [it for it, _ in lines] == list(range(1, lost_start + 1)) + list(
        range(committed + 1, ITERS + 1)
    )
    for it, loss in lines:
        assert loss == full[it]["lm-loss"], (it, loss, full[it]["lm-loss"])


@pytest.mark.timeout(300)
def test_nodes_that_disagree_fail_in_one_line_per_rank_within_a_minute(
    cluster, recipe_corpus, tmp_path
):
    other = make_corpus(tmp_path / "other", seed=1)  # what n2 sees at "its" data path
    slurm_cluster.node_env(cluster, "n2", {"DATA_PREFIX": other})
    variables = _launcher_env("deepspeed", recipe_corpus, tmp_path, NPROC_PER_NODE="1")
    try:
        job = submit(cluster, tmp_path, variables, RECIPE, 1)  # a rank per node: TP2 over them
        info = wait_ended(cluster, job, timeout=120)
    finally:
        slurm_cluster.node_env(cluster, "n2", None)
    output = (tmp_path / f"{job}.out").read_text()
    assert info["JobState"] == "FAILED", output[-6000:]
    ran = datetime.fromisoformat(info["EndTime"]) - datetime.fromisoformat(info["StartTime"])
    assert ran.total_seconds() <= 60, (ran, output[-6000:])
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    expected = (
        "the ranks do not run the same job: their command line differs: rank 0 (n1) has "
        f"--data-path {recipe_corpus}, rank 1 (n2) has --data-path {other}; every node "
        "must run the same code and command line on the same data (check what differs on n2"
    )
    prefixes = sorted(e.split(": the ranks")[0] for e in errors)
    assert prefixes == ["error: rank 0 (n1)", "error: rank 1 (n2)"], errors
    assert all(expected in e for e in errors), errors
    assert "Traceback" not in output, output[-6000:]
