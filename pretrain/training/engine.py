"""Model + optimizer + LR schedule -> a DeepSpeed engine, for PP = 1 and PP > 1.

PP = 1: `GPTModel` under `deepspeed.initialize(..., mpu=...)`; the mpu tells DeepSpeed that TP
ranks are model-parallel peers, so ZeRO 1-3 shard over data-parallel ranks only.
PP > 1: the same parts as a `PipelineModule` (`pretrain.model.pipeline`), DeepSpeed's pipeline
engine and grid (rank order TP fastest, then DP, then PP, which is also ours).
"""

from __future__ import annotations

from dataclasses import dataclass

import deepspeed
import torch

from pretrain.arguments import Config
from pretrain.model.gpt import GPTModel
from pretrain.model.pipeline import build_pipeline_model
from pretrain.parallel import state
from pretrain.parallel.random import seed_everything
from pretrain.training.deepspeed_config import build_deepspeed_config, we_clip_gradients
from pretrain.training.distributed import collective_device
from pretrain.training.lr_schedule import SampleLRScheduler
from pretrain.training.optimizer import build_optimizer


@dataclass
class Engine:
    ds: deepspeed.DeepSpeedEngine
    pipeline: bool
    scheduler: SampleLRScheduler
    params_total: int  # over the whole model, counted once
    padded_vocab_size: int
    ds_config: dict


def _count_parameters(model: torch.nn.Module) -> int:
    """Elements of the full model: TP shards summed over TP, tied copies and TP replicas once."""
    tp_rank0 = state.get_tensor_model_parallel_rank() == 0
    local = sum(
        p.numel()
        for p in model.parameters()
        if not getattr(p, "shared", False)
        and (tp_rank0 or getattr(p, "tensor_model_parallel", False))
    )
    count = torch.tensor([local], dtype=torch.int64, device=collective_device())
    group = state.get_model_parallel_group()
    if torch.distributed.is_initialized() and group is not None:
        torch.distributed.all_reduce(count, group=group)
    return int(count.item())


def build_engine(cfg: Config) -> Engine:
    par, t = cfg.parallel, cfg.training
    state.initialize_model_parallel(
        par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    )
    seed_everything(t.seed)
    pipeline = par.pipeline_model_parallel_size > 1
    if pipeline:
        model = build_pipeline_model(
            cfg.model,
            par.pipeline_model_parallel_size,
            par.tensor_model_parallel_size,
            par.data_parallel_size,
        )
    else:
        model = GPTModel(cfg.model)
    optimizer = build_optimizer(
        model.named_parameters(),
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        clip_grad=t.clip_grad if we_clip_gradients(cfg) else None,
        model_parallel_group=state.get_model_parallel_group(),
    )
    scheduler = SampleLRScheduler(
        optimizer,
        global_batch_size=t.global_batch_size,
        max_lr=t.lr,
        min_lr=t.min_lr,
        warmup_samples=t.lr_warmup_samples,
        decay_samples=t.lr_decay_samples,
        style=t.lr_decay_style,
        warmup_init=t.lr_warmup_init,
    )
    params_total = _count_parameters(model)
    ds_config = build_deepspeed_config(cfg)
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        mpu=None if pipeline else state.mpu,
    )
    return Engine(
        ds_engine,
        pipeline,
        scheduler,
        params_total,
        cfg.model.padded_vocab_size(par.tensor_model_parallel_size),
        ds_config,
    )
