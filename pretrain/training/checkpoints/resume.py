"""Resuming training: which step `--load` takes, whether this run can take it, and loading it.

Before the process group exists, `check_before_launch` picks the step
(`pretrain.checkpoint.integrity`) and refuses, in one line, one this run cannot resume (another
model; another layout without a layout-independent state: `compatible.py`). After the engine is built,
`load_checkpoint` loads it: at the saved layout through DeepSpeed's own load, at any other (or
from a `tools/reshard_checkpoint.py` output) through the full state
(`Engine.load_full_state`). Damaged files and NaN/Inf tensors are one line on every rank.
docs/CHECKPOINTS.md, "Loading", has the rules.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

import numpy as np
import torch

from pretrain.checkpoint import fingerprints, safe_load
from pretrain.checkpoint.agreement import disagreement, layout_disagreement
from pretrain.checkpoint.format import (
    LATEST_FILE,
    ResumeRecord,
    refuse_foreign_checkpoint,
    resume_record,
)
from pretrain.checkpoint.full_state import shard_payloads
from pretrain.checkpoint.integrity import Choice, check_finite
from pretrain.checkpoint.load_target import choose_load
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.random import get_tensor_parallel_rng
from pretrain.training.checkpoints import scheduler_resume
from pretrain.training.checkpoints.checkpoint_writes import agree
from pretrain.training.checkpoints.checkpointing import CheckpointConfig
from pretrain.training.checkpoints.compatible import check_compatible, relayout_possible
from pretrain.training.report.logging import logger
from pretrain.training.state import TrainState

if TYPE_CHECKING:
    from pretrain.training.engine import Engine


def restore_rng_state(rng: dict) -> None:
    """Put this rank's saved python/numpy/torch/CUDA/TP-dropout generator states back."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    get_tensor_parallel_rng().set_state(rng["tensor_parallel"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


def check_before_launch(
    config: CheckpointConfig,
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: str | None = None,
) -> Choice | None:
    """Pick the step `--load` resumes from and refuse an incompatible or damaged one, before the
    process group exists (one line on every rank, no hang). `precision`: this run's ("bf16",
    "fp16", "fp32"; None: not compared). None: nothing to load."""
    refuse_foreign_checkpoint(config.load)
    choice = choose_load(config.load, config.save)
    if choice is not None:
        step_dir = os.path.join(load_folder(config, choice), choice.tag)
        relayout = relayout_possible(step_dir, resume_record(choice.meta), parallel, precision)
        check_compatible(config, model, parallel, choice.meta, config.load, relayout, precision)
    return choice


def load_folder(config: CheckpointConfig, choice: Choice) -> str:
    """The folder holding the chosen step: --load, or its parent when --load named the step."""
    return choice.folder or config.load


def _fresh_start(config: CheckpointConfig) -> str:
    """The one line saying why a run with --load starts from scratch (--load is --save: any other
    --load without a checkpoint was refused by `choose_load`)."""
    return (
        f"WARNING: --load {config.load}: no checkpoint there (yet); starting from scratch: the "
        f"first launch of a job that resumes itself (--load = --save)"
    )


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
    try:
        for tree, what in engine.state_trees(with_optimizer):
            check_finite(tree, where, what)
    except UserError as err:
        return str(err)
    return None


def _load_rng(
    config: CheckpointConfig, step_dir: str, meta: dict
) -> tuple[dict | None, str | None]:
    """(this rank's RNG states or None, a problem line or None: damaged, or from another step)."""
    path = os.path.join(step_dir, f"rng_state_{torch.distributed.get_rank()}.pt")
    if config.no_load_rng:
        return None, None
    if not os.path.isfile(path):
        logger.warning(f"WARNING: {path} missing (different world size?); RNG states not restored")
        return None, None
    try:
        rng = safe_load.load(path)  # numpy/torch RNG states only; no pickled code runs
    except UserError as err:  # a refused global or a damaged file, in one line
        return None, str(err)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged file
        return None, f"{path}: cannot be read ({type(err).__name__}: {err}); the file is damaged"
    return rng, disagreement(path, rng, meta, step_dir)


def _full_state_problem(step_dir: str, meta: dict) -> str | None:
    """One line naming the first full-state file whose position or TP size is not the step's."""
    for path, payload in shard_payloads(step_dir):
        problem = disagreement(path, payload.get("extra"), meta, step_dir) or layout_disagreement(
            path, payload["tensor_parallel_size"], meta, step_dir
        )
        if problem is not None:
            return problem
    return None


def _refuse_foreign_files(step_dir: str, meta: dict) -> None:
    """Refuse on every rank, in one line naming the file, a step holding a file that is not the
    one it saved (copied in from another step: `fingerprints`), before any rank loads one. The
    ranks share the reads: rank r checks every world-th recorded file."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    problem = agree(fingerprints.mismatch(step_dir, meta, slice(rank, None, world)))
    if problem is not None:
        raise UserError(problem)


def _refuse_pickled_code(step_dir: str) -> None:
    """Refuse on every rank, in one line, a step whose files name a global outside safe_load's
    allowlist, before any rank starts loading (a rank stopped inside DeepSpeed's load would leave
    the others waiting in its collectives). The ranks share the scan: rank r reads the pickle
    (not the tensors) of every world-th file. The loads themselves stay allowlisted."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = sorted(n for n in os.listdir(step_dir) if n.endswith(".pt"))[rank::world]
    problems = (safe_load.refusal(os.path.join(step_dir, n), deepspeed=True) for n in mine)
    problem = agree(next((p for p in problems if p), None))
    if problem is not None:
        raise UserError(problem)


