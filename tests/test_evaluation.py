"""Evaluation and the logged learning rate as Megatron-LM does them: the LR after the step, the
periodic validation block, and the final validation and test passes after the last iteration.

One process through `pretrain_gpt.py` is the reference. One launched world of 2 ranks then runs
the same flags at TP2, PP2 and DP2 ZeRO-1 (validation and test losses equal the reference's), a
DP2 run stopped by --exit-interval and resumed (it evaluates the same batches as the
uninterrupted one: the same losses bit for bit), --eval-iters 0 (no evaluation, no valid/test
loaders) and --split 100,0,0 with --eval-iters > 0 (no crash, one info line, no evaluation).
"""

import json
import math
import re
from pathlib import Path

import pytest
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

from pretrain.training.report.logging import format_eval_line
from pretrain.training.schedules.lr_schedule import lr_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVAL_LINE = re.compile(
    r"^(-+)\n( validation loss at iteration (\d+)( on (?:validation|test) set)? \| "
    r"lm loss value: ([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+) \| )\n(-+)$",
    re.MULTILINE,
)


# every --eval-interval (2), then Megatron's final validation and test passes
EVALUATIONS = [(2, "validation"), (4, "validation"), (4, "validation"), (4, "test")]
RTOL = 1e-6  # fp32 sums in another order; measured <= 1.1e-7 (TP2, PP2, DP2 ZeRO-1)


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    make_corpus(tmp / "corpus")
    return tmp


def eval_flags(tmp: Path, name: str, *extra: str) -> list[str]:
    flags = model_flags("gpt2", vocab_divisible_by=None) + train_flags(str(tmp / "corpus"), iters=4)
    flags += ["--split", "80,10,10", "--eval-interval", "2", "--eval-iters", "2"]
    return flags + ["--metrics-file", str(tmp / f"{name}.jsonl"), *extra]


