"""The GPT of `pretrain.model.gpt` as a DeepSpeed `PipelineModule` (pipeline parallelism).

The same three parts, in the same order, become pipeline layers
(`pretrain.checkpoint.pipeline_layers` names them):

    index 0          EmbeddingPipe       (GPTModel's `embedding.*`)
    index 1 .. L     TransformerLayerPipe (GPTModel's `layers.<i>.*`, i = index - 1)
    index L + 1      HeadPipe            (GPTModel's `head.*`: the final norm, plus the output
                                          layer when embeddings are untied)
    index L + 2      tied embedding copy (tied embeddings only; not a GPTModel parameter)

DeepSpeed splits the transformer layers evenly over stages (`type:TransformerLayerPipe`); the
first stage also holds the embedding, the last the head and the loss. With tied embeddings the
last stage holds a second `EmbeddingPipe` under the same `TiedLayerSpec` key whose forward is the
LM head (hidden @ word_embeddings^T); DeepSpeed sums the two copies' gradients every step, so
both stay equal, and marks the copy `ds_pipe_replicated`. We also mark it `shared`, so our global
gradient norm counts it once. Every part initialises from its GPTModel name, so both copies and
every layer start from the one-process model's weights at any layout.

Activations between stages are tuples (hidden [b,s,h], position_ids [b,s] int64 [, document_ids
[b,s] int32 with --reset-attention-mask]): the document boundaries travel as O(s) ids, never as
an [s,s] mask. Under sequence parallelism hidden is this TP rank's [b, s/tp, h] chunk (the ids
stay whole), so each TP rank sends a different tensor: DeepSpeed's "pipe_partitioned" /
"grad_partitioned" (each TP rank sends 1/tp of a tensor it assumes all TP ranks share) must be off
(`config.py`). DeepSpeed learns the shapes from the first micro-batch.
The loss is the masked mean over the micro-batch's tokens, as at PP = 1 (`PipelineLoss`).

Full recompute (`recompute_granularity="full"`) chunks each stage's transformer layers as
GPTModel does (`recompute_segments`, Megatron's per-stage chunks): `GPTPipelineModule.forward`
runs every chunk under `checkpoint` and everything else (embedding, head) as DeepSpeed would.
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from pretrain.checkpoint.pipeline_layers import TIED_KEY, TIED_WEIGHT
from pretrain.model.config import ModelConfig
from pretrain.model.gpt import (
    Embedding,
    FinalNormAndHead,
    TransformerLayer,
    lm_head_logits,
    recompute_segments,
    recomputing,
)
from pretrain.model.loss import masked_mean_loss
from pretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.parallel.random import checkpoint


def _split(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    hidden, position_ids = inputs[0], inputs[1]
    return hidden, position_ids, inputs[2] if len(inputs) > 2 else None


def _pack(hidden, position_ids, document_ids):
    return (hidden, position_ids) if document_ids is None else (hidden, position_ids, document_ids)


class EmbeddingPipe(Embedding):
    def forward(self, inputs):
        tokens, position_ids, document_ids = _split(inputs)
        return _pack(super().forward(tokens, position_ids), position_ids, document_ids)


def tied_lm_head(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Forward of the last stage's embedding copy: the LM head with the word-embedding weight
    (-inf at padded vocabulary ids, as in GPTModel)."""
    words = embedding.word_embeddings
    return lm_head_logits(hidden, words.weight, words.vocab_size, embedding.sequence_parallel)


class TransformerLayerPipe(TransformerLayer):
    def forward(self, inputs):
        hidden, position_ids, document_ids = _split(inputs)
        return _pack(
            super().forward(hidden, position_ids, document_ids), position_ids, document_ids
        )


class HeadPipe(FinalNormAndHead):
    """Final norm, then the untied output layer; with tied embeddings the norm only (the tied copy
    that follows computes the logits)."""

    def forward(self, inputs):
        hidden = self.final_norm(inputs[0])
        return hidden if self.output_layer is None else self.logits(hidden)


def _run(funcs, inputs):
    for func in funcs:
        inputs = func(inputs)
    return inputs


class GPTPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule whose forward recomputes chunks of transformer layers as
    Megatron's full recompute does (DeepSpeed's own `activation_checkpoint_interval` counts the
    embedding and head into its chunks)."""

    def __init__(self, *args, config: ModelConfig, **kwargs):
        super().__init__(*args, **kwargs)
        layers = [
            i for i, f in enumerate(self.forward_funcs) if isinstance(f, TransformerLayerPipe)
        ]
        first, count = (layers[0], len(layers)) if layers else (0, 0)
        segments = [(first + a, first + b, on) for a, b, on in recompute_segments(config, count)]
        end = len(self.forward_funcs)
        self.segments = [(0, first, False), *segments, (first + count, end, False)]

    def forward(self, forward_input):
        """The stage's layers in order, recomputed chunks under `checkpoint`."""
        self.micro_offset += 1  # DeepSpeed's per-micro-batch counter, as its forward keeps it
        x = forward_input
        for start, end, recompute in self.segments:
            funcs = self.forward_funcs[start:end]
            if not funcs:
                continue
            if recompute and recomputing(self):  # x: a tuple (hidden, position_ids[, ids])
                x = checkpoint(lambda *xs, funcs=funcs: _run(funcs, xs), *x)
            else:
                x = _run(funcs, x)
        return x


class PipelineLoss:
    """The last stage's loss: vocab-parallel cross-entropy, masked mean.

    The labels item is (labels, loss_mask[, more tensors]). While `observer` is set (the
    evaluation's per-source sums), it is called with each micro-batch's per-token losses [b, s],
    loss mask and the extra label tensors (e.g. the samples' `dataset_id` [b]); the loss it
    returns is the same either way. Only the last stage ever calls it.
    """

    def __init__(self):
        self.observer = None

    def __call__(self, logits: torch.Tensor, labels_and_mask: tuple) -> torch.Tensor:
        """The micro-batch's masked mean loss."""
        labels, loss_mask, *extra = labels_and_mask
        per_token = vocab_parallel_cross_entropy(logits, labels)
        if self.observer is not None:
            self.observer(per_token, loss_mask, *extra)
        return masked_mean_loss(per_token, loss_mask)


def build_pipeline_model(config: ModelConfig, pp: int, tp: int, dp: int) -> PipelineModule:
    """The GPT as a DeepSpeed PipelineModule over `pp` stages (tied embedding unless untied)."""
    tied = not config.untie_embeddings_and_output_weights
    specs = [
        TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, tied_weight_attr=[TIED_WEIGHT])
        if tied
        else LayerSpec(EmbeddingPipe, config)
    ]
    specs += [LayerSpec(TransformerLayerPipe, config, i) for i in range(config.num_layers)]
    specs.append(LayerSpec(HeadPipe, config))
    if tied:
        specs.append(
            TiedLayerSpec(
                TIED_KEY,
                EmbeddingPipe,
                config,
                forward_fn=tied_lm_head,
                tied_weight_attr=[TIED_WEIGHT],
            )
        )
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    model = GPTPipelineModule(
        layers=specs,
        loss_fn=PipelineLoss(),
        topology=topology,
        partition_method="type:TransformerLayerPipe",
        activation_checkpoint_interval=0,
        config=config,
    )
    for param in model.parameters():
        if getattr(param, "ds_pipe_replicated", False):
            param.shared = True
    return model
