"""MoE models train on the torch backend (--use-torch-fsdp2) as one process does, at every expert
layout, and their checkpoints resume at another expert layout and on the other backend.

Two launches (tests/training_multirun.py): one 4-rank `deepspeed` launch, then one process. The
models are tests/test_moe_training.py's Mixtral-like (top-2 of 8, aux + z loss, grouped GEMM,
all-gather dispatcher) and DeepSeek-like (a dense first layer, sigmoid top-2 of 8, shared
expert, expert bias at update rate 0.05, sequence aux loss, all-to-all dispatcher); the reference
is the DeepSpeed backend's one process (which test_torch_backend.py shows the torch backend's one
process equals for dense models; here the torch one process is run as well).

At 4 ranks, on the torch backend (FSDP2, the experts sharded over expert DP,
pretrain/training/backends/torch/experts.py): Mixtral-like at DP 4 EP 2 (expert DP 2); DeepSeek-like
at DP 4 EP 4 (expert DP 1: FSDP2's one-rank mesh); DeepSeek-like at TP 2 x DP 2 EP 2 with expert
TP 1 (EP over the TP peers) and Mixtral-like with expert TP 2 (EP over DP), both under sequence
parallelism, and the DeepSeek-like one again without it (each TP rank routes its chunk of the
replicated sequence), as well as at TP 2 x PP 2 (1F1B) without it; a 4-layer Mixtral-like at PP 2 x DP 2 EP 2 under the ZBV zero-bubble schedule (two
chunks per rank, the weight gradients in a separate pass); PP 2 x DP 2 EP 2 under 1F1B (the
resume below). lm loss and grad norm of every iteration equal one process within 1e-5: the
expert gradients are summed over expert DP and divided by DP (FSDP2's own division by the expert
DP size fails it: measured, see docs/MOE.md), clipping counts every expert once (every step is
clipped at 0.05), and the aux losses reach the gradients with the scale each schedule gives the
loss. A Mixtral-like bf16 run at DP 4 EP 2 stays finite and within 2e-3 of fp32 per iteration
(the project's bf16 criterion, tests/test_bf16.py), and is not fp32's to the last digit. With
--cpu-offload (FSDP2's CPUOffloadPolicy, the experts' sharding included) DP 4 EP 2 equals the run
without it within 1e-6.

Resumes (DeepSeek-like, whose expert bias moves by 0.05 an iteration and must come back): a
DeepSpeed EP 2 (ZeRO-0) checkpoint at iteration 3 resumes on the torch backend at EP 4; a torch
EP 4 checkpoint resumes on the torch backend at PP 2 x EP 2, at one process (EP 1), and on
DeepSpeed at one process; a torch one-process checkpoint resumes natively (its DCP files, the
expert bias among them). Each writes a fresh metrics file that starts at iteration 4 and equals
the one-process run there within 1e-5. (The checkpoints are at iteration 3: after 2 the bias,
moving +-0.05 per iteration, happens to be back at zero and would not be tested.)
"""

import math

import pytest
from test_moe_training import MODELS
from training_fixtures import (
    make_corpus,
    model_flags,
    multirun_cmd,
    one_rank_multirun,
    read_metrics,
    run,
    train_flags,
)

