"""The GPT cut into pipeline stages for `torch.distributed.pipelining`, and which rank runs which.

`StagePlan` is Megatron's layer-to-chunk assignment: with PP ranks and V model chunks per rank
(virtual stages, --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank)
the layers split evenly into S = PP x V stages, stage s holding layers [s L/S, (s+1) L/S). Model
chunk c of rank r is stage c x PP + r (round robin: rank 0 holds stages 0, PP, 2 PP, ...), except
under the V-shaped zero-bubble schedule (ZBV: V = 2), where rank r holds stages r and 2 PP - 1 - r,
so the first and the last stage are both on rank 0.

`StageModule` is one stage: the first holds the embedding, every stage its transformer layers,
the last the final norm and LM head, all under their GPTModel names (`embedding.*`,
`layers.<i>.*`, `head.*`) and initialised from them, so the stages start from the one-process
model's weights at any layout. With tied embeddings the last stage holds its own copy of the word
embedding (`tied_embedding.weight`, initialised as `embedding.word_embeddings.weight`, marked
`shared` so the global gradient norm counts it once); the pipeline sums the two copies' gradients
every step, so they stay equal.

Between stages flow (hidden [b, s, h], position_ids [b, s] int64[, document_ids [b, s] int32]),
what the DeepSpeed backend's pipeline sends: under sequence parallelism hidden is this TP rank's
[b, s/tp, h] chunk and the ids stay whole. The last stage returns TP-local logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import (
    Embedding,
    FinalNormAndHead,
    TransformerLayer,
    recompute_segments,
    run_segments,
)
from pretrain.parallel import state
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layers import VocabParallelEmbedding

TIED_COPY = "tied_embedding.weight"
"""The last stage's copy of `embedding.word_embeddings.weight` (tied embeddings)."""
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def saved_name(name: str) -> str:
    """The GPTModel name a stage parameter is checkpointed under: its own, or for the tied copy
    the word embedding's (the full state holds it once, from the first stage)."""
    return WORD_EMBEDDING if name == TIED_COPY else name


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """How the layers split into pipeline stages and which PP rank runs each stage."""

    num_layers: int
    """Transformer layers of the model."""
    pipeline_size: int
    """PP ranks."""
    chunks: int = 1
    """Model chunks (virtual stages) per PP rank."""
    v_shape: bool = False
    """ZBV placement: rank r holds stages r and 2 PP - 1 - r (needs 2 chunks)."""

    @classmethod
    def of(cls, num_layers: int, parallel: ParallelConfig) -> StagePlan:
        """The plan of a run's layout and schedule."""
        return cls(
            num_layers=num_layers,
            pipeline_size=parallel.pipeline_model_parallel_size,
            chunks=parallel.virtual_pipeline_stages,
            v_shape=parallel.pipeline_schedule == "zbv-zero-bubble",
        )

    def __post_init__(self) -> None:
        if self.num_layers % self.num_stages:
            raise ValueError(f"{self.num_layers} layers do not split into {self.num_stages}")
        if self.v_shape and self.chunks != 2:
            raise ValueError("the V-shaped placement holds exactly 2 chunks per rank")

    @property
    def num_stages(self) -> int:
        """Stages of the whole pipeline (PP x chunks)."""
        return self.pipeline_size * self.chunks

    def stages_of(self, rank: int) -> list[int]:
        """The stages PP rank `rank` runs, in its chunk order."""
        if self.v_shape:
            return [rank, self.num_stages - 1 - rank]
        return [chunk * self.pipeline_size + rank for chunk in range(self.chunks)]

    def rank_of(self, stage: int) -> int:
        """The PP rank that runs `stage`."""
        return next(r for r in range(self.pipeline_size) if stage in self.stages_of(r))

    def layers_of(self, stage: int) -> range:
        """The global indices of the transformer layers of `stage`."""
        per_stage = self.num_layers // self.num_stages
        return range(stage * per_stage, (stage + 1) * per_stage)


class StageModule(nn.Module):
    """One pipeline stage of the GPT: (tokens or hidden, position_ids[, document_ids]) ->
    (hidden, position_ids[, document_ids]), or TP-local logits on the last stage."""

    def __init__(self, config: ModelConfig, layers: range, *, first: bool, last: bool):
        super().__init__()
        config.validate(tp=state.get_tensor_model_parallel_world_size())
        self.embedding = Embedding(config) if first else None
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i) for i in layers})
        self.segments = recompute_segments(config, len(layers))
        self.head = FinalNormAndHead(config) if last else None
        self.tied_embedding = None
        if last and not config.untie_embeddings_and_output_weights:
            tp = state.get_tensor_model_parallel_world_size()
            self.tied_embedding = VocabParallelEmbedding(
                config.padded_vocab_size(tp),
                config.hidden_size,
                dtype=config.params_dtype,
                vocab_size=config.vocab_size,
            )
            self.tied_embedding.initialize(
                WORD_EMBEDDING.removesuffix(".weight"), config.seed, config.init_method_std
            )
            self.tied_embedding.weight.shared = True

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ):
        hidden = inputs if self.embedding is None else self.embedding(inputs, position_ids)
        layers = list(self.layers.values())
        hidden = run_segments(self, layers, self.segments, hidden, position_ids, document_ids)
        if self.head is not None:
            tied = None if self.tied_embedding is None else self.tied_embedding.weight
            return self.head(hidden, tied)
        if document_ids is None:
            return hidden, position_ids
        return hidden, position_ids, document_ids


def build_stage_modules(config: ModelConfig, plan: StagePlan, rank: int) -> list[StageModule]:
    """The stage modules PP rank `rank` runs, in `plan.stages_of(rank)` order."""
    last = plan.num_stages - 1
    return [
        StageModule(config, plan.layers_of(s), first=s == 0, last=s == last)
        for s in plan.stages_of(rank)
    ]


class StageParts(nn.Module):
    """This PP rank's stage modules seen as one module under GPTModel's parameter names
    (`embedding.*`, `layers.<i>.*`, `head.*`, plus the tied copy `tied_embedding.weight`): what
    the engine's optimizer, checkpoints and full state read. The stage modules themselves (not
    registered here) are what the pipeline runs."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.stage_modules = stages
        self.embedding = next((s.embedding for s in stages if s.embedding is not None), None)
        self.layers = nn.ModuleDict({i: layer for s in stages for i, layer in s.layers.items()})
        self.head = next((s.head for s in stages if s.head is not None), None)
        self.tied_embedding = next(
            (s.tied_embedding for s in stages if s.tied_embedding is not None), None
        )

    def train(self, mode: bool = True) -> StageParts:
        """Train (or evaluate) every stage module."""
        super().train(mode)
        for stage in self.stage_modules:
            stage.train(mode)
        return self


def stage_parts(config: ModelConfig, plan: StagePlan) -> StageParts:
    """This PP rank's stages of the GPT under `plan`."""
    rank = state.get_pipeline_model_parallel_rank()
    return StageParts(build_stage_modules(config, plan, rank))
