"""Resuming training: which step `--load` takes, whether this run can take it, and loading it.

Before the process group exists, `check_before_launch` picks the step
(`pretrain.checkpoint.integrity`) and refuses, in one line, one this run cannot resume (another
model; another layout without a layout-independent state). After the engine is built,
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
    check_same_model,
    refuse_foreign_checkpoint,
    resume_record,
)
from pretrain.checkpoint.full_state import has_full_state, shard_payloads
from pretrain.checkpoint.integrity import Choice, check_finite
from pretrain.checkpoint.load_target import choose_load
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.random import get_tensor_parallel_rng
from pretrain.training.checkpoints import scheduler_resume
from pretrain.training.checkpoints.checkpoint_writes import agree
from pretrain.training.checkpoints.checkpointing import CheckpointConfig
from pretrain.training.report.logging import logger
from pretrain.training.state import TrainState

if TYPE_CHECKING:
    from pretrain.training.engine import Engine

RELAYOUT_HINT = (
    "export it with tools/convert_to_hf.py, re-import it with tools/convert_from_hf.py "
    "--target-tensor-parallel-size T --target-pipeline-parallel-size P and start with --finetune "
    "(docs/CONVERSION.md)"
)


def restore_rng_state(rng: dict) -> None:
    """Put this rank's saved python/numpy/torch/CUDA/TP-dropout generator states back."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    get_tensor_parallel_rng().set_state(rng["tensor_parallel"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


def _without_full_state(saved: ResumeRecord) -> str:
    """The reason a checkpoint saved with --no-save-full-state cannot move, for a refusal."""
    if saved.full_state:
        return ""
    return (
        ", and it was saved with --no-save-full-state: it has no layout-independent state to "
        "resume elsewhere from (resume it at its own layout and save once without that flag to "
        "move it)"
    )


def _check_zero_stage(
    record: ResumeRecord, zero_stage: int, loads_optimizer: bool, path: str
) -> None:
    """Refuse a ZeRO stage DeepSpeed's own load cannot cross (any to or from 3; 0 <-> 1/2 with the
    optimizer state: their files differ), rather than fail inside DeepSpeed as a "damaged"
    checkpoint. Only for checkpoints without the full state (with it, any stage resumes)."""
    saved = record.zero_stage
    if saved == zero_stage or {saved, zero_stage} == {1, 2}:
        return
    if 3 not in (saved, zero_stage) and not loads_optimizer:
        return  # the module weights alone are in the same files
    raise UserError(
        f"--load {path}: the checkpoint was written with --zero-stage {saved}, this run uses "
        f"{zero_stage}{_without_full_state(record)}; DeepSpeed's files differ between these stages: "
        f"run with --zero-stage {saved}"
        + ("" if 3 in (saved, zero_stage) else " (or --no-load-optim: weights and position only)")
    )


def _check_precision(
    record: ResumeRecord, precision: str | None, finetune: bool, path: str
) -> None:
    """Refuse a precision DeepSpeed's own load cannot cross (its optimizer files differ between
    fp32, bf16 and fp16) rather than fail inside DeepSpeed as a "damaged" checkpoint. Only for
    checkpoints without the full state (with it, any precision resumes)."""
    saved = record.precision
    if precision is None or saved in (None, precision) or finetune:
        return
    raise UserError(
        f"--load {path}: the checkpoint was saved in {saved}, this run uses "
        f"{_precision_flag(precision)}{_without_full_state(record)}; DeepSpeed's optimizer files "
        f"differ between precisions: resume in {_precision_flag(saved)}, or start from its "
        f"weights with --finetune"
    )


def _check_backend(record: ResumeRecord, parallel: ParallelConfig, path: str) -> None:
    """Refuse a checkpoint of the other backend that has no full state (each backend reads
    only its own native files)."""
    saved = record.backend
    if saved == parallel.backend:
        return
    flag = "with --use-torch-fsdp2" if saved == "torch" else "without --use-torch-fsdp2"
    raise UserError(
        f"--load {path}: the checkpoint was written by the {saved} backend{_without_full_state(record)}"
        f"; its native files are that backend's: resume it {flag}"
    )


