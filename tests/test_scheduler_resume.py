"""Resuming a changed LR schedule decides as megatron-core's `OptimizerParamScheduler.load_state_dict`
(test-only oracle): refused where it asserts, this run's schedule with
--override-opt_param-scheduler, the checkpoint's with --use-checkpoint-opt_param-scheduler; the
learning rate after the load and after further steps equal, bit for bit. Spans are built by hand
as Megatron's get_optimizer_param_scheduler builds them (iteration flags x global batch)."""

import pytest
import torch

from pretrain.cli import parse_args
from pretrain.errors import UserError
from pretrain.training.checkpoints.checkpointing import CheckpointConfig
from pretrain.training.checkpoints.scheduler_resume import resolve
from pretrain.training.schedules.lr_schedule import LRScheduleConfig, SampleLRScheduler

GBS, SAVED_AT, FURTHER = 8, 40, 6
# The run that saved: --train-iters 40 (the decay span) --lr-warmup-iters 4, cosine.
SAVED = dict(max_lr=3e-4, min_lr=3e-5, warmup=4 * GBS, decay=40 * GBS, style="cosine")
CHANGES = {
    "train_iters_44": dict(decay=44 * GBS),  # issue 25: --train-iters 44, default decay span
    "lr": dict(max_lr=1e-4),
    "min_lr": dict(min_lr=0.0),
    "warmup_fraction": dict(warmup=0.05 * 44 * GBS, decay=44 * GBS),
    "style": dict(style="linear"),
    "nothing": {},
}
MODES = {
    "neither": dict(override=False, use_checkpoint=False),
    "override": dict(override=True, use_checkpoint=False),
    "use_checkpoint": dict(override=False, use_checkpoint=True),
}


def _holder():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def megatron(values, *, override=False, use_checkpoint=False):
    """megatron-core's scheduler for these flags (weight decay constant, its span fixed)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    holder = _holder()
    return holder, OptimizerParamScheduler(
        holder,
        init_lr=0.0,
        max_lr=values["max_lr"],
        min_lr=values["min_lr"],
        lr_warmup_steps=values["warmup"],
        lr_decay_steps=values["decay"],
        lr_decay_style=values["style"],
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=40 * GBS,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=use_checkpoint,
        override_opt_param_scheduler=override,
    )


def ours(values):
    holder = _holder()
    config = LRScheduleConfig(
        lr=values["max_lr"],
        min_lr=values["min_lr"],
        warmup_samples=values["warmup"],
        decay_samples=values["decay"],
        decay_style=values["style"],
    )
    return holder, SampleLRScheduler(holder, config, global_batch_size=GBS)


def _saved_states():
    """Both schedulers after SAVED_AT iterations of the saved run: their state_dicts."""
    _, theirs = megatron(SAVED)
    _, mine = ours(SAVED)
    for _ in range(SAVED_AT):
        theirs.step(increment=GBS)
        mine.step()
    return theirs.state_dict(), mine.state_dict()


def _megatron_lrs(state, flags, mode):
    """megatron-core's lrs after load_state_dict(state) and FURTHER steps; None if it asserts."""
    holder, theirs = megatron(flags, **mode)
    try:
        theirs.load_state_dict(state)
    except AssertionError as err:
        assert "do not match" in str(err)
        return None
    lrs = [holder.param_groups[0]["lr"]]
    for _ in range(FURTHER):
        theirs.step(increment=GBS)
        lrs.append(holder.param_groups[0]["lr"])
    return lrs


