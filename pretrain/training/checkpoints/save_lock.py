"""The `--save` lock: one run writes a checkpoint folder at a time.

Two runs saving into one folder would interleave their steps (and `latest`). Rank 0 holds an
exclusive `flock` on `<save>/pretrain_gpt.lock` for the whole run and writes its holder into it
(host, pid, process start, start time, Slurm job); a second run finds the lock taken and every
one of its ranks stops with one line naming the holder. At a clean exit the holder empties the
file and lets go; the file itself stays (deleting a lock file that another run may be opening
would let two runs hold "the" lock).

A killed holder (SIGKILL, a node crash) holds nothing: the kernel (or the file server) drops its
lock, and the next run takes it over with a one-line note naming the run that did not let go. A
lock that is still held although its holder, on this host, no longer runs (a child process it
forked inherited the lock) is taken over too: the file is replaced. On a file system without
`flock` the holder recorded in the file decides: alive on this host, or on another host, refused
(the way out: delete the file if that job is gone); the same Slurm job (a requeue) or a dead pid
on this host, taken over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

import torch

from pretrain.errors import UserError
from pretrain.training.report.logging import logger

LOCK_FILE = "pretrain_gpt.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _process_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _holder_record() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "process_start": _process_start(pid),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def _read_holder(fd: int) -> dict | None:
    """The holder recorded in the lock file, or None (released cleanly, or unreadable)."""
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "another run (it has not recorded itself yet)"
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')}"
        f"{job})"
    )


def _runs_here(holder: dict) -> bool | None:
    """Whether the holder process still runs: True/False on this host, None on another."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    recorded = holder.get("process_start")
    return recorded is None or _process_start(pid) in (None, recorded)  # a reused pid: gone


def _same_job(holder: dict) -> bool:
    """The holder is an earlier launch of this Slurm job (requeued: that launch has ended)."""
    job = os.environ.get("SLURM_JOB_ID")
    return job is not None and holder.get("slurm_job_id") == job


class SaveLock:
    """The lock of one `--save` folder, held by this process between `acquire` and `release`."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_FILE)
        self._fd: int | None = None

    def _refusal(self, holder: dict | None, elsewhere: bool) -> UserError:
        gone = (
            f"if that job is gone (its node died), delete {self.path}"
            if elsewhere
            else "if that run is gone, launch again"
        )
        return UserError(
            f"--save {self.save_dir}: another run is writing this folder: {_describe(holder)} "
            f"holds {self.path}; wait for it to finish or use another --save ({gone})"
        )

    def acquire(self) -> str | None:
        """Take the lock (`UserError` naming the holder if another run has it); returns a note
        when the lock was taken over from a run that did not let go, else None."""
        try:
            os.makedirs(self.save_dir, exist_ok=True)
        except OSError as err:
            raise UserError(f"--save {self.save_dir}: cannot create it ({err.strerror})") from None
        stale = None
        for attempt in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as err:
                raise UserError(f"--save {self.save_dir}: cannot create {self.path} "
                                f"({err.strerror})") from None  # fmt: skip
            try:
                previous = self._lock(fd, retry=attempt == 0)
            except BaseException:
                os.close(fd)
                raise
            if not isinstance(previous, _Stale):
                break
            os.close(fd)
            stale = previous.holder
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)
        os.fsync(fd)
        if stale is not None:
            why = "it no longer runs, but a process it started kept the lock: file replaced"
            return f"--save {self.save_dir}: took over {self.path} from {_describe(stale)}: {why}"
        if previous is not None:
            return (
                f"--save {self.save_dir}: took over {self.path} from {_describe(previous)}, "
                f"which did not let go of it (killed?)"
            )
        return None

    def _lock(self, fd: int, retry: bool):
        """flock `fd`: the previous holder's record (None if it let go cleanly), or `_Stale`
        after removing a lock file still locked for a holder that is gone."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            alive = None if holder is None else _runs_here(holder)
            if retry and alive is False and _same_file(fd, self.path):
                os.unlink(self.path)
                return _Stale(holder)
            raise self._refusal(holder, elsewhere=alive is None) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise UserError(f"--save {self.save_dir}: cannot lock {self.path} "
                                f"({err.strerror})") from None  # fmt: skip
            return self._recorded_only(fd)
        holder = _read_holder(fd)
        if holder is not None and _runs_here(holder) and holder.get("pid") != os.getpid():
            raise self._refusal(
                holder, elsewhere=False
            )  # flock granted, but it runs: no real flock
        return holder

    def _recorded_only(self, fd: int) -> dict | None:
        """Without flock: the recorded holder decides (see the module docstring)."""
        holder = _read_holder(fd)
        if holder is None or _same_job(holder):
            return holder
        alive = _runs_here(holder)
        if alive is False:
            return holder
        raise self._refusal(holder, elsewhere=alive is None)

    def release(self) -> None:
        """Empty the lock file (a clean exit) and let go; idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # the folder is gone or the file system has no flock: closing is enough
        finally:
            os.close(fd)


class _Stale:
    """The record of a gone holder whose lock file was removed (acquire tries once more)."""

    def __init__(self, holder: dict):
        self.holder = holder


def _same_file(fd: int, path: str) -> bool:
    """True when `path` still names the file open as `fd` (nobody replaced it meanwhile)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def hold_save_lock(save_dir: str | None) -> SaveLock | None:
    """Rank 0 takes the lock of `save_dir` (None: no --save, no lock); every rank gets the
    outcome, so a refusal is the same one line on every rank, before anything is written.
    Collective: call on every rank after the process group exists."""
    if save_dir is None:
        return None
    lock = SaveLock(save_dir)
    outcome: list[tuple[bool, str | None]] = [(True, None)]
    if torch.distributed.get_rank() == 0:
        try:
            outcome = [(True, lock.acquire())]
        except UserError as err:
            outcome = [(False, str(err))]
    torch.distributed.broadcast_object_list(outcome, src=0)
    held, line = outcome[0]
    if not held:
        raise UserError(line)
    if line:
        logger.info(f"WARNING: {line}")  # rank 0 took it over: one line
    return lock
