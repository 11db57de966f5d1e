"""Model + optimizer + LR schedule -> the torch backend's engine (FSDP2, pipeline stages at PP > 1).

`build_torch_engine` builds the seeded GPT from our TP layers, shards it with FSDP2 over the
data-parallel dimension of the device mesh (`fsdp.py`), and steps our `ClippedAdamW` (the true
global gradient norm over DTensor shards and TP) with the `SampleLRScheduler`. At PP > 1 the
model is this rank's pipeline stages (`stages.py`; each stage module sharded as the GPT is) and
`pipeline.py`'s schedule runs the iteration. `TorchEngine` is the `Engine` of this backend: the
iteration (`steps.py`), its native checkpoint (DCP, `dcp.py`, also written in the background)
and the layout-independent state (`full_state.py`).
"""

from __future__ import annotations

import dataclasses
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel
from pretrain.parallel import state
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.random import seed_everything
from pretrain.training.backends.torch import dcp, experts, full_state, steps
from pretrain.training.backends.torch.fsdp import (
    ShardingPolicy,
    device_mesh,
    local_tensor,
    shard_model,
)
from pretrain.training.backends.torch.pipeline import Pipeline
from pretrain.training.backends.torch.stages import StagePlan, stage_parts
from pretrain.training.checkpoints.checkpoint_writes import RankFiles
from pretrain.training.distributed import collective_device
from pretrain.training.engine import Carried, Engine, StepFunctions, Write, count_parameters
from pretrain.training.precision import PrecisionConfig
from pretrain.training.schedules.lr_schedule import LRScheduleConfig, SampleLRScheduler
from pretrain.training.schedules.optimizer import OptimizerConfig, build_optimizer


@dataclass(eq=False)
class TorchEngine(Engine):
    """The FSDP2-sharded GPT, its optimizer and LR schedule on one rank."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: SampleLRScheduler
    mesh: DeviceMesh
    checkpoint_group: torch.distributed.ProcessGroup  # DCP's own (gloo), see dcp.py
    policy: ShardingPolicy
    params_total: int
    padded_vocab_size: int
    fp16: bool = False
    pipeline: bool = False  # DeepSpeed's per-layer checkpoint layout: never here
    pipe: Pipeline | None = None
    """PP > 1: the schedule over this rank's stages (`model` is their `StageParts`)."""
    step_functions: ClassVar[StepFunctions] = StepFunctions(steps.train_step, steps.evaluation_loss)

    @property
    def precision(self) -> str:
        """The compute precision: "bf16" or "fp32" (the sharded masters are fp32 either way)."""
        return "bf16" if self.policy.bf16 else "fp32"

    @property
    def offload(self) -> str | None:
        """What FSDP2's CPUOffloadPolicy keeps in CPU memory (None: nothing)."""
        if not self.policy.offload:
            return None
        return "parameters, gradients and optimizer step: cpu (FSDP2 CPUOffloadPolicy)"

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far: none (no fp16 loss scaling here)."""
        return 0

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """The LR schedule's sample increment (the micro-batch count is `train_step`'s)."""
        self.scheduler.increment = global_batch_size

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.scheduler.get_lr()[0]

    def grad_norm(self) -> float | None:
        """The global gradient norm the last step clipped with."""
        return self.optimizer.last_grad_norm

    def loss_scale(self) -> float:
        """1.0: no loss scaling on this backend."""
        return 1.0

    def state_trees(self, with_optimizer: bool) -> list[tuple[dict, str]]:
        """`Engine.state_trees`: this rank's shards of the (fp32 master) weights and, with the
        optimizer, of Adam's moments."""
        named = dict(self.model.named_parameters())
        trees = [({n: local_tensor(p).detach() for n, p in named.items()}, "weights")]
        if with_optimizer:
            moments = {
                f"{name}.{key}": local_tensor(value)
                for name, param in named.items()
                for key, value in self.optimizer.state.get(param, {}).items()
                if torch.is_tensor(value)
            }
            trees.append((moments, "optimizer state"))
        return trees

    def weight_bytes(self) -> int:
        """`Engine.weight_bytes`: this rank's shards."""
        return sum(
            local_tensor(p).numel() * local_tensor(p).element_size()
            for p in self.model.parameters()
        )

    def save_native(self, save_dir: str, tag: str, client_state: dict, files: RankFiles) -> None:
        """`Engine.save_native`: a DCP save (`dcp.save`), blocking."""
        dcp.save(self, f"{save_dir}/{tag}", client_state, files, background=False)

    def save_native_in_background(
        self, save_dir: str, tag: str, client_state: dict, files: RankFiles
    ) -> Future:
        """`Engine.save_native_in_background`: DCP's `async_save` (`dcp.save`)."""
        return dcp.save(self, f"{save_dir}/{tag}", client_state, files, background=True)

    def load_native(
        self, folder: str, tag: str, *, optimizer: bool, schedule: bool, module_only: bool
    ) -> tuple[str | None, dict | None]:
        """`Engine.load_native` (`dcp.load`)."""
        return dcp.load(
            self, f"{folder}/{tag}", optimizer=optimizer and not module_only, schedule=schedule
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
        """Nothing: this backend keeps no step counters of its own."""

    def config_record(self) -> dict:
        """`Engine.config_record`: what the torch backend ran with."""
        return {
            "backend": "torch",
            "fsdp2": {
                "mesh": dict(zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True)),
                "shard_dim": "dp",
                **dataclasses.asdict(self.policy),
            },
        }

    def model_parts(self) -> list[torch.nn.Module]:
        """`Engine.model_parts`: the FSDP2-sharded model."""
        return [self.model]

    def destroy(self) -> None:
        """Release DCP's process group (the checkpointer has waited for its saves)."""
        torch.distributed.destroy_process_group(self.checkpoint_group)


