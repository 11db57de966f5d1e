"""The DeepSpeed config dict, from the flags or from the user's (already checked) JSON.

Two choices here keep DeepSpeed's math equal to Megatron's at every layout:
- The optimizer is always ours (a client `torch.optim.AdamW`): a JSON optimizer would JIT-build
  `fused_adam` on CPU and bypass our parameter groups. `parse_args` refuses a JSON optimizer.
- Gradient clipping at ZeRO-0 in fp32 is done by our optimizer with the true global norm
  (`pretrain.training.optimizer`), so DeepSpeed's own clipping is switched off there: in a pipeline
  grid DeepSpeed's ZeRO-0 norm leaves out every stage but the first. ZeRO >= 1 and the
  bf16/fp16 optimizers compute the norm over the right groups, so they keep DeepSpeed's clipping.
"""

from __future__ import annotations

import copy
import math

from pretrain.arguments import Config


def we_clip_gradients(cfg: Config) -> bool:
    """True where our optimizer clips (ZeRO-0, fp32); else DeepSpeed does."""
    t = cfg.training
    return cfg.parallel.zero_stage == 0 and not (t.bf16 or t.fp16)


def build_deepspeed_config(cfg: Config) -> dict:
    t, par = cfg.training, cfg.parallel
    ds = copy.deepcopy(t.deepspeed_config) if t.deepspeed_config is not None else {}
    ds["train_batch_size"] = t.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.num_microbatches
    ds["gradient_clipping"] = 0.0 if we_clip_gradients(cfg) else t.clip_grad
    ds.setdefault("steps_per_print", 2**31 - 1)  # our log line replaces DeepSpeed's
    ds.setdefault("wall_clock_breakdown", False)

    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = par.zero_stage
    if par.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        # our torch AdamW on CPU-resident state (DeepSpeedCPUAdam would need a JIT build)
        ds["zero_force_ds_cpu_optimizer"] = False

    if t.bf16:
        ds["bf16"] = {"enabled": True}
    elif t.fp16:
        fp16 = ds.setdefault("fp16", {})
        fp16["enabled"] = True
        if t.loss_scale is not None:
            fp16["loss_scale"] = t.loss_scale  # static
        else:
            fp16.setdefault("loss_scale", 0)  # dynamic
            fp16.setdefault("initial_scale_power", int(round(math.log2(t.initial_loss_scale))))
            fp16.setdefault("loss_scale_window", t.loss_scale_window)
            fp16.setdefault("hysteresis", t.hysteresis)
            fp16.setdefault("min_loss_scale", t.min_loss_scale)
    return ds
