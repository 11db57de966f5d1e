"""--iterations-to-skip as Megatron main does it: the batch is read and dropped, the model is not
changed, the next iteration trains on the next samples; the skipped sample range is kept in the
checkpoint across a resume."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from training_fixtures import (
    PYTHON,
    REPO,
    logged_losses,
    make_corpus,
    model_flags,
    run,
    train_flags,
    training_batch,
)

from pretrain.convert.checkpoint_reader import find_checkpoint, read_checkpoint
from pretrain.model.gpt import GPTModel
from pretrain.training.skip import iteration_spec

GBS, MBS = 8, 2


def test_iteration_spec_accepts_numbers_and_ranges():
    assert iteration_spec("7") == [7]
    assert iteration_spec("3-5") == [3, 4, 5]
    for bad in ("0", "5-3", "x", "3-"):
        with pytest.raises(argparse.ArgumentTypeError):
            iteration_spec(bad)


def _model_loss(checkpoint: str, iteration: int, batch: dict) -> float:
    """Megatron's iteration loss of the checkpointed model on `batch`: the mean over micro-batches
    of each micro-batch's masked mean cross-entropy."""
    ck = read_checkpoint(checkpoint, iteration)
    config = dataclasses.replace(
        ck.config, make_vocab_size_divisible_by=1, params_dtype=torch.float32
    )
    model = GPTModel(config).eval()
    model.load_state_dict(ck.state_dict)
    with torch.no_grad():
        logits = model(batch["tokens"], position_ids=batch["position_ids"], gather_logits=True)
    per_token = torch.nn.functional.cross_entropy(
        logits.double().flatten(0, 1), batch["labels"].flatten(), reduction="none"
    ).view_as(batch["labels"])
    mask = batch["loss_mask"].double()
    micro = [
        (per_token[i : i + MBS] * mask[i : i + MBS]).sum() / mask[i : i + MBS].sum()
        for i in range(0, GBS, MBS)
    ]
    return float(torch.stack(micro).mean())


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
    expected = _model_loss(ckpt, 1, training_batch(base, 3))
    assert losses[3] == pytest.approx(expected, rel=2e-5)
    step_dir, meta = find_checkpoint(ckpt, 3)
    assert meta["skipped_train_samples"] == [[8, 16]]

    # resume without the flag: the recorded range stays in later checkpoints
    resumed = model_flags("gpt2") + train_flags(corpus, iters=4, gbs=GBS, mbs=MBS)
    resumed += ["--load", ckpt, "--save", ckpt, "--save-interval", "1"]
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
