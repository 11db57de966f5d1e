"""Model + optimizer + LR schedule -> a DeepSpeed engine, for PP = 1 and PP > 1.

PP = 1: `GPTModel` under `deepspeed.initialize(..., mpu=...)`; the mpu tells DeepSpeed that TP
ranks are model-parallel peers, so ZeRO 1-3 shard over data-parallel ranks only.
PP > 1: the same parts as a `PipelineModule` (`pipeline.py`), DeepSpeed's pipeline engine and
grid (rank order TP fastest, then DP, then PP, which is also ours).

`DeepSpeedEngine` is the `Engine` of this backend and, with the other modules of this package, the
one place that reads DeepSpeed's engine internals (skipped steps, loss scale, grad norm, its
checkpoint files); the loop and the metrics ask it.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import ClassVar

import deepspeed
import torch
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel
from pretrain.parallel import state
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.random import seed_everything
from pretrain.training.backends.deepspeed import experts, full_state, steps
from pretrain.training.backends.deepspeed import files as checkpoint_files
from pretrain.training.backends.deepspeed.comm import init_deepspeed_comm
from pretrain.training.backends.deepspeed.config import build_deepspeed_config, we_clip_gradients
from pretrain.training.backends.deepspeed.offload import partition_nvme_parameters
from pretrain.training.backends.deepspeed.pipeline import build_pipeline_model
from pretrain.training.checkpoints.checkpoint_writes import RankFiles
from pretrain.training.engine import Carried, Engine, StepFunctions, Write, count_parameters
from pretrain.training.precision import PrecisionConfig
from pretrain.training.schedules.lr_schedule import LRScheduleConfig, SampleLRScheduler
from pretrain.training.schedules.optimizer import ClippedAdamW, OptimizerConfig, build_optimizer


@dataclass(eq=False)
class DeepSpeedEngine(Engine):
    """DeepSpeed's engine and what the rest of training needs to know about it."""

    ds: deepspeed.DeepSpeedEngine
    pipeline: bool
    scheduler: SampleLRScheduler
    params_total: int  # over the whole model, counted once
    padded_vocab_size: int
    ds_config: dict
    fp16: bool
    step_functions: ClassVar[StepFunctions] = StepFunctions(steps.train_step, steps.evaluation_loss)

    @property
    def precision(self) -> str:
        """The module weights' precision: "bf16", "fp16" or "fp32"."""
        if self.fp16:
            return "fp16"
        return "bf16" if self.ds_config.get("bf16", {}).get("enabled") else "fp32"

    @property
    def offload(self) -> str | None:
        """What DeepSpeed's ZeRO optimizer keeps off the device, read from the optimizer itself
        (so the banner shows what runs, not what was asked): "optimizer state: cpu (AdamW),
        parameters: nvme"; None when nothing is offloaded."""
        zero = self.ds.optimizer
        parts = []
        if getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False):
            where = "nvme" if getattr(zero, "swap_optimizer", False) else "cpu"
            parts.append(f"optimizer state: {where} ({type(zero.optimizer).__name__})")
        if getattr(zero, "offload_param", False):
            where = "nvme" if getattr(zero, "params_in_nvme_and_cpu", False) else "cpu"
            parts.append(f"parameters: {where}")
        return ", ".join(parts) or None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (fp16 overflow)."""
        return int(self.ds.skipped_steps)

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Use this global batch for the next iteration: DeepSpeed's gradient-accumulation count
        (and the pipeline's micro-batch count) and the LR scheduler's sample increment."""
        if global_batch_size != self.ds.train_batch_size():
            self.ds.set_train_batch_size(global_batch_size)
        self.scheduler.increment = global_batch_size

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.scheduler.get_lr()[0]

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (None where DeepSpeed did not compute one)."""
        inner = getattr(self.ds.optimizer, "optimizer", None)  # under DeepSpeed's fp16/bf16 wrapper
        if isinstance(inner, ClippedAdamW):  # ours clipped: its norm, not the wrapper's
            return inner.last_grad_norm
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return float(getattr(self.ds.optimizer, "cur_scale", 1.0)) if self.fp16 else 1.0

    def step_counters(self) -> tuple[int, int, int]:
        """DeepSpeed's step, sample and micro-step counters (`withheld_update` puts them back)."""
        return self.ds.global_steps, self.ds.global_samples, self.ds.micro_steps

    @contextlib.contextmanager
    def withheld_update(self, counters: tuple[int, int, int]):
        """Inside: DeepSpeed's optimizer step changes no model state. Our optimizer's and LR
        scheduler's steps do nothing while DeepSpeed runs the rest of its step (so it clears, and
        under ZeRO frees, the gradients and copies the unchanged master weights back); after,
        its counters are `counters` (`step_counters()` before the iteration). fp16's dynamic
        loss scaler still counts the iteration."""
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)  # under ZeRO/fp16
        with _does_nothing(inner, "step"), _does_nothing(self.scheduler, "step"):
            yield
        self.ds.global_steps, self.ds.global_samples, self.ds.micro_steps = counters

    def state_trees(self, with_optimizer: bool) -> list[tuple[dict, str]]:
        """`Engine.state_trees`: the module's weights; the wrapped torch optimizer's state and
        ZeRO-1/2's fp32 master partitions."""
        named = dict(self.ds.module.named_parameters())
        trees = [({k: v.detach() for k, v in named.items()}, "weights")]
        if not with_optimizer:
            return trees
        names = {id(p): n for n, p in named.items()}
        optimizer = self.ds.optimizer
        base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
        opt_state = {
            names.get(id(param), f"partition{i}"): value
            for i, (param, value) in enumerate(getattr(base, "state", {}).items())
        }
        trees.append((opt_state, "optimizer state"))
        master = getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
        if master is not None:
            trees.append(
                ({f"fp32_partition{i}": t for i, t in enumerate(master)}, "fp32 master weights")
            )
        return trees

    def weight_bytes(self) -> int:
        """`Engine.weight_bytes`."""
        return sum(p.numel() * p.element_size() for p in self.ds.module.parameters())

    def save_native(self, save_dir: str, tag: str, client_state: dict, files: RankFiles) -> None:
        """`Engine.save_native`: DeepSpeed's `save_checkpoint` (`files.save`)."""
        checkpoint_files.save(self.ds, save_dir, tag, client_state, files)

    def load_native(
        self, folder: str, tag: str, *, optimizer: bool, schedule: bool, module_only: bool
    ) -> tuple[str | None, dict | None]:
        """`Engine.load_native`: DeepSpeed's `load_checkpoint` (`files.load`)."""
        return checkpoint_files.load(
            self.ds, folder, tag, optimizer=optimizer, schedule=schedule, module_only=module_only
        )

    def save_full_state(self, step_dir: str, write: Write, stamp: dict) -> None:
        """`Engine.save_full_state` (`full_state.save_full_state`)."""
        full_state.save_full_state(self, step_dir, write, stamp)

    def load_full_state(
        self, step_dir: str, *, vocab_size: int, with_optimizer: bool, with_schedule: bool
    ) -> Carried:
        """`Engine.load_full_state` (`full_state.load_full_state`)."""
        return full_state.load_full_state(
            self,
            step_dir,
            vocab_size=vocab_size,
            with_optimizer=with_optimizer,
            with_schedule=with_schedule,
        )

    def set_position(self, iteration: int, consumed_samples: int) -> None:
        """`Engine.set_position`: DeepSpeed's step and sample counters."""
        self.ds.global_steps = iteration
        self.ds.global_samples = consumed_samples

    def config_record(self) -> dict:
        """`Engine.config_record`: the DeepSpeed config the engine was built with."""
        return self.ds_config

    def model_parts(self) -> list[torch.nn.Module]:
        """`Engine.model_parts`: the module DeepSpeed wraps (this stage's under the pipeline)."""
        return [self.ds.module]

    def destroy(self) -> None:
        """`Engine.destroy`."""
        self.ds.destroy()