def _carried_words(carried) -> str:
    """ "resharded weights, fp32 master weights, Adam state and LR schedule", each part only where
    it was carried (`reshard.Carried`)."""
    parts = ["resharded weights"]
    parts += ["fp32 master weights"] if carried.fp32_masters else []
    parts += ["Adam state"] if carried.adam_state else []
    parts += ["fp16 loss scale"] if carried.loss_scale else []
    return ", ".join(parts) + " and LR schedule"


def _saved_layout(saved: ResumeRecord) -> str:
    """ "TP2 PP1 DP2 ZeRO-1", or "TP2 PP2 by tools/reshard_checkpoint.py", for the log line."""
    layout = f"TP{saved.tensor_model_parallel_size} PP{saved.pipeline_model_parallel_size} "
    if saved.full_state_only:
        return layout + "by tools/reshard_checkpoint.py"
    return layout + f"DP{saved.data_parallel_size} {saved.sharding}"


def _load_relayout(
    config: CheckpointConfig, engine: Engine, step_dir: str, meta: dict
) -> tuple[TrainState, None]:
    """Resume a checkpoint saved at another layout from its layout-independent state."""
    saved = resume_record(meta)
    problem = agree(_full_state_problem(step_dir, meta))
    if problem is not None:
        raise UserError(problem)
    loads_optimizer = not (config.finetune or config.no_load_optim)
    carried = engine.load_full_state(
        step_dir,
        vocab_size=saved.vocab_size,
        with_optimizer=loads_optimizer,
        with_schedule=not config.finetune,  # --finetune starts the schedule at sample 0
    )
    problem = agree(_nonfinite_problem(engine, step_dir, loads_optimizer))
    if problem is not None:
        raise UserError(problem)
    layout = _saved_layout(saved)
    if carried.precision not in (None, engine.precision):
        layout += f" in {carried.precision}, resumed in {engine.precision}"
    if config.finetune:
        logger.info(f"loaded weights from {step_dir} (saved at {layout}; --finetune)")
        return TrainState(), None
    scheduler_resume.resolve(engine.scheduler, config)
    train_state = TrainState.from_checkpoint(meta)
    engine.set_position(train_state.iteration, train_state.consumed_train_samples)
    logger.info(
        f"loaded checkpoint {step_dir} at iteration {train_state.iteration} "
        f"({train_state.consumed_train_samples} samples consumed), saved at {layout}: "
        f"{_carried_words(carried)}; RNG states not restored (another layout): generators stay "
        f"seeded from --seed"
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
        logger.warning(_fresh_start(config))
        return TrainState(), None
    _same_tag_everywhere(config, choice)
    folder = load_folder(config, choice)
    step_dir = os.path.join(folder, choice.tag)
    _refuse_foreign_files(step_dir, choice.meta)
    _refuse_pickled_code(step_dir)
    if parallel is not None and relayout_possible(
        step_dir, resume_record(choice.meta), parallel, engine.precision
    ):
        return _load_relayout(config, engine, step_dir, choice.meta)
    loads_optimizer = not (config.finetune or config.no_load_optim)
    problem, client_state = _load_native(config, engine, folder, choice, loads_optimizer)
    problem = problem or _nonfinite_problem(engine, step_dir, loads_optimizer)
    rng = None
    if problem is None and not config.finetune:
        rng, problem = _load_rng(config, step_dir, choice.meta)
    problem = agree(problem)
    if problem is not None:
        raise UserError(problem)
    if config.finetune:
        logger.info(f"loaded weights from {step_dir} (--finetune: iteration and data restart at 0)")
        return TrainState(), None
    train_state = TrainState.from_checkpoint(client_state)
    # ZeRO loads its optimizer state, with the saved lr, after the LR scheduler: the schedule
    # `resolve` chooses sets the lr again at the loaded position
    scheduler_resume.resolve(engine.scheduler, config)
    logger.info(
        f"loaded checkpoint {step_dir} at iteration {train_state.iteration} "
        f"({train_state.consumed_train_samples} samples consumed)"
    )
    return train_state, rng


def _load_native(
    config: CheckpointConfig, engine: Engine, folder: str, choice: Choice, loads_optimizer: bool
) -> tuple[str | None, dict | None]:
    """Load the backend's own files of the chosen step: (a problem line or None, the saved
    client state); a missing or damaged file, or a position other than the step's, is the
    problem."""
    step_dir = os.path.join(folder, choice.tag)
    try:
        load_path, client_state = engine.load_native(
            folder,
            choice.tag,
            optimizer=loads_optimizer,
            schedule=not config.finetune,
            module_only=config.finetune,
        )
    except UserError as err:  # a refused global or a damaged file, named by safe_load
        return str(err), None
    except Exception as err:  # noqa: BLE001 - a damaged file must be one line, not a traceback
        return (
            f"{step_dir}: cannot be loaded ({type(err).__name__}: {err}); the checkpoint is damaged"
        ), None
    if load_path is None:
        return f"{step_dir}: could not be loaded (files missing; see the warnings above)", None
    return disagreement(load_path, client_state, choice.meta, step_dir), client_state
