"""MoE training at expert-parallel size > 1 reproduces one process (DeepSpeed backend, ZeRO-0).

Real processes under the real `deepspeed` launcher: one process, then one 4-rank launch running
every layout below for three models: Mixtral-like (softmax top-2 of 8, aux + z loss, grouped
GEMM, all-gather dispatcher), DeepSeek-like (a dense first layer, sigmoid top-2 of 8 with a
shared expert and the expert bias at a large update rate, sequence aux loss, all-to-all
dispatcher) and Mixtral-like with capacity (factor 1, probs drop policy: tokens are dropped).
The layouts cut experts over EP 2 and 4 with expert DP 2, 1 (DP 4), over the TP peers (TP 2 x EP
2, expert TP 1), with expert TP 2 (TP 2 x EP 2: no expert DP) and under the pipeline (PP 2).
Every layout reproduces the one-process lm loss and grad norm of each iteration within 1e-5:
expert gradients are summed over their expert-data-parallel group, the dense ones averaged over
DP, the global norm counts every expert once (a norm clipped at 0.05 feeds every update). The
logged router statistics (`load_balancing_loss`, `z_loss`, token shares, dropped fraction) are
the same at every layout. Capacity runs keep each rank's tokens per expert at TP 1 only (each TP
rank routes its own sequence chunk), so they run at the TP 1 layouts.
"""

import pytest
from training_fixtures import (
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)

ITERATIONS = 3
RTOL = 1e-5
MIXTRAL = [
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-grouped-gemm",
]  # fmt: skip
MODELS = {
    "mixtral": MIXTRAL,
    "deepseek": [
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
        "--moe-layer-freq", "[0,1]", "--moe-router-score-function", "sigmoid",
        "--moe-shared-expert-intermediate-size", "32", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05", "--moe-router-load-balancing-type",
        "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
    ],
    "capacity": MIXTRAL + ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "probs"],
}  # fmt: skip
# (EP, TP, PP, expert TP) at 4 ranks, ZeRO-0
LAYOUTS = [(2, 1, 1, 1), (4, 1, 1, 1), (2, 2, 1, 1), (2, 2, 1, 2), (2, 1, 2, 1)]
LOGGED = ("lm-loss", "grad-norm", "moe/min_share", "moe/max_share", "moe/dropped_fraction")
LOSSES = {"mixtral": ("load_balancing_loss", "z_loss"), "deepseek": ("seq_load_balancing_loss",)}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _layouts(model: str) -> list[tuple]:
    return [x for x in LAYOUTS if model != "capacity" or x[1] == 1]


def _argv(model: str, corpus: str, layout, metrics) -> list[str]:
    ep, tp, pp, etp = layout
    return (
        model_flags("llama")
        + MODELS[model]
        + train_flags(corpus, iters=ITERATIONS)
        + layout_flags(tp, pp, 0)
        + ["--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp)]
        + (["--sequence-parallel"] if tp > 1 else [])
        + ["--metrics-file", str(metrics)]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ep")
    corpus = make_corpus(tmp / "corpus")
    files = {}
    for world in (1, 4):
        argvs = []
        for model in MODELS:
            for layout in [(1, 1, 1, 1)] if world == 1 else _layouts(model):
                files[model, layout] = tmp / f"{model}_{'_'.join(map(str, layout))}.jsonl"
                argvs.append(_argv(model, corpus, layout, files[model, layout]))
        result = run(multirun_cmd(world, argvs, tmp / f"runs_{world}.json"), timeout=1100)
        assert result.returncode == 0, f"world {world} failed:\n{result.stdout[-8000:]}"
    return {key: read_metrics(path) for key, path in files.items()}


@pytest.mark.parametrize("model", MODELS)
def test_expert_parallel_training_matches_one_process(runs, model):
    reference = runs[model, (1, 1, 1, 1)]
    keys = LOGGED + LOSSES.get(model, LOSSES["mixtral"])
    for layout in _layouts(model):
        got = runs[model, layout]
        for it in range(1, ITERATIONS + 1):
            for key in keys:
                expected = reference[it][key]
                assert abs(got[it][key] - expected) <= RTOL * abs(expected) + 1e-12, (
                    layout,
                    it,
                    key,
                    got[it][key],
                    expected,
                )
    # clipping was active (norm above --clip-grad): the norm, experts included, fed the update
    assert all(reference[it]["grad-norm"] > 0.05 for it in reference)
    dropped = [reference[it]["moe/dropped_fraction"] for it in reference]
    assert all(d > 0 for d in dropped) if model == "capacity" else not any(dropped)
