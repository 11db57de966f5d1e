"""MoE models train through pretrain_gpt.py the same at every layout (expert-parallel size 1).

Real processes under the real `deepspeed` launcher: one process, then one 4-rank launch running
DP 4 (ZeRO-1), TP 2 x DP 2 with expert TP = TP (ZeRO-2), and TP 2 x PP 2 with expert TP 1
(ZeRO-0: every TP rank holds whole experts, their gradients summed over TP), all with sequence
parallelism (MoE under TP needs it). Two models: Mixtral-like
(softmax top-2 of 4 in every layer, aux + z loss, grouped GEMM, all-gather dispatcher) and
DeepSeek-like (a dense first layer, sigmoid top-2 with a shared expert and the expert bias at a
large update rate, sequence aux loss, all-to-all dispatcher). Every layout reproduces the
one-process lm loss and grad norm of each iteration: the aux losses reach the gradients with
the loss's own scale (1 / micro-batches; a wrong scale moves the grad norm), and the expert
bias, updated from the whole global batch's token counts, routes the same at every DP size (a
wrong update moves the later losses).
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
MODELS = {
    "mixtral": [
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-grouped-gemm",
    ],
    "deepseek": [
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
        "--moe-layer-freq", "[0,1]", "--moe-router-score-function", "sigmoid",
        "--moe-shared-expert-intermediate-size", "32", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05", "--moe-router-load-balancing-type",
        "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
    ],
}  # fmt: skip
# (TP, PP, ZeRO, expert TP) at 4 ranks
LAYOUTS = [(1, 1, 1, 1), (2, 1, 2, 2), (2, 2, 0, 1)]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _argv(model: str, corpus: str, layout, metrics) -> list[str]:
    tp, pp, zero, etp = layout
    return (
        model_flags("llama")
        + MODELS[model]
        + train_flags(corpus, iters=ITERATIONS)
        + layout_flags(tp, pp, zero)
        + ["--sequence-parallel", "--expert-tensor-parallel-size", str(etp)]
        + ["--metrics-file", str(metrics)]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_training")
    corpus = make_corpus(tmp / "corpus")
    files = {}
    for world, layouts in ((1, [(1, 1, 0, 1)]), (4, LAYOUTS)):
        argvs = []
        for model in MODELS:
            for layout in layouts:
                files[model, layout] = tmp / f"{model}_{'_'.join(map(str, layout))}.jsonl"
                argvs.append(_argv(model, corpus, layout, files[model, layout]))
        result = run(multirun_cmd(world, argvs, tmp / f"runs_{world}.json"), timeout=600)
        assert result.returncode == 0, f"world {world} failed:\n{result.stdout[-8000:]}"
    return {key: read_metrics(path) for key, path in files.items()}


@pytest.mark.parametrize("model", MODELS)
def test_moe_training_matches_one_process(runs, model):
    reference = runs[model, (1, 1, 0, 1)]
    for layout in LAYOUTS:
        got = runs[model, layout]
        for it in range(1, ITERATIONS + 1):
            for key in ("lm-loss", "grad-norm"):
                expected = reference[it][key]
                assert abs(got[it][key] - expected) <= RTOL * abs(expected), (
                    layout,
                    it,
                    key,
                    got[it][key],
                    expected,
                )
    # clipping was active (norm above --clip-grad): the norm, aux losses included, fed the update
    assert all(reference[it]["grad-norm"] > 0.05 for it in reference)
