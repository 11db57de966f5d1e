"""A full state dict -> a checkpoint that `pretrain_gpt.py --load DIR --finetune` starts from.

`--finetune` loads weights only (DeepSpeed `load_module_only`): no optimizer, LR schedule,
iteration or RNG state. What DeepSpeed reads then is exactly what this module writes:

    DIR/latest, DIR/latest_checkpointed_iteration.txt       "global_step0", "0"
    DIR/global_step0/pretrain_meta.json                     model config and layout, checked by
                                                            pretrain/training/checkpoints/checkpointing.py
    PP = 1:  mp_rank_<tp:02>_model_states.pt                {"module": this TP rank's weights, ...}
    PP > 1:  mp_rank_<r:02>_model_states.pt (r < pp*tp)     {"module": None, ...} (engine bookkeeping)
             layer_<idx:02>-model_<tp:02>-model_states.pt   one per pipeline layer and TP rank

The layout is the one the target run uses (TP, PP); the data-parallel size and ZeRO stage 0-2 of
that run are free, because DeepSpeed rebuilds ZeRO's fp32 partitions from the loaded weights. A
ZeRO-3 run cannot start from it: DeepSpeed's ZeRO-3 `load_module_only` path reads the weights from
ZeRO-3 optimizer files instead (see docs/CONVERSION.md). Vocabulary rows are padded (with zeros)
to the target TP's `padded_vocab_size`. Everything is written under a temporary name and renamed
into place when complete.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil

import torch

from pretrain.atomic import make_temp_folder
from pretrain.checkpoint.format import (
    LATEST_FILE,
    MEGATRON_LATEST_FILE,
    META_FILE,
    build_metadata,
    tag_for,
)
from pretrain.checkpoint.pipeline_layers import layer_name_prefix
from pretrain.convert.state_dict import pad_vocab, parameter_partitions, split_tp
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig

ITERATION = 0  # --finetune restarts at iteration 0 whatever the tag says


def config_for_layout(config: ModelConfig, tp: int) -> ModelConfig:
    """`config` as a run at TP `tp` should give it: MoE under TP with sequence parallelism
    (Megatron's rule; here the faster choice), so the flags printed for the --finetune run
    include it."""
    if config.is_moe and tp > 1 and not config.sequence_parallel:
        return dataclasses.replace(config, sequence_parallel=True)
    return config


def _metadata(config: ModelConfig, tp: int, pp: int, tokenizer: dict | None, source: str) -> dict:
    return build_metadata(
        iteration=ITERATION,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        model=config,
        parallel=ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp
        ),
        pipeline_engine=pp > 1,
        tokenizer=tokenizer or {},
        weights_only=True,
        converted_from=source,
    )


def _engine_record(module: dict | None, mp_world_size: int) -> dict:
    """The DeepSpeed model-state file's fields that `load_checkpoint(load_module_only=True)` reads."""
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "lr_scheduler": None,
        "param_shapes": None,
        "skipped_steps": 0,
        "global_steps": ITERATION,
        "global_samples": 0,
        "dp_world_size": 1,
        "mp_world_size": mp_world_size,
        "ds_version": importlib.metadata.version("deepspeed"),
        "iteration": ITERATION,
    }


def _pipeline_layers(
    shard: dict[str, torch.Tensor], num_layers: int
) -> dict[int, dict[str, torch.Tensor]]:
    """One TP rank's full-model names -> {pipeline layer index: that layer's state dict}."""

    layers: dict[int, dict] = {}
    for index in range(num_layers + 2):
        prefix = layer_name_prefix(index, num_layers)
        layers[index] = {k[len(prefix) :]: v for k, v in shard.items() if k.startswith(prefix)}
    return layers


def _save(obj, path: str) -> None:
    """`torch.save` through a Python file: a failed write (full disk, file-size limit) is then an
    `OSError` with its errno (torch's own file writer reports only `iostream error`)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def _write_step_dir(
    step_dir: str, full: dict, config: ModelConfig, tp: int, pp: int, expert_tp: int
) -> None:
    partitions = parameter_partitions(config, expert_tp)
    shards = split_tp(pad_vocab(full, config.padded_vocab_size(tp)), partitions, tp)
    if pp == 1:
        for t, shard in enumerate(shards):
            _save(
                _engine_record(shard, tp),
                os.path.join(step_dir, f"mp_rank_{t:02d}_model_states.pt"),
            )
        return
    for r in range(pp * tp):
        _save(
            _engine_record(None, pp * tp),
            os.path.join(step_dir, f"mp_rank_{r:02d}_model_states.pt"),
        )
    for t, shard in enumerate(shards):
        for index, layer in _pipeline_layers(shard, config.num_layers).items():
            _save(layer, os.path.join(step_dir, f"layer_{index:02d}-model_{t:02d}-model_states.pt"))


def write_checkpoint(
    out_dir: str,
    full: dict[str, torch.Tensor],
    config: ModelConfig,
    tp: int = 1,
    pp: int = 1,
    tokenizer: dict | None = None,
    source: str = "",
    expert_tp: int | None = None,
) -> str:
    """Write `full` (unpadded, TP = 1 names) as a --finetune checkpoint at (tp, pp), MoE experts
    split over `expert_tp` (1 or tp; None = tp, as --expert-tensor-parallel-size defaults);
    returns out_dir."""
    expert_tp = tp if expert_tp is None else expert_tp
    if expert_tp not in (1, tp):
        raise UserError(
            f"--target-expert-tensor-parallel-size {expert_tp}: training supports 1 or the "
            f"tensor-parallel size {tp}"
        )
    config.validate(tp, pp, etp=expert_tp)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise UserError(
            f"{out_dir} exists and is not empty (choose a new directory; nothing was written)"
        )
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = make_temp_folder(parent, f".{os.path.basename(os.path.abspath(out_dir))}.partial.")
    try:
        tag = tag_for(ITERATION)
        step_dir = os.path.join(tmp, tag)
        os.makedirs(step_dir)
        _write_step_dir(step_dir, full, config, tp, pp, expert_tp)
        with open(os.path.join(step_dir, META_FILE), "w") as f:
            json.dump(_metadata(config, tp, pp, tokenizer, source), f, indent=2)
        with open(os.path.join(tmp, LATEST_FILE), "w") as f:
            f.write(tag)
        with open(os.path.join(tmp, MEGATRON_LATEST_FILE), "w") as f:
            f.write(str(ITERATION))
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
