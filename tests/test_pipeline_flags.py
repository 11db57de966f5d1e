"""The pipeline flags before launch: model chunks per rank (Megatron's virtual-pipeline flags and
divisibility rules), --pipeline-schedule, and the one-line refusals (no torch backend, a chunk
count the schedule cannot run, a micro-batch count torch's schedule cannot run)."""

from __future__ import annotations

import re

import pytest
from training_fixtures import make_corpus, model_flags, train_flags

from pretrain.cli import parse_args
from pretrain.errors import UserError

TWO_RANKS = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
PP2 = ["--pipeline-model-parallel-size", "2"]
TORCH = ["--use-torch-fsdp2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return make_corpus(tmp_path_factory.mktemp("pipeline_flags") / "corpus")


def parallel(corpus: str, *extra: str, gbs: int = 8, env=TWO_RANKS):
    """The ParallelConfig of a 4-layer GPT-2 (micro-batch 2) under these flags."""
    argv = model_flags("gpt2", layers=4) + train_flags(corpus, iters=4, gbs=gbs) + list(extra)
    return parse_args(argv, env=env).parallel


def refused(corpus: str, *extra: str, gbs: int = 8, env=TWO_RANKS) -> str:
    with pytest.raises(UserError) as err:
        parallel(corpus, *extra, gbs=gbs, env=env)
    line = str(err.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize(
    "flags, schedule, chunks",
    [
        ([], "1f1b", 1),
        (["--num-layers-per-virtual-pipeline-stage", "2"], "1f1b", 1),  # 4 layers / PP 2
        (["--num-virtual-stages-per-pipeline-rank", "1"], "1f1b", 1),
        (["--pipeline-schedule", "1f1b"], "1f1b", 1),
    ],
)
def test_one_chunk_per_stage_runs_on_either_backend(corpus, flags, schedule, chunks):
    for backend in ([], TORCH):
        got = parallel(corpus, *PP2, *backend, *flags)
        assert (got.pipeline_schedule, got.virtual_pipeline_stages) == (schedule, chunks)


@pytest.mark.parametrize(
    "flags, schedule, chunks",
    [
        (["--num-layers-per-virtual-pipeline-stage", "1"], "interleaved-1f1b", 2),
        (["--num-virtual-stages-per-pipeline-rank", "2"], "interleaved-1f1b", 2),
        (
            [
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--pipeline-schedule",
                "zbv-zero-bubble",
            ],
            "zbv-zero-bubble",
            2,
        ),
        (["--pipeline-schedule", "interleaved-zero-bubble"], "interleaved-zero-bubble", 1),
    ],
)
def test_the_torch_backend_takes_interleaved_and_zero_bubble_schedules(
    corpus, flags, schedule, chunks
):
    got = parallel(corpus, *PP2, *TORCH, *flags)
    assert (got.pipeline_schedule, got.virtual_pipeline_stages) == (schedule, chunks)


def test_deepspeed_refuses_them_naming_use_torch_fsdp2(corpus):
    for flags in (
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        ["--num-virtual-stages-per-pipeline-rank", "2"],
        ["--pipeline-schedule", "interleaved-zero-bubble"],
    ):
        line = refused(corpus, *PP2, *flags)
        assert line.startswith(f"{flags[0]} ") and "add --use-torch-fsdp2" in line, line


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--num-layers-per-virtual-pipeline-stage", "3"],
            "--num-layers-per-virtual-pipeline-stage 3: the 2 layers per pipeline stage "
            "(--num-layers 4 / --pipeline-model-parallel-size 2) do not divide by it",
        ),
        (
            ["--num-virtual-stages-per-pipeline-rank", "4"],
            "--num-virtual-stages-per-pipeline-rank 4: the 2 layers per pipeline stage",
        ),
        (
            [
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "are exclusive (keep one)",
        ),
        (
            ["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "1f1b"],
            "--pipeline-schedule 1f1b runs one model chunk per pipeline rank, but "
            "--num-virtual-stages-per-pipeline-rank 2 gives 2",
        ),
        (
            ["--pipeline-schedule", "zbv-zero-bubble"],
            "--pipeline-schedule zbv-zero-bubble runs 2 model chunks per pipeline rank (the V "
            "shape), not 1: add --num-virtual-stages-per-pipeline-rank 2",
        ),
    ],
)
def test_megatrons_divisibility_rules_and_the_schedules_chunks(corpus, flags, message):
    assert refused(corpus, *PP2, *TORCH, *flags).startswith(message)


def test_chunks_need_a_pipeline(corpus):
    one_rank = {**TWO_RANKS, "WORLD_SIZE": "1"}
    for flag in (
        "--num-virtual-stages-per-pipeline-rank",
        "--num-layers-per-virtual-pipeline-stage",
    ):
        line = refused(corpus, flag, "2", *TORCH, env=one_rank)  # 4 layers: 2 chunks either way
        assert line.startswith(
            f"{flag} 2: 2 model chunks per pipeline rank need --pipeline-model-parallel-size > 1"
        ), line


def test_torch_schedules_micro_batch_rules(corpus):
    # micro-batch 2 at DP 1: --global-batch-size 2 gives 1 micro-batch, 10 gives 5
    line = refused(corpus, *PP2, *TORCH, gbs=2)
    assert line.startswith(
        "--pipeline-schedule 1f1b on the torch backend needs at least "
        "--pipeline-model-parallel-size 2 micro-batches per iteration, got 1"
    )
    assert parallel(corpus, *PP2, gbs=2).pipeline_schedule == "1f1b"  # DeepSpeed's engine runs it
    interleaved = ["--num-virtual-stages-per-pipeline-rank", "2"]
    line = refused(corpus, *PP2, *TORCH, *interleaved, gbs=10)
    assert re.match(
        r"--pipeline-schedule interleaved-1f1b with 5 micro-batches per iteration: .* needs a "
        r"multiple of 2 ",
        line,
    ), line
    for gbs in (2, 6, 8):  # 1, 3 (fewer than 2 PP) and 4 micro-batches run
        assert parallel(corpus, *PP2, *TORCH, *interleaved, gbs=gbs).virtual_pipeline_stages == 2
    zbv = [*interleaved, "--pipeline-schedule", "zbv-zero-bubble"]
    assert parallel(corpus, *PP2, *TORCH, *zbv, gbs=10).pipeline_schedule == "zbv-zero-bubble"
