"""Loss spikes (--check-for-spiky-loss, --spiky-loss-policy): a real bad batch, one whose samples
are a single repeated token the corpus never uses otherwise, placed at iteration 9 by rewriting the
tokens `tools/explain_batch.py` says iteration 9 reads (document lengths, and so every index,
unchanged). `warn` trains on it; `skip` and `rewind` end with the losses of a run given
`--iterations-to-skip 9`, exactly (fp32), and so does a resume across the skip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    VOCAB,
    model_flags,
    multirun_cmd,
    multirun_outputs,
    one_rank_multirun,
    read_metrics,
    run,
    train_flags,
)

from pretrain.cli import parse_args
from pretrain.convert.checkpoint_reader import find_checkpoint
from pretrain.data.files.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from pretrain.errors import UserError
from pretrain.training.loop.spikes import is_spike

SPIKE, ITERS, BAD_TOKEN = 9, 12, VOCAB - 1  # the corpus draws ids 0..9 only
DETECT = "--check-for-spiky-loss --spiky-loss-window 4 --spiky-loss-min-window 3 "
DETECT += "--spiky-loss-factor 3"


def test_detector_on_plain_sequences():
    window = [1.0, 2.0, 3.0, 4.0]  # mean 2.5, sample sigma sqrt(5/3) = 1.2909944
    assert not is_spike(window, 2.5 + 2 * 1.2909944 - 1e-6, 2.0, 4)
    assert is_spike(window, 2.5 + 2 * 1.2909945, 2.0, 4)
    assert not is_spike(window, 100.0, 2.0, 5)  # the window is not filled enough yet
    assert not is_spike([5.0, 4.0, 3.0, 2.0], 1.5, 1.0, 2)  # a falling loss never is
    assert not is_spike(window, math.nan, 1.0, 2) and not is_spike(window, math.inf, 1.0, 2)
    assert is_spike([3.0, 3.0, 3.0], 3.0 + 1e-9, 6.0, 3)  # flat: anything above it


def _write(prefix, docs) -> str:
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


def _flags(prefix: str, *extra: str) -> list[str]:
    flags = model_flags("gpt2") + train_flags(prefix, iters=ITERS) + ["--lr", "1e-2"]
    return flags + [x for e in extra for x in e.split()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A corpus whose iteration-9 batch is all BAD_TOKEN (EODs kept), other batches skewed ids
    0..9: the prefix's documents written again with iteration 9's token ranges replaced."""
    root = tmp_path_factory.mktemp("spikes")
    rng = np.random.default_rng(0)
    p = 1 / np.arange(1, 11) ** 2
    docs = [
        np.append(rng.choice(10, size=int(rng.integers(5, 60)), p=p / p.sum()), VOCAB)
        for _ in range(300)
    ]
    clean = _write(root / "clean", docs)
    tool = [PYTHON, str(REPO / "tools" / "explain_batch.py"), *_flags(clean)]
    out = run([*tool, "--iteration", str(SPIKE), "--json"], timeout=200)
    assert out.returncode == 0, out.stdout[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [r["sample"] for r in rows] == list(range(64, 72))  # gbs 8
    for row in rows:
        for doc, first, end in row["documents"]:
            part = docs[doc][first:end]
            docs[doc][first:end] = np.where(part == VOCAB, VOCAB, BAD_TOKEN)
    return _write(root / "bad", docs)


TORCH = "--use-torch-fsdp2"
# a save every iteration, written in the background: the one staged at SPIKE - 1 is pending at
# the spike (torch backend: DeepSpeed's saves block)
REWIND_ASYNC = f"--spiky-loss-policy rewind {TORCH} --async-save --save-interval 1"


def _losses(metrics: dict) -> dict[int, float]:
    return {i: m["lm-loss"] for i, m in metrics.items() if "lm-loss" in m}


# name -> what the run adds to _flags(corpus) ({tmp}: the runs' folder), in the order they run,
# one after another in one process (tests/training_multirun.py)
POLICY_RUNS = {
    "ref": f"--iterations-to-skip {SPIKE}",
    "plain": "",
    "warn": DETECT,
    "skip": f"{DETECT} --spiky-loss-policy skip --save {{tmp}}/skip "
    "--save-interval 5 --exit-interval 10",
    "skip_resumed": f"{DETECT} --spiky-loss-policy skip --save {{tmp}}/skip "
    "--load {tmp}/skip --save-interval 5",
    "before": f"{DETECT} --spiky-loss-policy skip --save {{tmp}}/before --exit-interval 6",
    "before_resumed": f"{DETECT} --spiky-loss-policy skip --save {{tmp}}/before "
    "--load {tmp}/before --save-interval 100",
    "rewind": f"{DETECT} --spiky-loss-policy rewind --save {{tmp}}/rewind --save-interval 6",
    "rewind_without": f"{DETECT} --spiky-loss-policy rewind --save {{tmp}}/rewind_without "
    "--save-interval 10",
    "torch_ref": f"{TORCH} --iterations-to-skip {SPIKE}",
    "rewind_async": f"{DETECT} {REWIND_ASYNC} --save {{tmp}}/rewind_async",
}


@pytest.fixture(scope="module")
def policy_runs(corpus, tmp_path_factory) -> tuple[Path, dict[str, tuple[str, dict]]]:
    """Every one-rank run of POLICY_RUNS in one process, each with its own metrics file: (the
    runs' folder, name -> (the run's output, its metrics by iteration))."""
    tmp = tmp_path_factory.mktemp("policies")
    argvs = [
        _flags(corpus, extra.format(tmp=tmp), f"--metrics-file {tmp / name}.jsonl")
        for name, extra in POLICY_RUNS.items()
    ]
    result = one_rank_multirun(argvs, tmp / "runs.json", timeout=900)
    assert result.returncode == 0, result.stdout[-4000:]
    outputs = multirun_outputs(result.stdout)
    assert len(outputs) == len(POLICY_RUNS), result.stdout[-4000:]
    return tmp, {
        name: (output, read_metrics(tmp / f"{name}.jsonl"))
        for name, output in zip(POLICY_RUNS, outputs, strict=True)
    }


@pytest.fixture(scope="module")
def reference(policy_runs) -> dict[int, float]:
    """The losses of the run given --iterations-to-skip 9."""
    _, metrics = policy_runs[1]["ref"]
    assert sorted(_losses(metrics)) == [i for i in range(1, ITERS + 1) if i != SPIKE]
    return _losses(metrics)


def _spike_lines(output: str) -> list[str]:
    return [x for x in output.splitlines() if "is a spike" in x]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_warn_trains_on_the_spike_as_without_the_check(policy_runs, reference):
    (_, plain), (out, warned) = policy_runs[1]["plain"], policy_runs[1]["warn"]
    lines = _spike_lines(out)
    assert len(lines) == 1 and lines[0].startswith(f"WARNING: iteration {SPIKE}: lm loss ")
    assert lines[0].endswith("training on it (--spiky-loss-policy warn)")
    assert _losses(warned) == _losses(plain)  # warn changes nothing
    # the spike was trained on: its loss is far above the others, and later losses differ
    assert _losses(plain)[SPIKE] > 1.5 * _losses(plain)[SPIKE - 1]
    assert all(_losses(plain)[i] != reference[i] for i in range(SPIKE + 1, ITERS + 1))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_skip_equals_iterations_to_skip_and_resumes_exactly(policy_runs, reference):
    tmp, runs = policy_runs
    ckpt = str(tmp / "skip")
    out, first = runs["skip"]
    assert (
        " iteration        9 | skipped (--spiky-loss-policy skip, lm loss " in out
        and "training samples [64, 72) consumed without a step" in out
    )
    assert len(_spike_lines(out)) == 1
    assert _losses(first) == {i: reference[i] for i in reference if i <= 10}
    _, meta = find_checkpoint(ckpt, 10)
    assert meta["skipped_train_samples"] == [[64, 72]]
    assert len(meta["spike_loss_window"]) == 4  # the window is in the checkpoint

    # a resume across the skip: the resumed run writes its own metrics, from iteration 11
    _, resumed = runs["skip_resumed"]
    assert _losses(resumed) == {i: reference[i] for i in (11, 12)}
    _, meta = find_checkpoint(ckpt, 12)
    assert meta["skipped_train_samples"] == [[64, 72]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_before_the_spike_detects_it_from_the_saved_window(policy_runs, reference):
    out, first = policy_runs[1]["before"]
    assert _spike_lines(out) == [] and sorted(_losses(first)) == list(range(1, 7))
    # a fresh window would hold only iterations 7 and 8 at the spike (< --spiky-loss-min-window)
    out, resumed = policy_runs[1]["before_resumed"]
    assert len(_spike_lines(out)) == 1
    assert _losses(resumed) == {i: reference[i] for i in reference if i > 6}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rewind_reloads_the_checkpoint_and_skips_the_batch(policy_runs, reference):
    tmp, runs = policy_runs
    ckpt = str(tmp / "rewind")
    out, metrics = runs["rewind"]
    assert "rewound to iteration 6 (--spiky-loss-policy rewind)" in out
    assert f"loaded checkpoint {ckpt}/global_step6 at iteration 6" in out
    assert (
        " iteration        9 | skipped (--spiky-loss-policy rewind): training samples [64, 72)"
        in (out)
    )
    lines = (tmp / "rewind.jsonl").read_text().splitlines()
    trained = [json.loads(x)["iteration"] for x in lines if "lm-loss" in x]
    assert trained == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 10, 11, 12]  # 7 and 8 again after the rewind
    assert _losses(metrics) == reference
    _, meta = find_checkpoint(ckpt, 12)
    assert meta["skipped_train_samples"] == [[64, 72]] and meta["spike_pending_skips"] == []


def _rewound_to_the_pending_step(out: str, ckpt: Path, lines: list[str]) -> None:
    """The rewind of an --async-save run went to SPIKE - 1, staged just before the spike, and no
    save after it was refused; `lines`: the run's metrics file."""
    assert f"rewound to iteration {SPIKE - 1} (--spiky-loss-policy rewind)" in out, out[-4000:]
    assert f"loaded checkpoint {ckpt}/global_step{SPIKE - 1} at iteration {SPIKE - 1}" in out
    assert "from an earlier run" not in out and "not saving iteration" not in out
    trained = [json.loads(x)["iteration"] for x in lines if "lm-loss" in x]
    assert trained == [i for i in range(1, ITERS + 1) if i != SPIKE]  # nothing to train again
    _, meta = find_checkpoint(str(ckpt), ITERS)
    assert meta["skipped_train_samples"] == [[64, 72]] and meta["spike_pending_skips"] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rewind_under_async_save_goes_to_the_pending_step(policy_runs):
    """The torch backend with --async-save every iteration: the save of iteration 8 is still
    pending at the spike; the rewind commits it first and goes to it (it used to go to 7, and
    then the pending save was committed after the rewind, and the second save of 8 refused as
    "from an earlier run"). The losses are the --iterations-to-skip run's."""
    tmp, runs = policy_runs
    out, metrics = runs["rewind_async"]
    lines = (tmp / "rewind_async.jsonl").read_text().splitlines()
    _rewound_to_the_pending_step(out, tmp / "rewind_async", lines)
    assert _losses(metrics) == _losses(runs["torch_ref"][1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rewind_without_a_checkpoint_skips(policy_runs, reference):
    out, metrics = policy_runs[1]["rewind_without"]
    assert "--spiky-loss-policy rewind: no committed checkpoint in --save yet; skipping" in out
    assert _losses(metrics) == reference


TWO_RANK_LAYOUTS = {
    "dp2-zero2": "--zero-stage 2",
    "pp2": "--pipeline-model-parallel-size 2",
    "torch-pp2-zbv": "--use-torch-fsdp2 --pipeline-model-parallel-size 2 --num-layers 4 "
    "--num-virtual-stages-per-pipeline-rank 2 --pipeline-schedule zbv-zero-bubble",
}

ASYNC_LAYOUT = "torch-pp2-zbv"  # --async-save is the torch backend's


@pytest.fixture(scope="module")
def two_rank_runs(corpus, tmp_path_factory) -> tuple[Path, dict[tuple[str, str], tuple[str, dict]]]:
    """One two-rank launch of tests/training_multirun.py: at each layout of TWO_RANK_LAYOUTS,
    with dropout, the --iterations-to-skip run ("ref") and the skip-policy run ("skip"), and at
    ASYNC_LAYOUT the rewind policy under --async-save ("rewind_async"): (the runs' folder,
    (layout, name) -> (the run's output, its losses)). Each run ends in a barrier on every rank,
    so its lines come before rank 0's header of the next run."""
    tmp, runs = tmp_path_factory.mktemp("two_ranks"), {}
    for layout, flags in TWO_RANK_LAYOUTS.items():
        layout_flags = f"{flags} --hidden-dropout 0.1 --attention-dropout 0.1"
        for name, extra in (("ref", f"--iterations-to-skip {SPIKE}"), ("skip", DETECT)):
            policy = "--spiky-loss-policy skip" if name == "skip" else ""
            metrics = tmp / f"{layout}-{name}.jsonl"
            runs[layout, name] = (_flags(corpus, extra, policy, layout_flags), metrics)
    pp2 = TWO_RANK_LAYOUTS[ASYNC_LAYOUT] + " --hidden-dropout 0.1 --attention-dropout 0.1"
    rewind = f"{DETECT} {REWIND_ASYNC} --save {tmp / 'rewind_async'}"
    runs[ASYNC_LAYOUT, "rewind_async"] = (_flags(corpus, rewind, pp2), tmp / "rewind_async.jsonl")
    argvs = [[*flags, "--metrics-file", str(metrics)] for flags, metrics in runs.values()]
    out = run(multirun_cmd(2, argvs, tmp / "runs.json"), timeout=900)
    assert out.returncode == 0, out.stdout[-4000:]
    outputs = multirun_outputs(out.stdout)
    assert len(outputs) == len(runs), out.stdout[-4000:]
    return tmp, {
        key: (output, _losses(read_metrics(metrics)))
        for (key, (_, metrics)), output in zip(runs.items(), outputs, strict=True)
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", sorted(TWO_RANK_LAYOUTS))
def test_two_ranks_take_the_same_decision(two_rank_runs, layout):
    """Two ranks, with dropout. DP = 2 under ZeRO-2: each rank sees half the batch, the decision
    comes from the DP-averaged loss, DeepSpeed's own step frees the gradient partitions. PP = 2:
    the pipeline engine steps inside train_batch; the judge runs at its optimizer step, on the
    last stage's loss broadcast to the first. Either way the skip run equals the
    --iterations-to-skip run at the same layout (RNG states put back, too)."""
    runs = two_rank_runs[1]
    (_, ref), (out, skip) = runs[layout, "ref"], runs[layout, "skip"]
    lines = _spike_lines(out)  # warnings come from every rank
    assert len(lines) == 2 and all("update withheld" in x for x in lines)
    assert skip == ref and SPIKE not in skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rewind_under_async_save_at_pp2_goes_to_the_pending_step(two_rank_runs):
    """test_rewind_under_async_save_goes_to_the_pending_step at PP 2 (the torch backend's ZBV
    schedule, two chunks per rank, dropout): every rank waits for the pending save before the
    rewind, and the losses are the --iterations-to-skip run's at the same layout."""
    tmp, runs = two_rank_runs
    (out, rewound), (_, ref) = (runs[ASYNC_LAYOUT, k] for k in ("rewind_async", "ref"))
    lines = (tmp / "rewind_async.jsonl").read_text().splitlines()
    _rewound_to_the_pending_step(out, tmp / "rewind_async", lines)
    assert rewound == ref


def test_policies_refused_where_they_cannot_work(tmp_path):
    corpus = _write(tmp_path / "c", [np.array([1, 2, 3, VOCAB])] * 20)
    cases = [
        ("--spiky-loss-policy rewind", "--spiky-loss-policy rewind needs --save"),
        ("--spiky-loss-window 8 --spiky-loss-min-window 9", "need 2 <= min-window"),
        ("--spiky-loss-factor 0", "--spiky-loss-factor 0.0: must be a finite number > 0"),
    ]
    for extra, message in cases:
        with pytest.raises(UserError, match=message):
            parse_args(_flags(corpus, DETECT, extra), env={})
    cfg = parse_args(_flags(corpus, "--check-for-spiky-loss"), env={}).training.spikes
    assert (cfg.policy, cfg.window, cfg.factor, cfg.required) == ("warn", 128, 6.0, 64)