def build_torch_engine(
    *,
    model_config: ModelConfig,
    parallel: ParallelConfig,
    optimizer_config: OptimizerConfig,
    schedule: LRScheduleConfig,
    precision: PrecisionConfig,
    global_batch_size: int,
    seed: int,
    **_deepspeed_only,
) -> TorchEngine:
    """The process groups (over the already-initialised default group), the seeded model in its
    configured precision (with --bf16 its weights are rounded to bf16 once, as DeepSpeed's and
    Megatron's bf16 masters start), as fp32 masters sharded by FSDP2, AdamW and the LR schedule.
    `build_engine`'s other keyword arguments (DeepSpeed's JSON, batch split, communication
    setup) are DeepSpeed's and not used here."""
    # the GPT returns its per-token losses as a view; nothing changes them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    device = collective_device()
    tp = parallel.tensor_model_parallel_size
    state.initialize_model_parallel(
        tp,
        parallel.pipeline_model_parallel_size,
        parallel.expert_model_parallel_size,
        parallel.expert_tp,
    )
    seed_everything(seed)
    plan = StagePlan.of(model_config.num_layers, parallel)
    model = stage_parts(model_config, plan) if plan.pipeline_size > 1 else GPTModel(model_config)
    model = model.to(device=device, dtype=torch.float32)
    params_total = count_parameters(model)
    policy = ShardingPolicy(
        bf16=precision.bf16,
        offload=parallel.offload_param == "cpu",
        reshard_after_forward=plan.pipeline_size == 1,
    )
    mesh = device_mesh(device)
    pipe = _shard(model, model_config, plan, parallel, mesh, policy, device)
    optimizer = build_optimizer(
        model.named_parameters(),
        optimizer_config,
        lr=schedule.lr,
        we_clip=True,
        model_parallel_group=state.get_model_parallel_group(),
        shard_group=state.get_data_parallel_group(),
        expert_shard_group=experts.shard_group(),
    )
    return TorchEngine(
        model=model,
        optimizer=optimizer,
        scheduler=SampleLRScheduler(optimizer, schedule, global_batch_size=global_batch_size),
        mesh=mesh,
        checkpoint_group=dcp.checkpoint_group(),
        policy=policy,
        params_total=params_total,
        padded_vocab_size=model_config.padded_vocab_size(tp),
        pipe=pipe,
    )


def _shard(
    model: torch.nn.Module,
    model_config: ModelConfig,
    plan: StagePlan,
    parallel: ParallelConfig,
    mesh: DeviceMesh,
    policy: ShardingPolicy,
    device: torch.device,
) -> Pipeline | None:
    """Shard the GPT (or each of this rank's stage modules) with FSDP2 per layer; at PP > 1
    return the schedule over the stages."""
    edp_mesh = experts.expert_mesh(device)
    if plan.pipeline_size == 1:
        shard_model(model, list(model.layers), mesh, policy, edp_mesh)
        return None
    for stage in model.stage_modules:
        shard_model(stage, list(stage.layers.values()), mesh, policy, edp_mesh)
    dtype = torch.bfloat16 if policy.bf16 else torch.float32
    return Pipeline(
        model_config, plan, model.stage_modules, parallel.pipeline_schedule, device, dtype
    )
