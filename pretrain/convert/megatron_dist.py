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

Everything is read through `pretrain.checkpoint.dcp_reader` (DCP's load into global tensors
allocated from `.metadata`, `no_dist=True`: no process group): `.metadata` with a restricted
unpickler, the tensors with `weights_only=True`, the one byte item read, `common_state`, with the
safe loader's Megatron allowlist (as `common.pt`); no pickled code runs.
"""

from __future__ import annotations

import os

import torch

from pretrain.checkpoint import dcp_reader, safe_load
from pretrain.errors import UserError

METADATA_FILE = dcp_reader.METADATA_FILE
COMMON_FILE = "common.pt"
COMMON_STATE = "common_state"  # the object Megatron-LM main stores its common entries as
_STACKED = "decoder.layers."


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
    """(where it is, its value): the `common_state` byte item (Megatron's key for it carries a
    shard suffix, `common_state/shard_0_1`) through the safe loader."""
    keys = [
        key
        for key in dcp_reader.read_metadata(step_dir).state_dict_metadata
        if key.split("/", 1)[0] == COMMON_STATE
    ]
    if len(keys) != 1:
        raise UserError(
            f"{step_dir}: a torch_dist checkpoint without {COMMON_FILE} or one plain "
            f"'{COMMON_STATE}' object (they hold Megatron's args; copy the whole iteration folder)"
        )
    loaded = dcp_reader.load(step_dir, {keys[0]: None}, objects=keys, megatron=True, no_dist=True)
    return f"{step_dir} ({keys[0]})", loaded[keys[0]]


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
    entries = dcp_reader.tensor_entries(step_dir)
    # Preallocated global tensors, filled by torch's planner from every rank's shards (the
    # key-only loader needs planner data that megatron-core's planner does not write).
    tensors = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if not key.startswith("optimizer.") and not key.endswith("._extra_state")
    }
    dcp_reader.load(step_dir, tensors, no_dist=True)
    return _unstack(tensors, num_layers, step_dir)
