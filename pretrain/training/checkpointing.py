"""Saving and resuming training: DeepSpeed's files plus what DeepSpeed leaves out, committed last.

The format (file names, tags, `latest`, metadata) is `pretrain.checkpoint.format`; this module
adds the when (`Checkpointer.should_save`) and the how for a live DeepSpeed engine.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pretrain.atomic import atomic_write_bytes
from pretrain.checkpoint import safe_load
from pretrain.checkpoint.format import (
    LATEST_FILE,
    MEGATRON_LATEST_FILE,
    META_FILE,
    build_metadata,
    check_same_model,
    read_latest,
    refuse_foreign_checkpoint,
    tag_for,
)
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.random import get_tensor_parallel_rng
from pretrain.testing_hooks import SIGKILL_BEFORE_COMMIT, kill_here
from pretrain.training.logging import logger
from pretrain.training.state import TrainState

if TYPE_CHECKING:  # the engine module imports deepspeed, which must wait for the launch environment
    from pretrain.training.engine import Engine

RELAYOUT_HINT = (
    "export it with tools/convert_to_hf.py, re-import it with tools/convert_from_hf.py "
    "--target-tensor-parallel-size T --target-pipeline-parallel-size P and start with --finetune "
    "(docs/CONVERSION.md)"
)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints go, how often, and what a resume restores (Megatron's flags)."""

    save: str | None = None
    """Folder to write checkpoints into (--save)."""
    load: str | None = None
    """Folder to resume from, at its `latest` (--load)."""
    save_interval: int | None = None
    """Save after every this many iterations (--save-interval)."""
    no_save_rng: bool = False
    """Do not save per-rank RNG states (--no-save-rng)."""
    no_load_optim: bool = False
    """Resume weights and position but not the optimizer state (--no-load-optim)."""
    no_load_rng: bool = False
    """Do not restore RNG states (--no-load-rng)."""
    finetune: bool = False
    """Load weights only; iteration and data restart at 0 (--finetune)."""


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
    """Put this rank's saved python/numpy/torch/CUDA/TP-dropout generator states back."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    get_tensor_parallel_rng().set_state(rng["tensor_parallel"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


class Checkpointer:
    """Decides when to save (`should_save`) and saves a live engine, committing `latest` last.

    `run_record` is stored in every checkpoint's metadata beside the model and layout (the
    tokenizer, data and training settings, data fingerprints, argv), so a checkpoint says how it
    was made; `tokens_seen(consumed_samples)` adds the training tokens read per data prefix.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        model: ModelConfig,
        parallel: ParallelConfig,
        tokenizer: dict,
        run_record: dict,
        tokens_seen: Callable[[int], dict[str, int]] | None = None,
    ):
        self.config, self.model, self.parallel = config, model, parallel
        self.tokenizer, self.run_record = tokenizer, run_record
        self.tokens_seen = tokens_seen
        self.last_saved: int | None = None

    def should_save(self, iteration: int) -> bool:
        """True at every --save-interval iteration (with --save)."""
        c = self.config
        return bool(c.save and c.save_interval and iteration % c.save_interval == 0)

    def save_if_unsaved(self, engine: Engine, train_state: TrainState) -> None:
        """Save at exit unless this iteration was just saved (or --save is not given)."""
        if self.config.save and self.last_saved != train_state.iteration:
            self.save(engine, train_state)

    def save(self, engine: Engine, train_state: TrainState) -> str:
        """Write the checkpoint for `train_state.iteration` on every rank; returns its tag."""
        save_dir, tag = self.config.save, tag_for(train_state.iteration)
        rank = torch.distributed.get_rank()
        engine.ds.save_checkpoint(
            save_dir, tag=tag, client_state=dataclasses.asdict(train_state), save_latest=False
        )
        if not self.config.no_save_rng:
            torch.save(_rng_state(), os.path.join(save_dir, tag, f"rng_state_{rank}.pt"))
        torch.distributed.barrier()
        if rank == 0:
            kill_here(SIGKILL_BEFORE_COMMIT, train_state.iteration)
            meta = build_metadata(
                iteration=train_state.iteration,
                consumed_train_samples=train_state.consumed_train_samples,
                consumed_valid_samples=train_state.consumed_valid_samples,
                model=self.model,
                parallel=self.parallel,
                pipeline_engine=engine.pipeline,
                tokenizer=self.tokenizer,
                deepspeed_config=engine.ds_config,
                tokens_seen=(
                    None
                    if self.tokens_seen is None
                    else self.tokens_seen(train_state.consumed_train_samples)
                ),
                **self.run_record,
            )
            atomic_write_bytes(
                os.path.join(save_dir, tag, META_FILE),
                json.dumps(meta, indent=2, default=str).encode(),
            )
            atomic_write_bytes(os.path.join(save_dir, LATEST_FILE), tag.encode())
            atomic_write_bytes(
                os.path.join(save_dir, MEGATRON_LATEST_FILE), str(train_state.iteration).encode()
            )
        torch.distributed.barrier()
        self.last_saved = train_state.iteration
        logger.info(
            f"saved checkpoint at iteration {train_state.iteration:8d} to "
            f"{os.path.join(save_dir, tag)}"
        )
        return tag


