"""A checkpoint saved at one layout resumes at another (pretrain/training/reshard.py): the resumed
iterations print the uninterrupted run's losses and grad norms (fp32, CPU, dropout 0).

The reference is the uninterrupted run at the saving layout; the layouts are equivalent
(tests/test_training_equivalence.py), so the resumed run must match it to float rounding. The
vocabulary padding changes with TP (Megatron's default: 128 rows at TP 1, 256 at TP 2).
"""

import sys

import pytest
import torch
from training_fixtures import (
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)

from pretrain.convert.checkpoint_reader import read_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERS = 5
STOP_AT = 2
# name -> ((TP, PP, ZeRO) saved, (TP, PP, ZeRO) resumed), world 2 (DP = 2 / TP / PP)
MOVES = {
    "dp2_zero2_to_tp2_zero1": ((1, 1, 2), (2, 1, 1)),
    "tp2_zero0_to_dp2_zero1": ((2, 1, 0), (1, 1, 1)),
    "tp2_zero1_to_pp2_zero1": ((2, 1, 1), (1, 2, 1)),
    "pp2_zero0_to_dp2_zero2": ((1, 2, 0), (1, 1, 2)),
    "dp2_zero3_to_pp2_zero1": ((1, 1, 3), (1, 2, 1)),
    "tp2_zero1_to_dp2_zero3": ((2, 1, 1), (1, 1, 3)),
}


def _flags(corpus, layout, metrics, *extra):
    return (
        model_flags("gpt2", vocab_divisible_by=None)
        + train_flags(corpus, iters=ITERS)
        + layout_flags(*layout)
        + ["--metrics-file", str(metrics), *extra]
    )


# saved in a world of 4, resumed in a world of 4 or 2 (the world size changes too)
MOVES_FROM_4 = {
    "tp1_dp4_zero0_to_tp4": ((1, 1, 0), (4, 1, 0), 4),
    "tp2_pp2_zero1_to_dp2_zero2": ((2, 2, 1), (1, 1, 2), 2),
}


# saved in a world of 2, resumed in a world of 4
MOVES_TO_4 = {"dp2_zero2_to_tp2_dp2_zero1": ((1, 1, 2), (2, 1, 1))}

# tools/reshard_checkpoint.py on the TP2 PP2 ZeRO-1 checkpoint of MOVES_FROM_4:
# name -> ((TP, PP) target, (TP, PP, ZeRO) resumed at, world)
OFFLINE_SOURCE = "tp2_pp2_zero1_to_dp2_zero2"
OFFLINE = {
    "offline_tp1_resumed_dp2_zero2": ((1, 1), (1, 1, 2), 2),
    "offline_tp2_pp2_resumed_tp2_pp2_zero1": ((2, 2), (2, 2, 1), 4),
}


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """First launch: uninterrupted runs and runs stopped at STOP_AT; second: resumed elsewhere,
    each run writing its own metrics file."""
    tmp = tmp_path_factory.mktemp("reshard")
    corpus = make_corpus(tmp / "corpus")
    first, second = [], []
    first4, second4 = [], {4: [], 2: []}
    for name, (saved, resumed, world) in MOVES_FROM_4.items():
        ckpt = tmp / f"ckpt_{name}"
        first4.append(_flags(corpus, saved, tmp / f"{name}_full.jsonl"))
        stop = ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", str(STOP_AT)]
        first4.append(_flags(corpus, saved, tmp / f"{name}_first.jsonl", *stop))
        second4[world].append(
            _flags(corpus, resumed, tmp / f"{name}_resumed.jsonl", "--load", str(ckpt))
        )
    for name, (saved, resumed) in MOVES.items():
        ckpt = tmp / f"ckpt_{name}"
        first.append(_flags(corpus, saved, tmp / f"{name}_full.jsonl"))
        stop = ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", str(STOP_AT)]
        first.append(_flags(corpus, saved, tmp / f"{name}_first.jsonl", *stop))
        second.append(_flags(corpus, resumed, tmp / f"{name}_resumed.jsonl", "--load", str(ckpt)))
    for name, (saved, resumed) in MOVES_TO_4.items():
        ckpt = tmp / f"ckpt_{name}"
        first.append(_flags(corpus, saved, tmp / f"{name}_full.jsonl"))
        stop = ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", str(STOP_AT)]
        first.append(_flags(corpus, saved, tmp / f"{name}_first.jsonl", *stop))
        second4[4].append(
            _flags(corpus, resumed, tmp / f"{name}_resumed.jsonl", "--load", str(ckpt))
        )
    for name, (_, resumed, world) in OFFLINE.items():
        metrics = tmp / f"{name}_resumed.jsonl"
        second4[world].append(_flags(corpus, resumed, metrics, "--load", str(tmp / f"ckpt_{name}")))
    outputs = []
    launches = ((2, first, "first"), (4, first4, "first4"), (4, second4[4], "second4"))
    launches += ((2, second + second4[2], "second"),)
    for world, runs, label in launches:
        result = run(multirun_cmd(world, runs, tmp / f"{label}.json"), timeout=420)
        assert result.returncode == 0, result.stdout[-8000:]
        outputs.append(result.stdout)
        if label == "first4":
            for name, (target, _, _) in OFFLINE.items():
                _reshard_offline(tmp / f"ckpt_{OFFLINE_SOURCE}", tmp / f"ckpt_{name}", *target)
    return tmp, outputs[-1]


