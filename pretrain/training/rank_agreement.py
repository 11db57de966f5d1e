"""Every rank runs the same job: checked once, right after the process group is up.

A node set up differently (another checkout, another Python environment, another data path in its
environment, a stale copy of the data) would otherwise train on: at best a collective hangs or
fails on a shape, at worst the ranks train different models on different data. `check_ranks_agree`
gathers from every rank its node, its software versions, a digest of our code, its command line
and the counts of the data it opened, and compares each with rank 0's. On a difference every rank
raises the same `UserError` (one line per rank) naming what differs and on which ranks and nodes;
otherwise rank 0 logs one line naming the nodes and their ranks.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import socket
import sys
from pathlib import Path

import torch

from pretrain.errors import UserError
from pretrain.launch import LaunchEnv
from pretrain.training.report.logging import logger


def node_name() -> str:
    """The node as its scheduler names it (Slurm's node name), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@functools.cache
def code_digest() -> str:
    """SHA-256 (12 hex digits) over the path and bytes of every .py file of the `pretrain`
    package this process imported."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _software() -> str:
    """Python's version and the installed torch, DeepSpeed and numpy (from their package
    metadata: nothing is imported here)."""
    versions = [f"python {sys.version.split()[0]}"]
    for package in ("torch", "deepspeed", "numpy"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    return ", ".join(versions)


def _command_line(argv: tuple[str, ...]) -> list[str]:
    """`argv` without the launcher's per-rank `--local_rank` (the deepspeed launcher adds it)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith(("--local_rank", "--local-rank")):
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def identity(launch: LaunchEnv, argv: tuple[str, ...], data: dict) -> dict:
    """What this rank must share with every other: software, code, command line, data counts
    (`data`: the run record's data fingerprints), and where it runs."""
    return {
        "rank": launch.rank,
        "node": node_name(),
        "software": _software(),
        "code": code_digest(),
        "command line": _command_line(argv),
        "data": json.dumps(data, sort_keys=True, default=str),
    }


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start, prev = [], ranks[0], ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = rank
    return ",".join(parts)


def _who(identities: list[dict]) -> str:
    """ "ranks 2-3 (n2)", grouped by node in rank order."""
    nodes: dict[str, list[int]] = {}
    for ident in identities:
        nodes.setdefault(ident["node"], []).append(ident["rank"])
    return ", ".join(
        f"rank{'s' if len(r) > 1 else ''} {_ranges(r)} ({node})" for node, r in nodes.items()
    )


def _first_difference(ours: list[str], theirs: list[str]) -> tuple[str, str]:
    """The first differing argument of two command lines, with the flag it belongs to."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            flag = ours[i - 1] + " " if i and not a.startswith("-") else ""  # equal up to i
            return flag + a, flag + b
    n = min(len(ours), len(theirs))
    return " ".join(ours[n:]) or "(nothing more)", " ".join(theirs[n:]) or "(nothing more)"


def _describe(key: str, ours, theirs) -> tuple[str, str]:
    if key == "command line":
        return _first_difference(ours, theirs)
    if key == "data":
        a, b = json.loads(ours), json.loads(theirs)
        prefix = next(p for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p))
        return f"{prefix}: {a.get(prefix, 'not read')}", f"{prefix}: {b.get(prefix, 'not read')}"
    return str(ours), str(theirs)


def _disagreement(identities: list[dict]) -> str | None:
    """The first thing some ranks have differently from rank 0, said in one line, or None."""
    first = identities[0]
    for key in ("software", "code", "command line", "data"):
        odd = next((i[key] for i in identities if i[key] != first[key]), None)
        if odd is None:
            continue
        group = [i for i in identities if i[key] == odd]  # the first other value, and who has it
        ours, theirs = _describe(key, first[key], odd)
        more = sum(i[key] not in (first[key], odd) for i in identities)
        return (
            f"the ranks do not run the same job: their {key} differs: rank 0 ({first['node']}) "
            f"has {ours}, {_who(group)} {'have' if len(group) > 1 else 'has'} {theirs}"
            f"{f' ({more} more rank(s) have yet another)' if more else ''}; every node must run "
            f"the same code and command line on the same data (check what differs on "
            f"{', '.join(sorted({i['node'] for i in group}))}: its environment, checkout, Python "
            f"environment or files)"
        )
    return None


def check_ranks_agree(launch: LaunchEnv, argv: tuple[str, ...], data: dict) -> None:
    """Gather every rank's `identity` (a collective: call it on every rank, right after the
    process group is up); UserError on every rank if any differs from rank 0's, else rank 0
    logs which node holds which ranks."""
    if launch.world_size == 1:
        return
    identities: list[dict] = [{}] * launch.world_size
    torch.distributed.all_gather_object(identities, identity(launch, argv, data))
    problem = _disagreement(identities)
    if problem:
        raise UserError(f"rank {launch.rank} ({node_name()}): {problem}")
    nodes = len({i["node"] for i in identities})
    logger.info(
        f"{launch.world_size} ranks on {nodes} node{'s' if nodes > 1 else ''} run the same code "
        f"({identities[0]['code']}), software, command line and data: {_who(identities)}; "
        f"rendezvous {launch.master_addr}:{launch.master_port}"
    )
