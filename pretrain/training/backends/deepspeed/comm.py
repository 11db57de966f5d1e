"""DeepSpeed's communication layer (`deepspeed.comm`) over the torch process group.

Two DeepSpeed habits on CPU machines are avoided here (facts in docs/TRAINING.md): the first
`deepspeed.init_distributed` JIT-builds a shared-memory all-reduce op (~40 s) that training never
uses, and under its own launcher each rank then leaves a 66 MiB `/dev/shm` buffer behind.
`disable_deepspeed_shm_allreduce` turns that op off before DeepSpeed's backend is created.
"""

from __future__ import annotations

import datetime
import importlib

import deepspeed
import torch


def disable_deepspeed_shm_allreduce() -> None:
    """Stop DeepSpeed from JIT-building (and allocating /dev/shm for) its CPU shm all-reduce op.

    `deepspeed.comm.torch` calls its module-level `build_shm_op()` whenever it creates its torch
    backend; returning None there leaves DeepSpeed on plain torch.distributed collectives (gloo
    on CPU, NCCL on GPU), which is what our own tensor-parallel code uses anyway.
    `importlib` is needed because `import deepspeed.comm.torch as m` binds the real `torch`.
    """
    module = importlib.import_module("deepspeed.comm.torch")
    module.build_shm_op = lambda: None


def init_deepspeed_comm(backend: str, timeout: datetime.timedelta) -> None:
    """DeepSpeed's comm wrapper on the already initialised torch process group."""
    disable_deepspeed_shm_allreduce()
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        timeout=timeout,
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
    )
