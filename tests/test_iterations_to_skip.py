"""--iterations-to-skip as Megatron main does it: the batch is read and dropped, the model is not
changed, the next iteration trains on the next samples; the skipped sample range is kept in the
checkpoint across a resume."""

from __future__ import annotations

import argparse
import json

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    checkpointed_model,
    logged_losses,
    make_corpus,
    megatron_loss,
    model_flags,
    run,
    token_losses,
    train_flags,
    training_batch,
)

from pretrain.convert.checkpoint_reader import find_checkpoint
from pretrain.training.loop.skip import iteration_spec

GBS, MBS = 8, 2


def test_iteration_spec_accepts_numbers_and_ranges():
    assert iteration_spec("7") == [7]
    assert iteration_spec("3-5") == [3, 4, 5]
    for bad in ("0", "5-3", "x", "3-"):
        with pytest.raises(argparse.ArgumentTypeError):
            iteration_spec(bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_skipped_iteration_and_resume(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    ckpt = str(tmp_path / "ckpt")
    base = model_flags("gpt2") + train_flags(corpus, iters=3, gbs=GBS, mbs=MBS)
    skipping = base + ["--save", ckpt, "--save-interval", "1", "--iterations-to-skip", "2"]
    out = run([PYTHON, str(REPO / "pretrain_gpt.py"), *skipping], timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]

    assert "iteration        2 | skipped (--iterations-to-skip): training samples [8, 16)" in (
        out.stdout
    )
    losses = logged_losses(out.stdout)
    assert sorted(losses) == [1, 3]  # no training line for the skipped iteration
    assert "consumed samples:           24" in out.stdout  # as the uninterrupted run at 3
    # The model that trains at iteration 3 is the one after iteration 1 (the skip changed
    # nothing), and it trains on samples [16, 24): its logged loss is that model's on that batch.
    expected = megatron_loss(
        *token_losses(checkpointed_model(ckpt, 1), training_batch(base, 3)), MBS
    )
    assert losses[3] == pytest.approx(expected, rel=2e-5)
    step_dir, meta = find_checkpoint(ckpt, 3)
    assert meta["skipped_train_samples"] == [[8, 16]]

    # resume without the flag: the recorded range stays in later checkpoints
    resumed = model_flags("gpt2") + train_flags(corpus, iters=4, gbs=GBS, mbs=MBS)
    # one more iteration lengthens the default decay span: the flags' schedule, as before issue 25
    resumed += [
        "--load",
        ckpt,
        "--save",
        ckpt,
        "--save-interval",
        "1",
        "--override-opt_param-scheduler",
    ]
    out = run([PYTHON, str(REPO / "pretrain_gpt.py"), *resumed], timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    _, meta = find_checkpoint(ckpt, 4)
    assert meta["skipped_train_samples"] == [[8, 16]] and meta["consumed_train_samples"] == 32
    assert json.loads((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text()) == 4

    # explain_batch marks iteration 2's samples as skipped, from the checkpoint or from the flag
    tool = [PYTHON, str(REPO / "tools" / "explain_batch.py"), *base, "--iteration", "1-3", "--json"]
    for source in (["--load", ckpt], ["--iterations-to-skip", "2"]):
        r = run([*tool, *source], timeout=200)
        assert r.returncode == 0, r.stdout[-3000:]
        rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        assert [(x["sample"], x["skipped"]) for x in rows] == [
            (k, 8 <= k < 16) for k in range(3 * GBS)
        ]
