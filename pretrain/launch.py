"""Where this process sits in the job: rank, world size and rendezvous address from the launcher.

Four ways to start ranks, one answer after this module:
- the `deepspeed` launcher and `torchrun` set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / PORT
  (the deepspeed launcher also passes `--local_rank=N` on the command line); `accelerate launch`
  runs one of them and adds its ACCELERATE_* settings;
- Slurm's `srun` sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (+ the node list);
- a plain `python pretrain_gpt.py ...` sets nothing: world size 1 on a free local port.

It reads the environment only (no torch), so the command line can be checked against the world
size before any process group exists.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from pretrain.errors import UserError


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """This process's place in the job, as its launcher described it."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of ranks in the job."""
    local_rank: int
    """Rank on this node (picks the GPU)."""
    local_world_size: int
    """Ranks on this node (sets CPU threads per rank)."""
    master_addr: str
    """Rendezvous host of rank 0."""
    master_port: int
    """Rendezvous port of rank 0."""
    launcher: str
    """Who started us: "deepspeed", "torchrun", "accelerate (torchrun)", "accelerate
    (deepspeed)", "slurm" or "python"."""


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
    """A TCP port on 127.0.0.1 that is free right now (for single-process rendezvous and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch_env(
    env: Mapping[str, str] | None = None, local_rank_flag: int | None = None
) -> LaunchEnv:
    """Read rank/world/local rank from whichever launcher started us."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torch_launch_env(env, local_rank_flag)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm_launch_env(env)
    return LaunchEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=free_port(),
        launcher="python",
    )


def _torch_launch_env(env: Mapping[str, str], local_rank_flag: int | None) -> LaunchEnv:
    """The LaunchEnv of a torchrun/deepspeed (or `accelerate launch`) process: RANK and
    WORLD_SIZE are set; MASTER_ADDR/MASTER_PORT must be too, or one UserError."""
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed"
    if "ACCELERATE_MIXED_PRECISION" in env:  # `accelerate launch` runs one of the two
        launcher = f"accelerate ({launcher})"
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
        rank=_int(env, "RANK"),
        world_size=_int(env, "WORLD_SIZE"),
        local_rank=local_rank,
        local_world_size=local_size,
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        launcher=launcher,
    )


def _slurm_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """The LaunchEnv of an `srun` task (SLURM_PROCID and SLURM_NTASKS set): the master is
    MASTER_ADDR or the job's first host, the port MASTER_PORT or one derived from the job id."""
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
        rank=_int(env, "SLURM_PROCID"),
        world_size=ntasks,
        local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
        local_world_size=local_size,
        master_addr=addr,
        master_port=port,
        launcher="slurm",
    )


SILENT_EXIT_DELAY_SECONDS = 10.0
"""How long a rank that does not print its start-up error waits before it exits: launchers
(torchrun, DeepSpeed's launch.py, `srun --kill-on-bad-exit`) end every rank of the node as soon
as one fails, so a silent rank that failed first would end the first rank before it printed the
error. The launcher ends the waiting rank once the first rank has printed and failed."""


def reports_start_up_errors(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints a UserError raised before any process group exists: the first
    rank of each node does (LOCAL_RANK / SLURM_LOCALID 0, or no launcher). The others exit with
    the same status silently, after SILENT_EXIT_DELAY_SECONDS: every rank of a node checks the same command line against the same
    files and environment, so their error is the same line (a node whose files differ still says
    so, through its own first rank). An unreadable local rank prints, rather than hide an error."""
    env = os.environ if env is None else env
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if key in env:
            value = env[key].strip()
            return not value.isdigit() or int(value) == 0
    return True