def _our_lrs(state, flags, mode):
    """Our lrs after the load, `resolve` and FURTHER steps; the UserError if refused."""
    holder, mine = ours(flags)
    mine.load_state_dict(state)
    config = CheckpointConfig(
        load="CKPT",
        override_opt_param_scheduler=mode["override"],
        use_checkpoint_opt_param_scheduler=mode["use_checkpoint"],
    )
    try:
        resolve(mine, config)
    except UserError as err:
        return err
    lrs = [holder.param_groups[0]["lr"]]
    for _ in range(FURTHER):
        mine.step()
        lrs.append(holder.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_resume_decides_as_megatron(change, mode):
    flags = {**SAVED, **CHANGES[change]}
    megatron_state, our_state = _saved_states()
    expected = _megatron_lrs(megatron_state, flags, MODES[mode])
    # our checkpoint's state, and megatron-core's own state_dict (the same names), decide alike
    for state in (our_state, megatron_state):
        got = _our_lrs(state, flags, MODES[mode])
        if expected is None:
            assert isinstance(got, UserError), (change, mode, got)
            line = str(got)
            assert "\n" not in line and line.startswith("--load CKPT: ")
            assert "--override-opt_param-scheduler" in line
            assert "--use-checkpoint-opt_param-scheduler" in line
        else:
            assert got == expected, (change, mode)
    # megatron-core asserts exactly where a value differs and neither flag is given
    assert (expected is None) == (mode == "neither" and change != "nothing")


def test_refusal_names_each_differing_value():
    _, state = _saved_states()
    flags = {**SAVED, "decay": 44 * GBS, "max_lr": 1e-4}
    line = str(_our_lrs(state, flags, MODES["neither"]))
    assert "max_lr (--lr) 0.0003 in the checkpoint, 0.0001 now" in line
    assert "lr_decay_steps (--lr-decay-iters/-samples" in line
    assert "320 in the checkpoint, 352 now" in line
    assert "min_lr" not in line and "lr_decay_style" not in line


def test_megatron_loads_our_state_dict():
    """Our checkpoint's scheduler state is one megatron-core's load_state_dict reads (its names)."""
    _, state = _saved_states()
    flags = {**SAVED, "decay": 44 * GBS}
    for mode in ("override", "use_checkpoint"):
        holder, theirs = megatron(flags, **MODES[mode])
        theirs.load_state_dict(state)
        assert [holder.param_groups[0]["lr"]] == _our_lrs(state, flags, MODES[mode])[:1]


def test_checkpoint_written_before_megatron_names():
    """A state saved under our earlier names (`num_samples`, `decay_samples`, ...) decides alike."""
    _, state = _saved_states()
    old = {
        "num_samples": state["num_steps"],
        "max_lr": state["max_lr"],
        "min_lr": state["min_lr"],
        "warmup_samples": state["lr_warmup_steps"],
        "decay_samples": state["lr_decay_steps"],
        "style": state["lr_decay_style"],
        "warmup_init": 0.0,
        "wsd_decay_samples": None,
        "wsd_style": "exponential",
    }
    flags = {**SAVED, "decay": 44 * GBS}
    for mode in MODES.values():
        new, before = _our_lrs(state, flags, mode), _our_lrs(old, flags, mode)
        assert str(new) == str(before) if isinstance(new, UserError) else new == before


def test_a_value_the_checkpoint_lacks_comes_from_the_flags():
    _, state = _saved_states()
    flags = {**SAVED, "decay": 44 * GBS}
    position_only = {"num_steps": state["num_steps"]}
    lacks_decay = {k: v for k, v in state.items() if k != "lr_decay_steps"}
    expected = _megatron_lrs(state, flags, MODES["override"])
    for mode in MODES.values():
        assert _our_lrs(position_only, flags, mode) == expected
        assert _our_lrs(lacks_decay, flags, mode) == expected


def test_the_checkpoints_wsd_needs_the_anneal_from_the_flags():
    """WSD's anneal comes from the flags (megatron-core's state_dict omits it)."""
    _, mine = ours({**SAVED, "style": "WSD"})
    mine.use_values({"wsd_decay_steps": 8 * GBS})
    for _ in range(SAVED_AT):
        mine.step()
    wsd_state = mine.state_dict()
    refused = _our_lrs(wsd_state, SAVED, MODES["use_checkpoint"])
    assert isinstance(refused, UserError) and "give --lr-wsd-decay-iters/-samples" in str(refused)
    assert isinstance(_our_lrs(wsd_state, SAVED, MODES["neither"]), UserError)
    expected = _megatron_lrs(wsd_state, SAVED, MODES["override"])
    assert _our_lrs(wsd_state, SAVED, MODES["override"]) == expected


def test_both_flags_are_refused(mock_run_flags):
    both = ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]
    with pytest.raises(UserError, match="are exclusive"):
        parse_args(mock_run_flags + both, env={})
    with pytest.raises(AssertionError, match="both override and use-checkpoint"):
        megatron(SAVED, override=True, use_checkpoint=True)
    for flag in both:
        config = parse_args(mock_run_flags + [flag], env={}).checkpoint
        assert (config.override_opt_param_scheduler, config.use_checkpoint_opt_param_scheduler) == (
            flag == both[0],
            flag == both[1],
        )


