"""What a tool that writes neither datasets nor checkpoints must never replace: an existing
dataset file or anything of a checkpoint. The `protect` of `pretrain.outputs.refuse_output`."""

from __future__ import annotations

import os

from pretrain.checkpoint.format import (
    LATEST_FILE,
    MEGATRON_LATEST_FILE,
    META_FILE,
    available_tags,
)
from pretrain.data.files.fingerprint import sidecar_path
from pretrain.data.files.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path


def _dataset_of(path: str) -> str | None:
    """The prefix whose `.bin`, `.idx` or sidecar `path` is, if that dataset exists."""
    prefix, ext = os.path.splitext(path)
    if ext in (".bin", ".idx", ".json") and IndexedDataset.exists(prefix):
        if path in (get_bin_path(prefix), get_idx_path(prefix), sidecar_path(prefix)):
            return prefix
    return None


def _is_checkpoint(folder: str) -> bool:
    """A step folder (our metadata), a Megatron-LM save folder (its tracker file), or ours
    (`latest` beside a global_step<N> folder)."""
    if any(os.path.isfile(os.path.join(folder, f)) for f in (META_FILE, MEGATRON_LATEST_FILE)):
        return True
    return os.path.isfile(os.path.join(folder, LATEST_FILE)) and bool(available_tags(folder))


def _checkpoint_around(path: str) -> str | None:
    """The checkpoint folder `path` is or lies inside, if any."""
    folder = os.path.realpath(path)
    while True:
        if os.path.isdir(folder) and _is_checkpoint(folder):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def kept_data(path: str) -> str | None:
    """What writing the existing `path` would replace ("the dataset file ...", "part of the
    checkpoint ..."), or None when it does not exist or is neither."""
    if not os.path.lexists(path):
        return None
    prefix = _dataset_of(path)
    if prefix is not None:
        return f"a file of the dataset {prefix} (.bin/.idx)"
    checkpoint = _checkpoint_around(path)
    if checkpoint is not None:
        return f"part of the checkpoint {checkpoint}"
    return None
