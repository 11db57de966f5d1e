"""One run writes a --save folder at a time: a second run refuses in one line on every rank; a
killed holder does not leave the next launch stuck; a clean exit lets go.

Real runs of pretrain_gpt.py on one --save (the holder at one rank, the refused run at two),
a real SIGKILL, and a real orphan process holding the lock of a dead run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    deepspeed_cmd,
    layout_flags,
    make_corpus,
    model_flags,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

from pretrain.training.checkpoints.save_lock import LOCK_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _flags(corpus: str, iters: int, save: Path, metrics: Path) -> list[str]:
    return (
        model_flags("gpt2")
        + train_flags(corpus, iters=iters)
        + layout_flags(1, 1, 0)
        + ["--save", str(save), "--save-interval", "1", "--metrics-file", str(metrics)]
    )


def _holder(lock: Path, timeout: float = 300) -> dict:
    """The holder record once the lock file has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = lock.read_text() if lock.exists() else ""
        if text.strip():
            return json.loads(text)
        time.sleep(0.5)
    raise AssertionError(f"{lock} never named a holder")


def _wait_for(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("save_lock") / "corpus")


def test_second_run_refuses_and_a_killed_holder_is_taken_over(corpus, tmp_path):
    save = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [PYTHON, str(REPO / "pretrain_gpt.py"), *_flags(corpus, 5000, save, tmp_path / "a.jsonl")],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        record = _holder(save / LOCK_FILE)
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
        _wait_for(save / "global_step1")  # the holder is writing its steps
        second = run(deepspeed_cmd(2, _flags(corpus, 2, save, tmp_path / "b.jsonl")), timeout=300)
        assert second.returncode != 0
        errors = [line for line in second.stdout.splitlines() if line.startswith("error: ")]
        assert len(errors) == 2, second.stdout[-4000:]  # one line per rank, the same
        assert len(set(errors)) == 1 and "Traceback" not in second.stdout
        assert (
            f"--save {save}: another run is writing this folder: pid {holder.pid} on host"
            in errors[0]
        )
        assert str(save / LOCK_FILE) in errors[0]
        assert not (tmp_path / "b.jsonl").exists()  # it trained nothing
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the holder never lets go
        holder.wait(timeout=60)
    last = int((save / "latest").read_text()[len("global_step") :])
    after = run(
        [PYTHON, str(REPO / "pretrain_gpt.py"),
         *_flags(corpus, last + 1, save, tmp_path / "c.jsonl"), "--load", str(save),
         "--override-opt_param-scheduler"],  # another --train-iters: the flags' schedule
        timeout=300,
    )  # fmt: skip
    assert after.returncode == 0, after.stdout[-6000:]
    assert (
        f"took over {save / LOCK_FILE} from pid {holder.pid} on host {socket.gethostname()}"
        in after.stdout
    ) and "did not let go of it (killed?)" in after.stdout
    assert sorted(read_metrics(tmp_path / "c.jsonl")) == [last + 1]
    assert (save / LOCK_FILE).read_text() == ""  # a clean exit lets go


ORPHAN = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
host = sys.argv[2] or socket.gethostname()
os.pwrite(fd, json.dumps({"host": host, "pid": os.getpid(), "started": "then"}).encode(), 0)
if os.fork() == 0:  # the child keeps the locked file open, as a data-loader worker would
    time.sleep(600)
    os._exit(0)
print("locked", flush=True)
time.sleep(600)
"""


def _lock_holder(lock: Path, host: str = "") -> subprocess.Popen:
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(lock), host],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_dead_holder_whose_child_keeps_the_lock_does_not_block(corpus, tmp_path):
    save = tmp_path / "ckpt"
    holder = _lock_holder(save / LOCK_FILE)
    try:
        os.kill(holder.pid, signal.SIGKILL)  # its child still holds the flock
        holder.wait(timeout=30)
        result = run(
            [PYTHON, str(REPO / "pretrain_gpt.py"), *_flags(corpus, 3, save, tmp_path / "m.jsonl")],
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-6000:]
        assert f"took over {save / LOCK_FILE} from pid {holder.pid}" in result.stdout
        assert "it no longer runs, but a process it started kept the lock" in result.stdout
        assert sorted(read_metrics(tmp_path / "m.jsonl")) == [1, 2, 3]
    finally:
        os.killpg(holder.pid, signal.SIGKILL)


def test_a_holder_on_another_host_is_refused_with_the_way_out(corpus, tmp_path):
    save = tmp_path / "ckpt"
    holder = _lock_holder(save / LOCK_FILE, host="node-b")
    try:
        result = run(
            [PYTHON, str(REPO / "pretrain_gpt.py"), *_flags(corpus, 3, save, tmp_path / "h.jsonl")],
            timeout=300,
        )
        errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and len(errors) == 1, result.stdout[-4000:]
        assert f"pid {holder.pid} on host node-b" in errors[0]
        assert f"if that job is gone (its node died), delete {save / LOCK_FILE}" in errors[0]
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
