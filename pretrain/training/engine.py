"""The engine: what training asks of a backend (the choice of backend is
`pretrain.training.backends.factory`).

A backend owns the model's parallel form, the optimizer and its state, and how one iteration's
micro-batches run forward and backward; the loop, the evaluator, the checkpointer, the metrics
and the resume code only ask an `Engine` (this interface), never a backend's library. Backends:

- `deepspeed` (`pretrain.training.backends.deepspeed`, the default): DeepSpeed's engine and ZeRO
  over the data-parallel ranks, its pipeline engine at PP > 1.
- `torch` (`pretrain.training.backends.torch`, --use-torch-fsdp2): FSDP2 over the
  data-parallel ranks with our TP layers, DCP checkpoints written in the background.

Only a backend's own package imports its library (tests/test_layers.py checks it).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

from pretrain.checkpoint.full_state import FullState, write_shard
from pretrain.parallel import state
from pretrain.training.distributed import collective_device

if TYPE_CHECKING:
    from pretrain.training.checkpoints.checkpoint_writes import RankFiles
    from pretrain.training.report.per_source import SourceLosses
    from pretrain.training.schedules.lr_schedule import SampleLRScheduler

Write = Callable[[dict, str], None]
"""`write(payload, path)`: save one file of a checkpoint (fsynced; a failure is kept, not raised:
`pretrain.training.checkpoints.checkpoint_writes.RankFiles.write`)."""


@dataclass(frozen=True, kw_only=True)
class Carried:
    """What `Engine.load_full_state` set from a full state, for the log line."""

    fp32_masters: bool
    """The saved weights are fp32 master weights (older versions saved bf16/fp16 ZeRO-0 module
    weights in their place)."""
    adam_state: bool
    """Adam's moments and step count were set."""
    loss_scale: bool
    """fp16's loss scale and overflow counters were set."""
    precision: str | None
    """The saving run's precision ("fp32", "bf16", "fp16"; None: not recorded)."""


class StepFunctions(NamedTuple):
    """A backend's iteration as functions of its engine (its `steps` module's), which
    `Engine.train_step` / `Engine.evaluation_loss` call with the engine first."""

    train_step: Callable[..., float]
    evaluation_loss: Callable[..., float]


