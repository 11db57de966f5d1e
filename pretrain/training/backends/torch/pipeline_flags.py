"""The pipeline flags, checked before launch: model chunks per pipeline rank
(--num-layers-per-virtual-pipeline-stage N / --num-virtual-stages-per-pipeline-rank V, Megatron's
rules) and --pipeline-schedule (ours: torch.distributed.pipelining's schedules).

Interleaved and zero-bubble schedules run on the torch backend only (DeepSpeed's pipeline engine
runs one chunk per stage, 1F1B). The default schedule is 1F1B, or interleaved 1F1B with more than
one chunk per rank (Megatron's choice). ZBV holds exactly two chunks per rank (its V shape).
Megatron asks PP > 2 for interleaving (unless --overlap-p2p-comm); torch's schedules run it at
PP 2 too, so that is accepted. torch's schedules have their own micro-batch rules, checked for
every batch size of the run: 1F1B needs at least PP micro-batches, the interleaved schedules a
multiple of their rounds (max(1, m // PP)); ZBV takes any number.
"""

from __future__ import annotations

from pretrain.errors import UserError
from pretrain.training.schedules.batch_schedule import BatchSchedule

SCHEDULE_CHOICES = ("1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble")
"""--pipeline-schedule's values, in `pipeline.SCHEDULES` order."""
PER_CHUNK_FLAG = "--num-layers-per-virtual-pipeline-stage"
CHUNKS_FLAG = "--num-virtual-stages-per-pipeline-rank"


def model_chunks(
    *, layers_per_chunk: int | None, chunks: int | None, num_layers: int, pp: int
) -> tuple[int, str | None]:
    """(model chunks per pipeline rank, the flag that set it; None: neither flag, 1 chunk)."""
    if layers_per_chunk is not None and chunks is not None:
        raise UserError(f"{PER_CHUNK_FLAG} and {CHUNKS_FLAG} are exclusive (keep one)")
    per_stage = num_layers // pp
    if layers_per_chunk is not None:
        given, what = f"{PER_CHUNK_FLAG} {layers_per_chunk}", layers_per_chunk
    elif chunks is not None:
        given, what = f"{CHUNKS_FLAG} {chunks}", chunks
    else:
        return 1, None
    if what < 1 or per_stage % what:
        raise UserError(
            f"{given}: the {per_stage} layers per pipeline stage (--num-layers {num_layers} / "
            f"--pipeline-model-parallel-size {pp}) do not divide by it (give a divisor of "
            f"{per_stage})"
        )
    count = per_stage // layers_per_chunk if layers_per_chunk is not None else chunks
    if count > 1 and pp == 1:
        raise UserError(
            f"{given}: {count} model chunks per pipeline rank need --pipeline-model-parallel-size "
            f"> 1 (drop the flag at PP 1)"
        )
    return count, given


def _schedule(given_schedule: str | None, chunks: int, chunks_flag: str | None) -> str:
    """The schedule to run, checked against the chunk count."""
    schedule = given_schedule or ("interleaved-1f1b" if chunks > 1 else "1f1b")
    if schedule == "1f1b" and chunks > 1:
        raise UserError(
            f"--pipeline-schedule 1f1b runs one model chunk per pipeline rank, but {chunks_flag} "
            f"gives {chunks} (use --pipeline-schedule interleaved-1f1b or interleaved-zero-bubble, "
            f"or drop {chunks_flag.split()[0]})"
        )
    if schedule == "zbv-zero-bubble" and chunks != 2:
        raise UserError(
            f"--pipeline-schedule zbv-zero-bubble runs 2 model chunks per pipeline rank (the V "
            f"shape), not {chunks}: add {CHUNKS_FLAG} 2"
        )
    return schedule


def _check_backend(schedule: str, given: str, pp: int, torch_backend: bool) -> None:
    """Interleaved and zero-bubble schedules (`given`: the flag that asks for one) need the
    torch backend and a pipeline."""
    if schedule == "1f1b":
        return
    if not torch_backend:
        raise UserError(
            f"{given}: the {schedule} schedule runs on the torch backend only; add "
            f"--use-torch-fsdp2 (DeepSpeed's pipeline engine runs 1F1B, one chunk per stage)"
        )
    if pp == 1:
        raise UserError(
            f"{given}: a pipeline schedule needs --pipeline-model-parallel-size > 1 (drop the "
            f"flag at PP 1)"
        )


def _check_microbatches(schedule: str, pp: int, counts: set[int]) -> None:
    """torch's micro-batch rules for `schedule` at every micro-batch count of the run."""
    for m in sorted(counts):
        rounds = max(1, m // pp)
        if schedule == "1f1b" and m < pp:
            raise UserError(
                f"--pipeline-schedule 1f1b on the torch backend needs at least "
                f"--pipeline-model-parallel-size {pp} micro-batches per iteration, got {m} "
                f"(raise --global-batch-size, or use --pipeline-schedule interleaved-1f1b)"
            )
        if schedule.startswith("interleaved") and m % rounds:
            raise UserError(
                f"--pipeline-schedule {schedule} with {m} micro-batches per iteration: torch's "
                f"schedule runs them in rounds of PP {pp} and needs a multiple of {rounds} "
                f"(choose --global-batch-size so the micro-batches per iteration are a multiple "
                f"of {pp}, or fewer than {2 * pp})"
            )


def resolve_pipeline_flags(
    *,
    schedule: str | None,
    layers_per_chunk: int | None,
    chunks: int | None,
    num_layers: int,
    pp: int,
    torch_backend: bool,
    batches: BatchSchedule,
    train_samples: int,
) -> dict:
    """The ParallelConfig fields `pipeline_schedule` and `virtual_pipeline_stages`; a flag the
    run cannot honour is one UserError naming it and the fix."""
    count, chunks_flag = model_chunks(
        layers_per_chunk=layers_per_chunk, chunks=chunks, num_layers=num_layers, pp=pp
    )
    resolved = _schedule(schedule, count, chunks_flag)
    given = f"--pipeline-schedule {schedule}" if schedule else chunks_flag
    _check_backend(resolved, given, pp, torch_backend)
    if torch_backend and pp > 1:
        per_step = batches.micro_batch_size * batches.data_parallel_size
        sizes = {batches.global_batch_size} | {b for _, b in batches.iterations(0, train_samples)}
        _check_microbatches(resolved, pp, {size // per_step for size in sizes})
    return {"pipeline_schedule": resolved, "virtual_pipeline_stages": count}
