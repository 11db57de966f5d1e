"""Saving and resuming training: DeepSpeed's files plus what DeepSpeed leaves out, committed last.

The format (file names, tags, `latest`, metadata) is `pretrain.checkpoint.format`, the
file-system steps of the commit `pretrain.checkpoint.commit`, what "complete" means and which
step `--load` picks `pretrain.checkpoint.integrity`; this module adds the when
(`Checkpointer.should_save`) and the how for a live DeepSpeed engine on every rank.

Save (docs/CHECKPOINTS.md, "Commit protocol"): every rank writes its DeepSpeed files and RNG
state into a hidden temporary folder, each file fsynced; the ranks agree that all writes
succeeded; rank 0 writes the metadata with every file's size, renames the folder into place and
replaces `latest`; a final agreement. A failure on any rank (a full disk) is one line on every
rank, the temporary folder is removed, and the previous checkpoint is untouched. A process
killed at any point leaves `latest` naming a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pretrain.atomic import atomic_write_bytes
from pretrain.checkpoint import safe_load
from pretrain.checkpoint.commit import (
    StepInUse,
    commit_latest,
    directory_size,
    install_step,
    is_protected,
    latest_tag_or_none,
    new_unique,
    prune_steps,
    remove_stale_temporaries,
    write_failure_message,
)
from pretrain.checkpoint.format import (
    FILES_KEY,
    LATEST_FILE,
    META_FILE,
    build_metadata,
    check_same_model,
    refuse_foreign_checkpoint,
    tag_for,
    temporary_name,
)
from pretrain.checkpoint.full_state import has_full_state
from pretrain.checkpoint.integrity import (
    Choice,
    check_finite,
    choose_checkpoint,
    manifest,
)
from pretrain.checkpoint.relayout import is_full_state_only
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.random import get_tensor_parallel_rng
from pretrain.testing_hooks import SIGKILL_BEFORE_COMMIT, armed_save, kill_here, save_event
from pretrain.training.checkpoint_writes import RankFiles, agree
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
    no_save_full_state: bool = False
    """Do not save the layout-independent state (--no-save-full-state): smaller, faster saves
    that resume only at their own TP/PP/DP/ZeRO layout."""
    no_load_optim: bool = False
    """Resume weights and position but not the optimizer state (--no-load-optim)."""
    no_load_rng: bool = False
    """Do not restore RNG states (--no-load-rng)."""
    finetune: bool = False
    """Load weights only; iteration and data restart at 0 (--finetune)."""
    save_total_limit: int | None = None
    """Keep the newest this many complete steps, deleting older ones after each commit
    (--save-total-limit); the step `latest` names is never deleted."""


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


def _bytes_needed(engine: Engine, save_dir: str) -> int:
    """The size of the checkpoint `latest` names, else this rank's weights' bytes (a lower bound)."""
    previous = latest_tag_or_none(save_dir)
    size = directory_size(os.path.join(save_dir, previous)) if previous else 0
    if size:
        return size
    return sum(p.numel() * p.element_size() for p in engine.ds.module.parameters())


class Checkpointer:
    """Decides when to save (`should_save`) and saves a live engine by the commit protocol.

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
        self._cleaned = False

    def should_save(self, iteration: int) -> bool:
        """True at every --save-interval iteration (with --save)."""
        c = self.config
        return bool(c.save and c.save_interval and iteration % c.save_interval == 0)

    def save_if_unsaved(self, engine: Engine, train_state: TrainState) -> None:
        """Save at exit unless this iteration was just saved (or --save is not given)."""
        if self.config.save and self.last_saved != train_state.iteration:
            self.save(engine, train_state)

    def save(self, engine: Engine, train_state: TrainState) -> str | None:
        """Write the checkpoint for `train_state.iteration` on every rank and commit it; returns
        its tag, or None when the step `latest` names already has that tag (it is kept)."""
        iteration = train_state.iteration
        with armed_save(iteration):
            unique = self._begin(iteration)
            self.last_saved = iteration
            if unique is None:
                return None
            tmp_name = temporary_name(tag_for(iteration), "tmp", unique)
            failure = agree(self._write_rank_files(engine, train_state, tmp_name))
            if failure is None and torch.distributed.get_rank() == 0:
                failure = self._commit(engine, train_state, tmp_name, unique)
            failure = agree(failure)
            if failure is not None:
                if torch.distributed.get_rank() == 0:
                    shutil.rmtree(os.path.join(self.config.save, tmp_name), ignore_errors=True)
                raise UserError(failure)
            logger.info(
                f"saved checkpoint at iteration {iteration:8d} to "
                f"{os.path.join(self.config.save, tag_for(iteration))}"
            )
            limit = self.config.save_total_limit
            if limit and torch.distributed.get_rank() == 0:  # only after a newer step committed
                for removed in prune_steps(self.config.save, limit):
                    logger.info(
                        f"removed {os.path.join(self.config.save, removed)} (--save-total-limit)"
                    )
        return tag_for(iteration)

    def _begin(self, iteration: int) -> str | None:
        """Rank 0 prepares the folder and names the save's temporary folder (None: skip);
        every rank gets the same answer."""
        save_dir = self.config.save
        decision: list[str | None] = [None]
        if torch.distributed.get_rank() == 0:
            try:
                os.makedirs(save_dir, exist_ok=True)
            except OSError as err:
                decision = [f"!--save {save_dir}: cannot create it ({err.strerror or err})"]
            else:
                decision = self._decide(iteration)
        torch.distributed.broadcast_object_list(decision, src=0)
        if decision[0] is not None and decision[0].startswith("!"):
            raise UserError(decision[0][1:])
        return decision[0]

    def _decide(self, iteration: int) -> list[str | None]:
        """Rank 0: [the save's unique id], or [None] to keep the step `latest` names."""
        save_dir, tag = self.config.save, tag_for(iteration)
        if not self._cleaned:
            self._cleaned = True
            for name in remove_stale_temporaries(save_dir):
                logger.info(f"removed {os.path.join(save_dir, name)} (left by a killed save)")
        if is_protected(save_dir, tag):
            logger.warning(
                f"WARNING: not saving iteration {iteration}: {os.path.join(save_dir, tag)} is "
                f"the complete checkpoint `latest` names (from an earlier run) and is kept; "
                f"use another --save directory to keep this run's weights"
            )
            return [None]
        return [new_unique()]

    def _write_rank_files(
        self, engine: Engine, train_state: TrainState, tmp_name: str
    ) -> str | None:
        """This rank's DeepSpeed files, RNG state and (unless --no-save-full-state) part of the
        layout-independent state, each fsynced; a failure as one line."""
        save_dir = self.config.save
        files = RankFiles(engine.ds)
        try:
            engine.ds.save_checkpoint(
                save_dir,
                tag=tmp_name,
                client_state=dataclasses.asdict(train_state),
                save_latest=False,
            )
        except OSError as err:  # outside the file writes (DeepSpeed's copy of zero_to_fp32.py)
            files.fail(err.filename or save_dir, err.strerror or str(err))
            torch.distributed.barrier()  # stands in for DeepSpeed's closing barrier it skipped
        finally:
            files.close()
        if not self.config.no_save_rng:
            rank = torch.distributed.get_rank()
            files.write(_rng_state(), os.path.join(save_dir, tmp_name, f"rng_state_{rank}.pt"))
        if not self.config.no_save_full_state:
            from pretrain.training.reshard import save_full_state  # imports deepspeed

            save_full_state(engine, os.path.join(save_dir, tmp_name), files.write)  # a collective
        if files.failure is None:
            return None
        path, reason = files.failure
        return write_failure_message(path, reason, save_dir, _bytes_needed(engine, save_dir))

    def _commit(
        self, engine: Engine, train_state: TrainState, tmp_name: str, unique: str
    ) -> str | None:
        """Rank 0: metadata with the file list, rename into place, commit `latest`; a failure
        as one line."""
        save_dir, iteration = self.config.save, train_state.iteration
        tag, tmp_dir = tag_for(iteration), os.path.join(save_dir, tmp_name)
        kill_here(SIGKILL_BEFORE_COMMIT, iteration)
        meta = build_metadata(
            iteration=iteration,
            consumed_train_samples=train_state.consumed_train_samples,
            consumed_valid_samples=train_state.consumed_valid_samples,
            skipped_train_samples=train_state.skipped_train_samples,
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
            full_state=not self.config.no_save_full_state,
            **self.run_record,
        )
        meta[FILES_KEY] = manifest(tmp_dir)
        try:
            atomic_write_bytes(
                os.path.join(tmp_dir, META_FILE), json.dumps(meta, indent=2, default=str).encode()
            )
            save_event("metadata written")
            install_step(save_dir, tmp_name, tag, unique)
            commit_latest(save_dir, tag)
        except OSError as err:
            return write_failure_message(
                err.filename or save_dir,
                err.strerror or str(err),
                save_dir,
                _bytes_needed(engine, save_dir),
            )
        except StepInUse as err:
            return f"{err}: `latest` names it; not replaced (another run writes into --save?)"
        return None


