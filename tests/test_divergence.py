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
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

from pretrain.checkpoint.integrity import nonfinite_tensors
from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.launch import free_port
from pretrain.training.log_parse import read_run_log
from pretrain.training.logging import LoggingConfig, MetricsLogger, ScalarWriter, Throughput

DIVERGE = ["--lr", "1e8", "--clip-grad", "0"]  # after train_flags: these win
GOOD = 2


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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_diverging_run_stops_at_the_bad_iteration_and_its_last_checkpoint_resumes(tmp_path):
    """Two ranks (DP2, ZeRO-1). A run trains GOOD iterations and saves; its continuation with
    `--lr 1e8 --clip-grad 0` stops at the first NaN/Inf: one line from rank 0 naming the
    iteration and the checkpoint, exit 2, no save (it would have saved at its end). Resumed from
    that checkpoint with the first run's flags, the losses are an uninterrupted run's, bit for
    bit: nothing was lost."""
    corpus = make_corpus(tmp_path / "corpus")
    ckpt = tmp_path / "ckpt"
    runs = [
        _flags(corpus, GOOD + 3, tmp_path / "reference.jsonl", 1),
        _flags(corpus, GOOD, tmp_path / "good.jsonl", 1, "--save", str(ckpt), "--save-interval", "1"),
        _flags(corpus, GOOD + 4, tmp_path / "diverged.jsonl", 1, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "100")
        + DIVERGE,
    ]  # fmt: skip
    diverged = run(multirun_cmd(2, runs, tmp_path / "first.json"), timeout=400)
    assert diverged.returncode == 2, diverged.stdout[-6000:]
    metrics = read_metrics(tmp_path / "diverged.jsonl")
    bad = _first_bad(metrics)
    assert sorted(metrics) == list(range(GOOD + 1, bad + 1))  # it stopped at the bad iteration
    errors = _errors(diverged.stdout)
    assert len(errors) == 1, diverged.stdout[-6000:]  # rank 0's, not one per rank
    assert errors[0].startswith(f"error: iteration {bad}: loss is nan"), errors[0]
    assert "lower --lr or enable --clip-grad" in errors[0]
    assert f"resume from the last checkpoint, {ckpt / f'global_step{GOOD}'}" in errors[0]
    assert "Traceback" not in diverged.stdout
    assert diverged.stdout.count("saved checkpoint at iteration") == GOOD
    assert _steps(ckpt) == [f"global_step{i}" for i in range(1, GOOD + 1)]
    assert (ckpt / "latest").read_text() == f"global_step{GOOD}"

    again = [_flags(corpus, GOOD + 3, tmp_path / "resumed.jsonl", 1, "--load", str(ckpt))]
    resumed = run(multirun_cmd(2, again, tmp_path / "second.json"), timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    reference = read_metrics(tmp_path / "reference.jsonl")
    after = read_metrics(tmp_path / "resumed.jsonl")
    assert sorted(after) == list(range(GOOD + 1, GOOD + 4))
    for it in after:
        assert after[it]["lm-loss"] == reference[it]["lm-loss"], (it, after[it], reference[it])


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
