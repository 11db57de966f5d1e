"""A stop never abandons a finished step: with --async-save --save-interval 1 (the torch backend,
one rank, real runs of pretrain_gpt.py), the step staged just before a stop is committed first and
the stop's line names it, whatever stops the run:

- a NaN loss (`--lr 1e8 --clip-grad 0`): the finite step before the NaN iteration is committed and
  the `error:` line names it (it used to be left as `.global_stepN.tmp-*`, the line naming N - 1);
- an exception in the step (the test hook PRETRAIN_TEST_RAISE_IN_STEP): the pending step is
  committed before the traceback, and a resume from it trains an uninterrupted run's losses;
- --exit-interval: the exit line names the step a relaunch resumes from, which resumes exactly
  (and on DeepSpeed, whose saves block, the line names its step too).

The exception also at two ranks (DP 2, the deepspeed launcher): the ranks meet on the
checkpointer's stop group before the commit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    deepspeed_cmd,
    make_corpus,
    model_flags,
    multirun_outputs,
    one_rank_multirun,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

from pretrain.launch import free_port
from pretrain.testing_hooks import RAISE_IN_STEP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ITERS, RAISED, EXIT = 5, 3, 3
ASYNC = ["--use-torch-fsdp2", "--async-save", "--save-interval", "1"]


def _flags(corpus: str, metrics: Path, *extra: str) -> list[str]:
    return (
        model_flags("gpt2")
        + train_flags(corpus, iters=ITERS)
        + ["--lr-decay-iters", str(ITERS), "--metrics-file", str(metrics), *extra]
    )


def _one_rank(flags: list[str], **env: str):
    """pretrain_gpt.py as one rank of its own (a run that stops with an error ends its process)."""
    ranks = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    environment = clean_env(**ranks, MASTER_PORT=str(free_port()), **env)
    return run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=400, env=environment)


def _left(ckpt: Path) -> tuple[list[str], str]:
    """(the folders in `ckpt`, temporary ones included; what `latest` names)."""
    return sorted(p.name for p in ckpt.iterdir() if p.is_dir()), (ckpt / "latest").read_text()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The NaN run and the run the hook raises in (each a process of one rank), the raised run
    at two ranks (a launch), then one process: an uninterrupted reference, the --exit-interval
    run, resumes of the raised and exited runs, and DeepSpeed's --exit-interval run."""
    tmp = tmp_path_factory.mktemp("stops")
    corpus = make_corpus(tmp / "corpus")
    nan = _one_rank(
        _flags(corpus, tmp / "nan.jsonl", *ASYNC, "--save", str(tmp / "nan"))
        + ["--lr", "1e8", "--clip-grad", "0"]
    )
    raised = _one_rank(
        _flags(corpus, tmp / "raised.jsonl", *ASYNC, "--save", str(tmp / "raised")),
        **{RAISE_IN_STEP: str(RAISED)},
    )
    raised_dp2 = run(
        deepspeed_cmd(2, _flags(corpus, tmp / "dp2.jsonl", *ASYNC, "--save", str(tmp / "dp2"))),
        timeout=400,
        env=clean_env(**{RAISE_IN_STEP: str(RAISED)}),
    )
    exited = ["--save", str(tmp / "exited"), "--exit-interval", str(EXIT)]
    ds_exited = ["--save", str(tmp / "ds_exited"), "--save-interval", "1"]
    runs = [
        _flags(corpus, tmp / "reference.jsonl", "--use-torch-fsdp2"),
        _flags(corpus, tmp / "exited.jsonl", *ASYNC, *exited),
        _flags(corpus, tmp / "raised_resumed.jsonl", *ASYNC, "--load", str(tmp / "raised"))
        + ["--save", str(tmp / "raised_resumed")],
        _flags(corpus, tmp / "exited_resumed.jsonl", *ASYNC, "--load", str(tmp / "exited"))
        + ["--save", str(tmp / "exited_resumed")],
        _flags(corpus, tmp / "ds_exited.jsonl", *ds_exited, "--exit-interval", str(EXIT)),
    ]
    result = one_rank_multirun(runs, tmp / "runs.json", timeout=600)
    assert result.returncode == 0, result.stdout[-6000:]
    return tmp, nan, (raised, raised_dp2), multirun_outputs(result.stdout)


