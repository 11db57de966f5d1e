"""The file-system half of the save protocol: install a finished step, commit `latest`, prune.

A save is written into a hidden temporary folder (`format.temporary_name(tag, "tmp", unique)`),
then, on one process, `install_step` renames it to `global_step<N>` and `commit_latest` points
`latest` (then Megatron's `latest_checkpointed_iteration.txt`) at it, each file written under a
temporary name, fsynced and renamed, and each directory fsynced after a rename so the rename
itself survives a power cut. Until `latest` is replaced, a reader sees the previous checkpoint.
The folder `latest` names is never replaced or removed (`StepInUse`, `prune_steps`).
"""

from __future__ import annotations

import os
import shutil
import socket
import time

from pretrain.atomic import atomic_write_bytes
from pretrain.checkpoint.format import (
    LATEST_FILE,
    MEGATRON_LATEST_FILE,
    available_tags,
    iteration_of,
    read_latest_tag,
    temporary_name,
    temporary_owner,
)
from pretrain.checkpoint.integrity import step_problem
from pretrain.errors import UserError
from pretrain.testing_hooks import save_event


class StepInUse(Exception):
    """The step folder a save would replace is the one `latest` names."""


def new_unique() -> str:
    """An id for one save's temporary folder: time, pid and host (so stale ones are recognised)."""
    return f"{time.time_ns():x}-{os.getpid()}-{socket.gethostname()}"


def fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_tag_or_none(save_dir: str) -> str | None:
    """The tag `latest` names, or None if it is missing or damaged (then it protects nothing)."""
    try:
        return read_latest_tag(save_dir)
    except UserError:
        return None


def is_protected(save_dir: str, tag: str) -> bool:
    """Whether `tag` is the complete step `latest` names: what `--load` would pick."""
    return (
        latest_tag_or_none(save_dir) == tag and step_problem(os.path.join(save_dir, tag))[0] is None
    )


def install_step(save_dir: str, tmp_name: str, tag: str, unique: str) -> None:
    """Rename the complete temporary folder to `tag`. An existing `tag` folder (an older run's,
    not a complete one `latest` names) is moved aside first and deleted after; `StepInUse` if
    `latest` names it and it is complete (the caller keeps it and says so)."""
    final = os.path.join(save_dir, tag)
    fsync_path(os.path.join(save_dir, tmp_name))
    old = None
    if os.path.lexists(final):
        if is_protected(save_dir, tag):
            raise StepInUse(final)
        old = os.path.join(save_dir, temporary_name(tag, "old", unique))
        os.replace(final, old)
        save_event("older step moved aside")
    os.replace(os.path.join(save_dir, tmp_name), final)
    fsync_path(save_dir)
    save_event("step renamed into place")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def commit_latest(save_dir: str, tag: str) -> None:
    """Point `latest` (the commit point) and then Megatron's tracker file at `tag`."""
    atomic_write_bytes(os.path.join(save_dir, LATEST_FILE), tag.encode())
    save_event("latest committed")
    atomic_write_bytes(
        os.path.join(save_dir, MEGATRON_LATEST_FILE), str(iteration_of(tag)).encode()
    )
    fsync_path(save_dir)


def prune_steps(save_dir: str, keep: int) -> list[str]:
    """Delete complete steps older than the newest `keep` complete ones; the step `latest` names
    and incomplete steps are never touched. Returns the deleted tags."""
    protect = latest_tag_or_none(save_dir)
    complete = [
        tag
        for tag in available_tags(save_dir)
        if step_problem(os.path.join(save_dir, tag))[0] is None
    ]
    removed = []
    for tag in complete[:-keep] if keep > 0 else []:
        if tag == protect:
            continue
        # renamed first: a kill during the deletion leaves a hidden folder, not a damaged step
        old = os.path.join(save_dir, temporary_name(tag, "old", new_unique()))
        os.replace(os.path.join(save_dir, tag), old)
        save_event("old step moved aside for deletion")
        shutil.rmtree(old, ignore_errors=True)
        removed.append(tag)
    if removed:
        fsync_path(save_dir)
    return removed


def _owner_alive(unique: str) -> bool:
    """Whether the process that created a temporary folder may still be writing it."""
    _, pid, host = (unique.split("-", 2) + ["", ""])[:3]
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's: cannot tell, leave it
    if int(pid) == os.getpid():
        return False  # ours, from an earlier save that failed; saves here are sequential
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(save_dir: str) -> list[str]:
    """Delete temporary and half-deleted step folders left by killed runs on this machine."""
    removed = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        unique = temporary_owner(name)
        if unique is not None and not _owner_alive(unique):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def directory_size(path: str) -> int:
    """Bytes in the files directly inside `path` (0 if it does not exist)."""
    if not os.path.isdir(path):
        return 0
    return sum(
        os.path.getsize(os.path.join(path, n))
        for n in os.listdir(path)
        if os.path.isfile(os.path.join(path, n))
    )


def write_failure_message(path: str, reason: str, save_dir: str, needed: int) -> str:
    """One line for a failed checkpoint write: the path, the reason, the bytes needed and free."""
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        free = None
    room = f", {free} bytes free there" if free is not None else ""
    return (
        f"{path}: {reason} while saving a checkpoint (it needs about {needed} bytes{room}); "
        f"the previous checkpoint is intact; free space (or raise the file-size limit) and resume"
    )
