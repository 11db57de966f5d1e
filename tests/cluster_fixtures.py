"""What the cluster tests share (a pytest plugin, tests/conftest.py): the two-node Slurm cluster
for the session, submitting the recipes in examples/ to it and waiting for their jobs, the tiny
model the recipes are sized down to, and two uninterrupted runs of it every launcher is compared
with: one process (`one_process`) and `srun` over the two nodes, TP2 x DP2 (`two_nodes`).

The cluster fixture skips where `slurm-wlm` and `munge` are not installed (`.ci/run` installs
them) or the tests do not run as root; `one_process` needs neither.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import slurm_cluster
from training_fixtures import BIN, PYTHON, REPO, make_corpus, read_metrics, run
from training_fixtures import test_env as clean_env

from pretrain.launch import free_port

ITERS = 40  # long enough that a signal after 2 logged iterations lands mid-run
RTOL = 1e-6  # a layout against one process, as tests/test_training_equivalence.py
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


def recipe_env(corpus: str, save: Path, metrics: Path, **more: str) -> dict:
    """The recipes' variables (examples/model_gpt2_1.3b.sh) for the tiny fp32 model, TP2, on the
    NullTokenizer corpus; `more` adds or replaces variables."""
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
        **more,
    }


def submit(
    root: Path,
    out_dir: Path,
    variables: dict,
    recipe: str = "examples/slurm_train.sbatch",
    tasks_per_node: int = 2,
) -> str:
    """`sbatch` a recipe from the repository on 2 CPU nodes, `tasks_per_node` tasks each (1 for
    the per-node launchers: that task gets both CPUs); the job id. Output: out_dir/<job>.out."""
    exported = ",".join(f"{k}={v}" for k, v in variables.items())
    cmd = ["sbatch", "--parsable", "--nodes", "2", "--ntasks-per-node", str(tasks_per_node)]
    cmd += ["--gpus-per-node", "0", "--cpus-per-task", str(2 // tasks_per_node)]
    cmd += ["--output", f"{out_dir}/%j.out"]
    cmd += [f"--export=ALL,MASTER_PORT={free_port()},{exported}", recipe]
    env = slurm_cluster.env(root, clean_env(PATH=f"{BIN}:/usr/bin:/bin:/usr/sbin:/sbin"))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def slurm(root: Path, *args: str) -> str:
    """A Slurm command on the cluster under `root`; its stdout (it must succeed)."""
    result = subprocess.run(
        args, env=slurm_cluster.env(root), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, f"{' '.join(args)}: {result.stderr}"
    return result.stdout


def job_info(root: Path, job: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, NodeList, NumTasks, Restarts, ...)."""
    return dict(re.findall(r"(\w+)=(\S*)", slurm(root, "scontrol", "show", "job", "-o", job)))


def wait_ended(root: Path, job: str, timeout: float = 240) -> dict[str, str]:
    """The job's record once it has ended (a requeued job has not); on timeout cancel it and
    fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(root, job)
        if info.get("JobState") in ENDED:
            return info
        time.sleep(0.5)
    state = job_info(root, job).get("JobState")
    slurm(root, "scancel", job)
    raise AssertionError(f"job {job} still {state} after {timeout} s")


def finished(root: Path, out_dir: Path, job: str, tasks: str = "4") -> str:
    """The job's output, asserting it completed with exit code 0 on both nodes."""
    info = wait_ended(root, job)
    output = (out_dir / f"{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-6000:]
    assert (info["NodeList"], info["NumTasks"]) == ("n[1-2]", tasks), info  # both slurmd
    return output


def wait_for_iterations(root: Path, job: str, metrics: Path, count: int) -> None:
    """Return once `metrics` holds `count` lines; fail if the job ends or 240 s pass first."""
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metric_lines(metrics)) >= count):
        state = job_info(root, job).get("JobState")
        assert time.monotonic() < deadline and state not in ENDED, (state, metrics)
        time.sleep(0.1)


def metric_lines(path: Path) -> list[tuple[int, float]]:
    """(iteration, lm loss) of every line of a metrics file, in the order written (the starts
    of a requeued job append to one file)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["iteration"], r["lm-loss"]) for r in lines if "lm-loss" in r]


def one_process_argv(variables: dict) -> list[str]:
    """The recipes' pretrain_gpt.py flags for `variables`, at TP1 PP1 (sourced, not copied)."""
    script = (
        "source examples/model_gpt2_1.3b.sh && printf '%s\\n' --tensor-model-parallel-size 1 "
        '--pipeline-model-parallel-size 1 "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"'
    )
    env = {"PATH": "/usr/bin:/bin", **variables}
    out = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


@pytest.fixture(scope="session")
def recipe_corpus(tmp_path_factory) -> str:
    """The NullTokenizer corpus every recipe run trains on."""
    return make_corpus(tmp_path_factory.mktemp("recipe-data") / "corpus")


@pytest.fixture(scope="session")
def one_process(recipe_corpus, tmp_path_factory) -> dict[int, dict]:
    """iteration -> metrics of one `python pretrain_gpt.py` with the recipes' flags."""
    tmp = tmp_path_factory.mktemp("one-process")
    metrics = tmp / "one.jsonl"
    argv = one_process_argv(recipe_env(recipe_corpus, tmp / "ckpt", metrics))
    result = run([PYTHON, str(REPO / "pretrain_gpt.py"), *argv], timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    return read_metrics(metrics)


@pytest.fixture(scope="session")
def two_nodes(cluster, recipe_corpus, tmp_path_factory):
    """(out dir, output, iteration -> metrics) of one uninterrupted `sbatch
    examples/slurm_train.sbatch` job: 2 nodes x 2 tasks, TP2 x DP2, srun alone."""
    tmp = tmp_path_factory.mktemp("slurm-train")
    job = submit(cluster, tmp, recipe_env(recipe_corpus, tmp / "ckpt", tmp / "m.jsonl"))
    return tmp, finished(cluster, tmp, job), read_metrics(tmp / "m.jsonl")


def assert_equals_one_process(got: dict[int, float], reference: dict[int, dict]) -> None:
    """`got` (iteration -> loss) holds every iteration, each within RTOL of one process's."""
    assert sorted(got) == sorted(reference) == list(range(1, ITERS + 1))
    for it, loss in got.items():
        ref = reference[it]["lm-loss"]
        assert abs(loss - ref) <= RTOL * abs(ref), (it, loss, ref)
