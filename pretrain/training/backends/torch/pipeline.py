"""Pipeline parallelism of the torch backend: the GPT's stages under a `torch.distributed.pipelining`
schedule (1F1B, interleaved 1F1B, interleaved zero bubble, ZBV zero bubble).

`Pipeline` runs one iteration's micro-batches through this PP rank's `PipelineStage`s
(`stages.py`: which stages, which layers) under the schedule `--pipeline-schedule` names:

- the micro-batches go in as the loader made them: the schedule cuts the concatenated batch
  [m b, s] back into the same m micro-batches of b samples;
- the loss is Megatron's, on the rank that holds the last stage: each micro-batch's masked mean
  of the vocab-parallel cross-entropy (`MicroBatchLoss`; the schedule hands it the micro-batch's
  index as its target), the gradients divided by m (the schedule's `scale_grads`), so the
  iteration's gradient is that of the mean over micro-batches;
- with tied embeddings the word-embedding gradients of the first and the last stage are summed
  after every backward (`TiedEmbedding`, Megatron's embedding group), so both copies, updated
  alike, stay equal;
- evaluation runs the same schedule forward only (`schedule.eval`), and the loss function adds
  each micro-batch's per-token losses to the per-source sums.

Stages are built with static metadata (the shapes and dtypes of what flows between stages, known
from the micro-batch shape), so no schedule runs a hidden forward/backward to infer them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import uses_sequence_parallel
from pretrain.model.loss import masked_mean_loss
from pretrain.parallel import state
from pretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.training.backends.torch.fsdp import local_tensor, reshard
from pretrain.training.backends.torch.pipeline_flags import SCHEDULE_CHOICES
from pretrain.training.backends.torch.stages import StageModule, StagePlan
from pretrain.training.report.per_source import SourceLosses
from pretrain.training.step import dp_mean

SCHEDULES = dict(
    zip(
        SCHEDULE_CHOICES,
        (
            Schedule1F1B,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        ),
        strict=True,
    )
)
"""--pipeline-schedule -> torch's schedule class."""


class MicroBatchLoss:
    """The last stage's loss function: `loss(logits, index)` is the masked mean loss of micro-batch
    `index` of `batches` (this iteration's loader dicts); with `sources` set, its per-token losses
    are also added per blend source."""

    def __init__(self):
        self.batches: Sequence[dict] = ()
        self.sources: SourceLosses | None = None

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        batch = self.batches[int(index)]
        labels, loss_mask = batch["labels"].to(logits.device), batch["loss_mask"].to(logits.device)
        per_token = vocab_parallel_cross_entropy(logits, labels)
        if self.sources is not None:
            self.sources.add(per_token, loss_mask, batch["dataset_id"])
        return masked_mean_loss(per_token, loss_mask)


class TiedEmbedding:
    """The word embedding's two copies (first stage, last stage): their gradients summed."""

    def __init__(self, config: ModelConfig, modules: Sequence[StageModule], plan: StagePlan):
        self.weights = []
        if not config.untie_embeddings_and_output_weights:
            self.weights = [m.embedding.word_embeddings.weight for m in modules if m.embedding]
            self.weights += [m.tied_embedding.weight for m in modules if m.tied_embedding]
        split = plan.rank_of(0) != plan.rank_of(plan.num_stages - 1)
        self.group = state.get_embedding_group() if split else None

    def sum_gradients(self) -> None:
        """Both copies' gradient := the sum of both (over the embedding group when the first and
        the last stage are on different ranks)."""
        grads = [w.grad for w in self.weights if w.grad is not None]
        if not grads:
            return
        total = torch.stack([local_tensor(g) for g in grads]).sum(0)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            local_tensor(grad).copy_(total)


