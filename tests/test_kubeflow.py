"""examples/kubeflow_pytorchjob.yaml as the Kubeflow training operator runs it, without
Kubernetes: each pod (Master 0, Worker 0) is the container's command and args from the YAML,
started in the repository (the image's working folder) with the container's `env` and the
variables the operator sets (reproduced below from the operator's rules), so the environment
reaches torchrun and the ranks as in a cluster. Sized for CPU: nprocPerNode 1, the recipes' tiny
model at TP2 across the two pods. The operator names the master by its service, which does not
resolve here: MASTER_ADDR is 127.0.0.2, another address of this machine than torchrun's default
127.0.0.1, so a command that ignored the operator's MASTER_ADDR/MASTER_PORT would not rendezvous.

The ranks train the losses of one process (1e-6 relative); SIGTERM to each container's first
process (`exec torchrun`, what the kubelet signals when a pod is deleted or preempted) ends in a
committed checkpoint through --exit-signal-handler, and torchrun exits 1 (it re-raises the
signal; restartPolicy OnFailure then restarts the pod).
"""

from __future__ import annotations

import signal

import pytest
import yaml
from cluster_fixtures import RTOL, recipe_env
from signal_fixtures import finish, kill_group, wait_for_iterations
from training_fixtures import BIN, REPO, read_metrics, start
from training_fixtures import test_env as clean_env

from pretrain.launch import free_port

# the operator's container command runs torchrun (tests/launch_guard.py)
pytestmark = pytest.mark.slow

MASTER_ADDR = "127.0.0.2"


def operator_env(job: dict, replica: str, index: int) -> dict[str, str]:
    """The variables the training operator adds to a pod of `job` (a PyTorchJob without an
    elasticPolicy): replica "Master" or "Worker", `index` within its replicas."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    nproc = job["spec"]["nprocPerNode"]
    replicas = sum(spec["replicas"] for spec in specs.values())
    container = specs["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    rank = index + (1 if replica == "Worker" else 0)
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_PORT": str(port),
        "MASTER_ADDR": f"{job['metadata']['name']}-master-0",
        "WORLD_SIZE": str(replicas * int(nproc)),
        "RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(replicas),
    }


def _pod(job: dict, replica: str, tiny: dict[str, str]):
    """Start one pod's container: its command, the YAML's env (values from `tiny` where it names
    them), the operator's variables, then `tiny` (the user's sizing)."""
    container = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]
    env = clean_env(PATH=f"{BIN}:/usr/bin:/bin")
    env.update({e["name"]: tiny.get(e["name"], e["value"]) for e in container["env"]})
    env.update(operator_env(job, replica, 0), MASTER_ADDR=MASTER_ADDR, **tiny)
    return start([*container["command"], *container["args"]], env)


@pytest.mark.timeout(400)
def test_the_operators_environment_trains_and_sigterm_to_torchrun_saves(
    recipe_corpus, one_process, tmp_path
):
    job = yaml.safe_load((REPO / "examples" / "kubeflow_pytorchjob.yaml").read_text())
    job["spec"]["nprocPerNode"] = "1"  # CPU: one rank per pod
    port = free_port()
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    master["ports"][0]["containerPort"] = port  # the Worker's template is the same pod
    metrics, save = tmp_path / "m.jsonl", tmp_path / "ckpt"
    tiny = recipe_env(recipe_corpus, save, metrics)
    pods = [_pod(job, "Master", tiny), _pod(job, "Worker", tiny)]
    try:
        wait_for_iterations(pods[0], metrics, 2)
        for pod in pods:
            pod.send_signal(signal.SIGTERM)  # to PID 1: bash exec'd torchrun
        outputs = [finish(pod, 240) for pod in pods]
    finally:
        for pod in pods:
            kill_group(pod)
    assert [pod.returncode for pod in pods] == [1, 1], outputs[0][-6000:]
    stopped = int((save / "latest").read_text().removeprefix("global_step"))
    assert (
        f"exiting after iteration {stopped}: SIGTERM received (--exit-signal-handler)"
        in (outputs[0])
    )
    assert "2 rank(s) via torchrun" in outputs[0] and "TP=2  PP=1  DP=1" in outputs[0]
    assert f"; rendezvous {MASTER_ADDR}:{port}" in outputs[0], outputs[0][-6000:]
    got = read_metrics(metrics)
    assert sorted(got) == list(range(1, stopped + 1)) and stopped >= 2
    for it, m in got.items():
        ref = one_process[it]["lm-loss"]
        assert abs(m["lm-loss"] - ref) <= RTOL * abs(ref), (it, m["lm-loss"], ref)
