"""SIGKILL during an --async-save background write (the torch backend's DCP files, the files
queued behind them) and at its commit never damages the step `latest` names; the next launch
resumes from it with the uninterrupted losses.

tests/checkpoint_kill_trials.py runs the trials (two ranks, forked from one warm process),
as for DeepSpeed's saves (tests/test_checkpoint_kills.py). A background save's events are the
files its thread writes, by base name: DCP's shards and (rank 0) its `.metadata` index, then the
files queued behind them (rank 0's `train_state.pt`, each rank's RNG state and its share of the
full state), each cut after a seeded random number of bytes; then rank 0's commit steps, which
`wait` runs after every rank's write (the final save of each trial). The test first checks that
an unarmed save has exactly these events, then kills one save at each background file and at
the first commit step and the commit point (tests/test_checkpoint_kills.py kills every commit
step of the same protocol).
"""

from __future__ import annotations

import random

import pytest
from signal_fixtures import check_kill_trial, run_kill_trials
from training_fixtures import make_corpus, model_flags, train_flags

from pretrain.checkpoint.integrity import choose_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEED = 20251202
WORLD = 2
COMMIT = ["metadata written", "step renamed into place", "latest committed"]
PRUNE = "old step moved aside for deletion"  # --save-total-limit 2, from the third step on
COMMITTED = {"latest committed", PRUNE}  # `latest` names the save
EVENTS = [  # each rank's events of one save, in order
    ["__0_0.distcp", ".metadata.tmp", "train_state.pt", "rng_state_0.pt"]
    + ["full_state_tp00_pp00.pt", *COMMIT, PRUNE],
    ["__1_0.distcp", "rng_state_1.pt", "full_state_tp00_pp00_dp001.pt"],
]
# the commit steps are the blocking save's (tests/test_checkpoint_kills.py kills each); here the
# first and the commit point, run from `wait` after the background write
KILLED_COMMIT = {"metadata written", "latest committed"}


def _trials() -> list[dict]:
    rng = random.Random(SEED)
    trials = [{"kind": "resume", "event": None}]
    for rank, events in enumerate(EVENTS):
        for event in events:
            if event not in COMMIT + [PRUNE] or event in KILLED_COMMIT:
                trials.append({"kind": "resume", "event": event, "rank": rank})
    trials.append({"kind": "resume", "event": None})
    for trial in trials:
        is_file = trial["event"] is not None and trial["event"] not in KILLED_COMMIT
        trial["bytes"] = rng.randrange(1, 200_000) if is_file else 0
    return trials


def _check_events(trial: dict) -> None:
    got = trial["events"]
    if trial["event"] is None:
        assert got[0][: len(EVENTS[0]) - 1] == EVENTS[0][:-1], trial  # the prune: 1 or more
        assert set(got[0][len(EVENTS[0]) - 1 :]) <= {PRUNE} and got[1:] == EVENTS[1:], trial
        return
    armed = EVENTS[trial["rank"]]
    assert got[trial["rank"]] == armed[: armed.index(trial["event"]) + 1], trial
    for events, whole in zip(got, EVENTS, strict=True):
        assert events == whole[: len(events)], trial


def test_sigkill_during_a_background_save_never_damages_the_checkpoint_latest_names(tmp_path):
    trials = _trials()
    flags = (
        model_flags("gpt2")
        + ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]  # the RNG files count too
        + train_flags(make_corpus(tmp_path / "corpus"), iters=2)
        + ["--use-torch-fsdp2", "--async-save", "--ckpt-format", "torch_dist"]
        + ["--save-interval", "1", "--save-total-limit", "2"]
    )
    done, reference = run_kill_trials(tmp_path, flags, WORLD, trials)
    for t in done:
        _check_events(check_kill_trial(t, reference, COMMITTED))
    assert choose_checkpoint(str(tmp_path / "ckpt")).note is None
