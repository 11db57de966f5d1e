"""Checkpoints: DeepSpeed's files plus what DeepSpeed leaves out, committed atomically.

Layout (details in docs/CHECKPOINTS.md):

    <save>/latest                                   "global_step<N>", written last (rename)
    <save>/latest_checkpointed_iteration.txt        "<N>" (Megatron's name, same commit point)
    <save>/global_step<N>/                          DeepSpeed's files for every rank
    <save>/global_step<N>/rng_state_<rank>.pt       python/numpy/torch/CUDA/TP-dropout RNG per rank
    <save>/global_step<N>/pretrain_meta.json        our metadata (model, layout, iteration, samples)

Commit protocol: every rank writes its DeepSpeed files and RNG state, all ranks meet at a
barrier, rank 0 writes `pretrain_meta.json` and then replaces `latest` (write to a temporary
name, fsync, rename). A process killed at any point before the rename leaves `latest` naming the
previous complete checkpoint, which is what `--load` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pretrain.arguments import Config
from pretrain.atomic import atomic_write_bytes
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.random import get_tensor_parallel_rng
from pretrain.training.logging import logger

if TYPE_CHECKING:  # the engine module imports deepspeed, which must wait for the launch environment
    from pretrain.training.engine import Engine

FORMAT_VERSION = 1
META_FILE = "pretrain_meta.json"
LATEST_FILE = "latest"
MEGATRON_LATEST_FILE = "latest_checkpointed_iteration.txt"
RELAYOUT_HINT = (
    "export it with tools/convert_to_hf.py, re-import it with tools/convert_from_hf.py "
    "--target-tensor-parallel-size T --target-pipeline-parallel-size P and start with --finetune "
    "(docs/CONVERSION.md)"
)
# Test hook: kill this process with SIGKILL after the checkpoint files are written and before
# `latest` is replaced, the worst moment for a crash (see tests/test_training_checkpoint.py).
CRASH_BEFORE_COMMIT_ENV = "PRETRAIN_TEST_SIGKILL_BEFORE_COMMIT"


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def tag_for(iteration: int) -> str:
    return f"global_step{iteration}"


def _rng_state() -> dict:
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tensor_parallel": get_tensor_parallel_rng().get_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def restore_rng_state(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    get_tensor_parallel_rng().set_state(rng["tensor_parallel"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


def _json_safe(value):
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def build_metadata(cfg: Config, engine: Engine, ts: TrainState) -> dict:
    par = cfg.parallel
    return {
        "format_version": FORMAT_VERSION,
        "iteration": ts.iteration,
        "consumed_train_samples": ts.consumed_train_samples,
        "consumed_valid_samples": ts.consumed_valid_samples,
        "model": _json_safe(dataclasses.asdict(cfg.model)),
        "padded_vocab_size": engine.padded_vocab_size,
        "parallel": {
            "tensor_model_parallel_size": par.tensor_model_parallel_size,
            "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
            "data_parallel_size": par.data_parallel_size,
            "world_size": par.world_size,
            "zero_stage": par.zero_stage,
            "pipeline_engine": engine.pipeline,
        },
        "tokenizer": _json_safe(dataclasses.asdict(cfg.tokenizer)),
        "data": _json_safe(dataclasses.asdict(cfg.data)),
        "training": {
            k: v for k, v in dataclasses.asdict(cfg.training).items() if k != "deepspeed_config"
        },
        "deepspeed_config": engine.ds_config,
        "argv": list(cfg.argv),
    }


def save_checkpoint(cfg: Config, engine: Engine, ts: TrainState) -> str:
    save_dir, tag = cfg.checkpoint.save, tag_for(ts.iteration)
    rank = torch.distributed.get_rank()
    client_state = dataclasses.asdict(ts)
    engine.ds.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    if not cfg.checkpoint.no_save_rng:
        torch.save(_rng_state(), os.path.join(save_dir, tag, f"rng_state_{rank}.pt"))
    torch.distributed.barrier()
    if os.environ.get(CRASH_BEFORE_COMMIT_ENV) == str(ts.iteration) and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        atomic_write_bytes(
            os.path.join(save_dir, tag, META_FILE),
            json.dumps(build_metadata(cfg, engine, ts), indent=2, default=str).encode(),
        )
        atomic_write_bytes(os.path.join(save_dir, LATEST_FILE), tag.encode())
        atomic_write_bytes(os.path.join(save_dir, MEGATRON_LATEST_FILE), str(ts.iteration).encode())
    torch.distributed.barrier()
    logger.info(f"saved checkpoint at iteration {ts.iteration:8d} to {os.path.join(save_dir, tag)}")
    return tag


def read_latest(load_dir: str) -> tuple[str, dict] | None:
    """(tag, metadata) of the newest complete checkpoint in `load_dir`, or None if there is none."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    meta_path = os.path.join(load_dir, tag, META_FILE)
    if not os.path.isfile(meta_path):
        raise UserError(
            f"{path} names {tag}, but {meta_path} is missing (not a checkpoint written by "
            f"pretrain_gpt.py; point --load at one that is)"
        )
    with open(meta_path) as f:
        return tag, json.load(f)


def model_config_from_meta(model: dict) -> ModelConfig:
    """The ModelConfig saved in `pretrain_meta.json` (its "model" entry)."""
    values = {f.name: model[f.name] for f in dataclasses.fields(ModelConfig) if f.name in model}
    if isinstance(values.get("params_dtype"), str):
        values["params_dtype"] = getattr(torch, values["params_dtype"])
    return ModelConfig(**values)


