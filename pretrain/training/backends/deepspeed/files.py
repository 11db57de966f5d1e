"""DeepSpeed's own checkpoint files: saved through our fsynced, fail-soft writer, loaded through
the allowlisted unpickler.

DeepSpeed writes through its engine's `checkpoint_engine.save(state_dict, path)`; for its plain
torch engine that method is replaced, for the duration of a save, by `RankFiles.write` (the same
`torch.save` and serialisation, plus fsync and the error capture), so a full disk on one rank
still lets DeepSpeed reach its closing barrier and the ranks agree on one line.
"""

from __future__ import annotations

import contextlib

import torch

from pretrain.checkpoint import safe_load
from pretrain.training.checkpoints.checkpoint_writes import RankFiles


@contextlib.contextmanager
def _writes_through(ds_engine, files: RankFiles):
    """Inside: DeepSpeed's torch checkpoint engine saves with `files.write`."""
    engine = ds_engine.checkpoint_engine
    if type(engine).__name__ != "TorchCheckpointEngine":
        yield
        return
    zipfile = getattr(engine, "zipfile_serialization", True)
    engine.save = lambda state_dict, path: files.write(state_dict, path, zipfile=zipfile)
    try:
        yield
    finally:
        del engine.save


def save(ds_engine, save_dir: str, tag: str, client_state: dict, files: RankFiles) -> None:
    """DeepSpeed's `save_checkpoint` of this rank into `save_dir/tag` (no `latest` of its own);
    a failure is kept in `files`."""
    with _writes_through(ds_engine, files):
        try:
            ds_engine.save_checkpoint(
                save_dir, tag=tag, client_state=client_state, save_latest=False
            )
        except OSError as err:  # outside the file writes (DeepSpeed's copy of zero_to_fp32.py)
            files.fail(err.filename or save_dir, err.strerror or str(err))
            torch.distributed.barrier()  # stands in for DeepSpeed's closing barrier it skipped


def load(
    ds_engine, folder: str, tag: str, *, optimizer: bool, schedule: bool, module_only: bool
) -> tuple[str | None, dict | None]:
    """DeepSpeed's `load_checkpoint` of `folder/tag`, its unpickling reads allowlisted: (the path
    loaded or None, the client state)."""
    with safe_load.checked_torch_loads():
        load_path, client_state = ds_engine.load_checkpoint(
            folder,
            tag=tag,
            load_optimizer_states=optimizer,
            load_lr_scheduler_states=schedule,
            load_module_only=module_only,
        )
    return load_path, client_state
