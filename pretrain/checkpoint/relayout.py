"""A checkpoint re-cut offline for another TP/PP layout (tools/reshard_checkpoint.py).

The output is a checkpoint folder of its own:

    <save>/latest, <save>/latest_checkpointed_iteration.txt      global_step<N>, as the source
    <save>/global_step<N>/full_state_tp<t>_pp<p>.pt             one per target (TP rank, stage)
    <save>/global_step<N>/pretrain_meta.json                    the source's, with the target
                                                                layout, "full_state_only": true
                                                                and "resharded_from"

It holds the layout-independent state only (fp32 master weights, Adam moments and steps, the LR
schedule position, in `pretrain.checkpoint.full_state`'s format), no DeepSpeed files, so any
launch resumes it through that state: at the target TP/PP each rank reads just its own file
(`FullState.local` hands out the saved shard, no merge), and any other layout still works. The
data position, skipped samples and fingerprints are in the metadata, as in every checkpoint.
RNG states are not carried (they belong to ranks of the old layout).

Everything is written into a hidden sibling folder and renamed to `<save>` when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

from pretrain.atomic import atomic_write_bytes
from pretrain.checkpoint import fingerprints
from pretrain.checkpoint.commit import commit_latest, directory_size, fsync_path, new_unique
from pretrain.checkpoint.format import (
    FILES_KEY,
    FINGERPRINTS_KEY,
    FULL_STATE_ONLY,
    META_FILE,
    model_config_from_meta,
    tag_for,
)
from pretrain.checkpoint.full_state import FullState, write_shard
from pretrain.checkpoint.integrity import check_finite, manifest
from pretrain.checkpoint.pipeline_layers import stage_of_parameter
from pretrain.data.files.indexed_dataset import no_space_error
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class TargetLayout:
    """The model-parallel layout to cut the state for (data parallelism and the ZeRO stage are
    chosen freely at launch: the state does not depend on them)."""

    tensor_parallel_size: int
    """TP ranks of the jobs that will load it (--target-tensor-parallel-size)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages of those jobs (--target-pipeline-parallel-size)."""


def is_full_state_only(meta: dict) -> bool:
    """True for a checkpoint written by `reshard` (it holds no DeepSpeed files)."""
    return bool(meta.get(FULL_STATE_ONLY))


def _target_meta(meta: dict, config: ModelConfig, source_dir: str, target: TargetLayout) -> dict:
    out = {k: v for k, v in meta.items() if k not in (FILES_KEY, FINGERPRINTS_KEY)}
    out["padded_vocab_size"] = config.padded_vocab_size(target.tensor_parallel_size)
    out["parallel"] = {
        "tensor_model_parallel_size": target.tensor_parallel_size,
        "pipeline_model_parallel_size": target.pipeline_parallel_size,
        "data_parallel_size": None,
        "world_size": None,
        "zero_stage": None,
        "pipeline_engine": target.pipeline_parallel_size > 1,
    }
    out[FULL_STATE_ONLY] = True
    out["resharded_from"] = {"path": os.path.abspath(source_dir), "parallel": meta["parallel"]}
    return out


def _files(
    state: FullState, config: ModelConfig, target: TargetLayout
) -> Iterator[tuple[int, int, dict]]:
    """(TP rank, stage, entries) of every target file, built one file at a time (bounded
    memory: one file's tensors plus the parameter being merged)."""

    tp, pp = target.tensor_parallel_size, target.pipeline_parallel_size
    padded = config.padded_vocab_size(tp)
    for stage in range(pp):
        names = [n for n in state.names() if stage_of_parameter(n, config.num_layers, pp) == stage]
        for rank in range(tp):
            entries = {}
            for name in names:
                local = state.local(name, tp_rank=rank, tp_size=tp, padded_vocab_size=padded)
                entries[name] = {
                    "partition": state.partition(name),
                    "buffer": state.is_buffer(name),
                    "step": state.step(name),
                    **local,
                }
            yield rank, stage, entries


def _check_target(config: ModelConfig, target: TargetLayout) -> None:
    """Refuse (one line naming the flag) a layout the model cannot be split into (sequence
    parallelism, a launch choice, assumed where TP > 1: the strictest one)."""
    tp = target.tensor_parallel_size
    config = dataclasses.replace(config, sequence_parallel=config.sequence_parallel or tp > 1)
    try:
        config.validate(tp=tp, pp=target.pipeline_parallel_size)
    except UserError as err:
        message = str(err).replace("--tensor-model-parallel-size", "--target-tensor-parallel-size")
        message = message.replace(
            "--pipeline-model-parallel-size", "--target-pipeline-parallel-size"
        )
        raise UserError(message) from None


def reshard(source_dir: str, meta: dict, save: str, target: TargetLayout, progress=None) -> str:
    """Write the state of the step folder `source_dir` (its metadata `meta`) cut for `target`
    as the checkpoint folder `save` (which must not exist yet); returns its step folder.
    `progress(n)` is called after each file. A target the model cannot take, or a source
    without a full state, is refused before anything is written; a state holding NaN/Inf, or a
    full disk, is refused (one line) and leaves nothing behind; so is a source file that is not
    the one its step saved (`fingerprints`)."""
    config = model_config_from_meta(meta["model"])
    _check_target(config, target)
    fingerprints.check(source_dir, meta)
    state = FullState(source_dir, config.vocab_size)
    parent = os.path.dirname(os.path.abspath(save))
    tmp_root = os.path.join(
        parent, f".{os.path.basename(os.path.abspath(save))}.tmp-{new_unique()}"
    )
    tag = tag_for(int(meta["iteration"]))
    step_dir = os.path.join(tmp_root, tag)
    try:
        os.makedirs(step_dir)
        for rank, stage, entries in _files(state, config, target):
            check_finite(entries, source_dir, "the full state")
            write_shard(
                step_dir,
                tp_rank=rank,
                tp_size=target.tensor_parallel_size,
                pp_stage=stage,
                entries=entries,
                extra=state.extra,
            )
            if progress is not None:
                progress(1)
        out_meta = _target_meta(meta, config, source_dir, target)
        out_meta[FILES_KEY] = manifest(step_dir)
        out_meta[FINGERPRINTS_KEY] = fingerprints.record(step_dir, out_meta[FILES_KEY])
        atomic_write_bytes(
            os.path.join(step_dir, META_FILE), json.dumps(out_meta, indent=2).encode()
        )
        fsync_path(step_dir)
        commit_latest(tmp_root, tag)
        os.rename(tmp_root, save)
        fsync_path(parent)
    except OSError as err:
        shutil.rmtree(tmp_root, ignore_errors=True)
        needed = directory_size(source_dir)
        full = no_space_error(err.filename or save, err, needed)
        if full is not None:
            raise UserError(f"{full}; nothing was written to {save}") from None
        free = shutil.disk_usage(parent).free
        raise UserError(
            f"{err.filename or save}: cannot be written ({err.strerror or err}); the source's step "
            f"folder is {needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free in {parent}; "
            f"nothing was written to {save}"
        ) from None
    except BaseException:
        shutil.rmtree(tmp_root, ignore_errors=True)
        raise
    return os.path.join(save, tag)