@pytest.fixture
def mock_run_flags():
    from training_fixtures import model_flags, train_flags

    flags = model_flags("gpt2") + train_flags("unused")
    return [a for a in flags if a not in ("--data-path", "unused", "--split", "90,10,0")] + [
        "--mock-data"
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_run_resumed_with_a_longer_train_iters(tmp_path):
    """Train 4 iterations and save; resume with --train-iters 6 (a decay over 48 samples, not
    32): refused in one line; with either flag the logged lr of iterations 5 and 6 is
    megatron-core's for that flag; --finetune at another layout starts the schedule at 0."""
    from training_fixtures import (
        PYTHON,
        REPO,
        layout_flags,
        make_corpus,
        model_flags,
        multirun_cmd,
        read_metrics,
        run,
        train_flags,
    )

    corpus = make_corpus(tmp_path / "corpus")
    ckpt = str(tmp_path / "ckpt")

    def flags(iters, name, *extra):
        return (
            model_flags("gpt2")
            + train_flags(corpus, iters=iters)
            + layout_flags(1, 1, 0)
            + ["--metrics-file", str(tmp_path / f"{name}.jsonl"), *extra]
        )

    pretrain = [PYTHON, str(REPO / "pretrain_gpt.py")]
    first = run(pretrain + flags(4, "first", "--save", ckpt, "--save-interval", "4"), timeout=300)
    assert first.returncode == 0, first.stdout[-4000:]
    refused = run(pretrain + flags(6, "refused", "--load", ckpt), timeout=300)
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stdout[-4000:]
    assert f"--load {ckpt}: this run's LR schedule differs" in errors[0]
    assert "lr_decay_steps" in errors[0] and "32 in the checkpoint, 48 now" in errors[0]
    assert "Traceback" not in refused.stdout and not (tmp_path / "refused.jsonl").exists()

    modes = {"override": "--override-opt_param-scheduler"}
    modes["use_checkpoint"] = "--use-checkpoint-opt_param-scheduler"
    runs = [flags(6, mode, "--load", ckpt, flag) for mode, flag in modes.items()]
    # --finetune at another layout (ZeRO-1: through the full state) loads no scheduler state
    runs.append(flags(6, "finetune", "--load", ckpt, "--finetune", "--zero-stage", "1"))
    resumed = run(multirun_cmd(1, runs, tmp_path / "runs.json"), timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "--use-checkpoint-opt_param-scheduler: the checkpoint's LR schedule" in resumed.stdout
    # train_flags' schedule (lr 3e-3, min 3e-4, warmup 2 iterations, cosine), spans x 8 samples
    spans = {"override": 6 * 8, "use_checkpoint": 4 * 8}
    for mode, decay in spans.items():
        values = dict(max_lr=3e-3, min_lr=3e-4, warmup=2 * 8, decay=decay, style="cosine")
        holder, oracle = megatron(values)
        oracle.step(increment=4 * 8)
        metrics = read_metrics(tmp_path / f"{mode}.jsonl")
        assert sorted(metrics) == [5, 6]
        for iteration in (5, 6):  # the logged lr is the one after the iteration's step
            oracle.step(increment=8)
            lr = holder.param_groups[0]["lr"]
            assert metrics[iteration]["learning-rate"] == pytest.approx(lr, rel=1e-12), mode
    finetuned = read_metrics(tmp_path / "finetune.jsonl")
    assert sorted(finetuned) == list(range(1, 7))
    assert finetuned[1]["learning-rate"] == pytest.approx(3e-3 * 8 / 16, rel=1e-12)  # warmup
    # the checkpoint's schedule ended at sample 32: iterations 5 and 6 are at its floor
    assert read_metrics(tmp_path / "use_checkpoint.jsonl")[5]["learning-rate"] == 3e-4
