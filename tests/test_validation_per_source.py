"""Validation loss per blend source: a real run's logged per-source losses equal the checkpointed
model's cross-entropy on the same validation samples grouped by their source (one rank, DP = 2,
and PP = 2, where the last stage's loss function sums them); the Megatron total stays the mean of
per-micro-batch masked means; PP = 2 logs the one-rank run's numbers."""

from __future__ import annotations

import json
import re

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    checkpointed_model,
    make_corpus,
    megatron_loss,
    model_flags,
    run,
    token_losses,
    torchrun_cmd,
    train_flags,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GBS, MBS, EVAL_ITERS = 8, 2, 2


def _flags(tmp, a: str, b: str) -> list[str]:
    flags = model_flags("gpt2") + train_flags(a, iters=2, gbs=GBS, mbs=MBS)
    i = flags.index("--data-path")
    flags[i + 1 : i + 2] = [a, b]  # unweighted blend of two sources
    flags[flags.index("--split") + 1] = "80,20,0"
    flags[flags.index("--eval-interval") + 1] = "2"
    flags[flags.index("--eval-iters") + 1] = str(EVAL_ITERS)
    return flags + [
        "--metrics-file",
        str(tmp / "metrics.jsonl"),
        "--save",
        str(tmp / "ckpt"),
        "--save-interval",
        "2",
    ]


def _validation_samples(argv: list[str], count: int) -> dict:
    """The first `count` samples of the validation split, read through the data pipeline here."""
    from pretrain.cli import parse_args
    from pretrain.data.builder import build_train_valid_test_datasets
    from pretrain.data.config import train_valid_test_num_samples
    from pretrain.tokenizer import build_tokenizer

    cfg = parse_args(argv, env={})
    t, ev = cfg.training, cfg.evaluation
    num_samples = train_valid_test_num_samples(
        t.train_iters, t.train_samples, ev.eval_interval, ev.eval_iters, t.global_batch_size
    )
    valid = build_train_valid_test_datasets(cfg.data, build_tokenizer(cfg.tokenizer), num_samples)[
        1
    ]
    return valid.__getitems__(list(range(count)))


LAYOUTS = {"1rank": None, "dp2": [], "pp2": ["--pipeline-model-parallel-size", "2"]}
_RUNS: dict[str, tuple] = {}


def _blended_run(layout: str, tmp_path_factory) -> tuple:
    """Run `layout` once per module: (flags, output, metrics records, tmp, (prefix a, b))."""
    if layout not in _RUNS:
        tmp = tmp_path_factory.mktemp(f"per_source_{layout}")
        a = make_corpus(tmp / "alpha", seed=0)
        b = make_corpus(tmp / "beta", seed=1)
        flags = _flags(tmp, a, b)
        extra = LAYOUTS[layout]
        if extra is None:
            out = run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=400)
        else:
            out = run(torchrun_cmd(2, flags + extra), timeout=400)
        assert out.returncode == 0, out.stdout[-4000:]
        records = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
        _RUNS[layout] = flags, out.stdout, records, tmp, (a, b)
    return _RUNS[layout]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def blended_run(request, tmp_path_factory):
    """One rank, DP = 2 (the per-source sums are all-reduced over data-parallel ranks) and PP = 2
    (summed on the last stage, broadcast to the first, which logs)."""
    return _blended_run(request.param, tmp_path_factory)


def _per_source_records(records: list[dict], a: str, b: str) -> list[list[float]]:
    """[source a, source b, token-weighted] of every validation pass, in order."""
    return [
        [r[f"validation-loss/{a}"], r[f"validation-loss/{b}"], r["validation-loss/token-weighted"]]
        for r in records
        if f"validation-loss/{a}" in r
    ]


def test_pp2_logs_the_one_rank_runs_per_source_losses(tmp_path_factory):
    _, _, one, _, (a1, b1) = _blended_run("1rank", tmp_path_factory)
    _, _, pp2, _, (a2, b2) = _blended_run("pp2", tmp_path_factory)
    expected, got = _per_source_records(one, a1, b1), _per_source_records(pp2, a2, b2)
    assert len(got) == len(expected) == 2  # the periodic pass at 2, then the final one
    for e, g in zip(expected, got, strict=True):
        assert g == pytest.approx(e, rel=1e-6)
    totals = [[r["validation-loss"] for r in recs if "validation-loss" in r] for recs in (one, pp2)]
    assert totals[1] == pytest.approx(totals[0], rel=1e-6)


def test_per_source_losses_equal_the_models_loss_on_those_samples(blended_run):
    flags, _, records, tmp, (a, b) = blended_run
    # the periodic evaluation at iteration 2 (the final pass at 2 follows it): samples [0, 16)
    first = next(i for i, r in enumerate(records) if f"validation-loss/{a}" in r)
    periodic = {k: v for r in records[: first + 1] if r["iteration"] == 2 for k, v in r.items()}
    batch = _validation_samples(flags, EVAL_ITERS * GBS)
    ids = batch["dataset_id"]
    assert set(ids.tolist()) == {0, 1}  # both sources are in the pass

    model = checkpointed_model(str(tmp / "ckpt"))  # the model at iteration 2, as evaluated
    assert model.iteration == 2
    per_token, mask = token_losses(model, batch)

    for source, prefix in enumerate((a, b)):
        rows = ids == source
        expected = (per_token[rows] * mask[rows]).sum() / mask[rows].sum()
        assert periodic[f"validation-loss/{prefix}"] == pytest.approx(float(expected), rel=1e-5)
    token_weighted = (per_token * mask).sum() / mask.sum()
    assert periodic["validation-loss/token-weighted"] == pytest.approx(
        float(token_weighted), rel=1e-5
    )
    megatron_total = megatron_loss(per_token, mask, MBS)  # Megatron's total
    assert periodic["validation-loss"] == pytest.approx(megatron_total, rel=1e-5)


def test_log_has_megatrons_block_then_one_line_per_source(blended_run):
    _, output, _, _, (a, b) = blended_run
    block = re.search(
        r"-+\n validation loss at iteration 2 \| lm loss value: \S+ \| lm loss PPL: \S+ \| \n-+\n"
        r".*?validation loss at iteration 2 \| source (\S+) \| lm loss value: \S+ \| "
        r"lm loss PPL: \S+ \| tokens: \d+\n"
        r".*?validation loss at iteration 2 \| source (\S+) \| .*\n"
        r".*?validation loss at iteration 2 \| all sources, token-weighted \| lm loss value: \S+",
        output,
    )
    assert block, output[-3000:]
    assert (block.group(1), block.group(2)) == (a, b)
