"""Where this process sits in the job, and bringing up torch.distributed.

Four ways to start ranks, one code path after this module:
- the `deepspeed` launcher and `torchrun` set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / PORT
  (the deepspeed launcher also passes `--local_rank=N` on the command line);
- Slurm's `srun` sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (+ the node list);
- a plain `python pretrain_gpt.py ...` sets nothing: world size 1 on a free local port.

Two DeepSpeed habits on CPU machines are avoided here (facts in specs/deepspeed-cpu.md): the
first `init_distributed` JIT-builds a shared-memory all-reduce op (~40 s) that training never
uses, and under its own launcher each rank then leaves a 66 MiB `/dev/shm` buffer behind.
`disable_deepspeed_shm_allreduce` turns that op off before DeepSpeed's backend is created.
"""

from __future__ import annotations

import datetime
import importlib
import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

from pretrain.errors import UserError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "deepspeed" | "torchrun" | "slurm" | "python"


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(
            f"environment variable {key}={env[key]!r} is not an integer (unset it or fix the launcher)"
        ) from None


def _first_slurm_host(nodelist: str) -> str:
    """`node[03-05,7],gpu1` -> `node03`: the first host of a Slurm node list (no scontrol needed)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return "127.0.0.1"
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch_env(
    env: Mapping[str, str] | None = None, local_rank_flag: int | None = None
) -> LaunchEnv:
    """Read rank/world/local rank from whichever launcher started us."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed"
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else (local_rank_flag or 0)
        local_size = (
            _int(env, "LOCAL_WORLD_SIZE")
            if "LOCAL_WORLD_SIZE" in env
            else (_int(env, "LOCAL_SIZE") if "LOCAL_SIZE" in env else _int(env, "WORLD_SIZE"))
        )
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UserError(
                "RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not "
                "(launch with deepspeed or torchrun, or export both)"
            )
        return LaunchEnv(
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            local_rank,
            local_size,
            env["MASTER_ADDR"],
            _int(env, "MASTER_PORT"),
            launcher,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        ntasks = _int(env, "SLURM_NTASKS")
        local_size = ntasks
        if "SLURM_NTASKS_PER_NODE" in env:
            # "4" or "4(x2)"
            local_size = int(re.match(r"\d+", env["SLURM_NTASKS_PER_NODE"]).group(0))
        addr = env.get("MASTER_ADDR") or _first_slurm_host(
            env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        )
        # A job-specific default port so two jobs sharing a node do not collide.
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            port = 20000 + _int(env, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in env else 29500
        return LaunchEnv(
            _int(env, "SLURM_PROCID"),
            ntasks,
            _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            local_size,
            addr,
            port,
            "slurm",
        )
    return LaunchEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "python")


def default_threads_per_rank(local_world_size: int) -> int:
    """One rank per core's worth of threads: cores on this node / ranks on this node, at least 1."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return max(1, cores // max(1, local_world_size))


def disable_deepspeed_shm_allreduce() -> None:
    """Stop DeepSpeed from JIT-building (and allocating /dev/shm for) its CPU shm all-reduce op.

    `deepspeed.comm.torch` calls its module-level `build_shm_op()` whenever it creates its torch
    backend; returning None there leaves DeepSpeed on plain torch.distributed collectives (gloo
    on CPU, NCCL on GPU), which is what our own tensor-parallel code uses anyway.
    `importlib` is needed because `import deepspeed.comm.torch as m` binds the real `torch`.
    """
    module = importlib.import_module("deepspeed.comm.torch")
    module.build_shm_op = lambda: None


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


def init_distributed(launch: LaunchEnv, backend: str, timeout_minutes: float) -> torch.device:
    """env:// process group (gloo on CPU, nccl on GPU) + DeepSpeed's comm wrapper on top of it."""
    disable_deepspeed_shm_allreduce()
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
        torch.distributed.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            **_rendezvous(launch, timeout),
        )
    import deepspeed

    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        timeout=timeout,
        rank=launch.rank,
        world_size=launch.world_size,
    )
    return device


def collective_device() -> torch.device:
    """Where small tensors for collectives must live: NCCL only reduces CUDA tensors."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