RTOL = 1e-5
SAVED = 3  # the expert bias, +-0.05 an iteration, is back at 0 after iteration 2 (measured)
BF16_VS_FP32 = 2e-3
TORCH = ["--use-torch-fsdp2"]
SP = ["--sequence-parallel"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _ep(ep: int, etp: int = 1) -> list[str]:
    return ["--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp)]


def _tp(n: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(n)]


def _pp(n: int) -> list[str]:
    return ["--pipeline-model-parallel-size", str(n)]


def _save(folder: str) -> list[str]:
    return ["--save", folder, "--save-interval", str(SAVED)]


ZBV = _pp(2) + ["--pipeline-schedule", "zbv-zero-bubble", "--num-virtual-stages-per-pipeline-rank", "2"]  # fmt: skip
# name -> (world, model, layers, iterations, flags; "{tmp}" is the test's folder)
RUNS = {
    "ref_mixtral": (1, "mixtral", 2, 3, []),
    "ref_mixtral_4_layers": (1, "mixtral", 4, 3, []),
    "ref_deepseek": (1, "deepseek", 2, 5, []),
    "mixtral_dp4_ep2": (4, "mixtral", 2, 3, TORCH + _ep(2)),
    "mixtral_dp4_ep2_bf16": (4, "mixtral", 2, 3, TORCH + _ep(2) + ["--bf16"]),
    "mixtral_dp4_ep2_offload": (4, "mixtral", 2, 3, TORCH + _ep(2) + ["--cpu-offload"]),
    "deepseek_tp2_dp2_ep2": (4, "deepseek", 2, 3, TORCH + _tp(2) + SP + _ep(2)),
    "mixtral_tp2_dp2_ep2_etp2": (4, "mixtral", 2, 3, TORCH + _tp(2) + SP + _ep(2, 2)),
    "deepseek_tp2_dp2_ep2_no_sp": (4, "deepseek", 2, 3, TORCH + _tp(2) + _ep(2)),
    "deepseek_tp2_pp2_no_sp": (4, "deepseek", 2, 3, TORCH + _tp(2) + _pp(2)),
    "mixtral_4_layers_pp2_dp2_ep2_zbv": (4, "mixtral", 4, 3, TORCH + ZBV + _ep(2)),
    # checkpoints at iteration 3, then resumes to 5
    "ds_dp4_ep2_saves": (4, "deepseek", 2, 3, _ep(2) + _save("{tmp}/ds_ep2")),
    "deepseek_dp4_ep4_saves": (4, "deepseek", 2, 3, TORCH + _ep(4) + _save("{tmp}/torch_ep4")),
    "ep4_from_deepspeed_ep2": (4, "deepseek", 2, 5, TORCH + _ep(4) + ["--load", "{tmp}/ds_ep2"]),
    "pp2_dp2_ep2_from_ep4": (
        4,
        "deepseek",
        2,
        5,
        TORCH + _pp(2) + _ep(2) + ["--load", "{tmp}/torch_ep4"],
    ),  # fmt: skip
    "one_process_from_ep4": (1, "deepseek", 2, 5, TORCH + ["--load", "{tmp}/torch_ep4"]),
    "deepspeed_one_from_ep4": (1, "deepseek", 2, 5, ["--load", "{tmp}/torch_ep4"]),
    "one_process_saves": (1, "deepseek", 2, 3, TORCH + _save("{tmp}/torch_one")),
    "one_process_native": (1, "deepseek", 2, 5, TORCH + ["--load", "{tmp}/torch_one"]),
}
RESUMED = [name for name, (*_, flags) in RUNS.items() if "--load" in flags]


def _argv(tmp, corpus: str, name: str) -> list[str]:
    _, model, layers, iters, flags = RUNS[name]
    return (
        model_flags("llama", layers=layers)
        + MODELS[model]
        + train_flags(corpus, iters=iters)
        + ["--lr-decay-iters", "4"]  # one LR schedule for runs of 3 and 5 iterations
        + [flag.format(tmp=tmp) for flag in flags]
        + ["--metrics-file", str(tmp / f"{name}.jsonl")]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_torch")
    corpus = make_corpus(tmp / "corpus")
    four = [_argv(tmp, corpus, n) for n, r in RUNS.items() if r[0] == 4]
    result = run(multirun_cmd(4, four, tmp / "runs_4.json"), timeout=800)
    assert result.returncode == 0, f"world 4 failed:\n{result.stdout[-8000:]}"
    one = [_argv(tmp, corpus, n) for n, r in RUNS.items() if r[0] == 1]
    result = one_rank_multirun(one, tmp / "runs_1.json", timeout=400)
    assert result.returncode == 0, f"world 1 failed:\n{result.stdout[-8000:]}"
    return {"checkpoints": tmp} | {name: read_metrics(tmp / f"{name}.jsonl") for name in RUNS}


def _reference(runs, name: str) -> dict:
    _, model, layers, _, _ = RUNS[name]
    return runs[f"ref_{model}" + ("_4_layers" if layers == 4 else "")]


def _assert_close(got: dict, expected: dict, rtol: float, name: str, keys=("lm-loss", "grad-norm")):
    for it in got:
        for key in keys:
            a, b = got[it][key], expected[it][key]
            assert abs(a - b) <= rtol * abs(b), (name, it, key, a, b)


@pytest.mark.parametrize(
    "name",
    [
        "mixtral_dp4_ep2",
        "mixtral_dp4_ep2_offload",
        "deepseek_tp2_dp2_ep2",
        "mixtral_tp2_dp2_ep2_etp2",
        "deepseek_tp2_dp2_ep2_no_sp",
        "deepseek_tp2_pp2_no_sp",
        "mixtral_4_layers_pp2_dp2_ep2_zbv",
        "deepseek_dp4_ep4_saves",
        "one_process_saves",
    ],
)
def test_torch_backend_moe_matches_one_process(runs, name):
    got, reference = runs[name], _reference(runs, name)
    assert sorted(got) == list(range(1, RUNS[name][3] + 1))
    _assert_close(got, reference, RTOL, name)
    assert all(reference[it]["grad-norm"] > 0.05 for it in reference)  # every step clipped


def test_cpu_offload_changes_nothing(runs):
    """FSDP2's CPUOffloadPolicy (--cpu-offload) on the experts' own fully_shard and the layers'."""
    _assert_close(runs["mixtral_dp4_ep2_offload"], runs["mixtral_dp4_ep2"], 1e-6, "offload")


def test_the_expert_bias_moved_and_is_in_the_checkpoints(runs):
    from pretrain.checkpoint.full_state import read_full_state

    folder = runs["checkpoints"]
    for saved in ("torch_ep4", "ds_ep2", "torch_one"):
        state = read_full_state(str(folder / saved / f"global_step{SAVED}"), 100)
        assert state["layers.1.mlp.router.expert_bias"].param.abs().sum() > 0, saved
        assert state["layers.1.mlp.experts.fc1.weight"].param.shape[0] == 8, saved


def test_resumes_at_another_expert_layout_and_backend_continue(runs):
    reference = runs["ref_deepseek"]
    for name in RESUMED:
        got = runs[name]
        # a fresh metrics file: resumed after its checkpoint
        assert sorted(got) == list(range(SAVED + 1, 6)), name
        _assert_close(got, reference, RTOL, name, ("lm-loss", "grad-norm", "moe/max_share"))


def test_bf16_trains_and_tracks_fp32(runs):
    got, fp32 = runs["mixtral_dp4_ep2_bf16"], runs["ref_mixtral"]
    assert sorted(got) == [1, 2, 3]
    assert all(math.isfinite(got[it][k]) for it in got for k in ("lm-loss", "grad-norm"))
    _assert_close(got, fp32, BF16_VS_FP32, "bf16", ("lm-loss",))
    assert any(abs(got[it]["lm-loss"] - fp32[it]["lm-loss"]) > 1e-7 for it in got)  # bf16 ran