@contextlib.contextmanager
def _does_nothing(obj, method: str):
    """`obj.method(...)` returns None inside (an instance attribute over the class's method)."""
    saved = obj.__dict__.get(method)
    setattr(obj, method, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        if saved is None:
            delattr(obj, method)
        else:
            setattr(obj, method, saved)


PARALLEL_MARKS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "expert_parallel",
)


def _mark_master_copies(ds_optimizer) -> None:
    """DeepSpeed's fp16/bf16 ZeRO-0 wrapper steps our AdamW on fp32 copies of the parameters;
    give the copies the TP/shared marks our clipping's global norm reads."""
    low = getattr(ds_optimizer, "fp16_groups", None)
    high = getattr(ds_optimizer, "fp32_groups", None)
    if low is None or high is None:
        return
    for group16, group32 in zip(low, high, strict=True):
        for p16, p32 in zip(group16, group32, strict=True):
            for mark in PARALLEL_MARKS:
                if hasattr(p16, mark):
                    setattr(p32, mark, getattr(p16, mark))


def _undo_warmup_step(ds_optimizer) -> None:
    """DeepSpeed's fp16/bf16 ZeRO-0 wrapper steps our AdamW once on zero gradients when it is
    built (to create Adam's state): Adam's step count then runs one ahead of the iterations (its
    bias correction differs: bf16 ZeRO-0 left fp32 and every other bf16 layout by 1e-4 in the
    loss at iteration 3), and where the LR at sample 0 is not 0 weight decay shrinks the fp32
    copies once. Drop that state (the first real step creates it) and copy the copies back from
    the module weights they were cloned from."""
    if isinstance(ds_optimizer, FP16_UnfusedOptimizer):
        ds_optimizer.optimizer.state.clear()
        ds_optimizer.refresh_fp32_params()


