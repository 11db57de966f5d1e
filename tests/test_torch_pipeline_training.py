"""The torch backend's pipeline in real training runs: every schedule, at PP 2 x TP {1, 2} x
DP {1, 2}, reproduces one process and DeepSpeed's pipeline engine at the same layout; its
checkpoints resume at another schedule, on DeepSpeed and at PP 1, and DeepSpeed's resume on it.

Real ranks under the `deepspeed` launcher, one launch per world size (1, 4, 8), each running every
configuration of that size through `pretrain(argv)` (tests/training_multirun.py); 4 layers (2
chunks per rank at PP 2 hold one layer each), fp32, every step clipped:
- equivalence: each torch run's losses and logged grad norms per iteration and its validation
  loss equal DeepSpeed's one process within 1e-6 relative (docs/TRAINING.md); the 1F1B runs equal
  DeepSpeed's pipeline engine at the same layout (PP 2 DP 2 ZeRO-1, PP 2 TP 2 DP 2 ZeRO-1); a
  bf16 ZBV run (bf16 activations between stages) stays within 2e-3 of fp32's losses;
- checkpoints (GPT-2, tied embeddings): torch PP 2 DP 2 1F1B stops at 2 -> torch ZBV at the same
  layout resumes it to 3 (saved) -> torch PP 1 TP 2 DP 2 resumes that to 4; DeepSpeed PP 2 TP 2
  resumes the step-2 checkpoint to 3 (saved) -> torch PP 2 TP 2 interleaved zero bubble resumes
  that to 4: each resumed iteration's loss, grad norm and LR within 1e-5 of the uninterrupted run.
The unit-level test of every schedule x flavour (gradients, evaluation sums) is
tests/test_torch_pipeline.py.
"""

import time

import pytest
from training_fixtures import make_corpus, model_flags, multirun_cmd, read_metrics, run, train_flags

from pretrain.checkpoint.full_state import read_full_state