def check_compatible(
    config: CheckpointConfig, model: ModelConfig, parallel: ParallelConfig, meta: dict, path: str
) -> None:
    """Refuse (one line) a checkpoint this run cannot resume: another model, TP/PP, or a ZeRO
    optimizer state split over another number of data-parallel ranks."""
    if meta.get("weights_only") and not config.finetune:
        raise UserError(
            f"--load {path}: a weights-only checkpoint (converted, no optimizer or data position); "
            f"start from it with --finetune"
        )
    if meta.get("weights_only") and parallel.zero_stage == 3:
        raise UserError(
            f"--load {path}: a weights-only (converted) checkpoint cannot start a ZeRO-3 run "
            f"(DeepSpeed reads ZeRO-3 weights from optimizer files it does not have); use "
            f"--zero-stage 0-2"
        )
    check_same_model(meta, model, path)
    saved = meta["parallel"]
    for key, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ):
        if saved[key] != getattr(parallel, key):
            raise UserError(
                f"--load {path}: the checkpoint was written with {flag} {saved[key]}, this run uses "
                f"{getattr(parallel, key)}; DeepSpeed checkpoints are split per TP/PP rank: "
                f"{RELAYOUT_HINT}, or run with {flag} {saved[key]}"
            )
    padded = model.padded_vocab_size(parallel.tensor_model_parallel_size)
    if meta.get("padded_vocab_size", padded) != padded:
        raise UserError(
            f"--load {path}: the checkpoint's embedding has {meta['padded_vocab_size']} rows "
            f"(padded vocabulary), this run pads to {padded} (--make-vocab-size-divisible-by "
            f"{model.make_vocab_size_divisible_by}); use the checkpoint's "
            f"--make-vocab-size-divisible-by {meta['model'].get('make_vocab_size_divisible_by')}"
        )
    loads_optimizer = not (config.finetune or config.no_load_optim)
    dp = parallel.data_parallel_size
    if (
        saved["data_parallel_size"] != dp
        and parallel.zero_stage > 0
        and (loads_optimizer or saved["zero_stage"] == 3 or parallel.zero_stage == 3)
    ):
        ranks = (
            saved["data_parallel_size"]
            * parallel.tensor_model_parallel_size
            * parallel.pipeline_model_parallel_size
        )
        raise UserError(
            f"--load {path}: the checkpoint's ZeRO-{saved['zero_stage']} optimizer state is split "
            f"over {saved['data_parallel_size']} data-parallel ranks, this run has {dp}: resume "
            f"with --finetune (weights only) or convert it with DeepSpeed's ds_to_universal.py, or "
            f"launch {ranks} ranks"
        )


def check_before_launch(
    config: CheckpointConfig, model: ModelConfig, parallel: ParallelConfig
) -> None:
    """Refuse an incompatible `--load` before the process group exists (one line, no hang)."""
    refuse_foreign_checkpoint(config.load)
    found = read_latest(config.load)
    if found is not None:
        check_compatible(config, model, parallel, found[1], config.load)


def load_checkpoint(config: CheckpointConfig, engine: Engine) -> tuple[TrainState, dict | None]:
    """Resume from `--load` (its `latest`): (train state, this rank's RNG states or None).

    The caller restores the RNG states with `restore_rng_state` as the last step before training:
    building data loaders draws from the global torch generator.
    """
    found = read_latest(config.load)
    if found is None:
        if config.finetune:
            raise UserError(
                f"--finetune --load {config.load}: no `{LATEST_FILE}` file there (point --load at a "
                f"checkpoint directory)"
            )
        logger.warning(
            f"WARNING: no checkpoint in {config.load} (no `{LATEST_FILE}` file); starting from "
            f"scratch"
        )
        return TrainState(), None
    tag, _ = found  # compatibility was checked before any process group work (check_before_launch)
    load_path, client_state = engine.ds.load_checkpoint(
        config.load,
        tag=tag,
        load_optimizer_states=not (config.finetune or config.no_load_optim),
        load_lr_scheduler_states=not config.finetune,
        load_module_only=config.finetune,
    )
    if load_path is None:
        raise UserError(
            f"--load {config.load}: DeepSpeed could not load {tag} (files missing; see the warnings "
            f"above)"
        )
    if config.finetune:
        logger.info(
            f"loaded weights from {os.path.join(config.load, tag)} (--finetune: iteration and data "
            f"restart at 0)"
        )
        return TrainState(), None
    train_state = TrainState(
        **{f.name: int(client_state[f.name]) for f in dataclasses.fields(TrainState)}
    )
    rng_path = os.path.join(config.load, tag, f"rng_state_{torch.distributed.get_rank()}.pt")
    rng = None
    if not config.no_load_rng:
        if os.path.isfile(rng_path):
            rng = safe_load.load(rng_path)  # numpy/torch RNG states only; no pickled code runs
        else:
            logger.warning(
                f"WARNING: {rng_path} missing (different world size?); RNG states not restored"
            )
    logger.info(
        f"loaded checkpoint {os.path.join(config.load, tag)} at iteration {train_state.iteration} "
        f"({train_state.consumed_train_samples} samples consumed)"
    )
    return train_state, rng