def _same_layout(saved: ResumeRecord, parallel: ParallelConfig) -> bool:
    """True when the backend's own files resume here: the same backend, TP/PP/DP/ZeRO and the
    experts whole on every data-parallel rank on both sides (at expert-parallel size > 1
    DeepSpeed's files hold data-parallel rank 0's experts only: the full state resumes it)."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
    return (
        all(getattr(saved, k) == getattr(parallel, k) for k in keys)
        and saved.zero_stage == parallel.zero_stage
        and saved.backend == parallel.backend
        and saved.expert_model_parallel_size == parallel.expert_model_parallel_size == 1
    )


def _precision_flag(precision: str) -> str:
    return "fp32 (neither --bf16 nor --fp16)" if precision == "fp32" else f"--{precision}"


def relayout_possible(
    step_dir: str, saved: ResumeRecord, parallel: ParallelConfig, precision: str | None = None
) -> bool:
    """True when the checkpoint in `step_dir` was saved at another layout or (given this run's
    `precision`; None: not compared) in another precision and resumes here through its
    layout-independent state (`Engine.load_full_state`), or holds only that state
    (tools/reshard_checkpoint.py)."""
    if saved.full_state_only:
        return True
    same_precision = precision is None or saved.precision in (None, precision)
    same = _same_layout(saved, parallel) and same_precision
    return not same and has_full_state(step_dir)


def check_compatible(
    config: CheckpointConfig,
    model: ModelConfig,
    parallel: ParallelConfig,
    meta: dict,
    path: str,
    relayout: bool = False,
    precision: str | None = None,
) -> None:
    """Refuse (one line) a checkpoint this run cannot resume: another model, or (unless
    `relayout`: it resumes through its full state) another precision than this run's
    `precision` (None: not compared), another TP/PP, or a ZeRO optimizer state split over another
    number of data-parallel ranks."""
    saved = resume_record(meta)
    _check_weights_only(saved, config, parallel, path)
    check_same_model(meta, model, path)
    if relayout:
        return
    _check_backend(saved, parallel, path)
    _check_precision(saved, precision, config.finetune, path)
    _check_model_parallel(saved, parallel, path)
    _check_padded_vocab(saved, model, parallel, path)
    loads_optimizer = not (config.finetune or config.no_load_optim)
    _check_data_parallel(saved, parallel, loads_optimizer, path)
    _check_zero_stage(saved, parallel.zero_stage, loads_optimizer, path)


def _check_weights_only(
    saved: ResumeRecord, config: CheckpointConfig, parallel: ParallelConfig, path: str
) -> None:
    """A converted (weights-only) checkpoint starts a run with --finetune, never at ZeRO-3."""
    if saved.weights_only and not config.finetune:
        raise UserError(
            f"--load {path}: a weights-only checkpoint (converted, no optimizer or data position); "
            f"start from it with --finetune"
        )
    if saved.weights_only and parallel.zero_stage == 3:
        raise UserError(
            f"--load {path}: a weights-only (converted) checkpoint cannot start a ZeRO-3 run "
            f"(DeepSpeed reads ZeRO-3 weights from optimizer files it does not have); use "
            f"--zero-stage 0-2"
        )


def _check_model_parallel(saved: ResumeRecord, parallel: ParallelConfig, path: str) -> None:
    """The backend's files are split per EP, TP and PP rank: the same sizes, or refused."""
    if max(saved.expert_model_parallel_size, parallel.expert_model_parallel_size) > 1:
        raise UserError(
            f"--load {path}: the checkpoint was written with --expert-model-parallel-size "
            f"{saved.expert_model_parallel_size}, this run uses "
            f"{parallel.expert_model_parallel_size}{_without_full_state(saved)}; DeepSpeed's files "
            f"hold data-parallel rank 0's experts only, so it resumes only through its "
            f"layout-independent state"
        )
    for key, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ):
        if getattr(saved, key) != getattr(parallel, key):
            raise UserError(
                f"--load {path}: the checkpoint was written with {flag} {getattr(saved, key)}, "
                f"this run uses {getattr(parallel, key)}{_without_full_state(saved)}; DeepSpeed "
                f"checkpoints are split per TP/PP rank: "
                f"{RELAYOUT_HINT}, or run with {flag} {getattr(saved, key)}"
            )


def _check_padded_vocab(
    saved: ResumeRecord, model: ModelConfig, parallel: ParallelConfig, path: str
) -> None:
    """The embedding's rows (the padded vocabulary) as this run pads them."""
    padded = model.padded_vocab_size(parallel.tensor_model_parallel_size)
    if saved.padded_vocab_size not in (None, padded):
        raise UserError(
            f"--load {path}: the checkpoint's embedding has {saved.padded_vocab_size} rows "
            f"(padded vocabulary), this run pads to {padded} (--make-vocab-size-divisible-by "
            f"{model.make_vocab_size_divisible_by}); use the checkpoint's "
            f"--make-vocab-size-divisible-by {saved.make_vocab_size_divisible_by}"
        )


def _check_data_parallel(
    saved: ResumeRecord, parallel: ParallelConfig, loads_optimizer: bool, path: str
) -> None:
    """A ZeRO optimizer state (or ZeRO-3's weights) split over another number of data-parallel
    ranks does not load."""
    dp = parallel.data_parallel_size
    if (
        saved.data_parallel_size != dp
        and parallel.zero_stage > 0
        and (loads_optimizer or saved.zero_stage == 3 or parallel.zero_stage == 3)
    ):
        ranks = (
            saved.data_parallel_size
            * parallel.tensor_model_parallel_size
            * parallel.pipeline_model_parallel_size
        )
        raise UserError(
            f"--load {path}: the checkpoint's ZeRO-{saved.zero_stage} optimizer state is split "
            f"over {saved.data_parallel_size} data-parallel ranks, this run has {dp}"
            f"{_without_full_state(saved)}: resume "
            f"with --finetune (weights only) or convert it with DeepSpeed's ds_to_universal.py, or "
            f"launch {ranks} ranks"
        )


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