def _without_full_state(meta: dict) -> str:
    """The reason a checkpoint saved with --no-save-full-state cannot move, for a refusal."""
    if meta.get("full_state", True):
        return ""
    return (
        ", and it was saved with --no-save-full-state: it has no layout-independent state to "
        "resume elsewhere from (resume it at its own layout and save once without that flag to "
        "move it)"
    )


def _check_zero_stage(meta: dict, zero_stage: int, loads_optimizer: bool, path: str) -> None:
    """Refuse a ZeRO stage DeepSpeed's own load cannot cross (any to or from 3; 0 <-> 1/2 with the
    optimizer state: their files differ), rather than fail inside DeepSpeed as a "damaged"
    checkpoint. Only for checkpoints without the full state (with it, any stage resumes)."""
    saved = meta["parallel"]["zero_stage"]
    if saved == zero_stage or {saved, zero_stage} == {1, 2}:
        return
    if 3 not in (saved, zero_stage) and not loads_optimizer:
        return  # the module weights alone are in the same files
    raise UserError(
        f"--load {path}: the checkpoint was written with --zero-stage {saved}, this run uses "
        f"{zero_stage}{_without_full_state(meta)}; DeepSpeed's files differ between these stages: "
        f"run with --zero-stage {saved}"
        + ("" if 3 in (saved, zero_stage) else " (or --no-load-optim: weights and position only)")
    )


