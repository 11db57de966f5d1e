"""The torch backend's pipeline (torch.distributed.pipelining) reproduces one process.

Every schedule (1F1B, interleaved 1F1B, interleaved zero bubble, ZBV zero bubble) on real gloo
ranks, PP 2 x TP {1, 2}, each stage module sharded by FSDP2 as the engine shards it (over DP 1;
the training tests run DP 2), GPT-2 (tied embeddings) and Llama (untied) flavours: one
iteration's loss, the forward-only evaluation loss and its per-source sums, then (after the
evaluation) the same iteration's loss and every parameter's gradient again (each stage's, the
last stage's tied embedding copy included) equal those of the one-process GPTModel on the same
micro-batches (fp32). One launched world per TP size runs every case. The stage placement
(Megatron's round robin, ZBV's V) is checked against hand-written tables.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_on_ranks

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel
from pretrain.model.loss import masked_mean_loss
from pretrain.parallel.sharding import shard_tensor
from pretrain.training.backends.torch.stages import TIED_COPY, StagePlan

GPT2 = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=8,
    max_position_embeddings=8,
    make_vocab_size_divisible_by=32,  # 128 rows at TP 1 and 2
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA = dataclasses.replace(
    GPT2,
    num_attention_heads=8,
    num_query_groups=4,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    rotary_base=500,
)
MICRO_BATCH, SOURCES = 2, 3
SHARDING = {"reshard_after_forward": False}  # the engine's policy at PP > 1
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5

# (name, config, schedule, model chunks per rank, micro-batches, document ids)
CASES = [
    ("gpt2_1f1b", GPT2, "1f1b", 1, 4, False),
    ("llama_1f1b_docs", LLAMA, "1f1b", 1, 3, True),
    ("gpt2_interleaved", GPT2, "interleaved-1f1b", 2, 4, True),
    ("llama_interleaved", LLAMA, "interleaved-1f1b", 2, 3, False),
    ("gpt2_zero_bubble", GPT2, "interleaved-zero-bubble", 2, 4, False),
    ("llama_zero_bubble_docs", LLAMA, "interleaved-zero-bubble", 2, 2, True),
    ("gpt2_zbv", GPT2, "zbv-zero-bubble", 2, 4, True),
    ("llama_zbv", LLAMA, "zbv-zero-bubble", 2, 3, False),
    (
        "gpt2_zero_bubble_full_recompute",
        dataclasses.replace(
            GPT2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        "interleaved-zero-bubble",
        2,
        4,
        False,
    ),
    (
        "llama_zbv_selective_recompute",
        dataclasses.replace(LLAMA, recompute_granularity="selective"),
        "zbv-zero-bubble",
        2,
        4,
        False,
    ),
]


def micro_batches(count: int, document_ids: bool, seed: int) -> list[dict]:
    """Loader dicts: random tokens, a partial loss mask, a blend source per sample and, with
    `document_ids`, two documents per sample (positions restarting at the boundary)."""
    generator = torch.Generator().manual_seed(seed)
    s = GPT2.seq_length
    out = []
    for _ in range(count):
        tokens = torch.randint(0, GPT2.vocab_size, (MICRO_BATCH, s + 1), generator=generator)
        batch = {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": (torch.rand(MICRO_BATCH, s, generator=generator) > 0.25).float(),
            "position_ids": torch.arange(s).repeat(MICRO_BATCH, 1),
            "dataset_id": torch.randint(0, SOURCES, (MICRO_BATCH,), generator=generator),
        }
        if document_ids:
            boundary = torch.randint(1, s, (MICRO_BATCH, 1), generator=generator)
            later = torch.arange(s) >= boundary
            batch["document_ids"] = later.int()
            batch["position_ids"] = torch.where(later, torch.arange(s) - boundary, torch.arange(s))
        out.append(batch)
    return out


def one_process(config: ModelConfig, batches: list[dict], document_ids: bool) -> dict:
    """The reference: GPTModel in this process, Megatron's loss (mean of micro-batch means), its
    gradients, and the per-source (sum, tokens) of the per-token losses."""
    model = GPTModel(config)
    losses, sums, tokens = [], torch.zeros(SOURCES, dtype=torch.float64), torch.zeros(SOURCES)
    for batch in batches:
        per_token = model(
            batch["tokens"],
            position_ids=batch["position_ids"],
            document_ids=batch["document_ids"] if document_ids else None,
            labels=batch["labels"],
        )
        losses.append(masked_mean_loss(per_token, batch["loss_mask"]))
        masked = (per_token.detach().double() * batch["loss_mask"]).sum(1)
        sums.index_add_(0, batch["dataset_id"], masked)
        tokens.index_add_(0, batch["dataset_id"], batch["loss_mask"].sum(1))
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "sums": sums, "tokens": tokens}


def _run_case(case: tuple) -> dict:
    """One case on this rank: a training pass, then an evaluation pass with per-source sums."""
    from pretrain.parallel import state
    from pretrain.training.backends.torch.fsdp import (
        ShardingPolicy,
        device_mesh,
        local_tensor,
        shard_model,
    )
    from pretrain.training.backends.torch.pipeline import Pipeline
    from pretrain.training.backends.torch.stages import build_stage_modules
    from pretrain.training.report.per_source import SourceLosses

    _, config, schedule, chunks, count, document_ids = case
    plan = StagePlan(
        num_layers=config.num_layers,
        pipeline_size=state.get_pipeline_model_parallel_world_size(),
        chunks=chunks,
        v_shape=schedule == "zbv-zero-bubble",
    )
    modules = build_stage_modules(config, plan, state.get_pipeline_model_parallel_rank())
    mesh = device_mesh(torch.device("cpu"))
    for module in modules:  # as the engine shards them (FSDP2 over DP = 1 here)
        shard_model(module, list(module.layers.values()), mesh, ShardingPolicy(**SHARDING))
    pipeline = Pipeline(config, plan, modules, schedule, torch.device("cpu"))
    batches = micro_batches(count, document_ids, seed=count)
    loss = pipeline.train(batches, document_ids)
    sources = SourceLosses([f"source{i}" for i in range(SOURCES)], torch.device("cpu"))
    evaluation = pipeline.evaluate(batches, document_ids, sources)
    sources.reduce()
    for module in modules:  # what the optimizer's zero_grad does; then the same pass again
        module.zero_grad(set_to_none=True)
    again = pipeline.train(batches, document_ids)
    grads = {
        name: (
            local_tensor(p.grad).clone(),
            getattr(p, "partition_dim", None),
            getattr(p, "partition_stride", 1),
        )
        for module in modules
        for name, p in module.named_parameters()
    }
    return {
        "losses": (float(loss), float(again)),
        "grads": grads,
        "evaluation": float(evaluation),
        "sums": sources.sums.clone(),
        "tokens": sources.tokens.clone(),
    }


def run_cases(rank: int, world: int, tp: int, sequence_parallel: bool) -> dict:
    from pretrain.parallel import state

    state.initialize_model_parallel(tp, world // tp)
    out = {"tp_rank": state.get_tensor_model_parallel_rank()}
    for case in CASES:
        config = dataclasses.replace(case[1], sequence_parallel=sequence_parallel)
        out[case[0]] = _run_case((case[0], config, *case[2:]))
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, True)], ids=["tp1", "tp2_sp"])
def test_every_schedule_reproduces_one_process(tp, sequence_parallel):
    ranks = run_on_ranks(run_cases, 2 * tp, args=(tp, sequence_parallel), timeout=800)
    for name, config, _, _, count, document_ids in CASES:
        want = one_process(config, micro_batches(count, document_ids, seed=count), document_ids)
        for result in ranks:
            got = result[name]
            for loss in (*got["losses"], got["evaluation"]):
                assert abs(loss - want["loss"]) <= LOSS_RTOL * want["loss"], (name, got, want)
            torch.testing.assert_close(got["tokens"], want["tokens"].double(), rtol=0, atol=0)
            torch.testing.assert_close(got["sums"], want["sums"], rtol=LOSS_RTOL, atol=0)
            assert got["grads"], name
            for param, (grad, dim, stride) in got["grads"].items():
                full = want["grads"][
                    "embedding.word_embeddings.weight" if param == TIED_COPY else param
                ]
                if dim is not None:
                    full = shard_tensor(full, dim, result["tp_rank"], tp, stride)
                assert _rel(grad, full) <= GRAD_RTOL, (name, param, _rel(grad, full))


@pytest.mark.parametrize(
    "pp, chunks, v_shape, stages_by_rank",
    [
        (2, 1, False, [[0], [1]]),
        (4, 2, False, [[0, 4], [1, 5], [2, 6], [3, 7]]),  # chunk c of rank r: stage c * PP + r
        (2, 3, False, [[0, 2, 4], [1, 3, 5]]),
        (2, 2, True, [[0, 3], [1, 2]]),  # ZBV: rank r holds r and 2 PP - 1 - r
        (4, 2, True, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_stage_placement(pp, chunks, v_shape, stages_by_rank):
    plan = StagePlan(num_layers=24, pipeline_size=pp, chunks=chunks, v_shape=v_shape)
    assert [plan.stages_of(r) for r in range(pp)] == stages_by_rank
    assert [plan.rank_of(s) for s in stages_by_rank[1]] == [1] * chunks
    per_stage = 24 // (pp * chunks)
    layers = [list(plan.layers_of(s)) for s in range(plan.num_stages)]
    assert sum(layers, []) == list(range(24))
    assert {len(stage_layers) for stage_layers in layers} == {per_stage}
