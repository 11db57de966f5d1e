"""SIGKILL at every event of a checkpoint save, at one rank and at two: the checkpoint `latest`
names always loads, and the next launch resumes from it with the uninterrupted losses.

tests/checkpoint_kill_trials.py runs the trials in forked children of one warm process. The
events of a save (pretrain/testing_hooks.py) are each rank's `torch.save` calls (DeepSpeed's
model and ZeRO optimizer files, the RNG file, the rank's share of the layout-independent full
state) and rank 0's commit steps; every rank records them, so the test first checks that a
save has exactly the events below, then kills one save at each of them: a `torch.save` cut
after a seeded random number of bytes, a commit step right after it ran.
"""

from __future__ import annotations

import random

import pytest
from signal_fixtures import check_kill_trial, run_kill_trials
from training_fixtures import layout_flags, make_corpus, model_flags, train_flags

from pretrain.checkpoint.integrity import choose_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEED = 20240611
COMMIT = [
    "metadata written",
    "step renamed into place",
    "latest committed",
    "old step moved aside for deletion",  # --save-total-limit 2: the third step prunes the first
]
COMMITTED = {"latest committed", "old step moved aside for deletion"}  # `latest` names the save
# world -> (ZeRO stage, the events of one save on each rank, in order)
SAVES = {
    1: (0, [["mp_rank_00_model_states.pt", "rng_state_0.pt", "full_state_tp00_pp00.pt", *COMMIT]]),
    2: (
        1,
        [
            [
                "mp_rank_00_model_states.pt",
                "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "rng_state_0.pt",
                "full_state_tp00_pp00.pt",
                *COMMIT,
            ],
            ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pt", "full_state_tp00_pp00_dp001.pt"],
        ],
    ),
}  # fmt: skip
# a save over a complete step `latest` does not name (the one killed after its rename) first
# moves that step aside: one more event, killed in the trial after that kill
MOVED_ASIDE = "older step moved aside"


def _trials(world: int) -> list[dict]:
    """An unarmed save (its events are checked), a kill at each event of each rank, an unarmed
    save at the end; at one rank also a relaunch and a --finetune into the same folder."""
    rng = random.Random(SEED + world)
    trials = [{"kind": "resume", "event": None}]
    if world == 1:  # a run that saved the step `latest` names again would be killed inside it
        trials += [{"kind": "relaunch", "event": "mp_rank_00_model_states.pt", "rank": 0}]
        trials += [{"kind": "finetune", "event": "rng_state_0.pt", "rank": 0}]
    for rank, events in enumerate(SAVES[world][1]):
        for event in events:
            trials.append({"kind": "resume", "event": event, "rank": rank})
            if event == "step renamed into place":
                trials.append({"kind": "resume", "event": MOVED_ASIDE, "rank": 0})
    trials.append({"kind": "resume", "event": None})
    for trial in trials:
        trial["bytes"] = rng.randrange(1, 200_000) if str(trial["event"]).endswith(".pt") else 0
    return trials


def _save_events(world: int, follows_rename: bool) -> list[list[str]]:
    """The events of one whole save on each rank (one more after a kill after the rename)."""
    saves = [list(events) for events in SAVES[world][1]]
    if follows_rename:
        saves[0].insert(saves[0].index("step renamed into place"), MOVED_ASIDE)
    return saves


def _check_events(trial: dict, saves: list[list[str]]) -> None:
    """An unarmed save recorded every event; a killed one stopped at its event on the armed
    rank, and the other ranks (ended by the driver, wherever they waited) recorded a prefix of
    theirs."""
    got = trial["events"]
    if trial["event"] is None:  # one prune event per step deleted: more after a kill before it
        prune = COMMIT[-1]
        assert [e for i, e in enumerate(got[0]) if e != prune or got[0][i - 1] != prune] == (
            saves[0]
        ), trial
        assert got[1:] == saves[1:], trial
        return
    armed = saves[trial["rank"]]
    assert got[trial["rank"]] == armed[: armed.index(trial["event"]) + 1], trial
    for events, whole in zip(got, saves, strict=True):
        assert events == whole[: len(events)], trial


@pytest.mark.parametrize("world", [1, 2])
def test_sigkill_at_every_save_event_never_damages_the_checkpoint_latest_names(tmp_path, world):
    trials = _trials(world)
    flags = (
        model_flags("gpt2")
        + ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
        + train_flags(make_corpus(tmp_path / "corpus"), iters=2)
        + layout_flags(1, 1, SAVES[world][0])
        + ["--save-interval", "1", "--save-total-limit", "2"]
    )
    done, reference = run_kill_trials(tmp_path, flags, world, trials)
    follows_rename = False
    for t in done:
        if t["kind"] != "resume":  # nothing is saved over the step `latest` names
            before = int(t["latest_before"].removeprefix("global_step"))
            assert t["loaded"] == before and not t["traceback"] and t["every_file_loads"], t
            assert t["status"] == [0] * world and t["latest_after"] == t["latest_before"], t
            continue
        context = check_kill_trial(t, reference, COMMITTED)
        _check_events(context, _save_events(world, follows_rename))
        follows_rename = t["event"] == "step renamed into place"
    assert choose_checkpoint(str(tmp_path / "ckpt")).note is None
