"""Bringing up torch.distributed for the launch environment `pretrain.launch` detected.

`exit_with_launcher` makes every rank end when the launcher that started it dies (SIGTERM to the
`deepspeed` command, a killed torchrun agent), instead of training on as an orphan; with
`--exit-signal-handler` the death counts as the exit signal: the ranks save first.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping

import torch

from pretrain.errors import UserError
from pretrain.launch import LaunchEnv


def default_threads_per_rank(local_world_size: int) -> int:
    """One rank per core's worth of threads: cores on this node / ranks on this node, at least 1."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return max(1, cores // max(1, local_world_size))


LAUNCHER_POLL_SECONDS = 0.5
EXIT_LAUNCHER_GONE = 1
_launcher_watch: threading.Thread | None = None
_on_launcher_gone: Callable[[], bool] | None = None


def _parent_of(pid: int) -> int | None:
    """The parent PID of `pid` from /proc (Linux), or None if it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name may contain spaces and ")"


def _is_deepspeed_launch(pid: int) -> bool:
    """Whether `pid` runs DeepSpeed's per-node `deepspeed.launcher.launch`, which the
    `deepspeed` command starts and which does not die with it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"deepspeed.launcher.launch" in f.read()
    except OSError:
        return False


def _wait_until_gone(parent: int, grandparent: int | None) -> int:
    """Block until the launcher dies; return its PID."""
    while True:
        time.sleep(LAUNCHER_POLL_SECONDS)
        if os.getppid() != parent:  # re-parented: the launcher died
            return parent
        if grandparent is not None and _parent_of(parent) != grandparent:
            return grandparent


def _watch(rank: int, parent: int, grandparent: int | None) -> None:
    gone = _wait_until_gone(parent, grandparent)
    on_gone = _on_launcher_gone
    if on_gone is not None and on_gone():
        sys.stderr.write(
            f"warning: rank {rank}: the launcher (pid {gone}) is gone; counting it as the exit "
            f"signal (--exit-signal-handler): this rank saves after its iteration and exits\n"
        )
        sys.stderr.flush()
        return
    sys.stderr.write(
        f"error: rank {rank}: the launcher (pid {gone}) is gone; stopping this rank "
        f"(committed checkpoints are intact)\n"
    )
    sys.stderr.flush()
    os._exit(EXIT_LAUNCHER_GONE)


def exit_with_launcher(rank: int, on_gone: Callable[[], bool] | None = None) -> None:
    """Watch this process's launcher; within a second of its death call `on_gone` and, unless
    it returns True (it took the death as a request to stop: `ExitSignal.count`), exit
    (status 1, one line).

    The launcher is the parent process (torchrun's agent, DeepSpeed's per-node launch.py,
    slurmstepd, a shell); under the `deepspeed` command also the command itself, the parent of
    launch.py, which a scheduler signals and which does not pass SIGTERM on. A daemon thread
    polls, rather than PR_SET_PDEATHSIG, because that signal fires when the *thread* that
    started us exits, which some launchers do long before the process. One watch per process;
    a later call (another run in the same process) replaces `on_gone`.
    """
    global _launcher_watch, _on_launcher_gone
    _on_launcher_gone = on_gone
    parent = os.getppid()
    if _launcher_watch is not None or parent <= 1:
        return  # already watching, or started by init / a container's PID 1: nothing to watch
    grandparent = _parent_of(parent) if _is_deepspeed_launch(parent) else None
    if grandparent is not None and grandparent <= 1:
        grandparent = None
    _launcher_watch = threading.Thread(
        target=_watch, args=(rank, parent, grandparent), name="launcher-watch", daemon=True
    )
    _launcher_watch.start()


def prepare_process_environment(
    launch: LaunchEnv, environ: MutableMapping[str, str] | None = None
) -> None:
    """Make the env:// variables consistent for every launcher and set CPU threads per rank."""
    environ = os.environ if environ is None else environ
    environ["RANK"] = str(launch.rank)
    environ["WORLD_SIZE"] = str(launch.world_size)
    environ["LOCAL_RANK"] = str(launch.local_rank)
    environ["LOCAL_WORLD_SIZE"] = str(launch.local_world_size)
    environ["MASTER_ADDR"] = launch.master_addr
    environ["MASTER_PORT"] = str(launch.master_port)
    # The deepspeed launcher leaves OMP_NUM_THREADS unset: N ranks x all cores oversubscribes.
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in environ:
        environ["OMP_NUM_THREADS"] = str(default_threads_per_rank(launch.local_world_size))
    if "OMP_NUM_THREADS" in environ:
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def choose_backend(requested: str | None) -> str:
    """The requested backend, else nccl with GPUs and gloo without."""
    if requested:
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def _rendezvous(launch: LaunchEnv, timeout: datetime.timedelta) -> dict:
    """env://, except after a torchrun restart: there the agent's store still holds the previous
    attempt's keys, and gloo would try to connect to dead ranks' addresses (a hang or a refused
    connection), so every attempt gets its own key prefix in the agent's store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    store = torch.distributed.TCPStore(
        launch.master_addr, launch.master_port, launch.world_size, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": torch.distributed.PrefixStore(f"pretrain/attempt_{attempt}/", store)}


def _rendezvous_failure(launch: LaunchEnv, timeout_minutes: float, err: Exception) -> str:
    """One line for a rendezvous that failed: which rank, which host and port, torch's reason
    (its first line) and what to check."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"rank {launch.rank}: no rendezvous at {launch.master_addr}:{launch.master_port} "
        f"(waited up to {timeout_minutes:g} min, --distributed-timeout-minutes): {reason} "
        f"(check that the job's tasks started on every node, and that MASTER_ADDR:MASTER_PORT "
        f"is rank 0's host and a port free there and reachable from every node; "
        f"GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME choose the network interface)"
    )


def init_distributed(launch: LaunchEnv, backend: str, timeout_minutes: float) -> torch.device:
    """env:// process group (gloo on CPU, nccl on GPU); the backend builds its own layers on it."""
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise UserError(
                "--distributed-backend nccl needs CUDA GPUs; use --distributed-backend gloo on CPU"
            )
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not torch.distributed.is_initialized():
        try:
            torch.distributed.init_process_group(
                backend=backend,
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
                **_rendezvous(launch, timeout),
            )
        except torch.distributed.DistError as err:  # the store: a timeout, refused, a busy port
            raise UserError(_rendezvous_failure(launch, timeout_minutes, err)) from None
    return device


def collective_device() -> torch.device:
    """Where small tensors for collectives must live: NCCL only reduces CUDA tensors."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (a collective: call it on every rank at the
    same point), so all ranks take the same decision."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=collective_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())
