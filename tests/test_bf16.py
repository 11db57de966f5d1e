"""bf16 training (`--bf16`, DeepSpeed's bf16 path on CPU) tracks fp32, with the right grad norms.

One launch of one rank trains the tiny GPT-2 for 50 iterations in fp32, in bf16 at ZeRO-0
(DeepSpeed's fp16/bf16 wrapper around our AdamW, which clips by the true global norm) and in bf16
at ZeRO-1 (DeepSpeed's BF16_Optimizer clips). A second launch of two ranks runs bf16 at TP 2 and
at PP 2 for the first iterations of the same schedule (same batches). Tolerances (docs/TRAINING.md):
- the bf16 loss is within 2e-3 (relative) of the fp32 loss at every one of the 50 iterations
  (measured: 1.2e-4; 7e-4 before DeepSpeed's build-time Adam step at ZeRO-0 was undone);
- the grad norm logged at iteration 1, where the weights differ from fp32's only by bf16 rounding
  and the batch is the same, is within 1e-3 of the fp32 run's (an independent computation of the
  norm: our fp32 model and clipping) at every layout; over the run within 10% (measured: 1%;
  6% before);
- every step is clipped (--clip-grad 0.05 < the norm), so the norm that clipping used is logged.
DeepSpeed's own bf16/fp16 ZeRO-0 norm at TP 2 was 0.988 where the true norm is 1.078 (it drops
the other TP ranks' shards); the TP 2 comparison here fails with it.
fp16 is refused on CPU (DeepSpeed's CPU accelerator has no fp16 without AVX512-FP16/AMX): one line,
exit status 2.
"""

from __future__ import annotations

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    test_env,
    train_flags,
)

ITERATIONS = 50
LOSS_RTOL = 2e-3
FIRST_NORM_RTOL = 1e-3
NORM_RTOL = 0.10
ONE_RANK = {"fp32": [], "bf16": ["--bf16"], "bf16_zero1": ["--bf16", "--zero-stage", "1"]}
TWO_RANKS = {  # the first 3 iterations of the same 50-iteration schedule
    "bf16_tp2": ["--bf16"] + layout_flags(2, 1, 0),
    "bf16_pp2": ["--bf16"] + layout_flags(1, 2, 0),
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    corpus = make_corpus(tmp / "corpus")

    def argvs(runs: dict, extra: list[str]) -> list[list[str]]:
        return [
            model_flags("gpt2")
            + train_flags(corpus, iters=ITERATIONS)
            + flags
            + extra
            + ["--metrics-file", str(tmp / f"{name}.jsonl")]
            for name, flags in runs.items()
        ]

    for world, runs, extra in ((1, ONE_RANK, []), (2, TWO_RANKS, ["--exit-interval", "3"])):
        result = run(multirun_cmd(world, argvs(runs, extra), tmp / f"runs{world}.json"), 400)
        assert result.returncode == 0, result.stdout[-8000:]
    return {name: read_metrics(tmp / f"{name}.jsonl") for name in {**ONE_RANK, **TWO_RANKS}}


@pytest.mark.parametrize("name", ["bf16", "bf16_zero1"])
def test_bf16_losses_track_fp32_for_50_iterations(logged, name):
    ref, got = logged["fp32"], logged[name]
    assert sorted(got) == sorted(ref) == list(range(1, ITERATIONS + 1))
    for it in ref:
        assert _rel(got[it]["lm-loss"], ref[it]["lm-loss"]) <= LOSS_RTOL, (it, got[it], ref[it])
        assert _rel(got[it]["grad-norm"], ref[it]["grad-norm"]) <= NORM_RTOL, (it, got[it])
        assert got[it]["grad-norm"] > 0.05  # clipped every step
    assert ref[ITERATIONS]["lm-loss"] < ref[1]["lm-loss"]  # it learned


@pytest.mark.parametrize("name", ["bf16", "bf16_zero1", "bf16_tp2", "bf16_pp2"])
def test_bf16_grad_norm_equals_the_fp32_norm_on_the_same_weights(logged, name):
    ref, got = logged["fp32"][1], logged[name][1]
    assert _rel(got["grad-norm"], ref["grad-norm"]) <= FIRST_NORM_RTOL, (got, ref)
    assert _rel(got["lm-loss"], ref["lm-loss"]) <= LOSS_RTOL


def test_fp16_is_refused_on_cpu_in_one_line(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", num_docs=20)
    argv = model_flags("gpt2") + train_flags(corpus) + ["--fp16"]
    result = run([PYTHON, str(REPO / "pretrain_gpt.py"), *argv], timeout=120, env=test_env())
    assert result.returncode == 2, result.stdout[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("error: --fp16 needs a GPU") and "Traceback" not in result.stdout