ITERS = 4
RTOL, RESUME_RTOL = 1e-6, 1e-5
BF16_VS_FP32 = 2e-3  # DeepSpeed's bf16 promise (tests/test_bf16.py)
TORCH = ["--use-torch-fsdp2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
EVAL = ["--eval-interval", str(ITERS), "--eval-iters", "1"]
CHUNKS2 = ["--num-virtual-stages-per-pipeline-rank", "2"]


def _schedule(name: str) -> list[str]:
    chunks = CHUNKS2 if name != "1f1b" else []
    return ["--pipeline-schedule", name, *chunks]


# name -> (world, flavour, flags)
EQUIVALENCE = {
    "ds_one_gpt2": (1, "gpt2", []),
    "ds_one_llama": (1, "llama", []),
    "torch_tp2_zero_bubble_gpt2": (
        4,
        "gpt2",
        TORCH + PP2 + TP2 + ["--sequence-parallel"] + _schedule("interleaved-zero-bubble"),
    ),
    "torch_tp2_zbv_llama": (4, "llama", TORCH + PP2 + TP2 + _schedule("zbv-zero-bubble")),
    "torch_dp2_interleaved_gpt2": (
        4,
        "gpt2",
        TORCH + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    "torch_dp2_1f1b_llama": (4, "llama", TORCH + PP2),
    "torch_dp2_zbv_bf16_gpt2": (4, "gpt2", TORCH + PP2 + ["--bf16"] + _schedule("zbv-zero-bubble")),
    "ds_dp2_llama": (4, "llama", PP2 + ["--zero-stage", "1"]),
    "torch_tp2_dp2_1f1b_gpt2": (8, "gpt2", TORCH + PP2 + TP2),
    "ds_tp2_dp2_gpt2": (8, "gpt2", PP2 + TP2 + ["--zero-stage", "1"]),
}
SAME_LAYOUT = [
    ("torch_dp2_1f1b_llama", "ds_dp2_llama"),
    ("torch_tp2_dp2_1f1b_gpt2", "ds_tp2_dp2_gpt2"),
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _argv(corpus, tmp, name, flavour, *flags):
    return (
        model_flags(flavour, layers=4, vocab_divisible_by=None)
        + train_flags(corpus, iters=ITERS)
        + ["--lr-decay-iters", str(ITERS), "--metrics-file", str(tmp / f"{name}.jsonl"), *flags]
    )


def _stop(save, at: int) -> list[str]:
    return ["--save", str(save), "--save-interval", "100", "--exit-interval", str(at)]


def _checkpoint_runs(corpus, tmp) -> list[list[str]]:
    """The resume chain of four ranks (the module docstring)."""
    first, zbv, ds = tmp / "torch_pp2_1f1b", tmp / "torch_pp2_zbv", tmp / "ds_pp2_tp2"
    pp2_dp2 = TORCH + PP2
    return [
        _argv(corpus, tmp, "c_first", "gpt2", *pp2_dp2, *_stop(first, 2)),
        _argv(corpus, tmp, "c_zbv", "gpt2", *pp2_dp2, *_schedule("zbv-zero-bubble"))
        + ["--load", str(first), *_stop(zbv, 3)],
        _argv(corpus, tmp, "c_pp1", "gpt2", *TORCH, *TP2, "--load", str(zbv)),
        _argv(corpus, tmp, "c_ds", "gpt2", *PP2, *TP2, "--load", str(first), *_stop(ds, 3)),
        _argv(corpus, tmp, "c_from_ds", "gpt2", *TORCH, *PP2, *TP2)
        + [*_schedule("interleaved-zero-bubble"), "--load", str(ds)],
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_pipeline")
    corpus = make_corpus(tmp / "corpus")
    outputs = {}
    for world in (1, 4, 8):
        argvs = [
            _argv(corpus, tmp, name, flavour, *EVAL, *flags)
            for name, (size, flavour, flags) in EQUIVALENCE.items()
            if size == world
        ]
        argvs += _checkpoint_runs(corpus, tmp) if world == 4 else []
        started = time.monotonic()
        result = run(multirun_cmd(world, argvs, tmp / f"runs_{world}.json"), timeout=1000)
        print(f"world {world}: {time.monotonic() - started:.0f} s")
        outputs[world] = result.stdout
        assert result.returncode == 0, f"world {world} failed:\n{result.stdout[-8000:]}"
    return {"tmp": tmp, "outputs": outputs}


def _metrics(runs, name):
    return read_metrics(runs["tmp"] / f"{name}.jsonl")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _agree(got: dict, ref: dict, rtol: float, keys=("lm-loss", "grad-norm")) -> None:
    for it in got:
        for key in keys:
            assert got[it][key] is not None, (it, key)
            assert _rel(got[it][key], ref[it][key]) <= rtol, (it, key, got[it][key], ref[it][key])


@pytest.mark.parametrize("name", [n for n, (world, _, _) in EQUIVALENCE.items() if world > 1])
def test_pipeline_layout_matches_one_process(runs, name):
    flavour = EQUIVALENCE[name][1]
    ref, got = _metrics(runs, f"ds_one_{flavour}"), _metrics(runs, name)
    assert sorted(got) == sorted(ref) == list(range(1, ITERS + 1))
    if "--bf16" in EQUIVALENCE[name][2]:  # bf16 between stages: fp32's losses within 2e-3
        _agree(got, ref, BF16_VS_FP32, keys=("lm-loss",))
        assert any(_rel(got[it]["lm-loss"], ref[it]["lm-loss"]) > RTOL for it in ref)
        return
    _agree(got, ref, RTOL)
    assert _rel(got[ITERS]["validation-loss"], ref[ITERS]["validation-loss"]) <= RTOL
    assert all(ref[it]["grad-norm"] > 0.05 for it in ref)  # every step clipped


@pytest.mark.parametrize("torch_run, deepspeed_run", SAME_LAYOUT)
def test_torch_1f1b_equals_deepspeeds_pipeline_engine(runs, torch_run, deepspeed_run):
    _agree(_metrics(runs, torch_run), _metrics(runs, deepspeed_run), RTOL)


def test_pipeline_checkpoints_resume_across_schedules_backends_and_layouts(runs):
    ref = _metrics(runs, "ds_one_gpt2")
    expected = {"c_first": [1, 2], "c_zbv": [3], "c_pp1": [4], "c_ds": [3], "c_from_ds": [4]}
    for name, iterations in expected.items():
        resumed = _metrics(runs, name)
        assert sorted(resumed) == iterations, name  # it resumed: a fresh start would log 1..
        _agree(resumed, ref, RESUME_RTOL, keys=("lm-loss", "grad-norm", "learning-rate"))
    out = runs["outputs"][4]
    assert "saved at TP1 PP2 DP2 FSDP2: resharded weights, fp32 master weights, Adam state" in out
    assert "saved at TP2 PP2 DP1 ZeRO-0: resharded weights, fp32 master weights, Adam state" in out


def test_a_pipeline_checkpoint_holds_the_gptmodel_names_once(runs):
    """The full state of the torch PP 2 checkpoint: GPTModel's names (the tied copy of the last
    stage is not among them), as the DeepSpeed checkpoint of the same model has."""
    torch_state = read_full_state(str(runs["tmp"] / "torch_pp2_zbv" / "global_step3"), 100)
    ds_state = read_full_state(str(runs["tmp"] / "ds_pp2_tp2" / "global_step3"), 100)
    assert sorted(torch_state) == sorted(ds_state)
    assert "embedding.word_embeddings.weight" in torch_state
    assert not [n for n in torch_state if "tied" in n]


def test_banner_names_the_schedule(runs):
    out = runs["outputs"][8]
    assert " layout           |  TP=2  PP=2  DP=2  FSDP2  (fp32)" in out
    assert " pipeline         |  1f1b, 1 model chunk per rank" in out
    out = runs["outputs"][4]
    assert " layout           |  TP=2  PP=2  DP=1  FSDP2  (fp32)" in out
    assert " pipeline         |  zbv-zero-bubble, 2 model chunks per rank" in out
