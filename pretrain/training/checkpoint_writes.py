"""Per-rank checkpoint writes that fail softly, and the ranks' agreement on an outcome.

A rank that cannot write (a full disk, a file-size limit) must not raise on its own: the other
ranks would wait in DeepSpeed's closing barrier and the job would hang or end in tracebacks.
`RankFiles` keeps the failure; `agree` gives every rank the same verdict, so all of them print
the same one line and stop.
"""

from __future__ import annotations

import os

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
    failure (a full disk, a file-size limit) is kept as (path, reason) instead of raised, so
    DeepSpeed's save still reaches its closing barrier and the ranks can agree on the outcome.

    DeepSpeed writes through its engine's `checkpoint_engine.save(state_dict, path)`; for its
    plain torch engine that method is replaced, for this rank's lifetime of the object, by
    `write` (the same `torch.save` and serialisation, plus fsync and the error capture).
    """

    def __init__(self, ds_engine):
        self.failure: tuple[str, str] | None = None
        self._engine = ds_engine.checkpoint_engine
        self._zipfile = getattr(self._engine, "zipfile_serialization", True)
        self._replaced = type(self._engine).__name__ == "TorchCheckpointEngine"
        if self._replaced:
            self._engine.save = self.write

    def write(self, state_dict, path: str) -> None:
        """torch.save `state_dict` to `path` and fsync it; record (not raise) a failure."""
        if self.failure is not None:
            return  # the save has failed already: write nothing more
        try:
            with open(path, "wb") as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=self._zipfile)
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

    def close(self) -> None:
        """Give DeepSpeed its own save method back."""
        if self._replaced:
            del self._engine.save
