"""Whether this run can resume a checkpoint, and how: the refusals (one line each: another
model; another backend, precision, TP/PP/EP, padded vocabulary or ZeRO split without a
layout-independent state to cross it) and the choice between the backend's own files and the
full state (`relayout_possible`). Everything here reads the checkpoint through one record,
`pretrain.checkpoint.format.ResumeRecord`; docs/CHECKPOINTS.md, "Loading", has the rules."""

from __future__ import annotations

from pretrain.checkpoint.format import ResumeRecord, check_same_model, resume_record
from pretrain.checkpoint.full_state import has_full_state
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.training.checkpoints.checkpointing import CheckpointConfig

RELAYOUT_HINT = (
    "export it with tools/convert_to_hf.py, re-import it with tools/convert_from_hf.py "
    "--target-tensor-parallel-size T --target-pipeline-parallel-size P and start with --finetune "
    "(docs/CONVERSION.md)"
)


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
