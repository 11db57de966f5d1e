"""A checkpoint of any TP, PP and ZeRO stage -> one full, unpadded TP = 1 state dict.

What pretrain_gpt.py writes (pretrain/training/checkpoints/checkpointing.py, docs/CHECKPOINTS.md):

    <save>/latest                                   "global_step<N>"
    <save>/global_step<N>/pretrain_meta.json        model config, parallel layout, tokenizer config
    PP = 1, ZeRO 0-2:  mp_rank_<tp:02>_model_states.pt                 ["module"]: GPTModel names
    PP = 1, ZeRO 3:    zero_pp_rank_<dp>_mp_rank_<tp:02>_{model,optim}_states.pt
                       (the weights exist only as fp32 partitions in the optimizer files)
    PP > 1:            layer_<idx:02>-model_<tp:02>-model_states.pt    one per pipeline layer
    resharded offline: full_state_tp<t:02>_pp<p:02>.pt                 fp32 master weights
                       (tools/reshard_checkpoint.py; pretrain.checkpoint.full_state)
    torch backend:     .metadata + __<rank>_0.distcp (DCP), read through the same full_state
                       files beside them (--use-torch-fsdp2; a checkpoint saved with
                       --no-save-full-state there is refused: it has none)
    MoE at expert-parallel size > 1: the full_state files too (DeepSpeed's files hold data-
                       parallel rank 0's experts only; the full state holds every expert)

An MoE model's state dict has its routers' expert bias (a persistent buffer) besides the
parameters, under the names of docs/MOE.md.

Pipeline layer indices map to GPTModel names through `pretrain.checkpoint.pipeline_layers.layer_name_prefix`
(0 = embedding, 1..L = layers.0..L-1, L+1 = head; with tied embeddings L+2 is the last stage's
copy of the embedding, equal to layer 0's). TP shards are merged along each parameter's
partition dimension (`state_dict.merge_tp`: a contiguous split of the fused QKV already holds
whole query groups; SwiGLU's per-rank [gate_r; up_r] is de-interleaved by its stride of 2).
ZeRO-3 partitions are gathered with DeepSpeed's own `zero_to_fp32` functions, one TP rank at a
time. Weights keep the dtype they were saved in (ZeRO-3: fp32 master weights).
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
from dataclasses import dataclass

import torch

from pretrain.checkpoint import fingerprints, safe_load
from pretrain.checkpoint.format import (
    LATEST_FILE,
    META_FILE,
    available_tags,
    model_config_from_meta,
    read_latest_tag,
    saved_backend,
    tag_for,
)
from pretrain.checkpoint.full_state import FullState
from pretrain.checkpoint.integrity import check_finite
from pretrain.checkpoint.pipeline_layers import layer_name_prefix
from pretrain.checkpoint.relayout import is_full_state_only
from pretrain.convert.state_dict import expert_tp_of, merge_tp, parameter_partitions, trim_vocab
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.tokenizer import TokenizerConfig


@dataclass
class LoadedCheckpoint:
    path: str  # the global_step<N> directory
    iteration: int
    config: ModelConfig
    tokenizer: TokenizerConfig
    meta: dict
    state_dict: dict[str, torch.Tensor]  # full (TP = 1), vocabulary padding removed


def find_checkpoint(load_dir: str, iteration: int | None = None) -> tuple[str, dict]:
    """(global_step directory, metadata) for `load_dir` (a --save directory or one global_step<N>)."""
    if not os.path.isdir(load_dir):
        raise UserError(
            f"--load {load_dir}: no such directory (point it at the --save directory of a training run)"
        )
    if os.path.isfile(os.path.join(load_dir, META_FILE)) and iteration is None:
        step_dir = load_dir
    else:
        if iteration is not None:
            tag = tag_for(iteration)
        elif os.path.isfile(os.path.join(load_dir, LATEST_FILE)):
            tag = read_latest_tag(load_dir)
        else:
            tags = available_tags(load_dir)
            raise UserError(
                f"--load {load_dir}: not a checkpoint directory (no `{LATEST_FILE}` file"
                + (
                    f"; it holds {', '.join(tags)}: pick one with --iteration)"
                    if tags
                    else " and no global_step<N> directories; point --load at a --save directory of "
                    "pretrain_gpt.py)"
                )
            )
        step_dir = os.path.join(load_dir, tag)
        if not os.path.isdir(step_dir):
            tags = available_tags(load_dir)
            raise UserError(
                f"--load {load_dir}: there is no {tag} (available: {', '.join(tags) or 'none'})"
            )
    meta_path = os.path.join(step_dir, META_FILE)
    if not os.path.isfile(meta_path):
        raise UserError(
            f"{step_dir}: no {META_FILE} (not a complete checkpoint written by pretrain_gpt.py; a run "
            f"killed while saving leaves such a directory: use an earlier --iteration)"
        )
    try:
        with open(meta_path) as f:
            return step_dir, json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(
            f"{meta_path}: unreadable ({err}); the checkpoint is damaged, use another --iteration"
        ) from None


def _load(path: str) -> dict:
    """A DeepSpeed/pipeline-layer file, read without running code from it (safe_load)."""
    return safe_load.load(path, deepspeed=True)


def _require(paths: list[str], step_dir: str, what: str) -> None:
    missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if missing:
        raise UserError(
            f"{step_dir}: missing {len(missing)} {what} file(s): {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} (the checkpoint is incomplete; copy every "
            f"rank's files, or use another --iteration)"
        )


def _read_data_parallel_module(step_dir: str, tp: int) -> list[dict]:
    paths = [os.path.join(step_dir, f"mp_rank_{t:02d}_model_states.pt") for t in range(tp)]
    _require(paths, step_dir, "model-state")
    shards = []
    for path in paths:
        module = _load(path).get("module")
        if not module:
            raise UserError(f"{path}: holds no model weights (module is empty)")
        shards.append(dict(module))
    return shards


def _read_zero3(step_dir: str, tp: int, dp: int) -> list[dict]:
    from deepspeed.utils import zero_to_fp32

    shards = []
    for t in range(tp):
        model_files = [
            os.path.join(step_dir, f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt")
            for d in range(dp)
        ]
        optim_files = [
            os.path.join(step_dir, f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")
            for d in range(dp)
        ]
        _require(model_files, step_dir, "ZeRO-3 model-state")
        _require(
            optim_files,
            step_dir,
            "ZeRO-3 optimizer-state (at ZeRO-3 they hold the weights; copy "
            "every rank's files into the checkpoint folder)",
        )
        # zero_to_fp32 unpickles with torch.load(weights_only=False): inside checked_torch_loads
        # each of its reads is safe_load's (the file checked is the file it reads)
        with contextlib.redirect_stdout(io.StringIO()), safe_load.checked_torch_loads():
            states = zero_to_fp32.parse_model_states(model_files)
            stage, world, flat_groups, _ = zero_to_fp32.parse_optim_states(optim_files, step_dir)
            if stage != 3:
                raise UserError(
                    f"{step_dir}: {META_FILE} says ZeRO-3, the optimizer files say ZeRO-{stage}"
                )
            lazy = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(
                world, flat_groups, states, False
            )
            shards.append(zero_to_fp32.to_torch_tensor(lazy))
    return shards


def _read_pipeline(step_dir: str, tp: int, config: ModelConfig) -> list[dict]:

    shards: list[dict] = [{} for _ in range(tp)]
    for index in range(config.num_layers + 2):
        prefix = layer_name_prefix(index, config.num_layers)
        paths = sorted(glob.glob(os.path.join(step_dir, f"layer_{index:02d}-*model_states.pt")))
        if len(paths) != tp:
            raise UserError(
                f"{step_dir}: pipeline layer {index} ({prefix[:-1]}) has {len(paths)} file(s) "
                f"layer_{index:02d}-model_XX-model_states.pt, expected one per tensor-parallel rank "
                f"({tp}); the checkpoint is incomplete (copy every rank's files)"
            )
        for t, path in enumerate(paths):
            shards[t].update({prefix + k: v for k, v in _load(path).items()})
    return shards


def read_checkpoint(load_dir: str, iteration: int | None = None) -> LoadedCheckpoint:
    """The full (TP = 1, unpadded) model of a checkpoint at any TP/PP/ZeRO, with its configs; a
    file that is not the one its step saved (`fingerprints`) is refused before any is read."""
    step_dir, meta = find_checkpoint(load_dir, iteration)
    fingerprints.check(step_dir, meta)  # before any file of the step is opened
    try:
        config = model_config_from_meta(meta["model"])
        par = meta["parallel"]
        tp, pp, zero = (
            par["tensor_model_parallel_size"],
            par["pipeline_model_parallel_size"],
            par["zero_stage"],
        )
        dp = par["data_parallel_size"]
        ep = par.get("expert_model_parallel_size") or 1
        tokenizer = TokenizerConfig(**meta["tokenizer"])
    except (KeyError, TypeError) as err:
        raise UserError(
            f"{os.path.join(step_dir, META_FILE)}: missing or bad entry {err} (not written by this "
            f"version of pretrain_gpt.py?)"
        ) from None
    # tools/reshard_checkpoint.py's output (fp32 master weights only), the torch backend's
    # checkpoints (DCP files, read here through their layout-independent state), and experts
    # split over EP (DeepSpeed's files hold data-parallel rank 0's): the full state
    from_full_state = is_full_state_only(meta) or saved_backend(meta) == "torch" or ep > 1
    if from_full_state:
        state = FullState(step_dir, config.vocab_size)
        shards = [{name: state.entry(name).param for name in state.names()}]
    elif pp > 1:
        shards = _read_pipeline(step_dir, tp, config)
    elif zero == 3:
        shards = _read_zero3(step_dir, tp, dp)
    else:
        shards = _read_data_parallel_module(step_dir, tp)
    partitions = parameter_partitions(config, expert_tp_of(shards[0], config))
    missing, unexpected = partitions.keys() - shards[0].keys(), shards[0].keys() - partitions.keys()
    if missing or unexpected:
        raise UserError(
            f"{step_dir}: the weights do not match the model in {META_FILE}: missing "
            f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    if from_full_state:
        full = shards[0]
    else:
        full = trim_vocab(merge_tp(shards, partitions), config.vocab_size)
    check_finite(full, step_dir)
    return LoadedCheckpoint(step_dir, int(meta.get("iteration", 0)), config, tokenizer, meta, full)