def _same_layout(saved: dict, parallel: ParallelConfig) -> bool:
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
    return all(saved[k] == getattr(parallel, k) for k in keys) and saved["zero_stage"] == (
        parallel.zero_stage
    )


def relayout_possible(step_dir: str, meta: dict, parallel: ParallelConfig) -> bool:
    """True when the checkpoint in `step_dir` was saved at another layout and resumes at this one
    through its layout-independent state (pretrain/training/reshard.py), or holds only that
    state (written by tools/reshard_checkpoint.py)."""
    if is_full_state_only(meta):
        return True
    return not _same_layout(meta["parallel"], parallel) and has_full_state(step_dir)


def check_compatible(
    config: CheckpointConfig,
    model: ModelConfig,
    parallel: ParallelConfig,
    meta: dict,
    path: str,
    relayout: bool = False,
) -> None:
    """Refuse (one line) a checkpoint this run cannot resume: another model, or (unless
    `relayout`: it resumes through its full state) another TP/PP, or a ZeRO optimizer state split
    over another number of data-parallel ranks."""
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
    if relayout:
        return
    saved = meta["parallel"]
    for key, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ):
        if saved[key] != getattr(parallel, key):
            raise UserError(
                f"--load {path}: the checkpoint was written with {flag} {saved[key]}, this run uses "
                f"{getattr(parallel, key)}{_without_full_state(meta)}; DeepSpeed checkpoints are "
                f"split per TP/PP rank: "
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
            f"over {saved['data_parallel_size']} data-parallel ranks, this run has {dp}"
            f"{_without_full_state(meta)}: resume "
            f"with --finetune (weights only) or convert it with DeepSpeed's ds_to_universal.py, or "
            f"launch {ranks} ranks"
        )
    _check_zero_stage(meta, parallel.zero_stage, loads_optimizer, path)


def check_before_launch(
    config: CheckpointConfig, model: ModelConfig, parallel: ParallelConfig
) -> Choice | None:
    """Pick the step `--load` resumes from and refuse an incompatible or damaged one, before the
    process group exists (one line on every rank, no hang). None: nothing to load."""
    refuse_foreign_checkpoint(config.load)
    choice = choose_checkpoint(config.load)
    if choice is not None:
        step_dir = os.path.join(config.load, choice.tag)
        relayout = relayout_possible(step_dir, choice.meta, parallel)
        check_compatible(config, model, parallel, choice.meta, config.load, relayout)
    return choice


def _same_tag_everywhere(config: CheckpointConfig, choice: Choice) -> None:
    """Every rank chose from its own view of the folder: refuse if the views differ."""
    tags: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(tags, choice.tag)
    if len(set(tags)) > 1:
        raise UserError(
            f"--load {config.load}: the ranks see different checkpoints ({', '.join(map(str, tags))} "
            f"by rank); is the folder on a file system every node sees the same?"
        )


def _nonfinite_problem(engine: Engine, where: str, with_optimizer: bool) -> str | None:
    """One line naming the first NaN/Inf weight or optimizer-state tensor on this rank, or None."""
    named = dict(engine.ds.module.named_parameters())
    trees = [({k: v.detach() for k, v in named.items()}, "weights")]
    if with_optimizer:
        names = {id(p): n for n, p in named.items()}
        optimizer = engine.ds.optimizer
        base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
        state = {
            names.get(id(param), f"partition{i}"): value
            for i, (param, value) in enumerate(getattr(base, "state", {}).items())
        }
        trees.append((state, "optimizer state"))
        master = getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
        if master is not None:
            trees.append(
                ({f"fp32_partition{i}": t for i, t in enumerate(master)}, "fp32 master weights")
            )
    try:
        for tree, what in trees:
            check_finite(tree, where, what)
    except UserError as err:
        return str(err)
    return None


