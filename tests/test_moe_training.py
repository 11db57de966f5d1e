"""MoE models train through pretrain_gpt.py the same at every layout; their checkpoints resume
at any expert layout; their validation and batch tools work.

Real processes under the real `deepspeed` launcher, two launches in all: one process, then one
4-rank launch running every layout below (tests/training_multirun.py) for three models:
Mixtral-like (softmax top-2 of 8, aux + z loss, grouped GEMM, all-gather dispatcher),
DeepSeek-like (a dense first layer, sigmoid top-2 of 8 with a shared expert and the expert bias
at a large update rate, sequence aux loss, all-to-all dispatcher) and Mixtral-like with capacity
(factor 1, probs drop policy: tokens are dropped).

Layouts (EP, TP, PP, expert TP, ZeRO) at 4 ranks, sequence parallelism under TP, and three TP
layouts again without it (TP 2 x DP 2 with expert TP 2 at ZeRO-2, TP 2 x PP 2 with expert TP 1,
TP 2 x EP 2 with expert TP 2: the MoE layer routes each TP rank's chunk of the replicated
sequence and gathers the outputs): at EP 1, DP 4 ZeRO-1, TP 2 x DP 2 with expert TP 2 (ZeRO-2) and TP 2 x PP 2 with
expert TP 1 (every TP rank holds whole experts, their gradients summed over TP); at EP > 1
(ZeRO-0): EP 2 and 4 over DP 4 (expert DP 2 and 1), EP 2 over the TP peers (TP 2, expert TP 1),
TP 2 x EP 2 with expert TP 2 (no expert DP) and PP 2 x EP 2; at EP > 1 with ZeRO-1 (EP 2 x DP
4) and ZeRO-2 (TP 2 x EP 2, expert TP 2), where DeepSpeed's ZeRO partitions the experts over
their expert-data-parallel group. Every layout reproduces the one-process lm loss and grad norm
of each iteration within 1e-5: the aux losses reach the
gradients with the loss's own scale (a wrong scale moves the grad norm: tried, 1.6e-4 off at DP
4), expert gradients are summed over their expert-data-parallel group (skipping it: tried, grad
norm 7e-5 off at EP 2), the global norm counts every expert once (a norm clipped at 0.05 feeds
every update), and the expert bias, updated from the whole global batch's token counts, routes
the same at every DP size. The logged router statistics (`load_balancing_loss`, `z_loss`, token
shares, dropped fraction) are the same at every layout. Capacity runs keep each rank's tokens per
expert at TP 1 only (each TP rank routes its own sequence chunk), so they run at TP 1 layouts.

Checkpoints (DeepSeek-like: experts, shared expert, expert bias): a run at EP 2 (DP 4) saves at
iteration 3 (ZeRO-0; at even iterations this bias is back at exactly 0); one resumes it at EP 4
with ZeRO-2 and saves at 5, one at TP 2 x PP 2 x EP 2; one process (EP 1) resumes the EP 4 ZeRO-2
checkpoint. Each continues the one-process run
within 1e-5 from the iteration after its checkpoint (the expert bias, moving by 0.05 an iteration, must come back
too), and the converter's reader gives the same full state dict (all 8 experts, expert bias)
from the EP 4 checkpoint as from the one-process run's at the same iteration, and from that
checkpoint resharded offline to TP 2 x PP 2.

A DeepSeek-like run at EP 2 on a blend of two sources logs per-source validation losses equal to
its checkpointed model's loss on those samples, and tools/explain_batch.py explains its batches
from its checkpoint.
"""

