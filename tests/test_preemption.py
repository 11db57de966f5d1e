"""Preemption under every launcher: with --exit-signal-handler, SIGTERM to `torchrun`, to the
`deepspeed` command, to its whole process group, or to every process of every task (what Slurm's
`scancel --signal=TERM` does) ends in a committed checkpoint, and the run resumed from it trains the uninterrupted run's
losses, bit for bit; so does the torch backend with --async-save (the exit save written in the
background, waited for before the ranks exit). Real launchers, two ranks, a DataLoader worker per rank, real signals sent
after a logged iteration.

The launchers' own exit codes are theirs (docs/RELIABILITY.md, "Preemption under launchers"):
torchrun re-raises the signal after its workers end (exit 1), the single-node `deepspeed` command
has no handler (killed by the signal); the ranks exit 0, which the per-node launch.py reports and
the Slurm-style tasks return.

The five preemptions run one after another; the uninterrupted run of each backend and the five
resumes then run in one launched world (tests/training_multirun.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from signal_fixtures import finish, job, kill_group, wait_for_iterations
from training_fixtures import (
    PYTHON,
    REPO,
    deepspeed_cmd,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    start,
    torchrun_cmd,
    train_flags,
)
from training_fixtures import test_env as clean_env

from pretrain.launch import free_port

ITERS = 80  # seconds of training: the signal takes effect well before the end
SIGNALLED_AFTER = 2  # iterations logged before the signal
WORKER_GONE_WITHIN_SECONDS = 15  # torch's workers look for their parent every 5 s


DEEPSPEED = tuple(layout_flags(1, 1, 1))  # two ranks: DP = 2, ZeRO-1
TORCH = ("--use-torch-fsdp2", "--async-save")  # DP = 2, FSDP2; saves written in the background


def _flags(corpus: str, metrics: Path, *extra: str, backend=DEEPSPEED) -> list[str]:
    return (
        model_flags("gpt2")
        + ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
        + train_flags(corpus, iters=ITERS)
        + list(backend)
        + ["--num-workers", "1", "--metrics-file", str(metrics), *extra]
    )


def _preempt(
    folder: Path, corpus: str, launch, send, backend
) -> tuple[subprocess.Popen, str, int, list]:
    """Start `launch(flags)` with --exit-signal-handler, call `send(proc, ranks, workers)` after
    SIGNALLED_AFTER iterations, wait for every process; (proc, output, step `latest` names, the
    ranks' pids)."""
    ckpt, metrics = folder / "ckpt", folder / "m.jsonl"
    save = ["--save", str(ckpt), "--save-interval", "1000", "--exit-signal-handler"]
    proc = launch(_flags(corpus, metrics, *save, backend=backend))
    try:
        wait_for_iterations(proc, metrics, SIGNALLED_AFTER)
        ranks, workers = job(proc.pid)
        assert sorted(ranks) == [0, 1] and len(workers) >= 2, (ranks, workers)
        logged = len(read_metrics(metrics))
        send(proc, ranks, workers)
        output = finish(proc, 240)
    finally:
        kill_group(proc)
    assert "is killed by signal" not in output, output[-6000:]  # no DataLoader worker died
    assert (ckpt / "latest").exists(), output[-6000:]
    stopped = int((ckpt / "latest").read_text().removeprefix("global_step"))
    assert logged <= stopped < ITERS, output[-6000:]
    assert f"exiting after iteration {stopped}: SIGTERM received (--exit-signal-handler)" in output
    assert sorted(read_metrics(metrics)) == list(range(1, stopped + 1))
    return proc, output, stopped, [r.pid for r in ranks.values()]


def _term_the_launcher(proc, ranks, workers):
    proc.send_signal(signal.SIGTERM)


def _term_every_task_process(proc, ranks, workers):
    for p in [*ranks.values(), *workers]:
        p.send_signal(signal.SIGTERM)


def _term_the_process_group(proc, ranks, workers):
    os.killpg(proc.pid, signal.SIGTERM)  # the deepspeed command's process group: all of them


def _slurm_tasks(flags: list[str]) -> subprocess.Popen:
    """What `srun` under examples/slurm_train.sbatch starts: one task per rank, no launcher.
    Returned as a stand-in step: a process that waits for both tasks and exits with the first
    non-zero task status (0 when both exit 0), as srun does."""
    port = free_port()
    step = (
        "import os, subprocess, sys\n"
        "tasks = [subprocess.Popen(sys.argv[1:], env={**os.environ, 'SLURM_PROCID': str(r),"
        " 'SLURM_LOCALID': str(r)}) for r in (0, 1)]\n"
        "codes = [t.wait() for t in tasks]\n"
        "print('task exit codes:', codes, flush=True)\n"
        "sys.exit(next((c for c in codes if c), 0))\n"
    )
    env = clean_env(SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return start([PYTHON, "-c", step, PYTHON, str(REPO / "pretrain_gpt.py"), *flags], env)


def _torchrun(flags: list[str]) -> subprocess.Popen:
    return start(torchrun_cmd(2, flags, "--standalone"))


# name -> (how the two ranks are launched, how the signal is sent, the backend's flags)
PREEMPTIONS = {
    "torchrun": (_torchrun, _term_the_launcher, DEEPSPEED),
    "deepspeed_command": (
        lambda flags: start(deepspeed_cmd(2, flags)),
        _term_the_launcher,
        DEEPSPEED,
    ),
    "slurm_tasks": (_slurm_tasks, _term_every_task_process, DEEPSPEED),
    "deepspeed_group": (
        lambda flags: start(deepspeed_cmd(2, flags)),
        _term_the_process_group,
        DEEPSPEED,
    ),
    "torch_backend_async_save": (_torchrun, _term_the_launcher, TORCH),
}


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """Every preemption of PREEMPTIONS, one after another; then one two-rank launch of
    tests/training_multirun.py with the uninterrupted run of each backend and the resume from
    each checkpoint. (folder, name -> `_preempt`'s answer or the AssertionError it raised,
    backend flags -> the uninterrupted run's metrics by iteration)."""
    root = tmp_path_factory.mktemp("preemption")
    corpus = make_corpus(root / "corpus")
    outcomes = {}
    for name, (launch, send, backend) in PREEMPTIONS.items():
        (root / name).mkdir()
        try:
            outcomes[name] = _preempt(root / name, corpus, launch, send, backend)
        except AssertionError as err:  # that test fails with it; the others go on
            outcomes[name] = err
    references = {DEEPSPEED: root / "reference.jsonl", TORCH: root / "reference_torch.jsonl"}
    runs = [_flags(corpus, path, backend=backend) for backend, path in references.items()]
    for name, outcome in outcomes.items():
        if not isinstance(outcome, AssertionError):
            load = ["--load", str(root / name / "ckpt")]
            backend = PREEMPTIONS[name][2]
            runs.append(_flags(corpus, root / name / "resumed.jsonl", *load, backend=backend))
    result = run(multirun_cmd(2, runs, root / "runs.json"), timeout=600)
    assert result.returncode == 0, result.stdout[-6000:]
    return root, outcomes, {b: read_metrics(path) for b, path in references.items()}


def _preemption(preempted, name: str) -> tuple[subprocess.Popen, str, int, list]:
    """`_preempt`'s answer for `name`, after checking that the run resumed from its checkpoint
    wrote its own metrics, from the step it stopped at + 1 on, equal to the uninterrupted run's;
    so do the interrupted run's iterations before it."""
    root, outcomes, references = preempted
    if isinstance(outcomes[name], AssertionError):
        raise outcomes[name]
    full = references[PREEMPTIONS[name][2]]
    proc, output, stopped, pids = outcomes[name]
    first, second = (
        read_metrics(root / name / "m.jsonl"),
        read_metrics(root / name / "resumed.jsonl"),
    )
    assert sorted(second) == list(range(stopped + 1, ITERS + 1))
    losses = [first[i]["lm-loss"] for i in first] + [second[i]["lm-loss"] for i in second]
    assert losses == [full[i]["lm-loss"] for i in range(1, ITERS + 1)]
    return proc, output, stopped, pids


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_to_torchrun_saves_and_resumes_exactly(preempted):
    """torchrun forwards SIGTERM to each worker's process group (the rank and its DataLoader
    worker) and SIGKILLs after 30 s; the ranks save well within that."""
    proc, output, _, _ = _preemption(preempted, "torchrun")
    assert proc.returncode == 1 and "SignalException" in output, output[-3000:]  # torchrun's way
    assert "forcefully exiting via SIGKILL" not in output  # the ranks ended by themselves


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_to_the_deepspeed_command_saves_and_resumes_exactly(preempted):
    """The single-node `deepspeed` command dies of the signal without passing it on; the ranks
    notice their launcher's death, count it as the signal, save and exit 0 (launch.py says so)."""
    proc, output, _, pids = _preemption(preempted, "deepspeed_command")
    assert proc.returncode == -signal.SIGTERM, output[-3000:]
    for pid in pids:
        assert f"Process {pid} exits successfully." in output, output[-3000:]
    assert "counting it as the exit signal (--exit-signal-handler)" in output


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_to_every_process_of_every_task_saves_and_resumes_exactly(preempted):
    """Slurm's `scancel --signal=TERM` signals every process of each task: the ranks and their
    DataLoader workers. The workers ignore it; the ranks save and exit 0."""
    proc, output, _, _ = _preemption(preempted, "slurm_tasks")
    assert proc.returncode == 0 and "task exit codes: [0, 0]" in output, output[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_to_the_deepspeed_process_group_saves_and_resumes_exactly(preempted):
    """Every process of an `srun deepspeed ...` task: the command (dies of it), its launch.py
    (SIGTERMs every descendant, SIGKILLs what is left after 30 s, exits 1), the ranks and their
    workers. The ranks save and reach their end (`done:`) within launch.py's grace period."""
    proc, output, stopped, _ = _preemption(preempted, "deepspeed_group")
    assert proc.returncode == -signal.SIGTERM, output[-3000:]
    assert "Main process received SIGTERM, exiting" in output  # launch.py's handler ran
    assert f"done: {stopped} iterations" in output


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_with_async_save_on_the_torch_backend_waits_and_resumes_exactly(preempted):
    """The torch backend (FSDP2, DP 2) with --async-save under torchrun: the exit save is staged
    and written in the background, and the ranks wait for it and commit it before they exit; the
    resumed torch-backend run trains the uninterrupted one's losses bit for bit."""
    proc, output, stopped, _ = _preemption(preempted, "torch_backend_async_save")
    assert proc.returncode == 1, output[-3000:]  # torchrun re-raises the signal (see above)
    assert "forcefully exiting via SIGKILL" not in output  # the wait ended within the grace
    assert f"staged checkpoint at iteration {stopped:8d}; writing it in the background" in output, (
        output[-3000:]
    )


_LOADER = """
import sys, time
import torch
from pretrain.data.config import DataConfig
from pretrain.data.datasets.samplers import build_pretraining_data_loader
loader = build_pretraining_data_loader(
    torch.arange(64), 0, 2, 0, 1, DataConfig(seq_length=4, mock=True, num_workers=1)
)
batches = iter(loader)
next(batches)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # an end-to-end run over 5 s: not in `make test-fast`
@pytest.mark.timeout(120)
def test_workers_ignore_exit_signals_but_end_with_their_rank():
    """A DataLoader worker survives SIGTERM, SIGINT, SIGUSR1 and SIGUSR2, and still ends when its
    rank is SIGKILLed (torch's worker watchdog)."""
    rank = subprocess.Popen(
        [sys.executable, "-c", _LOADER],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert rank.stdout.readline() == "ready\n"
        (worker,) = psutil.Process(rank.pid).children()
        for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"):
            worker.send_signal(getattr(signal, name))
        time.sleep(2)
        assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        assert rank.poll() is None  # nor did its death reach the rank
        rank.kill()
        rank.wait(timeout=30)
        gone, _ = psutil.wait_procs([worker], timeout=WORKER_GONE_WITHIN_SECONDS)
        assert gone, "the worker outlived its rank"
    finally:
        kill_group(rank)  # the worker too, should it be left