def _losses(path: Path) -> dict[int, float]:
    return {i: m["lm-loss"] for i, m in read_metrics(path).items() if "lm-loss" in m}


def test_a_nan_stop_commits_the_finite_step_staged_before_it(stopped):
    tmp, nan, *_ = stopped
    assert nan.returncode == 2, nan.stdout[-6000:]
    metrics = read_metrics(tmp / "nan.jsonl")
    bad = min(i for i, m in metrics.items() if not math.isfinite(m["lm-loss"]))
    assert bad >= 2, metrics  # a finite step was staged before the NaN iteration
    assert _left(tmp / "nan") == (
        [f"global_step{i}" for i in range(1, bad)],
        f"global_step{bad - 1}",
    )
    errors = [line for line in nan.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: iteration {bad}: loss is nan")
    assert f"resume from the last checkpoint, {tmp / 'nan' / f'global_step{bad - 1}'} " in errors[0]


def test_an_exception_in_the_step_commits_the_pending_step_which_resumes_exactly(stopped):
    tmp, _, (raised, _), outputs = stopped
    assert raised.returncode == 1, raised.stdout[-6000:]
    assert f"RuntimeError: {RAISE_IN_STEP}={RAISED}: the test hook's exception" in raised.stdout
    steps = [f"global_step{i}" for i in range(1, RAISED)]
    assert _left(tmp / "raised") == (steps, f"global_step{RAISED - 1}")
    assert f"saved checkpoint at iteration {RAISED - 1:8d}" in raised.stdout
    reference = _losses(tmp / "reference.jsonl")
    resumed = _losses(tmp / "raised_resumed.jsonl")
    assert resumed == {i: reference[i] for i in range(RAISED, ITERS + 1)}
    assert f"loaded checkpoint {tmp / 'raised' / f'global_step{RAISED - 1}'}" in outputs[2]


def test_an_exit_names_the_committed_step_which_resumes_exactly(stopped):
    tmp, *_, outputs = stopped
    step = tmp / "exited" / f"global_step{EXIT}"
    line = (
        f"exiting after iteration {EXIT} (--exit-interval / --exit-duration-in-mins); a relaunch "
        f"resumes from {step}"
    )
    assert line in outputs[1], outputs[1][-4000:]
    assert _left(tmp / "exited") == ([f"global_step{i}" for i in range(1, EXIT + 1)], step.name)
    reference = _losses(tmp / "reference.jsonl")
    resumed = _losses(tmp / "exited_resumed.jsonl")
    assert resumed == {i: reference[i] for i in range(EXIT + 1, ITERS + 1)}


def test_an_exception_on_every_rank_of_two_commits_the_pending_step(stopped):
    tmp, _, (_, raised), _ = stopped
    assert raised.returncode != 0, raised.stdout[-6000:]
    assert f"RuntimeError: {RAISE_IN_STEP}={RAISED}: the test hook's exception" in raised.stdout
    steps = [f"global_step{i}" for i in range(1, RAISED)]
    assert _left(tmp / "dp2") == (steps, f"global_step{RAISED - 1}"), raised.stdout[-6000:]
    assert "is not committed" not in raised.stdout


def test_an_exit_on_deepspeed_names_its_step(stopped):
    tmp, *_, outputs = stopped
    step = tmp / "ds_exited" / f"global_step{EXIT}"
    assert (
        f"exiting after iteration {EXIT} (--exit-interval / --exit-duration-in-mins); a "
        in (outputs[4])
    )
    assert f"a relaunch resumes from {step}" in outputs[4]
    assert (tmp / "ds_exited" / "latest").read_text() == step.name