import pytest
import torch
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
# (EP, TP, PP, expert TP, ZeRO) at 4 ranks
LAYOUTS = [
    (1, 1, 1, 1, 1),
    (1, 1, 1, 1, 3),
    (1, 2, 1, 2, 2),
    (1, 2, 2, 1, 0),
    (2, 1, 1, 1, 0),
    (4, 1, 1, 1, 0),
    (2, 2, 1, 1, 0),
    (2, 2, 1, 2, 0),
    (2, 1, 2, 1, 0),
    (2, 1, 1, 1, 1),
    (2, 2, 1, 2, 2),
]
# TP 2 without --sequence-parallel (each TP rank routes its chunk of the whole sequence): TP 2 x
# DP 2 with expert TP 2 (ZeRO-2), TP 2 x PP 2 with expert TP 1 and TP 2 x EP 2 with expert TP 2
NO_SP_LAYOUTS = [(1, 2, 1, 2, 2, "no-sp"), (1, 2, 2, 1, 0, "no-sp"), (2, 2, 1, 2, 0, "no-sp")]
CAPACITY_LAYOUTS = [(1, 1, 1, 1, 1), (4, 1, 1, 1, 0), (2, 1, 2, 1, 0)]
LOGGED = ("lm-loss", "grad-norm", "moe/min_share", "moe/max_share", "moe/dropped_fraction")
LOSSES = {"mixtral": ("load_balancing_loss", "z_loss"), "deepseek": ("seq_load_balancing_loss",)}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _layouts(model: str) -> list[tuple]:
    return CAPACITY_LAYOUTS if model == "capacity" else LAYOUTS + NO_SP_LAYOUTS


