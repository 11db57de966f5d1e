"""Megatron-LM `--ckpt-format torch_dist` checkpoints -> megatron-core names, full tensors.

What megatron.core.dist_checkpointing writes with the torch_dist strategy (megatron-core 0.16):

    <load>/iter_<N:07d>/ .metadata          torch.distributed.checkpoint's index of all shards
                         __<rank>_<i>.distcp the shards' bytes
                         common.pt          the non-sharded entries: args, checkpoint_version,
                                            iteration, ... (Megatron-LM main: no common.pt;
                                            they are one object, `common_state`, in the
                                            .distcp files: a torch.save blob of [that dict])
                         metadata.json      {"sharded_backend": "torch_dist", ...}

Every tensor is stored once as its *global* (TP = 1, all pipeline stages) tensor, whatever the
TP/PP it was saved at. Transformer layers are stacked: `decoder.layers.<rest>` has a leading
layer axis over all global layers (virtual pipeline chunks included). The local spec saves its
norms under Transformer Engine's names (`linear_qkv.layer_norm_weight`, ...). `_extra_state`
entries are bytes (TE's FP8 metadata), not weights, and are not read.

The tensors are read with torch's own reader (`torch.distributed.checkpoint.load` into global
tensors allocated from `.metadata`, `no_dist=True`: no process group; shards with
`weights_only=True`), `.metadata` with a restricted unpickler, `common.pt` with the project's
safe loader: no pickled code runs.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pretrain.checkpoint import safe_load
from pretrain.errors import UserError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
COMMON_STATE = "common_state"  # the object Megatron-LM main stores its common entries as
_STACKED = "decoder.layers."


class _SafeReader(FileSystemReader):
    """torch's FileSystemReader with the restricted `.metadata` unpickler (the tensor shards are
    read by torch with `weights_only=True` already)."""

    def read_metadata(self, *args, **kwargs):  # noqa: D102 (torch API)
        metadata = safe_load.dcp_metadata(os.path.join(self.path, METADATA_FILE))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def is_torch_dist(step_dir: str) -> bool:
    """Whether `step_dir` is a torch.distributed.checkpoint folder (Megatron's torch_dist)."""
    return os.path.isfile(os.path.join(step_dir, METADATA_FILE))


def read_common(step_dir: str) -> dict:
    """The common entries (args, checkpoint_version, iteration), read with the safe loader from
    common.pt or, without it, from the `common_state` object in the .distcp files."""
    path = os.path.join(step_dir, COMMON_FILE)
    if os.path.isfile(path):
        common = safe_load.load(path, megatron=True)
    else:
        path, common = _read_common_state(step_dir)
    if isinstance(common, list) and len(common) == 1:  # common_state holds [the dict]
        common = common[0]
    if not isinstance(common, dict) or "args" not in common:
        raise UserError(f"{path}: holds no 'args' (not written by Megatron-LM's checkpointing)")
    return common


def _read_common_state(step_dir: str) -> tuple[str, object]:
    """(where it is, its value): the `common_state` object's bytes (its byte range in a .distcp
    file, from `.metadata`) through the safe loader."""
    places = [
        (index, place)
        for index, place in _metadata(step_dir).storage_data.items()
        if index.fqn.split("/", 1)[0] == COMMON_STATE
    ]
    if len(places) != 1 or places[0][1].transform_descriptors:
        raise UserError(
            f"{step_dir}: a torch_dist checkpoint without {COMMON_FILE} or one plain "
            f"'{COMMON_STATE}' object (they hold Megatron's args; copy the whole iteration folder)"
        )
    index, place = places[0]
    where = f"{os.path.join(step_dir, place.relative_path)} ({index.fqn})"
    with open(os.path.join(step_dir, place.relative_path), "rb") as f:
        f.seek(place.offset)
        data = f.read(place.length)
    with tempfile.TemporaryDirectory() as tmp:
        blob = os.path.join(tmp, f"{COMMON_STATE}.pt")
        with open(blob, "wb") as f:
            f.write(data)
        try:
            return where, safe_load.load(blob, megatron=True)
        except UserError as err:
            raise UserError(str(err).replace(blob, where)) from None


def _metadata(step_dir: str):
    try:
        return _SafeReader(step_dir).read_metadata()
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable index is the same user problem
        raise UserError(f"{step_dir}/{METADATA_FILE}: unreadable ({err}); copy it again") from err


def _tensor_entries(step_dir: str) -> dict[str, TensorStorageMetadata]:
    return {
        key: entry
        for key, entry in _metadata(step_dir).state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and not key.endswith("._extra_state")
    }


def _unstack(tensors: dict[str, torch.Tensor], num_layers: int, step_dir: str) -> dict:
    """`decoder.layers.<rest>` [L, ...] -> `decoder.layers.<i>.<rest>` (global numbering)."""
    out = {}
    for key, tensor in tensors.items():
        rest = key[len(_STACKED) :] if key.startswith(_STACKED) else None
        if rest is None or rest.split(".", 1)[0].isdigit():  # not stacked (or per-layer keys)
            out[key] = tensor
            continue
        if tensor.shape[0] != num_layers:
            raise UserError(
                f"{step_dir}: {key} stacks {tensor.shape[0]} layers but args say {num_layers} "
                f"(args that do not belong to these weights)"
            )
        for layer in range(num_layers):
            out[f"{_STACKED}{layer}.{rest}"] = tensor[layer].clone()
    return out


def read_model_tensors(step_dir: str, num_layers: int) -> dict[str, torch.Tensor]:
    """All model weights of a torch_dist folder: megatron-core names, global layer numbers, full
    (TP = 1) tensors; optimizer state (`optimizer.*`) is skipped."""
    entries = _tensor_entries(step_dir)
    # Preallocated global tensors, filled by torch's planner from every rank's shards (the
    # key-only loader needs planner data that megatron-core's planner does not write).
    tensors = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if not key.startswith("optimizer.")
    }
    try:
        dcp.load(tensors, storage_reader=_SafeReader(step_dir), no_dist=True)
    except Exception as err:  # noqa: BLE001 - e.g. a missing or truncated .distcp file
        raise UserError(
            f"{step_dir}: the .distcp shards cannot be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); copy every __*.distcp file"
        ) from err
    return _unstack(tensors, num_layers, step_dir)
