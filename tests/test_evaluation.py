"""Evaluation and the logged learning rate as Megatron-LM does them: the LR after the step, the
periodic validation block, and the final validation and test passes after the last iteration."""

import math
import re

import pytest
from training_fixtures import PYTHON, REPO, make_corpus, model_flags, read_metrics, run, train_flags

from pretrain.training.lr_schedule import lr_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVAL_LINE = re.compile(
    r"^(-+)\n( validation loss at iteration (\d+)( on (?:validation|test) set)? \| "
    r"lm loss value: ([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+) \| )\n(-+)$",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    corpus = make_corpus(tmp / "corpus")
    flags = model_flags("gpt2") + train_flags(corpus, iters=4)
    flags += ["--split", "80,10,10", "--eval-interval", "2", "--eval-iters", "2"]
    flags += ["--metrics-file", str(tmp / "metrics.jsonl")]
    out = run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout, read_metrics(tmp / "metrics.jsonl")


def test_validation_blocks_are_megatrons(evaluated_run):
    output, _ = evaluated_run
    blocks = [m.groups() for m in EVAL_LINE.finditer(output)]
    where = [(int(b[2]), b[3]) for b in blocks]
    # every --eval-interval, then Megatron's final validation and test passes
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
