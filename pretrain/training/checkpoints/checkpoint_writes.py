"""Per-rank checkpoint writes that fail softly, and the ranks' agreement on an outcome.

A rank that cannot write (a full disk, a file-size limit) must not raise on its own: the other
ranks would wait in the backend's closing collectives and the job would hang or end in tracebacks.
`RankFiles` keeps the failure; `agree` gives every rank the same verdict, so all of them print
the same one line and stop.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future

import torch


def agree(problem: str | None) -> str | None:
    """The first rank's problem (naming the rank), the same on every rank; None if none had one.
    Also a barrier."""
    world = torch.distributed.get_world_size()
    problems: list[str | None] = [None] * world
    torch.distributed.all_gather_object(problems, problem)
    for rank, found in enumerate(problems):
        if found is not None:
            return found if world == 1 else f"rank {rank}: {found}"
    return None


class RankFiles:
    """This rank's checkpoint file writes: each file written, flushed and fsynced; the first
    failure (a full disk, a file-size limit) is kept as (path, reason) instead of raised, so the
    backend's save still reaches its closing collectives and the ranks can agree on the outcome.
    A backend whose library writes files itself routes them through `write` (the DeepSpeed
    backend replaces its checkpoint engine's save for the duration of a save) or reports a
    failure with `fail`.
    """

    def __init__(self, watch=None):
        self.failure: tuple[str, str] | None = None
        # `watch(stream, name)`: the context a file is written through (the test hooks' cut)
        self._watch = watch or (lambda stream, _name: contextlib.nullcontext(stream))

    def write(self, state_dict, path: str, zipfile: bool = True) -> None:
        """torch.save `state_dict` to `path` and fsync it; record (not raise) a failure."""
        if self.failure is not None:
            return  # the save has failed already: write nothing more
        try:
            with open(path, "wb") as f:
                with self._watch(f, os.path.basename(path)) as out:
                    torch.save(state_dict, out, _use_new_zipfile_serialization=zipfile)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as err:
            # torch reports a failed write as a RuntimeError caused by the OSError
            cause = err if isinstance(err, OSError) else err.__context__
            reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(err)
            self.failure = (path, reason)

    def fail(self, path: str, reason: str) -> None:
        """Record a failure seen outside `write`."""
        self.failure = self.failure or (path, reason)


class BackgroundFiles(RankFiles):
    """`RankFiles` of a background save: `write` only queues (the payload must be this rank's
    own copy: training goes on changing the originals); `start` writes the queue in a thread
    once another write (the backend's native files) has finished. `watch` is the test hooks'
    `stream_watcher()` of the save."""

    def __init__(self, watch=None):
        super().__init__(watch)
        self._queue: list[tuple] = []

    def write(self, state_dict, path: str, zipfile: bool = True) -> None:
        """Queue `state_dict` for `path`."""
        self._queue.append((state_dict, path, zipfile))

    def start(self, after: Future, where: str) -> Future:
        """Write the queue in the background once `after` is done (its exception, one line, is
        this save's failure, at `where`); the returned future is done when every file is
        written."""
        done: Future = Future()

        def run() -> None:
            try:
                after.result()
            except Exception as err:  # noqa: BLE001 - any failed write is the save's failure
                self.fail(where, str(err))
            for state_dict, path, zipfile in self._queue:
                RankFiles.write(self, state_dict, path, zipfile)
            self._queue.clear()
            done.set_result(None)

        threading.Thread(target=run, name="checkpoint-writes", daemon=True).start()
        return done
