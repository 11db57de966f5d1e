"""`pretrain_gpt.py` with --eod-mask-loss --reset-position-ids --reset-attention-mask, end to end.

Two real 2-rank runs under the deepspeed launcher, PP=2 (the document ids travel between the
pipeline stages as a tensor) and DP=2, log the same losses; and the first iteration's loss equals
a reference computed here from the run's own first global batch, with megatron-core's dense
[S, S] masks, loss masks and positions fed to the model through plain dense-mask SDPA.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from training_fixtures import (
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)

import pretrain.model.gpt as gpt_module
from pretrain.cli import parse_args
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import train_valid_test_num_samples
from pretrain.model import GPTModel
from pretrain.model.loss import masked_mean_loss
from pretrain.tokenizer import build_tokenizer

DOCUMENT_FLAGS = ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]
# a wide init makes attention matter to an untrained model's loss (with 0.02 the loss is nearly
# uniform, and keeping documents apart moves it by only ~4e-5 relative)
WIDE_INIT = ["--init-method-std", "0.5"]
ITERATIONS = 3
LAYOUTS = {"pp2": (1, 2, 0), "dp2": (1, 1, 0)}  # (TP, PP, ZeRO) on 2 ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def argv(corpus: str, tp: int, pp: int, zero: int) -> list[str]:
    return (
        model_flags("llama")
        + train_flags(corpus, iters=ITERATIONS)
        + layout_flags(tp, pp, zero)
        + DOCUMENT_FLAGS
        + WIDE_INIT
    )


@contextlib.contextmanager
def megatron_dense_mask_attention(masked: torch.Tensor):
    """The model's document attention replaced by SDPA with megatron's dense mask (True = masked)."""

    def attend(q, k, v, document_ids, dropout_p=0.0, enable_gqa=False):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=~masked, dropout_p=dropout_p, enable_gqa=enable_gqa
        )

    kernel = gpt_module.document_causal_attention
    gpt_module.document_causal_attention = attend
    try:
        yield
    finally:
        gpt_module.document_causal_attention = kernel


def dense_reference_first_loss(args: list[str]) -> tuple[float, float]:
    """Iteration 1's loss from megatron's dense masks over the run's first global batch, and the
    same batch's loss with plain causal attention (documents not kept apart)."""
    warnings.filterwarnings("ignore")
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    cfg = parse_args(args, env={})
    t, ev = cfg.training, cfg.evaluation
    counts = train_valid_test_num_samples(
        t.train_iters, t.train_samples, ev.eval_interval, ev.eval_iters, t.global_batch_size
    )
    tokenizer = build_tokenizer(cfg.tokenizer)
    train, _, _ = build_train_valid_test_datasets(cfg.data, tokenizer, counts)
    model = GPTModel(cfg.model)
    losses, causal = [], []
    mbs = t.micro_batch_size
    for first in range(0, t.global_batch_size, mbs):  # the `single` sampler's first step
        samples = [train[i] for i in range(first, first + mbs)]
        tokens = torch.stack([s["tokens"] for s in samples])
        labels = torch.stack([s["labels"] for s in samples])
        masks, loss_masks, positions = zip(
            *(
                _get_ltor_masks_and_position_ids(x, tokenizer.eod, True, True, True, True)
                for x in tokens
            ),
            strict=True,
        )
        masked = torch.stack(masks)  # [b, 1, S, S] bool, True = masked: megatron's
        assert masked.shape[-2:] == (cfg.data.seq_length, cfg.data.seq_length)
        document_ids = torch.stack([s["document_ids"] for s in samples])  # unused by the reference
        with torch.no_grad(), megatron_dense_mask_attention(masked):
            per_token = model(tokens, torch.stack(positions), document_ids, labels=labels)
        losses.append(masked_mean_loss(per_token, torch.stack(loss_masks)))
        with torch.no_grad():
            per_token = model(tokens, labels=labels)
        causal.append(masked_mean_loss(per_token, torch.stack(loss_masks)))
    return float(torch.stack(losses).mean()), float(torch.stack(causal).mean())


def test_document_flags_train_at_pp2_and_match_the_dense_mask_reference(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    runs, metrics = [], {}
    for name, (tp, pp, zero) in LAYOUTS.items():
        metrics[name] = tmp_path / f"{name}.jsonl"
        runs.append(argv(corpus, tp, pp, zero) + ["--metrics-file", str(metrics[name])])
    result = run(multirun_cmd(2, runs, tmp_path / "runs.json"), timeout=420)
    assert result.returncode == 0, result.stdout[-8000:]
    losses = {
        name: [read_metrics(path)[i]["lm-loss"] for i in range(1, ITERATIONS + 1)]
        for name, path in metrics.items()
    }
    assert losses["pp2"] == pytest.approx(losses["dp2"], rel=1e-5)
    reference, causal = dense_reference_first_loss(argv(corpus, 1, 1, 0))
    # the documents really are kept apart: plain causal attention is ~100x the tolerance away
    assert abs(causal - reference) > 50 * 2e-6 * reference
    assert losses["pp2"][0] == pytest.approx(reference, rel=2e-6)
    assert losses["dp2"][0] == pytest.approx(reference, rel=2e-6)