def build_deepspeed_engine(
    *,
    model_config: ModelConfig,
    parallel: ParallelConfig,
    optimizer_config: OptimizerConfig,
    schedule: LRScheduleConfig,
    precision: PrecisionConfig,
    global_batch_size: int,
    micro_batch_size: int,
    num_microbatches: int,
    seed: int,
    backend: str,
    timeout_minutes: float,
    user_json: dict | None = None,
) -> DeepSpeedEngine:
    """DeepSpeed's communication layer over the torch process group (`backend`), process
    groups, the seeded model, AdamW, the LR schedule, then `deepspeed.initialize`."""
    init_deepspeed_comm(backend, datetime.timedelta(minutes=timeout_minutes))
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    state.initialize_model_parallel(tp, pp, parallel.expert_model_parallel_size, parallel.expert_tp)
    seed_everything(seed)
    pipeline = pp > 1
    if pipeline:
        model = build_pipeline_model(model_config, pp, tp, parallel.data_parallel_size)
    else:
        model = GPTModel(model_config)
    optimizer = build_optimizer(
        model.named_parameters(),
        optimizer_config,
        lr=schedule.lr,
        we_clip=we_clip_gradients(parallel, precision),
        model_parallel_group=state.get_model_parallel_group(),
    )
    local_experts = _local_experts(model, optimizer, parallel, model_config)
    scheduler = SampleLRScheduler(optimizer, schedule, global_batch_size=global_batch_size)
    params_total = count_parameters(model)
    ds_config = build_deepspeed_config(
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        clip_grad=optimizer_config.clip_grad,
        parallel=parallel,
        precision=precision,
        user_json=user_json,
        sequence_parallel=model_config.sequence_parallel and tp > 1,
    )
    if not pipeline:
        partition_nvme_parameters(model, ds_config, state.mpu)
    ds_engine = _initialize(model, optimizer, scheduler, ds_config, pipeline)
    experts.finish(ds_engine, model)
    if parallel.zero_stage == 0:
        experts.reduce_over_expert_data_parallel(ds_engine, local_experts)
    return DeepSpeedEngine(
        ds=ds_engine,
        pipeline=pipeline,
        scheduler=scheduler,
        params_total=params_total,
        padded_vocab_size=model_config.padded_vocab_size(tp),
        ds_config=ds_config,
        fp16=precision.fp16,
    )


def _local_experts(model, optimizer, parallel: ParallelConfig, model_config: ModelConfig) -> list:
    """This rank's expert parameters, kept out of DeepSpeed's broadcast (and, under ZeRO, in
    optimizer groups of their own, before the LR scheduler reads the groups)."""
    local_experts = experts.expert_parameters(model)
    experts.keep_local(local_experts)
    if local_experts and parallel.zero_stage > 0:
        experts.use_expert_groups(model, optimizer, local_experts, model_config.num_moe_experts)
    return local_experts


def _initialize(model, optimizer, scheduler, ds_config: dict, pipeline: bool):
    """`deepspeed.initialize` (the mpu so ZeRO shards over DP only, none for the pipeline
    engine), then the fp16/bf16 ZeRO-0 wrapper's copies made to match the model."""
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        mpu=None if pipeline else state.mpu,
    )
    _mark_master_copies(ds_engine.optimizer)
    _undo_warmup_step(ds_engine.optimizer)
    return ds_engine