class _Stage(PipelineStage):
    """torch's `PipelineStage`, whose forward-only passes touch no gradient: torch 2.13's
    schedules still run their gradient step (`perform_reduce_grad`: FSDP's post-backward, then
    every existing gradient divided by m) and, under ZBV, the same-rank gradient hand-off between
    a rank's two stages (which asserts) when they evaluate."""

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.has_backward:
            super().perform_reduce_grad(grad_scale_factor)

    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def _stage_io(
    config: ModelConfig, module: StageModule, shape: tuple[int, int], ids: tuple, dtype
) -> tuple[tuple, tuple]:
    """Example (inputs, outputs) of a stage for micro-batches of `shape` [b, s] with the id tensors
    `ids` (position_ids[, document_ids]) that flow beside the hidden states."""
    b, s = shape
    tp = state.get_tensor_model_parallel_world_size()
    local_s = s // tp if uses_sequence_parallel(config) else s
    hidden = torch.empty(b, local_s, config.hidden_size, dtype=dtype, requires_grad=True)
    tokens = torch.empty(b, s, dtype=torch.int64)
    inputs = (tokens if module.embedding is not None else hidden, *ids)
    if module.head is None:
        return inputs, (hidden, *ids)
    logits = torch.empty(b, s, config.padded_vocab_size(tp) // tp, dtype=dtype, requires_grad=True)
    return inputs, (logits,)


def _inputs(batch: dict, use_document_ids: bool) -> tuple[torch.Tensor, ...]:
    names = ("tokens", "position_ids") + (("document_ids",) if use_document_ids else ())
    return tuple(batch[name] for name in names)


class Pipeline:
    """This PP rank's stages of the GPT and the schedule that runs them.

    `modules` are `build_stage_modules(config, plan, pp_rank)`, possibly wrapped (FSDP2) by the
    engine; `activation_dtype` is the dtype of the hidden states between stages."""

    def __init__(
        self,
        config: ModelConfig,
        plan: StagePlan,
        modules: Sequence[StageModule],
        schedule: str,
        device: torch.device,
        activation_dtype: torch.dtype = torch.float32,
    ):
        self.config, self.plan, self.modules = config, plan, list(modules)
        self.schedule_class = SCHEDULES[schedule]
        self.device, self.activation_dtype = device, activation_dtype
        rank = state.get_pipeline_model_parallel_rank()
        self.stage_indices = plan.stages_of(rank)
        self.first = 0 in self.stage_indices
        self.last = plan.num_stages - 1 in self.stage_indices
        self.tied = TiedEmbedding(config, self.modules, plan)
        self.loss = MicroBatchLoss()
        self._stages, self._stage_key = None, None
        self._schedule, self._schedule_key = None, None

    @property
    def stages(self) -> list[_Stage]:
        """This rank's `PipelineStage`s (built by the first pass; bench/pipeline_bubble.py times
        their compute)."""
        return list(self._stages or ())

    def _pipeline_stages(self, shape: tuple[int, int], ids: tuple) -> list[_Stage]:
        """The `PipelineStage`s for micro-batches of `shape` and these id tensors (built once)."""
        key = (shape, tuple(t.dtype for t in ids))
        if self._stage_key != key:
            ids = tuple(torch.empty(shape, dtype=t.dtype) for t in ids)
            self._stages = [
                _Stage(
                    module,
                    index,
                    self.plan.num_stages,
                    self.device,
                    *_stage_io(self.config, module, shape, ids, self.activation_dtype),
                    group=state.get_pipeline_model_parallel_group(),
                )
                for module, index in zip(self.modules, self.stage_indices, strict=True)
            ]
            self._stage_key, self._schedule_key = key, None
        return self._stages

    def _schedule_for(self, batches: Sequence[dict], use_document_ids: bool):
        """The schedule for this many micro-batches of this shape (rebuilt when either changes)."""
        first = _inputs(batches[0], use_document_ids)
        stages = self._pipeline_stages(tuple(first[0].shape), first[1:])
        if self._schedule_key != len(batches):
            single = self.schedule_class is Schedule1F1B
            self._schedule = self.schedule_class(
                stages[0] if single else stages, len(batches), loss_fn=self.loss
            )
            self._schedule_key = len(batches)
        return self._schedule

    def _run(self, batches: Sequence[dict], use_document_ids: bool, train: bool) -> torch.Tensor:
        """One pass over `batches` (forward and backward when `train`); returns the mean of the
        micro-batch losses, on every rank of the pipeline."""
        schedule = self._schedule_for(batches, use_document_ids)
        args = ()
        if self.first:
            columns = zip(*(_inputs(b, use_document_ids) for b in batches), strict=True)
            args = tuple(torch.cat(column).to(self.device) for column in columns)
        target = torch.arange(len(batches)) if self.last else None
        losses: list[torch.Tensor] = []
        self.loss.batches = batches
        try:
            run = schedule.step if train else schedule.eval
            run(*args, target=target, losses=losses, return_outputs=False)
        finally:
            self.loss.batches = ()
        mean = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            mean += torch.stack([loss.detach().float() for loss in losses]).mean()
        if state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(mean, group=state.get_pipeline_model_parallel_group())
        return mean

    def train(self, batches: Sequence[dict], use_document_ids: bool) -> torch.Tensor:
        """Forward and backward over one iteration's micro-batches, gradients accumulated into
        the stage modules' (summed over the tied copies); returns the iteration's loss averaged
        over micro-batches and data-parallel ranks, on every rank."""
        loss = self._run(batches, use_document_ids, train=True)
        self.tied.sum_gradients()
        return dp_mean(loss)

    @torch.no_grad()
    def evaluate(
        self,
        batches: Sequence[dict],
        use_document_ids: bool,
        sources: SourceLosses | None = None,
    ) -> torch.Tensor:
        """The loss of `batches` forward only (averaged as `train`'s); with `sources`, the last
        stage adds every micro-batch's per-token losses per blend source."""
        self.loss.sources = sources
        try:
            return dp_mean(self._run(batches, use_document_ids, train=False))
        finally:
            self.loss.sources = None
            for module in self.modules:  # a forward-only pass leaves FSDP2's parameters gathered
                reshard(module)
