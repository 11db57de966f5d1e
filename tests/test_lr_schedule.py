"""The LR schedule against megatron-core's OptimizerParamScheduler (test-only oracle), value by
value after every step of whole runs, for every decay style (WSD with each anneal shape), with
constant and varying global batches, iteration- and sample-based spans built from the flags as
Megatron's get_optimizer_param_scheduler builds them; and the flag checks."""

import pytest
import torch

from pretrain.cli import parse_args
from pretrain.errors import UserError
from pretrain.training.schedules.batch_schedule import BatchSchedule
from pretrain.training.schedules.lr_schedule import (
    DECAY_STYLES,
    WSD_DECAY_STYLES,
    LRScheduleConfig,
    SampleLRScheduler,
    spans_in_samples,
)

MAX_LR, MIN_LR, INIT_LR = 3e-3, 3e-4, 1e-5


def megatron_scheduler(style, wsd_style, warmup, decay, wsd):
    """megatron-core's scheduler over a bare param-group holder (all it reads of the optimizer)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return holder, OptimizerParamScheduler(
        holder,
        init_lr=INIT_LR,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=wsd_style,
    )


def ours(style, wsd_style, warmup, decay, wsd, gbs):
    holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    config = LRScheduleConfig(
        lr=MAX_LR,
        min_lr=MIN_LR,
        warmup_init=INIT_LR,
        decay_style=style,
        decay_samples=decay,
        warmup_samples=warmup,
        wsd_decay_samples=wsd if style == "WSD" else None,
        wsd_decay_style=wsd_style,
    )
    return holder, SampleLRScheduler(holder, config, global_batch_size=gbs)


STYLES = [(s, "exponential") for s in DECAY_STYLES if s != "WSD"] + [
    ("WSD", w) for w in WSD_DECAY_STYLES
]


def assert_same_run(style, wsd_style, spans, batches):
    """Step both schedulers by each iteration's batch; every lr equal, bit for bit."""
    m_holder, theirs = megatron_scheduler(style, wsd_style, spans.warmup, spans.decay, spans.wsd)
    o_holder, mine = ours(style, wsd_style, spans.warmup, spans.decay, spans.wsd, batches[0])
    assert o_holder.param_groups[0]["lr"] == m_holder.param_groups[0]["lr"]
    for i, batch in enumerate(batches):
        mine.increment = batch  # what Engine.set_global_batch_size does before each step
        mine.step()  # as DeepSpeed calls it
        theirs.step(increment=batch)  # as Megatron's train_step calls it
        assert o_holder.param_groups[0]["lr"] == m_holder.param_groups[0]["lr"], (i, style)
    # the run went through warmup, decay and the floor
    assert o_holder.param_groups[0]["lr"] == (MAX_LR if style == "constant" else MIN_LR)


@pytest.mark.parametrize("style,wsd_style", STYLES)
@pytest.mark.parametrize("warmup", ["iters", "fraction"])
def test_iteration_based_run_equals_megatron(style, wsd_style, warmup):
    gbs, train_iters = 24, 300
    spans = spans_in_samples(
        train_iters=train_iters,
        train_samples=train_iters * gbs,
        global_batch_size=gbs,
        decay_iters=250,
        decay_samples=None,
        warmup_iters=20 if warmup == "iters" else 0,
        warmup_samples=0,
        warmup_fraction=0.07 if warmup == "fraction" else None,  # 0.07 x 6000: fractional
        wsd_decay_iters=90,
    )
    assert spans.decay == 250 * gbs and spans.wsd == 90 * gbs
    assert_same_run(style, wsd_style, spans, [gbs] * train_iters)


@pytest.mark.parametrize("style,wsd_style", STYLES)
def test_sample_based_run_with_rampup_equals_megatron(style, wsd_style):
    """A ramp-up steps the schedule by each iteration's own batch (Megatron's increment)."""
    batches = BatchSchedule(
        micro_batch_size=2, data_parallel_size=2, global_batch_size=64, rampup=(8, 8, 3000)
    )
    train_samples = 12_000
    spans = spans_in_samples(
        train_iters=None,
        train_samples=train_samples,
        global_batch_size=64,
        decay_iters=None,
        decay_samples=10_001,
        warmup_iters=0,
        warmup_samples=997,
        warmup_fraction=None,
        wsd_decay_samples=4_003,
    )
    consumed, sizes = 0, []
    for _ in range(batches.train_iters(train_samples)):
        sizes.append(batches.global_batch_size_at(consumed))
        consumed += sizes[-1]
    assert len(set(sizes)) == 8  # 8, 16, ..., 64
    assert_same_run(style, wsd_style, spans, sizes)


def test_state_dict_resumes_mid_schedule():
    spans = spans_in_samples(
        train_iters=100,
        train_samples=800,
        global_batch_size=8,
        decay_iters=None,
        decay_samples=None,
        warmup_iters=10,
        warmup_samples=0,
        warmup_fraction=None,
        wsd_decay_iters=30,
    )
    holder, full = ours("WSD", "minus_sqrt", spans.warmup, spans.decay, spans.wsd, 8)
    lrs = []
    for _ in range(100):
        full.step()
        lrs.append(holder.param_groups[0]["lr"])
    holder2, first = ours("WSD", "minus_sqrt", spans.warmup, spans.decay, spans.wsd, 8)
    for _ in range(77):
        first.step()
    holder3, resumed = ours("WSD", "minus_sqrt", spans.warmup, spans.decay, spans.wsd, 8)
    resumed.load_state_dict(first.state_dict())
    assert holder3.param_groups[0]["lr"] == lrs[76]
    for i in range(77, 100):
        resumed.step()
        assert holder3.param_groups[0]["lr"] == lrs[i]


def test_wsd_flags(mock_run_flags):
    base = mock_run_flags
    cfg = parse_args(
        base
        + [
            "--lr-decay-style",
            "WSD",
            "--lr-wsd-decay-style",
            "cosine",
            "--lr-wsd-decay-iters",
            "3",
        ],
        env={},
    )
    assert cfg.schedule.decay_style == "WSD" and cfg.schedule.wsd_decay_style == "cosine"
    assert cfg.schedule.wsd_decay_samples == 3 * 8 and cfg.schedule.decay_samples == 5 * 8
    cfg = parse_args(base + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"], env={})
    assert cfg.schedule.wsd_decay_style == "exponential"  # Megatron's default
    cfg = parse_args(base + ["--lr-decay-style", "inverse-square-root"], env={})
    assert cfg.schedule.decay_style == "inverse-square-root"
    for extra, words in (
        (["--lr-decay-style", "WSD"], "needs the anneal length"),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "8"], "--lr-wsd-decay-samples"),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "9"], "at most the decay span"),
        (["--lr-wsd-decay-style", "quadratic"], "invalid choice"),
    ):
        with pytest.raises(UserError, match=words):
            parse_args(base + extra, env={})


@pytest.fixture
def mock_run_flags():
    from training_fixtures import model_flags, train_flags

    flags = model_flags("gpt2") + train_flags("unused")  # 5 iterations of 8
    return [a for a in flags if a not in ("--data-path", "unused", "--split", "90,10,0")] + [
        "--mock-data"
    ]