class Engine(abc.ABC):
    """One rank's model, optimizer and LR schedule under a backend.

    Attributes every backend sets: `scheduler` (the `SampleLRScheduler` stepping the optimizer's
    LR), `params_total` (elements of the whole model, counted once), `padded_vocab_size`,
    `fp16` (fp16 with loss scaling) and `pipeline` (the checkpoint is in the pipeline engine's
    per-layer layout, `pretrain.checkpoint.pipeline_layers`)."""

    scheduler: SampleLRScheduler
    params_total: int
    padded_vocab_size: int
    fp16: bool
    pipeline: bool
    step_functions: ClassVar[StepFunctions]
    """The backend's `train_step` and `evaluation_loss` (its `steps` module's)."""

    # --- what the iteration asks ---------------------------------------------------------------

    @property
    @abc.abstractmethod
    def precision(self) -> str:
        """The module weights' precision: "bf16", "fp16" or "fp32"."""

    @property
    @abc.abstractmethod
    def offload(self) -> str | None:
        """What is kept off the device, as the banner says it (None: nothing)."""

    @property
    @abc.abstractmethod
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (fp16 overflow)."""

    @abc.abstractmethod
    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Use this global batch for the next iteration (gradient accumulation, LR increment)."""

    def train_step(
        self,
        batches: Iterator[dict],
        num_microbatches: int,
        use_document_ids: bool,
        device: torch.device,
        judge: Callable[[float], bool] | None = None,
    ) -> float:
        """Forward/backward over this rank's `num_microbatches` loader dicts of the global batch
        and one optimizer step; returns the iteration's loss (Megatron's: each micro-batch's
        masked mean, averaged over micro-batches and data-parallel ranks, on every rank).
        `judge(loss)`, asked on every rank before the optimizer step, returning False withholds
        the update: weights, optimizer state, LR schedule and step counters stay as they were."""
        return self.step_functions.train_step(
            self, batches, num_microbatches, use_document_ids, device, judge
        )

    def evaluation_loss(
        self,
        batches: Iterator[dict],
        eval_iters: int,
        num_microbatches: int,
        use_document_ids: bool,
        device: torch.device,
        sources: SourceLosses | None = None,
    ) -> float:
        """Mean loss over `eval_iters` global batches, without gradients or steps; with
        `sources`, each micro-batch's per-token losses are also added per blend source (where
        the loss is computed; the caller reduces them)."""
        return self.step_functions.evaluation_loss(
            self, batches, eval_iters, num_microbatches, use_document_ids, device, sources
        )

    @abc.abstractmethod
    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses."""

    @abc.abstractmethod
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (None where none was computed)."""

    @abc.abstractmethod
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""

    # --- what checkpoints ask ------------------------------------------------------------------

    @abc.abstractmethod
    def state_trees(self, with_optimizer: bool) -> list[tuple[dict, str]]:
        """(tensors by name, what they are) of this rank's weights and, `with_optimizer`, its
        optimizer state and master weights (the NaN/Inf checks read them)."""

    @abc.abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of this rank's module weights (a lower bound of a checkpoint's size)."""

    @abc.abstractmethod
    def save_native(self, save_dir: str, tag: str, client_state: dict, files: RankFiles) -> None:
        """Write this rank's files of the backend's own checkpoint format into `save_dir/tag`
        through `files` (a failure is recorded there, not raised, after the backend's own
        collectives); `client_state` (the `TrainState`) goes with them."""

    def save_native_in_background(
        self, save_dir: str, tag: str, client_state: dict, files: RankFiles
    ) -> Future:
        """`save_native`, staged: this rank's state is copied now and written in the background
        (training may change it at once); the future completes, on every rank, when every
        rank's native files are written (an exception: the write failed). Backends whose saves
        block do not have it (--async-save is refused for them before launch)."""
        raise NotImplementedError(f"{type(self).__name__} has no background save")

    @abc.abstractmethod
    def load_native(
        self, folder: str, tag: str, *, optimizer: bool, schedule: bool, module_only: bool
    ) -> tuple[str | None, dict | None]:
        """Load `folder/tag` saved by `save_native` at this layout: (the path loaded and the
        saved `client_state`; None, None when files are missing). Files are unpickled through
        `pretrain.checkpoint.safe_load`."""

    @abc.abstractmethod
    def save_full_state(self, step_dir: str, write: Write, stamp: dict) -> None:
        """Write this rank's part of the layout-independent state (`pretrain.checkpoint.
        full_state`: fp32 masters, Adam moments, LR schedule, loss scale) into `step_dir`
        (a collective); `stamp` goes into its `extra`."""

    @abc.abstractmethod
    def load_full_state(
        self, step_dir: str, *, vocab_size: int, with_optimizer: bool, with_schedule: bool
    ) -> Carried:
        """Set this rank's weights (and optimizer state, LR schedule position) from `step_dir`'s
        full state, saved at any layout or backend; say what was set."""

    @abc.abstractmethod
    def set_position(self, iteration: int, consumed_samples: int) -> None:
        """Tell the backend's own counters where a resumed run is."""

    @abc.abstractmethod
    def config_record(self) -> dict:
        """The backend's configuration as checkpoint metadata records it."""

    @abc.abstractmethod
    def model_parts(self) -> list[torch.nn.Module]:
        """This rank's model (its pipeline chunks), for model-level bookkeeping between
        iterations (`step.model_iteration`: MoE expert biases)."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the backend's process groups and buffers."""


def write_full_state_shard(
    step_dir: str,
    collect: Callable[[Callable[[int], bool]], dict[str, dict]],
    *,
    extra: dict,
    write: Write,
) -> None:
    """This rank's part of the layout-independent state (`pretrain.checkpoint.full_state`),
    for either backend (collective over DP): the data-parallel ranks of one (TP rank, PP stage)
    share the writing, DP rank d taking every DP-th entry d, d + DP, ... of `collect(keep)`, so
    each writes (and holds on the CPU) 1/DP of the state; `extra` goes beside the entries."""
    dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
    write_shard(
        step_dir,
        tp_rank=state.get_tensor_model_parallel_rank(),
        tp_size=state.get_tensor_model_parallel_world_size(),
        pp_stage=state.get_pipeline_model_parallel_rank(),
        dp_rank=dp_rank,
        entries=collect(lambda i: i % dp == dp_rank),
        extra=extra,
        write=write,
    )


def split_over_ep(param: torch.Tensor) -> bool:
    """True for an expert parameter whose experts are split over EP ranks (EP > 1)."""
    return getattr(param, "expert_parallel", False) and (
        state.get_expert_model_parallel_world_size() > 1
    )


def all_experts(tensor: torch.Tensor) -> torch.Tensor:
    """This EP rank's experts (dim 0) -> every expert, all-gathered over EP (a collective): how
    either backend puts experts into the full state."""
    parts = [torch.empty_like(tensor) for _ in range(state.get_expert_model_parallel_world_size())]
    torch.distributed.all_gather(
        parts, tensor.contiguous(), group=state.get_expert_model_parallel_group()
    )
    return torch.cat(parts)


def local_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every expert (dim 0) -> this EP rank's, for each tensor (`pretrain.model.moe.layer.
    local_experts`: rank r holds experts [r E/EP, (r+1) E/EP))."""
    ep, rank = state.get_expert_model_parallel_world_size(), state.get_expert_model_parallel_rank()
    return {k: v.chunk(ep)[rank] for k, v in tensors.items()}


@torch.no_grad()
def set_buffers(buffers: dict[str, torch.Tensor], full: FullState) -> None:
    """Set `buffers` (this rank's persistent buffers by GPTModel name) from the full state `full`;
    a state saved before buffers were part of it leaves them as they are (the expert bias then
    restarts at 0)."""
    saved = set(full.names())
    for name, buffer in buffers.items():
        if name in saved:
            buffer.copy_(full.entry(name).param)


def count_parameters(model: torch.nn.Module) -> int:
    """Elements of the full model: TP shards summed over TP, tied copies and TP replicas once,
    experts once (summed over expert TP x EP)."""
    tp_rank0 = state.get_tensor_model_parallel_rank() == 0
    dense = sum(
        p.numel()
        for p in model.parameters()
        if not getattr(p, "shared", False)
        and not getattr(p, "expert_parallel", False)
        and (tp_rank0 or getattr(p, "tensor_model_parallel", False))
    )
    expert = sum(p.numel() for p in model.parameters() if getattr(p, "expert_parallel", False))
    return _summed(dense, [state.get_model_parallel_group()]) + _summed(
        expert,
        [
            state.get_expert_tensor_and_model_parallel_group(),
            state.get_pipeline_model_parallel_group(),
        ],
    )


def _summed(count: int, groups: list) -> int:
    """`count` summed over each of `groups` in turn (every rank calls it alike)."""
    total = torch.tensor([count], dtype=torch.int64, device=collective_device())
    for group in groups:
        if torch.distributed.is_initialized() and group is not None:
            torch.distributed.all_reduce(total, group=group)
    return int(total.item())