def eval_records(path: Path) -> list[tuple[int, str, float]]:
    """(iteration, "validation" | "test", loss) of every evaluation, in the order run."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for split in ("validation", "test"):
            if f"{split}-loss" in record:
                out.append((record["iteration"], split, record[f"{split}-loss"]))
    return out


@pytest.fixture(scope="module")
def evaluated_run(eval_dir):
    flags = eval_flags(eval_dir, "reference")
    out = run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout, read_metrics(eval_dir / "reference.jsonl")


def test_validation_blocks_are_megatrons(evaluated_run):
    output, _ = evaluated_run
    blocks = [m.groups() for m in EVAL_LINE.finditer(output)]
    where = [(int(b[2]), b[3]) for b in blocks]
    assert where == [
        (2, None),
        (4, None),
        (4, " on validation set"),
        (4, " on test set"),
    ], where
    for top, text, _, _, loss, ppl, bottom in blocks:
        assert len(top) == len(bottom) == len(text) + 1  # Megatron: '-' * (len(string) + 1)
        assert float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-6)


def test_logged_learning_rate_is_the_one_after_the_step(evaluated_run):
    _, metrics = evaluated_run
    # train_flags: --lr 3e-3 --min-lr 3e-4, warmup 2 iterations, cosine over 4 x 8 samples
    schedule = dict(max_lr=3e-3, min_lr=3e-4, warmup_samples=16, decay_samples=32, style="cosine")
    for iteration in range(1, 5):
        expected = lr_at(iteration * 8, **schedule)
        assert metrics[iteration]["learning-rate"] == pytest.approx(expected, rel=1e-12)
    assert metrics[4]["validation-loss"] > 0 and metrics[4]["test-loss"] > 0


def test_ppl_is_megatrons_formula():
    """exp(loss), capped at exp(20) as Megatron caps it; both printed with %.6E."""
    assert "lm loss value: 2.500000E+00 | lm loss PPL: 1.218249E+01 |" in format_eval_line(7, 2.5)
    capped = format_eval_line(7, 25.0)
    assert f"lm loss value: 2.500000E+01 | lm loss PPL: {math.exp(20):.6E} |" in capped


def test_metrics_file_has_the_printed_evaluations(evaluated_run, eval_dir):
    output, _ = evaluated_run
    records = eval_records(eval_dir / "reference.jsonl")
    assert [(it, split) for it, split, _ in records] == EVALUATIONS
    printed = [float(m.group(5)) for m in EVAL_LINE.finditer(output)]
    assert printed == [float(f"{loss:.6E}") for _, _, loss in records]
    final = read_metrics(eval_dir / "reference.jsonl")[4]
    for split in ("validation", "test"):
        assert final[f"{split}-ppl"] == pytest.approx(math.exp(final[f"{split}-loss"]), rel=1e-12)


LAYOUTS = {"tp2": (2, 1, 0), "pp2": (1, 2, 0), "dp2_zero1": (1, 1, 1)}


@pytest.fixture(scope="module")
def world2(eval_dir, evaluated_run):
    """One launch of 2 ranks: the layouts, a stopped and resumed run, and the edge cases."""
    tmp = eval_dir
    runs = [eval_flags(tmp, name, *layout_flags(*lay)) for name, lay in LAYOUTS.items()]
    dp2 = layout_flags(1, 1, 1)
    ckpt = ["--save", str(tmp / "ckpt"), "--save-interval", "100"]
    runs.append(eval_flags(tmp, "resumed", *dp2, *ckpt, "--exit-interval", "3"))
    runs.append(eval_flags(tmp, "resumed", *dp2, "--load", str(tmp / "ckpt")))
    runs.append(eval_flags(tmp, "no_eval_iters", *dp2, "--eval-iters", "0"))
    runs.append(eval_flags(tmp, "no_valid_split", *dp2, "--split", "100,0,0"))
    result = run(multirun_cmd(2, runs, tmp / "runs.json"), timeout=480)
    assert result.returncode == 0, result.stdout[-8000:]
    return result.stdout


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_validation_and_test_losses_equal_at_every_layout(world2, eval_dir, name):
    reference = eval_records(eval_dir / "reference.jsonl")
    got = eval_records(eval_dir / f"{name}.jsonl")
    assert [(it, split) for it, split, _ in got] == EVALUATIONS
    for (it, split, loss), (_, _, ref) in zip(got, reference, strict=True):
        assert loss == pytest.approx(ref, rel=RTOL), (name, it, split, loss, ref)


def test_resumed_run_evaluates_the_same_batches(world2, eval_dir):
    """Stopped after iteration 3 (one evaluation done), resumed: the evaluations at 4 and at the
    end read the validation samples after the first evaluation's, as the uninterrupted run."""
    uninterrupted = eval_records(eval_dir / "dp2_zero1.jsonl")
    resumed = eval_records(eval_dir / "resumed.jsonl")
    assert resumed == uninterrupted  # the stopped part (2) and the resumed part (4, 4, 4 test)
    assert (eval_dir / "ckpt" / "latest").read_text() == "global_step3"


def test_eval_iters_0_and_an_empty_valid_split(world2, eval_dir):
    for name in ("no_eval_iters", "no_valid_split"):
        metrics = read_metrics(eval_dir / f"{name}.jsonl")
        assert sorted(metrics) == [1, 2, 3, 4]  # trained to the end
        assert eval_records(eval_dir / f"{name}.jsonl") == []
    # 3 layouts x 4 blocks + the stopped run's 1 + the resumed run's 3; none from the edge cases
    assert len(EVAL_LINE.findall(world2)) == 3 * 4 + 1 + 3
    note = "no validation data (--split 100,0,0 leaves the valid split empty): --eval-iters 2 is "
    note += "unused and no evaluation runs (nor a final test pass)"
    assert world2.count(note) == 1  # the empty split says so once; --eval-iters 0 says nothing