def _argv(model: str, corpus: str, layout, metrics, iters: int = ITERATIONS) -> list[str]:
    ep, tp, pp, etp, zero, *no_sp = layout
    return (
        model_flags("llama")
        + MODELS[model]
        + train_flags(corpus, iters=iters)
        + ["--lr-decay-iters", "6"]  # one LR schedule for runs of 2 to 6 iterations
        + layout_flags(tp, pp, zero)
        + ["--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp)]
        + (["--sequence-parallel"] if tp > 1 and not no_sp else [])
        + ["--metrics-file", str(metrics)]
    )


REFERENCE = (1, 1, 1, 1, 0)
# name -> (world, layout, --load, --save, train iters): DeepSeek-like, saving every iteration.
# The resumes start at odd iterations: here the expert bias (rate 0.05) moves away from 0 at odd
# iterations and back to exactly 0 at even ones, where a resume could not tell whether it was
# restored.
RESUMES = {
    "ep2": (4, (2, 1, 1, 1, 0), None, "ckpt_ep2", 3),
    "ep4": (4, (4, 1, 1, 1, 2), "ckpt_ep2", "ckpt_ep4", 5),
    "tp2_pp2_ep2": (4, (2, 2, 2, 1, 0), "ckpt_ep2", None, 4),
    "ep1": (1, REFERENCE, "ckpt_ep4", None, 6),
}


EVAL_ITERS, GBS = 2, 8


def _blend_argv(tmp, layout) -> list[str]:
    """DeepSeek-like on an unweighted blend of two sources, validated per source at iteration
    2, saved there."""
    argv = _argv("deepseek", "", layout, tmp / "blend.jsonl", 2)
    i = argv.index("--data-path")
    argv[i + 1 : i + 2] = [str(tmp / "alpha"), str(tmp / "beta")]
    argv[argv.index("--split") + 1] = "80,20,0"
    argv[argv.index("--eval-interval") + 1] = "2"
    argv[argv.index("--eval-iters") + 1] = str(EVAL_ITERS)
    return argv + ["--save", str(tmp / "ckpt_blend"), "--save-interval", "2"]


def _resume_argv(tmp, corpus: str, name: str) -> list[str]:
    _, layout, load, save, iters = RESUMES[name]
    argv = _argv("deepseek", corpus, layout, tmp / f"resume_{name}.jsonl", iters)
    argv += ["--load", str(tmp / load)] if load else []
    return argv + (["--save", str(tmp / save), "--save-interval", "1"] if save else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ep")
    corpus = make_corpus(tmp / "corpus")
    make_corpus(tmp / "alpha", seed=0), make_corpus(tmp / "beta", seed=1)
    files = {}
    for world in (4, 1):
        argvs = []
        for model in MODELS:
            for layout in [REFERENCE] if world == 1 else _layouts(model):
                files[model, layout] = tmp / f"{model}_{'_'.join(map(str, layout))}.jsonl"
                argvs.append(_argv(model, corpus, layout, files[model, layout]))
                if model == "deepseek" and world == 1:  # the resumes' reference: 6 iterations
                    argvs[-1] = _argv(model, corpus, layout, files[model, layout], 6)
                    argvs[-1] += ["--save", str(tmp / "ckpt_reference"), "--save-interval", "5"]
        argvs += [_resume_argv(tmp, corpus, n) for n, r in RESUMES.items() if r[0] == world]
        argvs += [_blend_argv(tmp, (2, 1, 1, 1, 0))] if world == 4 else []
        result = run(multirun_cmd(world, argvs, tmp / f"runs_{world}.json"), timeout=1100)
        assert result.returncode == 0, f"world {world} failed:\n{result.stdout[-8000:]}"
    out = {key: read_metrics(path) for key, path in files.items()}
    out.update({name: read_metrics(tmp / f"resume_{name}.jsonl") for name in RESUMES})
    out["checkpoints"] = tmp
    return out


@pytest.mark.parametrize("model", MODELS)
def test_moe_training_matches_one_process(runs, model):
    reference = runs[model, REFERENCE]
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


def _close(got: float, expected: float) -> bool:
    return abs(got - expected) <= RTOL * abs(expected)


def test_resume_at_another_expert_layout_continues(runs):
    reference = runs["deepseek", REFERENCE]
    assert reference[6]["grad-norm"] > 0.05
    for name, (_, _, load, _, iters) in RESUMES.items():
        got = runs[name]
        first = 1 if load is None else {"ckpt_ep2": 4, "ckpt_ep4": 6}[load]
        assert sorted(got) == list(range(first, iters + 1)), name  # resumed after its checkpoint
        for it in got:
            for key in ("lm-loss", "grad-norm", "seq_load_balancing_loss", "moe/max_share"):
                assert _close(got[it][key], reference[it][key]), (name, it, key)


def test_the_reader_gives_every_expert_of_an_expert_parallel_checkpoint(runs, tmp_path):
    from pretrain.convert.checkpoint_reader import read_checkpoint
    from tools.reshard_checkpoint import main as reshard

    folder = runs["checkpoints"]
    whole = read_checkpoint(str(folder / "ckpt_reference"), 5).state_dict
    assert whole["layers.1.mlp.experts.fc1.weight"].shape[0] == 8
    assert whole["layers.1.mlp.router.expert_bias"].abs().sum() > 0  # it moved and is there
    # the resumes start from a bias that is not 0, so one lost on resume would show
    first = read_checkpoint(str(folder / "ckpt_ep2"), 3).state_dict
    assert first["layers.1.mlp.router.expert_bias"].abs().sum() > 0
    args = ["--load", str(folder / "ckpt_ep4"), "--iteration", "5", "--save", str(tmp_path / "r")]
    reshard(args + ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"])
    for source in (folder / "ckpt_ep4", tmp_path / "r"):  # saved at EP 4; resharded to TP 2 PP 2
        split = read_checkpoint(str(source), 5).state_dict
        assert split.keys() == whole.keys()
        for name, tensor in whole.items():
            torch.testing.assert_close(split[name].float(), tensor.float(), rtol=1e-5, atol=1e-6)


def test_per_source_validation_and_explain_batch_of_an_moe_run(runs):
    import json

    from test_validation_per_source import _validation_samples
    from training_fixtures import PYTHON, REPO, checkpointed_model, token_losses

    tmp = runs["checkpoints"]
    records = [json.loads(x) for x in (tmp / "blend.jsonl").read_text().splitlines()]
    a, b = str(tmp / "alpha"), str(tmp / "beta")
    logged = next(r for r in records if f"validation-loss/{a}" in r)
    one_process = _blend_argv(tmp, REFERENCE)  # the same samples, parsed here
    batch = _validation_samples(one_process, EVAL_ITERS * GBS)
    assert set(batch["dataset_id"].tolist()) == {0, 1}
    model = checkpointed_model(str(tmp / "ckpt_blend"))  # saved at EP 2: every expert
    per_token, mask = token_losses(model, batch)
    for source, prefix in enumerate((a, b)):
        rows = batch["dataset_id"] == source
        expected = (per_token[rows] * mask[rows]).sum() / mask[rows].sum()
        assert abs(logged[f"validation-loss/{prefix}"] - float(expected)) <= 1e-5 * float(expected)
    tool = [PYTHON, str(REPO / "tools" / "explain_batch.py"), *_blend_argv(tmp, (2, 1, 1, 1, 0))]
    result = run([*tool, "--load", str(tmp / "ckpt_blend"), "--iteration", "2", "--json"], 300)
    assert result.returncode == 0, result.stdout[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["sample"] for r in rows) == list(range(GBS, 2 * GBS))
    assert {r["dataset"] for r in rows} <= {a, b} and all(r["documents"] for r in rows)
