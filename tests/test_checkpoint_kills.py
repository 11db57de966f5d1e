"""SIGKILL at random points inside DeepSpeed's own checkpoint writes (and ours), many times: the
checkpoint `latest` names always loads, and training continues with the uninterrupted losses.

tests/checkpoint_kill_trials.py runs the trials in forked children of one warm process; the
test hook PRETRAIN_TEST_SIGKILL_IN_SAVE (pretrain/testing_hooks.py) cuts the chosen torch.save
after a random number of bytes, or kills at a commit step (metadata written, step renamed into
place, `latest` committed, an old step moved aside by --save-total-limit).
"""

from __future__ import annotations

import json
import random

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

from pretrain.checkpoint.integrity import choose_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RESUME_TRIALS = 10
EVENTS = 8  # 3 torch.save calls, metadata, rename, latest, prune; 7 means "no kill"
SEED = 20240611


def _trials() -> list[dict]:
    rng = random.Random(SEED)
    trials = [
        {"kind": "resume", "event": rng.randrange(EVENTS), "bytes": rng.randrange(1, 400_000)}
        for _ in range(RESUME_TRIALS)
    ]
    # a finished run launched again, and --finetune into its own folder: a run that saved the
    # step `latest` names again would be killed inside it
    trials.insert(3, {"kind": "relaunch", "event": 0, "bytes": 1000})
    trials.insert(7, {"kind": "finetune", "event": 1, "bytes": 5000})
    return trials


def test_sigkill_inside_checkpoint_writes_never_damages_the_checkpoint_latest_names(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    final = 2 + RESUME_TRIALS
    flags = (
        model_flags("gpt2")
        + ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
        + train_flags(corpus, iters=2)
        + layout_flags(1, 1, 1)
        + ["--save-interval", "1", "--save-total-limit", "2"]
        + ["--lr-decay-iters", str(final)]  # one schedule whatever --train-iters a trial has
    )
    spec = {
        "flags": flags,
        "save": str(tmp_path / "ckpt"),
        "metrics": str(tmp_path / "m.jsonl"),
        "reference": {"save": str(tmp_path / "ref"), "iters": final, "metrics": str(tmp_path / "ref.jsonl")},
        "trials": _trials(),
    }  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = run(
        [PYTHON, str(REPO / "tests" / "checkpoint_kill_trials.py"), str(tmp_path / "spec.json")],
        timeout=850,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stdout[-6000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    phases = [r for r in lines if "phase" in r]
    assert [p["status"] for p in phases] == [0, 0], phases
    trials = [r for r in lines if "trial" in r]
    assert len(trials) == len(spec["trials"])
    killed = 0
    for t in trials:
        context = {k: v for k, v in t.items() if k != "tail"}
        before = int(t["latest_before"].removeprefix("global_step"))
        assert t["loaded"] == before, (context, t["tail"])  # the previous checkpoint loaded
        assert not t["traceback"] and t["every_file_loads"], (context, t["tail"])
        if t["kind"] == "resume":
            assert t["status"] in (0, -9), (context, t["tail"])
            assert t["latest_after"] in (t["latest_before"], f"global_step{before + 1}"), context
            killed += t["status"] == -9
        else:  # nothing is saved over the step `latest` names, so nothing is killed there
            assert t["status"] == 0 and t["latest_after"] == t["latest_before"], (
                context,
                t["tail"],
            )
    assert killed >= RESUME_TRIALS // 2, trials  # most trials really were killed mid-save
    # the surviving history equals one uninterrupted run, bit for bit
    reference = read_metrics(tmp_path / "ref.jsonl")
    resumed = read_metrics(tmp_path / "m.jsonl")
    assert [resumed[i]["lm-loss"] for i in sorted(resumed)] == [
        reference[i]["lm-loss"] for i in sorted(resumed)
    ]
    assert choose_checkpoint(str(tmp_path / "ckpt")).note is None
