"""--manual-gc (Megatron-LM's flags): the automatic garbage collector is off during the training
loop, and every rank collects at the same points: when the loop starts, after every
--manual-gc-interval-th iteration, fully before an evaluation and the youngest generation after
it (not with --no-manual-gc-eval). A real one-rank `pretrain_gpt.py` run records, in order, each
collection Python makes (`gc.callbacks`), each iteration the loop logs and each evaluation, and
whether the collector was enabled at each iteration."""

import json

import pytest
from training_fixtures import PYTHON, REPO, make_corpus, model_flags, run, train_flags
from training_fixtures import test_env as clean_env  # (pytest would collect test_env)

from pretrain.cli import parse_args
from pretrain.errors import UserError
from pretrain.launch import free_port

pytestmark = pytest.mark.timeout(600)

RECORDING_RUN = """
import gc, json, sys
from pretrain.training.report.evaluator import Evaluator
from pretrain.training.report.logging import MetricsLogger

events, phase = [], {"loop": False}

def on_gc(stage, info):
    if stage == "start" and phase["loop"]:
        events.append(["gc", info["generation"]])

def wrap(cls, name, before, after):
    real = getattr(cls, name)
    def wrapper(self, *args, **kwargs):
        before(kwargs)
        out = real(self, *args, **kwargs)
        after(kwargs)
        return out
    setattr(cls, name, wrapper)

def iteration_done(kwargs):
    events.append(["iteration", kwargs["iteration"], gc.isenabled()])

import pretrain.training.loop.loop as loop

real_train = loop.train

def train(*args, **kwargs):  # the loop: recorded from its start
    phase["loop"] = True
    events.append(["train"])
    return real_train(*args, **kwargs)

loop.train = train
wrap(MetricsLogger, "record_iteration", lambda kw: None, iteration_done)
wrap(Evaluator, "evaluate", lambda kw: events.append(["evaluate"]), lambda kw: None)
gc.callbacks.append(on_gc)

from pretrain.cli import parse_args
from pretrain.training.run import pretrain

pretrain(parse_args(sys.argv[1:]))
phase["loop"] = False
print("EVENTS " + json.dumps(events) + " ENABLED " + json.dumps(gc.isenabled()))
"""


def _recorded(tmp_path, *extra: str) -> tuple[list, bool]:
    """The events of a 5-iteration run evaluating after iteration 3, from the loop's start to its
    fifth iteration, and whether the collector was enabled after `pretrain` returned."""
    tmp_path.mkdir(exist_ok=True)
    argv = model_flags("gpt2") + train_flags(make_corpus(tmp_path / "corpus"), iters=5)
    argv += ["--eval-interval", "3", "--eval-iters", "1", *extra]
    env = clean_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = run([PYTHON, "-c", RECORDING_RUN, *argv], timeout=500, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:]
    line = out.stdout.split("EVENTS ", 1)[1].splitlines()[0]
    events, enabled = line.split(" ENABLED ")
    events = json.loads(events)
    last = next(i for i, e in enumerate(events) if e[:2] == ["iteration", 5])
    return events[: last + 1], json.loads(enabled)


def test_manual_gc_collects_at_the_same_points_only(tmp_path):
    events, enabled_after = _recorded(tmp_path, "--manual-gc", "--manual-gc-interval", "2")
    assert events == [
        ["train"],
        ["gc", 2],  # the loop starts
        ["iteration", 1, False],
        ["iteration", 2, False],
        ["gc", 2],  # --manual-gc-interval 2
        ["iteration", 3, False],
        ["gc", 2],  # before the evaluation
        ["evaluate"],
        ["gc", 0],  # what the evaluation made
        ["iteration", 4, False],
        ["gc", 2],
        ["iteration", 5, False],
    ], events
    assert enabled_after  # restored after the loop


@pytest.mark.slow  # an end-to-end run over 5 s: not in `make test-fast`
def test_without_eval_collections_and_without_the_flag(tmp_path):
    events, _ = _recorded(tmp_path / "a", "--manual-gc", "--no-manual-gc-eval")
    assert [e for e in events if e[0] != "iteration"] == [["train"], ["gc", 2], ["evaluate"]]
    assert all(e[2] is False for e in events if e[0] == "iteration")
    events, _ = _recorded(tmp_path / "b")
    assert all(e[2] is True for e in events if e[0] == "iteration")  # automatic, as before


def test_a_negative_interval_names_the_flag():
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    argv += ["--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1"]
    argv += ["--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    argv += ["--vocab-size", "100", "--lr", "1e-3", "--manual-gc", "--manual-gc-interval", "-1"]
    with pytest.raises(UserError, match="--manual-gc-interval -1: must be 0"):
        parse_args(argv, env={})
