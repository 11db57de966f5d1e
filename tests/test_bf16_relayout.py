"""bf16 checkpoints resume at another ZeRO stage, TP, PP or DP size (or from fp32) from their real
fp32 master weights and Adam moments, and the log says what was carried.

Two launches (world 1, world 2) run, in bf16, for every layout below an uninterrupted run and a
run stopped at STOP_AT, then resume each stopped run at another layout (its own metrics file).
DeepSpeed steps a different optimizer at each of these layouts: ZeRO-0 its fp16/bf16 wrapper
around our AdamW (fp32 copies of the parameters), ZeRO-0 under the pipeline engine its
BF16_Optimizer (fp32 partitions), ZeRO 1/2 and 3 its ZeRO optimizers.

A resumed run continues the trajectory of the run it was saved from: every resumed iteration's
loss is within LOSS_RTOL and its grad norm within NORM_RTOL of the source layout's uninterrupted
run (measured at most 2.2e-5 and 8.5e-4), and within TARGET_LOSS_RTOL, TARGET_NORM_RTOL of the
target layout's (measured 2.6e-5, 1.7e-3). Two uninterrupted layouts differ by up to 2.9e-5 in
the loss and 1.7e-3 in the grad norm over these iterations. Before the masters were carried
(ZeRO-0 targets kept their initial fp32 copies and fresh Adam state; ZeRO-0 sources saved the
bf16 weights without moments), the resumed losses were 1.1e-4 to 1.7e-3 and the grad norms 1e-2
to 0.23 away from the source's at iteration STOP_AT + 2. Figures: docs/RELIABILITY.md, "bf16
and fp16 resumes at another layout".

fp16 needs a GPU (DeepSpeed has no fp16 on CPU): `test_an_fp16_resume_at_another_zero_stage_
carries_the_loss_scale` runs on one where CUDA exists and is skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from training_fixtures import (
    PYTHON,
    REPO,
    deepspeed_cmd,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env  # (a plain name: pytest would collect test_env)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ITERS, STOP_AT = 6, 3
LOSS_RTOL, NORM_RTOL = 5e-5, 2e-3
TARGET_LOSS_RTOL, TARGET_NORM_RTOL = 1e-4, 5e-3
FP16_LOSS_RTOL = 1e-3  # one GPU, ZeRO-1 -> ZeRO-2 (not measured here: no GPU)

# name -> ((TP, PP, ZeRO), world size, precision flags)
LAYOUTS = {
    "z0": ((1, 1, 0), 1, ["--bf16"]),
    "z1": ((1, 1, 1), 1, ["--bf16"]),
    "z2": ((1, 1, 2), 1, ["--bf16"]),
    "fp32_z1": ((1, 1, 1), 1, []),
    "dp2_z0": ((1, 1, 0), 2, ["--bf16"]),
    "dp2_z3": ((1, 1, 3), 2, ["--bf16"]),
    "tp2_z1": ((2, 1, 1), 2, ["--bf16"]),
    "pp2_z0": ((1, 2, 0), 2, ["--bf16"]),
}
# name -> (saved at, resumed at); both in one world
MOVES = {
    "z1_to_z0": ("z1", "z0"),
    "z0_to_z2": ("z0", "z2"),
    "dp2_z0_to_tp2_z1": ("dp2_z0", "tp2_z1"),  # DP 2 -> 1, TP 1 -> 2, ZeRO 0 -> 1
    "tp2_z1_to_pp2_z0": ("tp2_z1", "pp2_z0"),  # TP 2 -> 1, PP 1 -> 2, ZeRO 1 -> 0
    "pp2_z0_to_dp2_z3": ("pp2_z0", "dp2_z3"),  # PP 2 -> 1, DP 1 -> 2, ZeRO 0 -> 3
    "dp2_z3_to_dp2_z0": ("dp2_z3", "dp2_z0"),  # ZeRO 3 -> 0
}
PRECISION_MOVES = {"fp32_z1_to_z1": ("fp32_z1", "z1")}  # fp32 checkpoint, --bf16 run, same layout
SAME_LAYOUT = {"z0_to_z0": ("z0", "z0")}  # DeepSpeed's own load
# one more resume of z1_to_z0's checkpoint, without its Adam state: (at, flags)
NO_OPTIM = ("z2", ["--no-load-optim"])


def _flags(corpus, layout, metrics, *extra):
    parallel, _, precision = LAYOUTS[layout]
    return (
        model_flags("gpt2")
        + train_flags(corpus, iters=ITERS)
        + layout_flags(*parallel)
        + precision
        + ["--metrics-file", str(metrics), *extra]
    )


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """{world: launch output}; metrics and checkpoints under the returned folder."""
    tmp = tmp_path_factory.mktemp("bf16_relayout")
    corpus = make_corpus(tmp / "corpus")
    moves = {**MOVES, **PRECISION_MOVES, **SAME_LAYOUT}
    outputs = {}
    for world in (1, 2):
        runs = [
            _flags(corpus, name, tmp / f"{name}_full.jsonl")
            for name, (_, w, _) in LAYOUTS.items()
            if w == world
        ]
        resumed = []
        for name, (source, target) in moves.items():
            if LAYOUTS[source][1] != world:
                continue
            ckpt = str(tmp / f"ckpt_{name}")
            stop = ["--save", ckpt, "--save-interval", "100", "--exit-interval", str(STOP_AT)]
            runs.append(_flags(corpus, source, tmp / f"{name}_stopped.jsonl", *stop))
            resumed.append(_flags(corpus, target, tmp / f"{name}_resumed.jsonl", "--load", ckpt))
        if world == 1:
            at, flags = NO_OPTIM
            load = ["--load", str(tmp / "ckpt_z1_to_z0"), *flags]
            resumed.append(_flags(corpus, at, tmp / "no_optim_resumed.jsonl", *load))
        result = run(multirun_cmd(world, runs + resumed, tmp / f"runs{world}.json"), timeout=800)
        assert result.returncode == 0, result.stdout[-8000:]
        outputs[world] = result.stdout
    return tmp, outputs


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _metrics(tmp, name):
    return read_metrics(tmp / f"{name}.jsonl")


def _check_continues(tmp, name, source, target):
    resumed = _metrics(tmp, f"{name}_resumed")
    assert sorted(resumed) == list(range(STOP_AT + 1, ITERS + 1))  # its own file, from k + 1
    src, dst = _metrics(tmp, f"{source}_full"), _metrics(tmp, f"{target}_full")
    for it, got in resumed.items():
        assert _rel(got["lm-loss"], src[it]["lm-loss"]) <= LOSS_RTOL, (it, got, src[it])
        assert _rel(got["grad-norm"], src[it]["grad-norm"]) <= NORM_RTOL, (it, got, src[it])
        assert _rel(got["lm-loss"], dst[it]["lm-loss"]) <= TARGET_LOSS_RTOL, (it, got, dst[it])
        assert _rel(got["grad-norm"], dst[it]["grad-norm"]) <= TARGET_NORM_RTOL, (it, got)
        assert got["learning-rate"] == pytest.approx(src[it]["learning-rate"], rel=1e-6)


@pytest.mark.parametrize("name", sorted(MOVES))
def test_a_bf16_resume_at_another_layout_continues_the_run(moved, name):
    tmp, _ = moved
    _check_continues(tmp, name, *MOVES[name])


def test_an_fp32_checkpoint_resumes_in_bf16_at_its_layout_through_its_full_state(moved):
    """Same layout, another precision: through the full state (DeepSpeed's own files differ);
    fp32 and bf16 are about as close as two bf16 layouts over these iterations."""
    tmp, _ = moved
    _check_continues(tmp, "fp32_z1_to_z1", *PRECISION_MOVES["fp32_z1_to_z1"])


def test_a_bf16_zero0_resume_at_its_own_layout_is_exact(moved):
    """DeepSpeed's own load after the build-time Adam step is undone: bit for bit."""
    tmp, _ = moved
    resumed, full = _metrics(tmp, "z0_to_z0_resumed"), _metrics(tmp, "z0_full")
    assert sorted(resumed) == list(range(STOP_AT + 1, ITERS + 1))
    for it, got in resumed.items():
        assert (got["lm-loss"], got["grad-norm"]) == (full[it]["lm-loss"], full[it]["grad-norm"])


@pytest.mark.parametrize("zero0", ["z0", "dp2_z0"])
def test_bf16_zero0_takes_the_adam_steps_of_the_other_layouts(moved, zero0):
    """DeepSpeed's bf16 ZeRO-0 wrapper steps Adam once at build time; undone, its uninterrupted
    run is ZeRO-1's (before: Adam's bias correction one step ahead, 1.2e-4 in the loss and 1% in
    the grad norm at iteration 3, where the other layouts agree to 3e-5)."""
    tmp, _ = moved
    got, ref = _metrics(tmp, f"{zero0}_full"), _metrics(tmp, "z1_full")
    assert sorted(got) == sorted(ref) == list(range(1, ITERS + 1))
    for it in ref:
        assert _rel(got[it]["lm-loss"], ref[it]["lm-loss"]) <= LOSS_RTOL, (it, got[it], ref[it])
        assert _rel(got[it]["grad-norm"], ref[it]["grad-norm"]) <= NORM_RTOL, (it, got[it])


@pytest.mark.parametrize("source", ["z0", "pp2_z0"])
def test_a_bf16_zero0_full_state_holds_fp32_masters_and_moments(moved, source):
    """ZeRO-0 (DeepSpeed's wrapper; under the pipeline its BF16_Optimizer): the saved "param" is
    the fp32 master, not the bf16 module weight, and the Adam moments are there."""
    tmp, _ = moved
    name = next(m for m, (s, _) in MOVES.items() if s == source)
    step = tmp / f"ckpt_{name}" / f"global_step{STOP_AT}"
    files = sorted(step.glob("full_state_*.pt"))
    assert files
    off_bf16 = 0
    for path in files:
        payload = torch.load(path, weights_only=True)
        assert payload["extra"]["fp32_masters"] is True
        for param, entry in payload["entries"].items():
            master = entry["param"]
            assert master.dtype == torch.float32
            off_bf16 += int((master != master.to(torch.bfloat16).float()).sum())
            assert entry["step"] == STOP_AT, param
            assert entry["exp_avg"].abs().sum() > 0 and entry["exp_avg_sq"].abs().sum() > 0, param
    assert off_bf16 > 0  # masters hold values no bf16 weight has


def test_the_log_says_what_was_carried(moved):
    _, outputs = moved
    lines = {line for out in outputs.values() for line in out.splitlines() if "saved at TP" in line}
    everything = "resharded weights, fp32 master weights, Adam state and LR schedule;"
    assert sum(everything in line for line in lines) == len(MOVES) + len(PRECISION_MOVES)
    no_optim = [line for line in lines if "fp32 master weights and LR schedule;" in line]
    assert len(no_optim) == 1 and "saved at TP1 PP1 DP1 ZeRO-1:" in no_optim[0]
    assert any("saved at TP1 PP1 DP1 ZeRO-1 in fp32, resumed in bf16:" in line for line in lines)
    assert sorted(_metrics(moved[0], "no_optim_resumed")) == list(range(STOP_AT + 1, ITERS + 1))


def test_bf16_on_an_fp32_checkpoint_without_full_state_is_one_line(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", num_docs=60)
    ckpt = tmp_path / "ckpt"
    argv = model_flags("gpt2") + train_flags(corpus, iters=4)
    save = ["--save", str(ckpt), "--exit-interval", "1", "--no-save-full-state"]
    first = run([PYTHON, str(REPO / "pretrain_gpt.py"), *argv, *save], timeout=180)
    assert first.returncode == 0, first.stdout[-4000:]
    again = argv + ["--load", str(ckpt), "--bf16"]
    result = run([PYTHON, str(REPO / "pretrain_gpt.py"), *again], timeout=180, env=clean_env())
    assert result.returncode == 2, result.stdout[-4000:]
    last = result.stdout.strip().splitlines()[-1]
    assert "Traceback" not in result.stdout and "damaged" not in last
    assert last.startswith(
        f"error: --load {ckpt}: the checkpoint was saved in fp32, this run uses "
    )
    assert "--bf16" in last and "--no-save-full-state" in last


def _carry_a_zero_loss_scaler(rank, world_size):
    """DeepSpeed's ZeRO loss scaler after overflows and growth, carried into a fresh one through
    the full state's `loss_scaler` values: (scale, hysteresis) of both over the next updates, and
    of a fresh scaler that was not given them."""
    from types import SimpleNamespace

    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from pretrain.training.backends.deepspeed.comm import disable_deepspeed_shm_allreduce
    from pretrain.training.backends.deepspeed.masters import loss_scale_state, set_loss_scale_state

    disable_deepspeed_shm_allreduce()  # (a 40-second JIT build otherwise)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)  # overflow messages ask its rank

    def scaler():
        args = dict(init_scale=2.0**10, scale_window=3, min_scale=1.0, delayed_shift=2)
        return DynamicLossScaler(**args, consecutive_hysteresis=False)

    def engine(loss_scaler):
        return SimpleNamespace(
            ds=SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=loss_scaler)), fp16=True
        )

    source, target, fresh = scaler(), scaler(), scaler()
    for overflow in (False, True, False, True, True, False, False, False, False):
        source.update_scale(overflow)
    saved = loss_scale_state(engine(source))
    assert set_loss_scale_state(engine(target), saved)
    runs = {"source": [], "target": [], "fresh": []}
    for overflow in (False, False, True, False, False, False, False, True, True):
        for name, one in (("source", source), ("target", target), ("fresh", fresh)):
            one.update_scale(overflow)
            runs[name].append((one.cur_scale, one.cur_hysteresis))
    return saved, runs


