"""Where DeepSpeed keeps each parameter's fp32 master weight, Adam moments and fp16 loss scale.

DeepSpeed steps a different optimizer for each precision, ZeRO stage and engine:

- ZeRO 1/2 (`DeepSpeedZeroOptimizer`), ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`), and bf16 at
  ZeRO-0 under the pipeline engine (`BF16_Optimizer`): fp32 flat partitions over data
  parallelism, stepped by our AdamW. A parameter reaches its fragment through DeepSpeed's
  `safe_get/set_full_fp32_param` and `safe_get/set_full_optimizer_state` (collectives over DP),
  which in DeepSpeed 0.19.8 serve exactly these three (ZeRO-3 by `ds_id`, the others by
  `_hp_mapping`). `_Fragments`.
- bf16 or fp16 at ZeRO-0 otherwise: `FP16_UnfusedOptimizer` (DeepSpeed's wrapper for a client
  optimizer that is not its fused Adam): one fp32 copy of each module parameter
  (`fp32_groups[g][i]` beside `fp16_groups[g][i]`), stepped by our AdamW; it has no fragments
  and the `safe_*` functions answer None for its parameters. `_Copies`.
- fp32 at ZeRO-0: our AdamW itself on the module parameters, which are their own masters.
  `_Copies` with each parameter its own copy.

`masters(engine)` gives the accessor of the engine's optimizer. fp16's dynamic loss scale lives
in `loss_scaler` (ZeRO) or `loss_scale_config` (ZeRO-0); `loss_scale_state` and
`set_loss_scale_state` carry its scale and overflow counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

if TYPE_CHECKING:
    from pretrain.training.backends.deepspeed.held import Held


MOMENTS = ("exp_avg", "exp_avg_sq")
LOSS_SCALE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class _Fragments:
    """Masters and moments in DeepSpeed's fp32 partitions (ZeRO 1-3, BF16_Optimizer)."""

    def __init__(self, engine: Held):
        self.optimizer = engine.ds.optimizer  # DeepSpeed's; .optimizer is our AdamW
        self.stage3 = engine.ds.zero_optimization_stage() == 3

    def step(self) -> int | None:
        """Adam's step count of the flat partitions (one per group, all equal); None before the
        first step."""
        steps = [s["step"] for s in self.optimizer.optimizer.state.values() if "step" in s]
        return int(steps[0]) if steps else None

    def _relink(self) -> None:
        """Point every parameter's fragment at its group's Adam state. DeepSpeed links them after
        the first group's first step, before the other groups (no weight decay) have any state,
        and never again, so the fragments of those groups would stay empty. ZeRO-3 finds its
        state by parameter id and needs no link."""
        if not self.stage3:
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def prepare_get(self) -> None:
        """Make `get` see every group's moments (call once before the first `get`)."""
        if self.step() is not None:
            self._relink()

    def get(self, param: torch.nn.Parameter) -> dict:
        """{"param": the full fp32 master, moments and "step" when the optimizer has state}
        (collective over DP)."""
        entry = {"param": safe_get_full_fp32_param(param)}
        step = self.step()
        if step is not None:
            entry.update({k: safe_get_full_optimizer_state(param, k) for k in MOMENTS}, step=step)
        return entry

    def prepare_set(self, step: int) -> None:
        """Create the Adam state (DeepSpeed makes it lazily at the first step) at `step` and
        link the fragments to it, so that `set` can fill the moments."""
        if self.stage3:
            flats = self.optimizer.fp32_partitioned_groups_flat
        elif isinstance(self.optimizer, BF16_Optimizer):
            flats = self.optimizer.fp32_groups_flat_partition
        else:
            flats = self.optimizer.single_partition_of_fp32_groups
        for flat in flats:
            self.optimizer.optimizer.state[flat] = {
                "step": torch.tensor(float(step)),
                **{k: torch.zeros_like(flat) for k in MOMENTS},
            }
        self._relink()

    def set(self, param: torch.nn.Parameter, local: dict, with_optimizer: bool) -> None:
        """Put this rank's part of `local`'s master (and, `with_optimizer`, its moments) into
        the partitions."""
        safe_set_full_fp32_param(param, local["param"])
        if with_optimizer:
            for key in MOMENTS:
                safe_set_full_optimizer_state(param, local[key], key)


class _Copies:
    """Masters and moments per parameter, unpartitioned (ZeRO-0 without BF16_Optimizer)."""

    def __init__(self, engine: Held):
        optimizer = engine.ds.optimizer
        self.wrapped = isinstance(optimizer, FP16_UnfusedOptimizer)
        self.adam = optimizer.optimizer if self.wrapped else optimizer
        self.step_count: int | None = None  # the Adam step `set` gives (see prepare_set)
        self.copy_of = {}  # id(module parameter) -> its fp32 master
        if self.wrapped:
            for low, high in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
                self.copy_of.update({id(p): m for p, m in zip(low, high, strict=True)})

    def _master(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self.copy_of[id(param)] if self.wrapped else param

    def prepare_get(self) -> None:
        """Nothing to prepare (the interface of `_Fragments`)."""

    def get(self, param: torch.nn.Parameter) -> dict:
        """{"param": the fp32 master, moments and "step" when the optimizer has state}."""
        master = self._master(param)
        entry = {"param": master.detach()}
        saved = self.adam.state.get(master, {})
        if "step" in saved:
            entry.update({k: saved[k] for k in MOMENTS}, step=int(saved["step"]))
        return entry

    def prepare_set(self, step: int) -> None:
        """Remember the Adam step count `set` gives each parameter's state."""
        self.step_count = step

    def set(self, param: torch.nn.Parameter, local: dict, with_optimizer: bool) -> None:
        """Put `local`'s master into the fp32 copy (the module weight is set by the caller) and,
        `with_optimizer`, its moments into our AdamW's state."""
        master = self._master(param)
        with torch.no_grad():
            master.copy_(local["param"])
        if with_optimizer:
            self.adam.state[master] = {
                "step": torch.tensor(float(self.step_count)),
                **{k: local[k].to(master.device, master.dtype, copy=True) for k in MOMENTS},
            }


def masters(engine: Held) -> _Fragments | _Copies:
    """The accessor of the fp32 masters and Adam state of `engine`'s optimizer."""
    if engine.ds.zero_optimization_stage() or isinstance(engine.ds.optimizer, BF16_Optimizer):
        return _Fragments(engine)
    return _Copies(engine)


def _scaler(engine: Held):
    optimizer = engine.ds.optimizer
    return getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)


def loss_scale_state(engine: Held) -> dict | None:
    """fp16: the loss scaler's scale and overflow counters (plain numbers); else None."""
    scaler = _scaler(engine) if engine.fp16 else None
    if scaler is None:
        return None
    values = {k: getattr(scaler, k, None) for k in LOSS_SCALE_KEYS}
    return {k: float(v) for k, v in values.items() if v is not None}


def set_loss_scale_state(engine: Held, saved: dict | None) -> bool:
    """Put a saved fp16 loss scale into this fp16 run's dynamic scaler; False (nothing set)
    without a saved one, without fp16 or with a static --loss-scale. A counter the target's
    scaler does not have (hysteresis at ZeRO-0) is dropped, one it has and the source did not
    keeps its start value."""
    scaler = _scaler(engine) if engine.fp16 else None
    dynamic = getattr(scaler, "dynamic", getattr(scaler, "dynamic_loss_scale", False))
    if not saved or scaler is None or not dynamic:
        return False
    for key, value in saved.items():
        if hasattr(scaler, key):
            setattr(scaler, key, value if key == "cur_scale" else int(value))
    return True