# The shape-deciding model settings, compared as resolved sizes (an explicit --ffn-hidden-size equal to
# the default is the same model): (attribute of ModelConfig, the flag that sets it).
SHAPE_MUST_MATCH = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("query_groups", "--num-query-groups"),
    ("ffn_size", "--ffn-hidden-size"),
    ("head_dim", "--kv-channels"),
    ("position_embedding_type", "--position-embedding-type"),
    ("normalization", "--normalization"),
    ("swiglu", "--swiglu"),
    ("add_bias_linear", "--disable-bias-linear"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("vocab_size", "the tokenizer's vocabulary size"),
)


def check_compatible(cfg: Config, meta: dict, path: str) -> None:
    if meta.get("weights_only") and not cfg.checkpoint.finetune:
        raise UserError(
            f"--load {path}: a weights-only checkpoint (converted, no optimizer or data position); "
            f"start from it with --finetune"
        )
    if meta.get("weights_only") and cfg.parallel.zero_stage == 3:
        raise UserError(
            f"--load {path}: a weights-only (converted) checkpoint cannot start a ZeRO-3 run (DeepSpeed "
            f"reads ZeRO-3 weights from optimizer files it does not have); use --zero-stage 0-2"
        )
    saved_model = model_config_from_meta(meta["model"])
    for attr, flag in SHAPE_MUST_MATCH:
        saved, ours = getattr(saved_model, attr), getattr(cfg.model, attr)
        if saved != ours:
            raise UserError(
                f"--load {path}: the checkpoint has {attr}={saved} but this run has {ours} ({flag}); "
                f"use the checkpoint's model flags"
            )
    saved, par = meta["parallel"], cfg.parallel
    for key, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ):
        if saved[key] != getattr(par, key):
            raise UserError(
                f"--load {path}: the checkpoint was written with {flag} {saved[key]}, this run uses "
                f"{getattr(par, key)}; DeepSpeed checkpoints are split per TP/PP rank: {RELAYOUT_HINT}, "
                f"or run with {flag} {saved[key]}"
            )
    loads_optimizer = not (cfg.checkpoint.finetune or cfg.checkpoint.no_load_optim)
    if (
        saved["data_parallel_size"] != par.data_parallel_size
        and par.zero_stage > 0
        and (loads_optimizer or saved["zero_stage"] == 3 or par.zero_stage == 3)
    ):
        raise UserError(
            f"--load {path}: the checkpoint's ZeRO-{saved['zero_stage']} optimizer state is split over "
            f"{saved['data_parallel_size']} data-parallel ranks, this run has {par.data_parallel_size}: resume with "
            f"--finetune (weights only) or convert it with DeepSpeed's ds_to_universal.py, or launch "
            f"{saved['data_parallel_size'] * par.tensor_model_parallel_size * par.pipeline_model_parallel_size} ranks"
        )


def check_before_launch(cfg: Config) -> None:
    """Refuse an incompatible `--load` before the process group exists (one line, no hang)."""
    found = read_latest(cfg.checkpoint.load)
    if found is not None:
        check_compatible(cfg, found[1], cfg.checkpoint.load)


def load_checkpoint(cfg: Config, engine: Engine) -> tuple[TrainState, dict | None]:
    """Resume from `--load` (its `latest`): (train state, this rank's RNG states or None).

    The caller restores the RNG states with `restore_rng_state` as the last step before training:
    building data loaders draws from the global torch generator.
    """
    ck = cfg.checkpoint
    found = read_latest(ck.load)
    if found is None:
        if ck.finetune:
            raise UserError(
                f"--finetune --load {ck.load}: no `{LATEST_FILE}` file there (point --load at a "
                f"checkpoint directory)"
            )
        logger.warning(
            f"WARNING: no checkpoint in {ck.load} (no `{LATEST_FILE}` file); starting from scratch"
        )
        return TrainState(), None
    tag, _ = found  # compatibility was checked before any process group work (check_before_launch)
    load_path, client_state = engine.ds.load_checkpoint(
        ck.load,
        tag=tag,
        load_optimizer_states=not (ck.finetune or ck.no_load_optim),
        load_lr_scheduler_states=not ck.finetune,
        load_module_only=ck.finetune,
    )
    if load_path is None:
        raise UserError(
            f"--load {ck.load}: DeepSpeed could not load {tag} (files missing; see the warnings above)"
        )
    if ck.finetune:
        logger.info(
            f"loaded weights from {os.path.join(ck.load, tag)} (--finetune: iteration and data restart at 0)"
        )
        return TrainState(), None
    ts = TrainState(**{f.name: int(client_state[f.name]) for f in dataclasses.fields(TrainState)})
    rng_path = os.path.join(ck.load, tag, f"rng_state_{torch.distributed.get_rank()}.pt")
    rng = None
    if not ck.no_load_rng:
        if os.path.isfile(rng_path):
            rng = torch.load(rng_path, weights_only=False)
        else:
            logger.warning(
                f"WARNING: {rng_path} missing (different world size?); RNG states not restored"
            )
    logger.info(
        f"loaded checkpoint {os.path.join(ck.load, tag)} at iteration {ts.iteration} "
        f"({ts.consumed_train_samples} samples consumed)"
    )
    return ts, rng
