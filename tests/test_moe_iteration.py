"""What the training loop does around an MoE iteration, in one process: a withheld update (a loss
spike) leaves the expert bias as it was and its counts do not leak into the next update; the
iteration line and the dashboards carry the router statistics at log iterations only."""

from __future__ import annotations

import logging

import torch

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel
from pretrain.training.report.logging import LoggingConfig, MetricsLogger, Throughput
from pretrain.training.step import model_iteration, moe_collector

BATCH, SEQ, VOCAB = 2, 12, 64


def _model(**moe) -> tuple[GPTModel, ModelConfig]:
    config = ModelConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=VOCAB,
        seq_length=SEQ,
        ffn_hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=4,
        moe_ffn_hidden_size=16,
        add_bias_linear=False,
        **moe,
    )
    return GPTModel(config), config


class _Engine:
    """The two things `model_iteration` asks of an engine."""

    def __init__(self, model):
        self.model = model

    def loss_scale(self) -> float:
        return 1.0

    def model_parts(self):
        return [self.model]


def _iteration(model, applied: bool, seed: int) -> torch.Tensor | None:
    """One forward/backward inside `model_iteration`; returns the layer-0 router's expert-bias
    counts (None without the expert bias)."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    router = model.layers[0].mlp.router
    with model_iteration(_Engine(model), 1, lambda: applied):
        model(tokens, labels=tokens).mean().backward()
        counts = router.local_tokens_per_expert
        counts = None if counts is None else counts.clone()
    return counts


def test_a_withheld_update_leaves_the_expert_bias():
    model, _ = _model(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01,
    )
    bias = model.layers[0].mlp.router.expert_bias
    counts = _iteration(model, applied=False, seed=1)
    assert counts.sum() > 0 and counts.std() > 0  # an update would have moved the bias
    assert bias.abs().sum() == 0
    assert model.layers[0].mlp.router.local_tokens_per_expert.sum() == 0  # counts forgotten
    counts = _iteration(model, applied=True, seed=2)  # its own counts only
    torch.testing.assert_close(bias, 0.01 * torch.sign(counts.mean() - counts))


def test_the_log_line_carries_router_statistics_at_log_iterations(caplog):
    model, config = _model(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    written = []

    class Writer:
        def write(self, step, scalars, dashboards=True):
            written.append((step, scalars))

    logger = MetricsLogger(
        LoggingConfig(log_interval=2),
        Writer(),
        Throughput(
            tokens_per_iteration=BATCH * SEQ,
            flops_per_iteration=1.0,
            world_size=1,
            peak_tflops=None,
        ),
        train_iters=4,
        global_batch_size=BATCH,
        skipped_steps_at_start=0,
        moe=moe_collector(_Engine(model), config),
    )
    losses = []
    with caplog.at_level(logging.INFO, logger="pretrain"):
        for iteration in (1, 2):
            _iteration(model, applied=True, seed=iteration)
            losses.append(model.layers[0].mlp.router.stats.losses["load_balancing_loss"].item())
            logger.record_iteration(
                iteration=iteration,
                consumed_samples=iteration * BATCH,
                loss=1.0,
                seconds=1.0,
                learning_rate=1e-3,
                grad_norm=1.0,
                loss_scale=1.0,
                skipped_steps=0,
            )
    assert "load_balancing_loss" not in written[0][1]  # not a log iteration: not collected
    scalars = written[1][1]
    line = caplog.records[-1].getMessage()
    # the layer-0 router's loss, summed over both iterations, averaged over them
    assert abs(scalars["moe/load_balancing_loss_layer_0"] - losses[1] / 2) < 1e-6
    total = (
        scalars["moe/load_balancing_loss_layer_0"] + scalars["moe/load_balancing_loss_layer_1"]
    ) / 2
    assert abs(scalars["load_balancing_loss"] - total) < 1e-9
    assert f" load_balancing_loss: {total:.6E} |" in line
    assert f" z_loss: {scalars['z_loss']:.6E} |" in line
    assert 0 < scalars["moe/min_share"] <= 0.25 <= scalars["moe/max_share"] < 1
    share = f"{scalars['moe/min_share']:.4f}/{scalars['moe/max_share']:.4f}"
    assert f" expert token share min/max: {share} |" in line
    assert " dropped tokens: 0.0000 |" in line
    assert line.index("lm loss:") < line.index("load_balancing_loss:") < line.index("loss scale:")