def _reshard_offline(load, save, tp, pp):
    cmd = [sys.executable, str(REPO / "tools" / "reshard_checkpoint.py"), "--load", str(load)]
    cmd += ["--save", str(save), "--target-tensor-parallel-size", str(tp)]
    result = run(cmd + ["--target-pipeline-parallel-size", str(pp)], timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]


@pytest.mark.parametrize("name", sorted(MOVES) + sorted(MOVES_FROM_4) + sorted(MOVES_TO_4))
def test_resume_at_another_layout_continues_the_run(moved, name):
    tmp, _ = moved
    full = read_metrics(tmp / f"{name}_full.jsonl")
    assert sorted(read_metrics(tmp / f"{name}_first.jsonl")) == list(range(1, STOP_AT + 1))
    # the resumed launch's own file: it starts after the step it loaded (a fresh start would
    # write iterations 1..ITERS, with the uninterrupted losses: the layouts are equivalent)
    resumed = read_metrics(tmp / f"{name}_resumed.jsonl")
    assert sorted(resumed) == list(range(STOP_AT + 1, ITERS + 1))
    for it in range(STOP_AT + 1, ITERS + 1):
        for key in ("lm-loss", "grad-norm", "learning-rate"):
            assert resumed[it][key] == pytest.approx(full[it][key], rel=1e-5), (it, key)


def test_the_log_says_what_was_carried_over(moved):
    _, output = moved
    assert "saved at TP1 PP1 DP2 ZeRO-2: resharded weights" in output
    assert "saved at TP1 PP1 by tools/reshard_checkpoint.py: resharded weights" in output
    assert "RNG states not restored (another layout)" in output


@pytest.mark.parametrize("name", sorted(OFFLINE))
def test_an_offline_resharded_checkpoint_continues_the_run(moved, name):
    tmp, _ = moved
    full = read_metrics(tmp / f"{OFFLINE_SOURCE}_full.jsonl")
    resumed = read_metrics(tmp / f"{name}_resumed.jsonl")
    assert sorted(resumed) == list(range(STOP_AT + 1, ITERS + 1))
    for it in resumed:
        for key in ("lm-loss", "grad-norm", "learning-rate"):
            assert resumed[it][key] == pytest.approx(full[it][key], rel=1e-5), (it, key)


def test_offline_files_at_the_saved_layout_are_the_files_training_wrote(moved):
    """Resharding TP2 PP2 to TP2 PP2 gives back what the TP2 PP2 ranks wrote: the tool assigns
    each parameter to the pipeline stage DeepSpeed gave it."""
    tmp, _ = moved
    tag = f"global_step{STOP_AT}"
    source = tmp / f"ckpt_{OFFLINE_SOURCE}" / tag
    same = tmp / "ckpt_offline_tp2_pp2_resumed_tp2_pp2_zero1" / tag
    for t in range(2):
        for p in range(2):
            name = f"full_state_tp{t:02d}_pp{p:02d}.pt"
            a = torch.load(source / name, weights_only=True)["entries"]
            b = torch.load(same / name, weights_only=True)["entries"]
            assert a.keys() == b.keys(), name
            for param, entry in a.items():
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(entry[key], b[param][key]), (name, param, key)


def test_the_converter_reads_the_same_weights_from_an_offline_checkpoint(moved):
    tmp, _ = moved
    source = read_checkpoint(str(tmp / f"ckpt_{OFFLINE_SOURCE}")).state_dict
    offline = read_checkpoint(str(tmp / "ckpt_offline_tp1_resumed_dp2_zero2")).state_dict
    assert source.keys() == offline.keys()
    for name, tensor in source.items():
        assert torch.equal(tensor.float(), offline[name]), name


def test_the_data_parallel_ranks_share_the_full_state_writes(moved):
    """Saved at DP2: each DP rank wrote every other parameter, disjoint, together all of them."""
    tmp, _ = moved
    step = tmp / "ckpt_dp2_zero2_to_tp2_zero1" / f"global_step{STOP_AT}"
    first = torch.load(step / "full_state_tp00_pp00.pt", weights_only=True)
    second = torch.load(step / "full_state_tp00_pp00_dp001.pt", weights_only=True)
    assert (first["data_parallel_rank"], second["data_parallel_rank"]) == (0, 1)
    a, b = set(first["entries"]), set(second["entries"])
    assert a and b and not a & b
    names = set(read_checkpoint(str(tmp / "ckpt_dp2_zero2_to_tp2_zero1")).state_dict)
    assert a | b == names
    assert abs(len(a) - len(b)) <= 1
