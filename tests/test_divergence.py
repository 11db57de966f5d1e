"""A run that diverges stops, says so, and loses nothing.

Real runs of the tiny model with `--lr 1e8 --clip-grad 0`: the loss and grad norm are finite for
the first iterations and NaN/Inf from the third on (the metrics file says which; the tests read
the first bad iteration from it rather than assume it). With the default
`--check-for-nan-in-loss-and-grad` the run stops there, at two ranks, with one line and exit 2, and
its last checkpoint resumes; with `--no-check-for-nan-in-loss-and-grad` it trains on, but no
non-finite step is ever committed and `--save-total-limit 1` keeps the good one. The log line of
an all-NaN interval says `NAN`, as Megatron's does, and the log tools read it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from convert_fixtures import load_tool
from training_fixtures import (
    PYTHON,
    REPO,
    checkpointed_model,
    layout_flags,
    make_corpus,
    megatron_loss,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    token_losses,
    train_flags,
    training_batch,
)
from training_fixtures import test_env as clean_env

from pretrain.checkpoint.integrity import nonfinite_tensors
from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.launch import free_port
from pretrain.training.report.log_parse import read_run_log
from pretrain.training.report.logging import LoggingConfig, MetricsLogger, ScalarWriter, Throughput

DIVERGE = ["--lr", "1e8", "--clip-grad", "0"]  # after train_flags: these win
GOOD = 2
MBS = 2  # train_flags' micro-batch size
# The resumes change --train-iters (the default decay span) or --lr: this run's schedule, as
# Megatron's flag asks for it (without it they are refused, as in Megatron)
OVERRIDE = "--override-opt_param-scheduler"


def _flags(corpus: str, iters: int, metrics: Path, zero: int, *extra: str) -> list[str]:
    return (
        model_flags("gpt2")
        + train_flags(corpus, iters=iters)
        + layout_flags(1, 1, zero)
        + ["--metrics-file", str(metrics), *extra]
    )


def _first_bad(metrics: dict[int, dict]) -> int:
    """The first iteration whose loss or grad norm was not finite."""
    return min(
        i
        for i, m in metrics.items()
        if not (math.isfinite(m["lm-loss"]) and math.isfinite(m["grad-norm"]))
    )


def _steps(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.is_dir())


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """Two ranks (DP2, ZeRO-1), two launches. First: an uninterrupted reference; a run that
    trains GOOD iterations and saves each; its continuation with `--lr 1e8 --clip-grad 0` (a save
    due only at its end), which stops. Second: that checkpoint resumed with the first run's flags,
    and resumed with `--lr 0` (a lower --lr after a divergence, taken to the limit)."""
    tmp = tmp_path_factory.mktemp("divergence")
    corpus = make_corpus(tmp / "corpus")
    ckpt = tmp / "ckpt"
    first = [
        _flags(corpus, GOOD + 3, tmp / "reference.jsonl", 1),
        _flags(corpus, GOOD, tmp / "good.jsonl", 1, "--save", str(ckpt), "--save-interval", "1"),
        _flags(corpus, GOOD + 4, tmp / "diverged.jsonl", 1, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "100", OVERRIDE)
        + DIVERGE,
    ]  # fmt: skip
    stopped = run(multirun_cmd(2, first, tmp / "first.json"), timeout=400)
    steps, latest = _steps(ckpt), (ckpt / "latest").read_text()  # before the resumes
    second = [
        _flags(corpus, GOOD + 3, tmp / "resumed.jsonl", 1, "--load", str(ckpt), OVERRIDE),
        _flags(corpus, GOOD + 2, tmp / "lr0.jsonl", 1, "--load", str(ckpt), "--lr", "0", "--min-lr", "0", OVERRIDE),
    ]  # fmt: skip
    resumed = run(multirun_cmd(2, second, tmp / "second.json"), timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    return tmp, corpus, ckpt, stopped, steps, latest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_diverging_run_stops_at_the_bad_iteration_with_one_line_and_saves_nothing(diverged):
    """Every rank stops at the first NaN/Inf; one line from rank 0 naming the iteration and the
    checkpoint; exit 2; the save due at the end never happens."""
    tmp, _, ckpt, stopped, steps, latest = diverged
    assert stopped.returncode == 2, stopped.stdout[-6000:]
    metrics = read_metrics(tmp / "diverged.jsonl")
    bad = _first_bad(metrics)
    assert sorted(metrics) == list(range(GOOD + 1, bad + 1))  # it stopped at the bad iteration
    errors = _errors(stopped.stdout)
    assert len(errors) == 1, stopped.stdout[-6000:]  # rank 0's, not one per rank
    assert errors[0].startswith(f"error: iteration {bad}: loss is nan"), errors[0]
    assert "lower --lr or enable --clip-grad" in errors[0]
    assert "a lower --lr there needs --override-opt_param-scheduler" in errors[0]
    assert f"resume from the last checkpoint, {ckpt / f'global_step{GOOD}'}" in errors[0]
    assert "Traceback" not in stopped.stdout
    assert stopped.stdout.count("saved checkpoint at iteration") == GOOD
    assert steps == [f"global_step{i}" for i in range(1, GOOD + 1)]
    assert latest == f"global_step{GOOD}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resumed_from_the_last_checkpoint_nothing_was_lost(diverged):
    """Resumed with the first run's flags, it starts right after the checkpoint and prints an
    uninterrupted run's losses, bit for bit."""
    tmp = diverged[0]
    reference = read_metrics(tmp / "reference.jsonl")
    after = read_metrics(tmp / "resumed.jsonl")
    assert sorted(after) == list(range(GOOD + 1, GOOD + 4))
    for it in after:
        assert after[it]["lm-loss"] == reference[it]["lm-loss"], (it, after[it], reference[it])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lower_lr_takes_effect_at_the_first_resumed_step(diverged):
    """ZeRO's optimizer load used to bring back the saved lr for the first resumed step. With
    `--lr 0` no step moves the weights, so the second resumed iteration's loss is the
    checkpoint's model's on that iteration's batch (computed here in float64)."""
    tmp, corpus, ckpt, *_ = diverged
    losses = read_metrics(tmp / "lr0.jsonl")
    assert sorted(losses) == [GOOD + 1, GOOD + 2]
    one_process = model_flags("gpt2") + train_flags(corpus, iters=GOOD + 2)
    model = checkpointed_model(str(ckpt), GOOD)
    expected = megatron_loss(*token_losses(model, training_batch(one_process, GOOD + 2)), MBS)
    assert losses[GOOD + 2]["lm-loss"] == pytest.approx(expected, rel=2e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_the_check_off_no_nonfinite_step_is_committed_or_kept_by_pruning(tmp_path):
    """One rank, ZeRO-0 (the weights go NaN), --save-total-limit 1 and a save every iteration:
    each non-finite save is refused with one warning, the good step survives, and the log says
    NAN for the NaN iterations."""
    corpus = make_corpus(tmp_path / "corpus")
    ckpt = tmp_path / "ckpt"
    iters = 5
    flags = _flags(
        corpus,
        iters,
        tmp_path / "m.jsonl",
        0,
        "--save",
        str(ckpt),
        "--save-interval",
        "1",
        "--save-total-limit",
        "1",
        "--no-check-for-nan-in-loss-and-grad",
        *DIVERGE,
    )
    env = clean_env(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    result = run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-6000:]  # the check is off: it trains on
    bad = _first_bad(read_metrics(tmp_path / "m.jsonl"))
    assert 1 < bad < iters
    good = f"global_step{bad - 1}"
    assert _steps(ckpt) == [good]
    assert (ckpt / "latest").read_text() == good
    refused = [line for line in result.stdout.splitlines() if "not saving iteration" in line]
    assert len(refused) == iters - bad + 1, refused  # one line per refused save, the last one too
    for iteration, line in zip(range(bad, iters + 1), refused, strict=True):
        assert line.startswith(f"WARNING: not saving iteration {iteration}: non-finite values")
        assert f"the last checkpoint, {ckpt / good}, is kept" in line
    lines = read_run_log(_write(tmp_path / "train.log", result.stdout)).rows
    assert [r["lm loss"] for r in lines[bad - 1 :]] == ["NAN"] * (iters - bad + 1)
    loaded = read_checkpoint(str(ckpt))  # refuses NaN/Inf itself; checked here as well
    assert loaded.iteration == bad - 1
    assert list(nonfinite_tensors(loaded.state_dict)) == []


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_an_interval_without_a_finite_loss_logs_nan_and_the_log_tools_read_it(tmp_path):
    """Megatron's `lm loss: NAN` (its `{:.6E}` of NaN) for an all-NaN interval, never 0; a
    mixed interval averages its finite losses and counts the others; parser and plot accept it."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("pretrain")
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    metrics = MetricsLogger(
        LoggingConfig(log_interval=2),
        ScalarWriter(0, None, None, None, None, {}),
        Throughput(
            tokens_per_iteration=128, flops_per_iteration=1e6, world_size=1, peak_tflops=None
        ),
        train_iters=6,
        global_batch_size=8,
        skipped_steps_at_start=0,
    )
    try:
        for it, loss in enumerate([math.nan, math.inf, 3.0, math.nan, 2.0, 4.0], start=1):
            metrics.record_iteration(
                iteration=it,
                consumed_samples=8 * it,
                loss=loss,
                seconds=0.5,
                learning_rate=1e-3,
                grad_norm=math.nan if not math.isfinite(loss) else 1.0,
                loss_scale=1.0,
                skipped_steps=0,
            )
    finally:
        log.removeHandler(handler)
        log.level = level
    assert len(lines) == 3
    assert "| lm loss: NAN |" in lines[0] and "number of nan iterations:   2 |" in lines[0]
    assert "| lm loss: 3.000000E+00 |" in lines[1] and "nan iterations:   1 |" in lines[1]
    assert "| lm loss: 3.000000E+00 |" in lines[2] and "nan iterations:   0 |" in lines[2]
    path = _write(tmp_path / "train.log", "\n".join(lines) + "\n")
    its, losses = read_run_log(path).series("lm loss")
    assert its == [2, 4, 6] and math.isnan(losses[0]) and losses[1:] == [3.0, 3.0]
    assert load_tool("plot_run").main(["--log", str(path), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0
