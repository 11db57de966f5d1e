"""Batch-size schedules: --rampup-batch-size against megatron-core 0.16's
RampupBatchsizeNumMicroBatchesCalculator (test-only oracle) value by value;
--step-batch-size-schedule against Megatron-LM main's documented examples, worked by hand (the
calculator that implements it, StepBatchsizeNumMicroBatchesCalculator, ships only in
megatron-core >= 0.18, which cannot be installed beside the 0.16 oracle); the flag checks; and
real pretrain_gpt.py runs under a ramp-up: the log's consumed samples, global batch size and
learning rate follow the calculator and megatron-core's OptimizerParamScheduler, a run resumed
mid-ramp-up gives the uninterrupted run's losses, DP=2 and PP=2 give DP=1's, and the equivalent
step schedule gives the same run."""

import json
import re

import pytest
import torch
from training_fixtures import (
    VOCAB,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    multirun_outputs,
    run,
)

from pretrain.cli import parse_args
from pretrain.errors import UserError
from pretrain.training.schedules.batch_schedule import BatchSchedule, parse_step_schedule


def megatron_rampup(start, increment, samples, gbs, mbs, dp):
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator,
    )

    return RampupBatchsizeNumMicroBatchesCalculator(
        gbs, mbs, dp, False, 1, start, increment, samples
    )


def megatron_train_iters(calc, rampup_samples, train_samples, gbs):
    """megatron/training/training.py update_train_iters (0.16) with the calculator driving it."""
    iterations = consumed = 0
    while consumed <= rampup_samples and consumed <= train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    calc.update(0, consistency_check=False)
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


RAMPUPS = [
    # start, increment, samples, final gbs, mbs, dp
    (16, 8, 300_000, 1024, 1, 8),  # Megatron's documented example
    (32, 32, 1000, 256, 4, 2),
    (3, 3, 50, 30, 3, 1),  # 50 / 9 samples per increment: a float step
    (8, 8, 1, 64, 2, 4),  # one ramp-up sample: the final size after the first batch
    (4, 4, 40, 12, 2, 2),  # the real runs below
]