def _load_rng(config: CheckpointConfig, step_dir: str) -> tuple[dict | None, str | None]:
    """(this rank's RNG states or None, a problem line or None)."""
    path = os.path.join(step_dir, f"rng_state_{torch.distributed.get_rank()}.pt")
    if config.no_load_rng:
        return None, None
    if not os.path.isfile(path):
        logger.warning(f"WARNING: {path} missing (different world size?); RNG states not restored")
        return None, None
    try:
        return safe_load.load(path), None  # numpy/torch RNG states only; no pickled code runs
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged file
        return None, f"{path}: cannot be read ({type(err).__name__}: {err}); the file is damaged"


def _load_relayout(
    config: CheckpointConfig, engine: Engine, step_dir: str, meta: dict
) -> tuple[TrainState, None]:
    """Resume a checkpoint saved at another layout from its layout-independent state."""
    from pretrain.training.reshard import load_full_state  # imports deepspeed

    loads_optimizer = not (config.finetune or config.no_load_optim)
    load_full_state(
        engine, step_dir, vocab_size=meta["model"]["vocab_size"], with_optimizer=loads_optimizer
    )
    problem = agree(_nonfinite_problem(engine, step_dir, loads_optimizer))
    if problem is not None:
        raise UserError(problem)
    saved = meta["parallel"]
    layout = f"TP{saved['tensor_model_parallel_size']} PP{saved['pipeline_model_parallel_size']} "
    if is_full_state_only(meta):
        layout += "by tools/reshard_checkpoint.py"
    else:
        layout += f"DP{saved['data_parallel_size']} ZeRO-{saved['zero_stage']}"
    if config.finetune:
        logger.info(f"loaded weights from {step_dir} (saved at {layout}; --finetune)")
        return TrainState(), None
    train_state = TrainState.from_checkpoint(meta)
    engine.ds.global_steps = train_state.iteration
    engine.ds.global_samples = train_state.consumed_train_samples
    logger.info(
        f"loaded checkpoint {step_dir} at iteration {train_state.iteration} "
        f"({train_state.consumed_train_samples} samples consumed), saved at {layout}: resharded "
        f"weights, fp32 master weights, Adam state and LR schedule; RNG states not restored "
        f"(another layout): generators stay seeded from --seed"
    )
    return train_state, None


def load_checkpoint(
    config: CheckpointConfig,
    engine: Engine,
    choice: Choice | None,
    parallel: ParallelConfig | None = None,
) -> tuple[TrainState, dict | None]:
    """Resume from the step `check_before_launch` chose: (train state, this rank's RNG states or
    None). A file that cannot be loaded, or NaN/Inf in the weights or optimizer state, is one
    line on every rank. Given this run's `parallel` layout, a checkpoint saved at another one
    resumes from its layout-independent state (`_load_relayout`).

    The caller restores the RNG states with `restore_rng_state` as the last step before training:
    building data loaders draws from the global torch generator.
    """
    if choice is None:
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
    _same_tag_everywhere(config, choice)
    step_dir = os.path.join(config.load, choice.tag)
    if parallel is not None and relayout_possible(step_dir, choice.meta, parallel):
        return _load_relayout(config, engine, step_dir, choice.meta)
    loads_optimizer = not (config.finetune or config.no_load_optim)
    problem, client_state = None, None
    try:
        load_path, client_state = engine.ds.load_checkpoint(
            config.load,
            tag=choice.tag,
            load_optimizer_states=loads_optimizer,
            load_lr_scheduler_states=not config.finetune,
            load_module_only=config.finetune,
        )
        if load_path is None:
            problem = (
                f"{step_dir}: DeepSpeed could not load it (files missing; see the warnings above)"
            )
    except Exception as err:  # noqa: BLE001 - a damaged file must be one line, not a traceback
        problem = (
            f"{step_dir}: cannot be loaded ({type(err).__name__}: {err}); the checkpoint is damaged"
        )
    problem = problem or _nonfinite_problem(engine, step_dir, loads_optimizer)
    rng = None
    if problem is None and not config.finetune:
        rng, problem = _load_rng(config, step_dir)
    problem = agree(problem)
    if problem is not None:
        raise UserError(problem)
    if config.finetune:
        logger.info(f"loaded weights from {step_dir} (--finetune: iteration and data restart at 0)")
        return TrainState(), None
    train_state = TrainState.from_checkpoint(client_state)
    logger.info(
        f"loaded checkpoint {step_dir} at iteration {train_state.iteration} "
        f"({train_state.consumed_train_samples} samples consumed)"
    )
    return train_state, rng
