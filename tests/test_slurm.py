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

import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import slurm_cluster
from training_fixtures import BIN, PYTHON, REPO, make_corpus, read_metrics, run
from training_fixtures import test_env as clean_env

from pretrain.launch import free_port

pytestmark = pytest.mark.slurm

ITERS = 40  # long enough that SIGTERM after 2 logged iterations lands mid-run
RTOL = 1e-6
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The cluster's directory, the cluster up for the session and down after it."""
    missing = slurm_cluster.missing_commands()
    if missing:
        pytest.skip(f"not installed: {' '.join(missing)} (apt-get install -y slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("the Slurm daemons run as root (tests/slurm_cluster.py)")
    root = tmp_path_factory.mktemp("slurm-cluster")
    try:
        slurm_cluster.up(root)
        yield root
    finally:
        slurm_cluster.down(root)
        assert not any(slurm_cluster.status(root).values()), slurm_cluster.status(root)


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


def _recipe_env(corpus: str, save: Path, metrics: Path) -> dict:
    """The recipe's variables for a tiny fp32 model on the NullTokenizer corpus."""
    return {
        "TP": "2",
        "PP": "1",
        "NUM_LAYERS": "2",
        "HIDDEN_SIZE": "32",
        "NUM_ATTENTION_HEADS": "4",
        "SEQ_LENGTH": "16",
        "MICRO_BATCH_SIZE": "2",
        "GLOBAL_BATCH_SIZE": "8",
        "TRAIN_ITERS": str(ITERS),
        "LOG_INTERVAL": "1",
        "EVAL_ITERS": "0",
        "SAVE_INTERVAL": "100000",
        "PRECISION": "fp32",
        "DATA_PREFIX": corpus,
        "SAVE_DIR": str(save),
        "TOKENIZER_FLAGS": "--tokenizer-type NullTokenizer --vocab-size 100",
        "EXTRA_ARGS": f"--distributed-backend gloo --make-vocab-size-divisible-by 64 "
        f"--metrics-file {metrics}",
    }


def _submit(root: Path, out_dir: Path, variables: dict) -> str:
    """`sbatch` the recipe from the repository on 2 nodes x 2 tasks; the job id."""
    exported = ",".join(f"{k}={v}" for k, v in variables.items())
    cmd = ["sbatch", "--parsable", "--nodes", "2", "--ntasks-per-node", "2"]
    cmd += ["--gpus-per-node", "0", "--cpus-per-task", "1", "--output", f"{out_dir}/%j.out"]
    cmd += [f"--export=ALL,MASTER_PORT={free_port()},{exported}", "examples/slurm_train.sbatch"]
    env = slurm_cluster.env(root, clean_env(PATH=f"{BIN}:/usr/bin:/bin:/usr/sbin:/sbin"))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def _job(root: Path, job: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job],
        env=slurm_cluster.env(root),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(root: Path, job: str, timeout: float = 240) -> dict[str, str]:
    """The job's record once it has ended; on timeout cancel it and fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job(root, job)
        if info.get("JobState") in ENDED:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=slurm_cluster.env(root), timeout=30)
    raise AssertionError(f"job {job} still {_job(root, job).get('JobState')} after {timeout} s")


def _finished(root: Path, out_dir: Path, job: str) -> str:
    """The job's output, asserting it completed with exit code 0."""
    info = _wait(root, job)
    output = (out_dir / f"{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-6000:]
    assert (info["NodeList"], info["NumTasks"]) == ("n[1-2]", "4"), info  # both slurmd
    return output


@pytest.fixture(scope="module")
def two_nodes(cluster, tmp_path_factory):
    """(corpus, out dir, output and metrics of one uninterrupted 2-node job)."""
    tmp = tmp_path_factory.mktemp("slurm-train")
    corpus = make_corpus(tmp / "corpus")
    job = _submit(cluster, tmp, _recipe_env(corpus, tmp / "ckpt", tmp / "m.jsonl"))
    return corpus, tmp, _finished(cluster, tmp, job), read_metrics(tmp / "m.jsonl")


def _one_process_argv(variables: dict) -> list[str]:
    """The recipe's pretrain_gpt.py flags for `variables`, at TP1 PP1 (sourced, not copied)."""
    script = (
        "source examples/model_gpt2_1.3b.sh && printf '%s\\n' --tensor-model-parallel-size 1 "
        '--pipeline-model-parallel-size 1 "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"'
    )
    env = {"PATH": "/usr/bin:/bin", **variables}
    out = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


@pytest.mark.timeout(420)
def test_tp2_dp2_over_two_nodes_equals_one_process(two_nodes, tmp_path):
    corpus, _, output, got = two_nodes
    assert re.search(r"job \d+: 2 nodes \(n\[1-2\]\), 4 tasks, TP=2 PP=1, master n1:", output)
    assert "4 rank(s) via slurm, backend gloo" in output and "TP=2  PP=1  DP=2" in output
    metrics = tmp_path / "one.jsonl"
    argv = _one_process_argv(_recipe_env(corpus, tmp_path / "ckpt", metrics))
    result = run([PYTHON, str(REPO / "pretrain_gpt.py"), *argv], timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    ref = read_metrics(metrics)
    assert sorted(got) == sorted(ref) == list(range(1, ITERS + 1))
    for it in ref:
        a, b = got[it]["lm-loss"], ref[it]["lm-loss"]
        assert abs(a - b) <= RTOL * abs(b), (it, a, b)


@pytest.mark.timeout(600)
def test_scancel_signal_term_saves_and_the_resubmission_resumes_exactly(cluster, two_nodes):
    corpus, tmp, _, full = two_nodes
    save, first, second = tmp / "preempted", tmp / "first.jsonl", tmp / "second.jsonl"
    job = _submit(cluster, tmp, _recipe_env(corpus, save, first))
    deadline = time.monotonic() + 240
    while not (first.exists() and len(read_metrics(first)) >= 2):
        assert time.monotonic() < deadline and _job(cluster, job).get("JobState") not in ENDED
        time.sleep(0.1)
    subprocess.run(
        ["scancel", "--signal=TERM", job], env=slurm_cluster.env(cluster), check=True, timeout=30
    )
    output = _finished(cluster, tmp, job)
    stopped = int((save / "latest").read_text().removeprefix("global_step"))
    assert 2 <= stopped < ITERS, output[-6000:]
    assert f"exiting after iteration {stopped}: SIGTERM received (--exit-signal-handler)" in output
    assert sorted(read_metrics(first)) == list(range(1, stopped + 1))

    again = _submit(cluster, tmp, _recipe_env(corpus, save, second))
    output = _finished(cluster, tmp, again)
    assert f"loaded checkpoint {save / f'global_step{stopped}'}" in output, output[-6000:]
    resumed = read_metrics(second)
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    losses = [read_metrics(first)[i]["lm-loss"] for i in range(1, stopped + 1)]
    losses += [resumed[i]["lm-loss"] for i in range(stopped + 1, ITERS + 1)]
    assert losses == [full[i]["lm-loss"] for i in range(1, ITERS + 1)]
