"""Activation recompute as Megatron defines it: the same losses and gradients, less memory.

- Every setting (`--recompute-granularity selective`, `full` with `--recompute-method uniform|block`
  and several `--recompute-num-layers`) gives bit-for-bit the gradients of the model without
  recompute, with dropout on (the recomputation replays both dropout generators), both flavours.
- The chunks follow Megatron's loops (megatron/core: uniform = every chunk of N layers, the last
  one shorter; block = the first N layers one by one, the rest not recomputed).
- The memory a training forward leaves for backward (bench/activation_memory.py's measure): full
  < selective < none; with attention dropout on CPU the attention core keeps the [b, nh, s, s]
  probabilities, which selective recompute drops (its saving is at least that size per layer).
- The flags: `--recompute-activations` = selective (Megatron), contradictions and Megatron's
  rules refused in one line.
- End to end under DeepSpeed's pipeline engine (PP 2, dropout 0.1): full uniform/block and
  selective log the same losses and grad norms as the run without recompute.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from test_model_gpt import GPT2, LLAMA
from training_fixtures import (
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)

from pretrain.cli import parse_args
from pretrain.errors import UserError
from pretrain.model import GPTModel
from pretrain.model.gpt import recompute_segments
from pretrain.parallel.random import seed_everything

FULL = {"recompute_granularity": "full"}
SETTINGS = {
    "selective": {"recompute_granularity": "selective"},
    "uniform_1": {**FULL, "recompute_method": "uniform", "recompute_num_layers": 1},
    "uniform_2": {**FULL, "recompute_method": "uniform", "recompute_num_layers": 2},
    "block_1": {**FULL, "recompute_method": "block", "recompute_num_layers": 1},
    "block_3": {**FULL, "recompute_method": "block", "recompute_num_layers": 3},
}


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_activation_memory", REPO / "bench" / "activation_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grads(config, tokens, labels) -> tuple[torch.Tensor, dict]:
    model = GPTModel(config).train()
    seed_everything(3)
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("flavour", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_every_recompute_setting_gives_the_same_gradients(flavour):
    config = dataclasses.replace(flavour, num_layers=3, hidden_dropout=0.2, attention_dropout=0.2)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (2, 12), generator=generator)
    labels = torch.randint(0, 100, (2, 12), generator=generator)
    ref_loss, ref = _grads(config, tokens, labels)
    no_dropout_loss, _ = _grads(dataclasses.replace(config, hidden_dropout=0.0), tokens, labels)
    assert not torch.equal(ref_loss, no_dropout_loss), "dropout had no effect"
    for name, setting in SETTINGS.items():
        loss, grads = _grads(dataclasses.replace(config, **setting), tokens, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, msg=name)
        for param, grad in ref.items():
            torch.testing.assert_close(
                grads[param], grad, rtol=1e-6, atol=1e-7, msg=lambda m, p=param: f"{p}: {m}"
            )


@pytest.mark.parametrize(
    "method, n, layers, expected",
    [
        # Megatron's uniform loop: layer_idx += N while < layers, chunk end min(idx + N, layers)
        ("uniform", 1, 3, [(0, 1, True), (1, 2, True), (2, 3, True)]),
        ("uniform", 2, 5, [(0, 2, True), (2, 4, True), (4, 5, True)]),
        # block: layers [0, N) checkpointed one by one, the rest run plainly
        ("block", 2, 5, [(0, 1, True), (1, 2, True), (2, 5, False)]),
        ("block", 3, 3, [(0, 1, True), (1, 2, True), (2, 3, True)]),
    ],
)
def test_full_recompute_chunks_follow_megatron(method, n, layers, expected):
    config = dataclasses.replace(
        GPT2,
        num_layers=layers,
        recompute_granularity="full",
        recompute_method=method,
        recompute_num_layers=n,
    )
    assert recompute_segments(config, layers) == expected
    assert recompute_segments(GPT2, layers) == [(0, layers, False)]


def test_recompute_saves_activation_memory():
    bench = _bench()
    args = bench.parse_args(["--seq-length", "128", "--hidden-size", "64", "--tp"])
    args.num_attention_heads, args.vocab_size = 4, 512
    rows = bench.recompute_rows(args)
    assert rows["full_uniform_1"] < rows["full_block_half"] < rows["none"], rows
    assert rows["full_uniform_1"] < rows["selective"] < rows["none"], rows
    # the attention probabilities of every layer, fp32: what the CPU attention core keeps
    probs = args.micro_batch_size * args.num_attention_heads * args.seq_length**2 * 4
    assert rows["none"] - rows["selective"] >= args.num_layers * probs, rows


def test_recompute_flags(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", num_docs=20)
    base = model_flags("gpt2", layers=4) + train_flags(corpus)

    def model(*extra):
        return parse_args(base + list(extra), env={}).model

    assert model("--recompute-activations").recompute_granularity == "selective"
    full = model(
        "--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", "2",
    )  # fmt: skip
    assert (full.recompute_method, full.recompute_num_layers) == ("block", 2)
    refused = {
        ("--recompute-activations", "--recompute-granularity", "full"): "contradicts",
        ("--recompute-granularity", "full"): "needs --recompute-method",
        ("--recompute-granularity", "full", "--recompute-method", "uniform"): "between 1 and",
        ("--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "5"): "between 1 and the layers per pipeline stage \\(4\\)",
        ("--recompute-granularity", "selective", "--recompute-num-layers", "1"): "for full",
        ("--recompute-method", "block"): "need --recompute-granularity full",
    }  # fmt: skip
    for flags, message in refused.items():
        with pytest.raises(UserError, match=message):
            model(*flags)
    # Megatron-DeepSpeed's spelling: full recompute, uniform, one layer per chunk
    mds = model("--checkpoint-activations")
    assert (mds.recompute_granularity, mds.recompute_method, mds.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    with pytest.raises(UserError, match="contradicts"):
        model("--checkpoint-activations", "--recompute-activations")


E2E = {
    "none": [],
    "uniform_2": ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    + ["--recompute-num-layers", "2"],
    "block_1": ["--recompute-granularity", "full", "--recompute-method", "block"]
    + ["--recompute-num-layers", "1"],
    "selective": ["--recompute-activations"],
}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_training_with_recompute_logs_the_same_losses(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    argvs = [
        model_flags("llama", layers=4)
        + dropout
        + train_flags(corpus, iters=3)
        + layout_flags(1, 2, 0)
        + flags
        + ["--metrics-file", str(tmp_path / f"{name}.jsonl")]
        for name, flags in E2E.items()
    ]
    result = run(multirun_cmd(2, argvs, tmp_path / "runs.json"), timeout=360)
    assert result.returncode == 0, result.stdout[-8000:]
    logged = {name: read_metrics(tmp_path / f"{name}.jsonl") for name in E2E}
    ref = logged["none"]
    assert sorted(ref) == [1, 2, 3]
    for name, got in logged.items():
        for it in ref:
            for field in ("lm-loss", "grad-norm"):
                assert got[it][field] == pytest.approx(ref[it][field], rel=1e-6), (name, it)