@pytest.mark.parametrize("start,increment,samples,gbs,mbs,dp", RAMPUPS)
def test_rampup_equals_megatron_calculator(start, increment, samples, gbs, mbs, dp):
    ours = BatchSchedule(
        micro_batch_size=mbs,
        data_parallel_size=dp,
        global_batch_size=gbs,
        rampup=(start, increment, samples),
    )
    calc = megatron_rampup(start, increment, samples, gbs, mbs, dp)
    step = max(1, samples // 5000)
    for consumed in list(range(0, samples + 3 * gbs, step)) + [samples, samples + 1]:
        calc.update(consumed, consistency_check=False)
        assert ours.global_batch_size_at(consumed) == calc.get_current_global_batch_size(), consumed
        assert ours.num_microbatches_at(consumed) == calc.get(), consumed
    for train_samples in (1, samples // 3 + 1, samples, samples + 7 * gbs + 5):
        want = megatron_train_iters(calc, samples, train_samples, gbs)
        assert ours.train_iters(train_samples) == want, train_samples


def test_step_schedule_parses_megatron_examples():
    # Megatron-LM main, examples/gpt3/train_gpt3_175b_distributed.sh (seq 2048): tokens / 2048
    gpt3 = parse_step_schedule("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert gpt3 == (
        (0, 16),
        (1_171_875, 320),
        (2_343_750, 624),
        (3_515_625, 928),
        (4_687_500, 1232),
        (5_859_375, 1536),
    )
    # training_config.py's docstring example, unordered, commas, lower-case suffixes, no seq length
    assert parse_step_schedule("500b:3072, 0:768 250B:1536 750B:6144", None) == (
        (0, 768),
        (250 * 10**9, 1536),
        (500 * 10**9, 3072),
        (750 * 10**9, 6144),
    )
    assert parse_step_schedule("0:1k 1.5K:2K", 1) == ((0, 1000), (1500, 2000))


def test_step_schedule_batches_by_hand():
    steps = parse_step_schedule("0:4 320:8 640:12", 16)  # thresholds 20 and 40 samples
    s = BatchSchedule(micro_batch_size=2, data_parallel_size=2, global_batch_size=12, steps=steps)
    expect = {0: 4, 19: 4, 20: 8, 39: 8, 40: 12, 10**9: 12}
    assert {c: s.global_batch_size_at(c) for c in expect} == expect
    assert [s.num_microbatches_at(c) for c in (0, 20, 40)] == [1, 2, 3]
    # Megatron-LM main counts iterations until the samples are reached (a last batch may overshoot)
    # 0,4,8,12,16 -> 20 (5 x 4), 20,28,36 -> 44 (3 x 8), then 12s: 56, 68, 80, 92
    assert s.train_iters(92) == 12 and s.train_iters(81) == 12 and s.train_iters(80) == 11


@pytest.mark.parametrize(
    "text,words",
    [
        ("", "is empty"),
        ("0:4 100", 'entry "100" has no ":"'),
        ("16:4 100:8", "first threshold must be 0"),
        ("0:4 0:8", "thresholds must increase"),
        ("0:4 10:8", "thresholds must increase"),  # 10 tokens // 16 = 0 samples
        ("0:4 1X:8", "not THRESHOLD:BATCH"),
        ("0:0", "must be positive"),
    ],
)
def test_step_schedule_bad_input(text, words):
    with pytest.raises(UserError, match=re.escape(words)):
        parse_step_schedule(text, 16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("batch") / "corpus")


def run_flags(corpus, *schedule, samples=92):
    """A tiny GPT trained by samples (a batch schedule needs --train-samples), WSD schedule."""
    return model_flags("gpt2") + [
        "--micro-batch-size",
        "2",
        "--train-samples",
        str(samples),
        *schedule,
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-warmup-samples",
        "16",
        "--lr-decay-style",
        "WSD",
        "--lr-wsd-decay-style",
        "linear",
        "--lr-wsd-decay-samples",
        "40",
        "--clip-grad",
        "1.0",
        "--seed",
        "7",
        "--data-path",
        corpus,
        "--split",
        "90,10,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        "--log-interval",
        "1",
        "--eval-interval",
        "5",
        "--eval-iters",
        "1",
        "--num-workers",
        "0",
        "--distributed-backend",
        "gloo",
    ]


RAMP = ["--rampup-batch-size", "4", "4", "40", "--global-batch-size", "12"]
STEPS = ["--step-batch-size-schedule", "0:4 320:8 640:12"]  # seq 16: the same batches as RAMP


def _world(n):
    env = {"RANK": "0", "WORLD_SIZE": str(n), "LOCAL_RANK": "0"}
    return env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def test_schedule_flags(corpus):
    cfg = parse_args(run_flags(corpus, *RAMP), env=_world(2))
    s = cfg.training.batch_schedule
    assert s.rampup == (4, 4, 40) and cfg.training.global_batch_size == 12
    assert cfg.training.train_iters == 12 and cfg.training.num_microbatches == 3
    cfg = parse_args(run_flags(corpus, *STEPS), env=_world(2))
    assert cfg.training.batch_schedule.steps == ((0, 4), (20, 8), (40, 12))
    assert cfg.training.global_batch_size == 12 and cfg.training.train_iters == 12
    assert (
        parse_args(run_flags(corpus, "--global-batch-size", "12"), env={}).training.batch_schedule
        is None
    )
    for flags, env, words in (
        (RAMP, _world(4), "--global-batch-size 12 is not divisible by --micro-batch-size 2"),
        (
            ["--rampup-batch-size", "2", "2", "40", "--global-batch-size", "12"],
            _world(2),
            "global batch size(s) 2, 6, 10 are not divisible by --micro-batch-size 2 x",
        ),
        (STEPS + ["--global-batch-size", "12"], {}, "are exclusive"),
        (RAMP + STEPS, {}, "are exclusive"),
        (
            ["--rampup-batch-size", "5", "4", "40", "--global-batch-size", "12"],
            {},
            "not a multiple",
        ),
        (["--rampup-batch-size", "16", "4", "40", "--global-batch-size", "12"], {}, "larger than"),
        (["--rampup-batch-size", "4", "4", "0", "--global-batch-size", "12"], {}, "SAMPLES must"),
    ):
        with pytest.raises(UserError, match=re.escape(words)):
            parse_args(run_flags(corpus, *flags), env=env)
    by_iterations = {
        "--train-samples": "--train-iters",
        "--lr-warmup-samples": "--lr-warmup-iters",
        "--lr-wsd-decay-samples": "--lr-wsd-decay-iters",
    }
    iteration_based = [by_iterations.get(a, a) for a in run_flags(corpus, *RAMP)]
    with pytest.raises(UserError, match="needs sample-based training: use --train-samples"):
        parse_args(iteration_based, env={})


# ---- real runs ------------------------------------------------------------------------------

STOP_AT = 6  # consumed 28 samples: inside the ramp-up (batch 8 of 4 -> 8 -> 12)
RTOL = 1e-5
GBS_LINE = re.compile(
    r" iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.* global batch size:\s+(\d+) \|"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("ramp")

    def flags(name, *extra, schedule=RAMP, layout=(1, 1, 0)):
        return (
            run_flags(corpus, *schedule)
            + layout_flags(*layout)
            + [
                "--metrics-file",
                str(tmp / f"{name}.jsonl"),
                *extra,
            ]
        )

    ckpt = ["--save", str(tmp / "ckpt"), "--save-interval", "100"]
    one = [
        flags("dp1"),
        flags("steps", schedule=STEPS),
        flags("resumed", *ckpt, "--exit-interval", str(STOP_AT)),
    ]
    resume = flags("resumed", "--load", str(tmp / "ckpt"))  # after the stopped run, same launch
    two = [flags("dp2", layout=(1, 1, 1)), flags("pp2", layout=(1, 2, 0))]
    out = {}
    for world, argvs, label in ((1, [*one, resume], "one"), (2, two, "two")):
        result = run(multirun_cmd(world, argvs, tmp / f"{label}.json"), timeout=400)
        assert result.returncode == 0, result.stdout[-8000:]
        out[label] = result.stdout
    *first, out["resume"] = multirun_outputs(out["one"])  # one rank: split exactly per run
    out["one"] = "".join(first)
    names = ("dp1", "steps", "resumed", "dp2", "pp2")
    return {n: merged_metrics(tmp / f"{n}.jsonl") for n in names}, out


def merged_metrics(path):
    """iteration -> every recorded scalar (training and validation lines merged); a resumed
    run's later lines replace the earlier ones."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record.pop("iteration"), {}).update(record)
    return out


TIMING = ("iteration-time", "tokens-per-second", "tflops-per-device")


def without_timing(metrics):
    return {i: {k: v for k, v in r.items() if k not in TIMING} for i, r in metrics.items()}


def megatron_iterations(train_iters=12):
    """(consumed after, batch, lr before the step, lr after it) per iteration, from megatron-core's
    calculator and OptimizerParamScheduler with the spans run_flags gives."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    calc = megatron_rampup(4, 4, 40, 12, 2, 1)
    holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(
        holder, 0.0, 3e-3, 3e-4, 16, 92, "WSD", 0.01, 0.01, 92, "constant",
        wsd_decay_steps=40, lr_wsd_decay_style="linear",
    )  # fmt: skip
    consumed, out = 0, []
    for _ in range(train_iters):
        calc.update(consumed, consistency_check=True)
        batch = calc.get_current_global_batch_size()
        before = holder.param_groups[0]["lr"]
        sched.step(increment=batch)
        consumed += batch
        out.append((consumed, batch, before, holder.param_groups[0]["lr"]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_rampup_run_follows_megatron(runs):
    metrics, out = runs
    expected = megatron_iterations()
    got = metrics["dp1"]
    assert sorted(got) == list(range(1, 13))
    assert [got[i]["consumed-samples"] for i in got] == [e[0] for e in expected]
    assert [got[i]["global-batch-size"] for i in got] == [e[1] for e in expected]
    logged = {int(m[1]): (int(m[3]), int(m[4])) for m in GBS_LINE.finditer(out["one"])}
    assert logged[12] == (92, 12) and logged[1] == (4, 4) and logged[7] == (36, 8)
    # the metrics file records the lr either before or after the step (see logging.py); whichever
    # it is, every value equals megatron-core's
    lrs = [got[i]["learning-rate"] for i in sorted(got)]
    assert lrs in ([e[2] for e in expected], [e[3] for e in expected]), lrs


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_resume_mid_rampup_and_other_layouts_give_the_same_losses(runs):
    metrics, out = runs
    ref = metrics["dp1"]
    assert "global batch 8 at 28 consumed samples, 12 at the end" in out["resume"]
    # bit for bit: loss, grad norm, lr, consumed samples, batch, validation loss
    assert without_timing(metrics["resumed"]) == without_timing(ref)
    assert "validation-loss" in ref[5] and "validation-loss" in ref[10]
    # the step schedule with the same batches is the same run
    assert without_timing(metrics["steps"]) == without_timing(ref)
    for name in ("dp2", "pp2"):
        got = metrics[name]
        assert sorted(got) == sorted(ref)
        for i in ref:
            assert got[i]["global-batch-size"] == ref[i]["global-batch-size"]
            assert abs(got[i]["lm-loss"] - ref[i]["lm-loss"]) <= RTOL * ref[i]["lm-loss"], (name, i)
    # every iteration took an optimizer step (random tokens: the loss itself need not fall)
    assert all(r["grad-norm"] > 0 for r in ref.values())
    assert len({r["lm-loss"] for r in ref.values()}) == len(ref)
