"""The torch backend's native checkpoint: torch.distributed.checkpoint (DCP, Megatron's
`--ckpt-format torch_dist`), blocking or written in the background (`--async-save`).

In the step folder, beside our metadata, RNG and full-state files:

    .metadata            DCP's index of every shard (rank 0)
    __<rank>_0.distcp    each rank's shards: the fp32 master weights and Adam's moments and step
                         counts, under `tp<t>.<GPTModel name>[.exp_avg|.exp_avg_sq|.step]`
                         (MoE experts at EP > 1: `tp<t>.ep<e>.<name>...`, this EP rank's
                         experts), and the persistent buffers (the routers' expert bias)
    train_state.pt       rank 0: the `TrainState` (client state) and the LR schedule position

Weights and moments are FSDP2's DTensors over the data-parallel mesh (experts at EP > 1: over the
expert-data-parallel mesh), so DCP stores each once whatever the data-parallel size; TP shards
are plain tensors, told apart by their `tp<t>.` key, EP ranks' experts by `ep<e>.`.
Only tensors go into DCP (no byte items, no pickled objects in the shards): it is read through
`pretrain.checkpoint.dcp_reader` (`.metadata` admitting DCP's own classes only, the tensors with
`weights_only=True`, a byte item at any key refused naming its file and key, unread),
`train_state.pt` with `pretrain.checkpoint.safe_load`.

DCP coordinates over a gloo group of its own (`checkpoint_group`), so a background save's
collectives never interleave with training's. `async_save` stages (copies) this rank's state to
CPU memory before it returns; the write and DCP's closing gather run in its thread. Every file
stream passes through the test hooks' `stream_watcher` (SIGKILL at real points of the write).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta

from pretrain.checkpoint import dcp_reader, safe_load
from pretrain.parallel import state
from pretrain.testing_hooks import stream_watcher
from pretrain.training.backends.torch.full_state import persistent_buffers
from pretrain.training.checkpoints.checkpoint_writes import RankFiles
from pretrain.training.engine import split_over_ep

if TYPE_CHECKING:
    from pretrain.training.backends.torch.held import Held

TRAIN_STATE_FILE = "train_state.pt"
METADATA_FILE = dcp_reader.METADATA_FILE
MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def _state_dict(engine: Held, optimizer: bool) -> dict[str, torch.Tensor]:
    """The tensors DCP saves or loads in place: this rank's weights and, with `optimizer`, Adam's
    state (created, zero, where no step has run yet, so a load has somewhere to go)."""
    tp_prefix = f"tp{state.get_tensor_model_parallel_rank():02d}."
    out = {tp_prefix + name: buffer for name, buffer in persistent_buffers(engine.model).items()}
    for name, param in engine.model.named_parameters():
        prefix = tp_prefix
        if split_over_ep(param):  # each EP rank holds other experts under the same name
            prefix += f"ep{state.get_expert_model_parallel_rank():02d}."
        out[prefix + name] = param
        if not optimizer:
            continue
        adam = engine.optimizer.state[param]
        if not adam:
            adam.update(
                step=torch.tensor(0.0),
                exp_avg=torch.zeros_like(param),
                exp_avg_sq=torch.zeros_like(param),
            )
        out.update({f"{prefix}{name}.{key}": adam[key] for key in MOMENTS})
    return out


class _WatchedFileSystem(FileSystem):
    """torch's file system; every stream written goes through the save's `stream_watcher`."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):  # noqa: D102 (torch API)
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            with self.watch(stream, os.path.basename(str(path))) as out:
                yield out


class _Writer(FileSystemWriter):
    """torch's FileSystemWriter (fsynced files, never over an existing checkpoint) writing
    through the save's `stream_watcher`, whose index names its folder as a plain string (torch's
    would pickle a `pathlib.Path`, which the safe `.metadata` reader refuses)."""

    def __init__(self, path: str):
        super().__init__(path, sync_files=True, overwrite=False)
        self.fs = _WatchedFileSystem(stream_watcher())

    def storage_meta(self) -> StorageMeta:  # noqa: D102 (torch API)
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)


def save(
    engine: Held, path: str, client_state: dict, files: RankFiles, *, background: bool
) -> Future | None:
    """Write this rank's part of the DCP checkpoint into `path` and (rank 0) `train_state.pt`
    through `files`; a failure is recorded in `files`, not raised. `background`: staged now,
    written by DCP's `async_save`; returns its future (an exception: the write failed)."""
    os.makedirs(path, exist_ok=True)
    if torch.distributed.get_rank() == 0:
        train_state = {"client_state": client_state, "lr_scheduler": engine.scheduler.state_dict()}
        files.write(train_state, os.path.join(path, TRAIN_STATE_FILE))
    tensors = _state_dict(engine, optimizer=True)
    group = engine.checkpoint_group
    if background:
        writing = dcp.async_save(tensors, storage_writer=_Writer(path), process_group=group)
        return _one_line_failure(writing)
    try:
        dcp.save(tensors, storage_writer=_Writer(path), process_group=group)
    except CheckpointException as err:  # raised on every rank alike (a BaseException)
        files.fail(path, dcp_reader.failure_reason(err))
    return None


def _one_line_failure(writing: Future) -> Future:
    """`writing`'s outcome, its failure (DCP's CheckpointException, a BaseException holding
    every rank's traceback) as a one-line RuntimeError."""
    done: Future = Future()

    def settle(finished: Future) -> None:
        try:
            done.set_result(finished.result())
        except CheckpointException as err:
            done.set_exception(RuntimeError(dcp_reader.failure_reason(err)))
        except Exception as err:  # noqa: BLE001 - any other failure of the write, as it is
            done.set_exception(err)

    writing.add_done_callback(settle)
    return done


def load(
    engine: Held, path: str, *, optimizer: bool, schedule: bool
) -> tuple[str | None, dict | None]:
    """Load `path` (saved by `save` at this TP size, any data-parallel size) into this rank's
    weights and, with `optimizer`, Adam's state; with `schedule` the LR schedule position:
    (the path, the saved client state); (None, None) when its files are missing."""
    train_state_path = os.path.join(path, TRAIN_STATE_FILE)
    if not os.path.isfile(os.path.join(path, METADATA_FILE)) or not os.path.isfile(
        train_state_path
    ):
        return None, None
    saved = safe_load.load(train_state_path)
    tensors = _state_dict(engine, optimizer=optimizer)
    dcp_reader.load(path, tensors, process_group=engine.checkpoint_group)  # no byte items
    if schedule:
        engine.scheduler.load_state_dict(saved["lr_scheduler"])
    return path, saved["client_state"]


def checkpoint_group() -> torch.distributed.ProcessGroup:
    """A gloo group over every rank for DCP's coordination (a collective: every rank calls it)."""
    return torch.distributed.new_group(backend="gloo")
