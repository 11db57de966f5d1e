"""Sequence parallelism (`--sequence-parallel`, Megatron's) changes where activations live, not the math.

- The sequence collectives on real gloo ranks: forward and backward against tensors built here
  from every rank's (seeded) inputs.
- The model, 4 ranks, both flavours, at TP 2 (with document ids) and TP 4: logits, per-token
  loss and every parameter gradient (TP shards gathered) equal the TP=1 model without sequence
  parallelism (which `test_model_gpt` proves equal to megatron-style TP without it); between the
  layers each rank holds [b, s/tp, h]; norm weights and row biases are marked `sequence_parallel`
  and their gradients are the same on every TP rank. With dropout, recomputation (selective and
  full) replays the same masks under sequence parallelism.
- End to end (the real deepspeed launcher, fp32, dropout 0): `pretrain_gpt.py --sequence-parallel`
  logs the same losses and grad norms as the run without it at TP 4, TP 2 x PP 2 (both flavours:
  the tied GPT-2 head runs on the last stage's embedding copy, Llama's on its own output layer)
  and TP 2 x DP 2 with ZeRO-1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from test_model_gpt import GPT2, LLAMA, batch, gathered, reset_documents_and_positions
from training_fixtures import (
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)

from pretrain.model import GPTModel
from pretrain.parallel import state
from pretrain.parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from pretrain.parallel.random import seed_everything
from pretrain.parallel.sharding import is_tensor_parallel

TOL = 1e-5


def _per_rank(rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """The tensor TP rank `rank` uses, reproducible on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def check_sequence_collectives(tp: int) -> None:
    state.initialize_model_parallel(tp, 1)
    r, b, s, h = state.get_tensor_model_parallel_rank(), 2, 8, 3
    chunk = slice(r * s // tp, (r + 1) * s // tp)
    ranks = range(tp)

    full = _per_rank(0, (b, s, h), salt=1).requires_grad_(True)  # replicated
    out = scatter_to_sequence_parallel_region(full)
    assert torch.equal(out, full[:, chunk].detach())
    out.backward(_per_rank(r, (b, s // tp, h), salt=2))
    torch.testing.assert_close(
        full.grad, torch.cat([_per_rank(i, (b, s // tp, h), salt=2) for i in ranks], dim=1)
    )

    for tp_output_grad in (True, False):
        part = _per_rank(r, (b, s // tp, h), salt=3).requires_grad_(True)
        out = gather_from_sequence_parallel_region(part, tp_output_grad)
        torch.testing.assert_close(
            out, torch.cat([_per_rank(i, (b, s // tp, h), salt=3) for i in ranks], dim=1)
        )
        out.backward(_per_rank(r, (b, s, h), salt=4))
        upstream = [_per_rank(i, (b, s, h), salt=4) for i in ranks]
        expected = (sum(upstream) if tp_output_grad else upstream[r])[:, chunk]
        torch.testing.assert_close(part.grad, expected)

    partial = _per_rank(r, (b, s, h), salt=5).requires_grad_(True)
    out = reduce_scatter_to_sequence_parallel_region(partial)
    torch.testing.assert_close(out, sum(_per_rank(i, (b, s, h), salt=5) for i in ranks)[:, chunk])
    out.backward(_per_rank(r, (b, s // tp, h), salt=6))
    torch.testing.assert_close(
        partial.grad, torch.cat([_per_rank(i, (b, s // tp, h), salt=6) for i in ranks], dim=1)
    )
    state.destroy_model_parallel()


def _run(config, document_ids=None, positions=None):
    model = GPTModel(config)
    tokens, labels = batch()
    shapes = []
    model.layers[0].register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))
    loss = model(tokens, positions, document_ids, labels=labels)
    loss.mean().backward()
    with torch.no_grad():
        logits = model(tokens, positions, document_ids, gather_logits=True)
    return model, loss.detach(), logits, shapes[0]


def _assert_same_on_tp_peers(tensor: torch.Tensor, what: str) -> None:
    peers = [torch.empty_like(tensor) for _ in range(state.get_tensor_model_parallel_world_size())]
    dist.all_gather(peers, tensor.contiguous(), group=state.get_tensor_model_parallel_group())
    assert all(torch.equal(p, peers[0]) for p in peers), f"{what} differs between TP ranks"


def check_model_equals_tp1(config, tp: int, with_documents: bool) -> None:
    documents, positions = reset_documents_and_positions() if with_documents else (None, None)
    ref_model, ref_loss, ref_logits, ref_shape = _run(config, documents, positions)  # TP=1
    ref_params = dict(ref_model.named_parameters())

    state.initialize_model_parallel(tp, 1)
    sp = dataclasses.replace(config, sequence_parallel=True)
    model, loss, logits, shape = _run(sp, documents, positions)
    what = f"{'llama' if config.swiglu else 'gpt2'} tp={tp} sp documents={with_documents}"
    b, s, h = ref_shape
    assert shape == (b, s // tp, h), f"{what}: layer output {shape}, not this rank's chunk"
    torch.testing.assert_close(logits, ref_logits, rtol=TOL, atol=TOL, msg=lambda m: f"{what} {m}")
    torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL, msg=lambda m: f"{what} {m}")
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            gathered(param.grad, param),
            ref_params[name].grad,
            rtol=TOL,
            atol=TOL,
            msg=lambda m, name=name: f"{what} grad of {name}: {m}",
        )
        replicated = not is_tensor_parallel(param)
        if replicated:
            _assert_same_on_tp_peers(param.grad, f"{what} grad of {name}")
        sequence_region = "norm" in name or (name.endswith(".bias") and replicated)
        if sequence_region and "position" not in name:
            assert getattr(param, "sequence_parallel", False), f"{name} not marked"
    state.destroy_model_parallel()


def check_dropout_and_recompute(tp: int) -> None:
    """Dropout on sequence chunks: recomputation replays the same masks; replicated parameters
    still get one gradient on every TP rank."""
    config = dataclasses.replace(
        LLAMA, hidden_dropout=0.2, attention_dropout=0.2, sequence_parallel=True
    )
    state.initialize_model_parallel(tp, 1)
    tokens, labels = batch()
    grads = []
    for recompute in (
        {},
        {"recompute_granularity": "selective"},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    ):
        model = GPTModel(dataclasses.replace(config, **recompute)).train()
        seed_everything(5)
        model(tokens, labels=labels).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-6, atol=1e-7)
    _assert_same_on_tp_peers(grads[0]["layers.1.post_attention_norm.weight"], "norm grad")
    state.destroy_model_parallel()


def sequence_parallel_world(rank: int, world: int) -> str:
    for tp in (2, 4):
        check_sequence_collectives(tp)
    for config in (GPT2, LLAMA):
        check_model_equals_tp1(config, 2, with_documents=True)
        check_model_equals_tp1(config, 4, with_documents=False)
    check_dropout_and_recompute(2)
    return "ok"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequence_parallel_model_equals_tp1_on_4_ranks():
    assert run_on_ranks(sequence_parallel_world, 4, timeout=240) == ["ok"] * 4


def test_sequence_length_must_divide_over_tp():
    from pretrain.errors import UserError

    bad = dataclasses.replace(GPT2, seq_length=10, sequence_parallel=True)
    with pytest.raises(UserError, match="--sequence-parallel splits --seq-length 10"):
        bad.validate(tp=4)
    bad.validate(tp=1)  # a no-op at TP 1, as in Megatron


# end to end: (flavour, TP, PP, ZeRO, sequence parallel); every run against the same flavour's
# run without sequence parallelism in this world (any layout equals one process: test_training_
# equivalence)
E2E_RUNS = [
    ("gpt2", 4, 1, 0, False),
    ("gpt2", 4, 1, 0, True),
    ("gpt2", 2, 2, 0, True),
    ("llama", 2, 2, 0, False),
    ("llama", 2, 2, 0, True),
    ("llama", 2, 1, 1, True),
]
ITERATIONS = 4


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sequence_parallel_training_logs_the_same_losses_and_grad_norms(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    argvs, metrics = [], {}
    for flavour, tp, pp, zero, sp in E2E_RUNS:
        path = tmp_path / f"{flavour}_tp{tp}_pp{pp}_zero{zero}_sp{int(sp)}.jsonl"
        metrics[flavour, tp, pp, zero, sp] = path
        argvs.append(
            model_flags(flavour)
            + train_flags(corpus, iters=ITERATIONS)
            + layout_flags(tp, pp, zero)
            + (["--sequence-parallel"] if sp else [])
            + ["--metrics-file", str(path)]
        )
    result = run(multirun_cmd(4, argvs, tmp_path / "runs.json"), timeout=360)
    assert result.returncode == 0, result.stdout[-8000:]
    logged = {key: read_metrics(path) for key, path in metrics.items()}
    for key, got in logged.items():
        flavour, *_, sp = key
        if not sp:
            continue
        ref = next(v for k, v in logged.items() if k[0] == flavour and not k[-1])
        assert sorted(got) == sorted(ref) == list(range(1, ITERATIONS + 1)), key
        for it in ref:
            for field in ("lm-loss", "grad-norm"):
                assert got[it][field] == pytest.approx(ref[it][field], rel=1e-6), (key, it, field)
        assert all(ref[it]["grad-norm"] > 0.05 for it in ref)  # clipped: the norm is used