def test_the_fp16_loss_scale_and_its_counters_carry_over():
    """On the CPU, what the GPU test shows end to end: the scale, overflow counters and hysteresis
    of DeepSpeed's own ZeRO scaler go into the plain values the full state keeps and back, so the
    carried scaler grows and shrinks at the same updates as the one it was saved from."""
    saved, runs = run_on_ranks(_carry_a_zero_loss_scaler, world_size=1, timeout=300)[0]
    assert set(saved) == {"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"}
    assert saved["cur_scale"] != 2.0**10
    assert runs["target"] == runs["source"]
    assert runs["fresh"] != runs["source"]


FP16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2"]


@pytest.mark.gpu
def test_an_fp16_resume_at_another_zero_stage_carries_the_loss_scale(tmp_path):
    """One GPU, fp16, ZeRO-1 -> ZeRO-2: the dynamic loss scale grows every 2 good steps, so at
    STOP_AT it is no longer the initial one; the resumed run logs the uninterrupted run's scales
    (both DeepSpeed ZeRO optimizers count overflows alike) and continues its losses."""
    if not torch.cuda.is_available():
        if os.environ.get("PRETRAIN_REQUIRE_GPU"):  # bench/gpu_check.py: a GPU must be there
            pytest.fail("PRETRAIN_REQUIRE_GPU is set but torch.cuda.is_available() is False")
        pytest.skip("fp16 needs CUDA (DeepSpeed has no fp16 on CPU)")
    corpus = make_corpus(tmp_path / "corpus")
    ckpt = str(tmp_path / "ckpt")

    def train(zero, name, *extra):
        argv = model_flags("gpt2") + train_flags(corpus, iters=ITERS) + layout_flags(1, 1, zero)
        argv += [*FP16, "--distributed-backend", "nccl", "--metrics-file", str(tmp_path / name)]
        result = run(deepspeed_cmd(1, argv + list(extra)), timeout=300)
        assert result.returncode == 0, result.stdout[-6000:]
        return result.stdout

    train(1, "full.jsonl")
    train(1, "stopped.jsonl", "--save", ckpt, "--save-interval", "100", "--exit-interval", "3")
    output = train(2, "moved.jsonl", "--load", ckpt)
    assert "Adam state, fp16 loss scale and LR schedule;" in output
    full, moved = read_metrics(tmp_path / "full.jsonl"), read_metrics(tmp_path / "moved.jsonl")
    assert sorted(moved) == list(range(STOP_AT + 1, ITERS + 1))
    assert full[STOP_AT + 1]["loss-scale"] > 1024  # it grew before the save (at the 3rd step)
    for it, got in moved.items():
        assert got["loss-scale"] == full[it]["loss-scale"], it
        assert _rel(got["lm-loss"], full[it]["lm-loss"]) <= FP16_LOSS_RTOL, (it, got, full[it])
