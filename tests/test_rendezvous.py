"""A rendezvous that cannot complete ends the waiting rank with one line naming the host and
port, after --distributed-timeout-minutes, not a hang or a torch traceback: rank 0 of a 2-rank
job whose rank 1 never comes (it hosts the store and waits for clients), and rank 1 of a job
whose rank 0 is not there (nothing listens at MASTER_ADDR:MASTER_PORT). Real processes, with the
launcher's variables as torchrun or the deepspeed launcher set them; both run at once."""

from __future__ import annotations

import time

import pytest
from signal_fixtures import finish
from training_fixtures import PYTHON, REPO, make_corpus, model_flags, start, train_flags
from training_fixtures import test_env as clean_env

from pretrain.launch import free_port

pytestmark = pytest.mark.slow  # launches (tests/launch_guard.py)

TIMEOUT_MINUTES = 0.1  # 6 s


@pytest.mark.timeout(300)
def test_a_rendezvous_timeout_is_one_line_naming_host_and_port(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", num_docs=20)
    argv = model_flags("gpt2") + train_flags(corpus, iters=5)
    argv += ["--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    ports = {rank: free_port() for rank in (0, 1)}  # two jobs: each misses its other rank
    began = time.monotonic()
    procs = {
        rank: start(
            [PYTHON, str(REPO / "pretrain_gpt.py"), *argv],
            clean_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
        )  # fmt: skip
        for rank, port in ports.items()
    }
    outputs = {rank: finish(proc, 240) for rank, proc in procs.items()}
    assert time.monotonic() - began < 120
    reasons = {  # torch's own words, which the line passes on
        0: "seconds waiting for clients. 1/2 clients joined.",
        1: f"ms while trying to connect to (127.0.0.1, {ports[1]}).",
    }
    for rank, output in outputs.items():
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert procs[rank].returncode == 2 and "Traceback" not in output, output[-3000:]
        assert len(errors) == 1, output[-3000:]
        head, reason = errors[0].split(" --distributed-timeout-minutes): ")
        assert head == (
            f"error: rank {rank}: no rendezvous at 127.0.0.1:{ports[rank]} (waited up to "
            f"{TIMEOUT_MINUTES:g} min,"
        )
        assert reasons[rank] in reason and reason.endswith(
            " (check that the job's tasks started on every node, and that "
            "MASTER_ADDR:MASTER_PORT is rank 0's host and a port free there and reachable from "
            "every node; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME choose the network interface)"
        ), errors[0]
