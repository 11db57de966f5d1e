"""Bringing up torch.distributed for the launch environment `pretrain.launch` detected.

Two DeepSpeed habits on CPU machines are avoided here (facts in docs/TRAINING.md): the
first `init_distributed` JIT-builds a shared-memory all-reduce op (~40 s) that training never
uses, and under its own launcher each rank then leaves a 66 MiB `/dev/shm` buffer behind.
`disable_deepspeed_shm_allreduce` turns that op off before DeepSpeed's backend is created.
"""

from __future__ import annotations

import datetime
import importlib
import os
from collections.abc import MutableMapping

import torch

from pretrain.errors import UserError
from pretrain.launch import LaunchEnv


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
