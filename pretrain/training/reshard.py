"""A live DeepSpeed engine <-> the layout-independent state of `pretrain.checkpoint.full_state`.

`save_full_state` runs on every rank after DeepSpeed's own save: each parameter's fp32 master
weight and Adam moments are gathered over data parallelism (ZeRO 1-3: DeepSpeed's fp32
partitions through its `safe_get_full_*` functions; ZeRO-0: the plain optimizer's state) and
written, TP-local, by one data-parallel rank of each TP rank (the DP ranks take turns). `load_full_state` does the reverse
at another layout, after the engine is built: it cuts each parameter for this TP rank and puts
it into the module, the fp32 partition and the optimizer state.

Any TP, PP, DP and ZeRO stage 0-3 on either side (under the pipeline engine DeepSpeed allows
ZeRO 0-1); `resume.relayout_possible` chooses this path over DeepSpeed's own load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from pretrain.checkpoint.full_state import FullState, write_shard
from pretrain.errors import UserError
from pretrain.parallel import state
from pretrain.training.engine import Engine

MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero_stage(engine: Engine) -> int:
    return int(engine.ds.zero_optimization_stage())


def _partition(param: torch.Tensor) -> tuple[int, int] | None:
    if getattr(param, "tensor_model_parallel", False):
        return (int(param.partition_dim), int(getattr(param, "partition_stride", 1)))
    return None


def _zero_step(engine: Engine) -> int | None:
    """Adam's step count of the ZeRO 1-3 flat partitions (one per group, all equal)."""
    steps = [s["step"] for s in engine.ds.optimizer.optimizer.state.values() if "step" in s]
    return int(steps[0]) if steps else None


def _relink(engine: Engine) -> None:
    """Point every parameter's fragment at its group's Adam state. DeepSpeed links them after the
    first group's first step, before the other groups (no weight decay) have any state, and never
    again, so the fragments of those groups would stay empty."""
    zero_opt = engine.ds.optimizer
    zero_opt._hp_optimizer_states_linked = False
    zero_opt._lazy_init_hp_params_optimizer_state()


def _named_parameters(engine: Engine, owned: bool = False) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by GPTModel name. Under the pipeline engine DeepSpeed names them
    `<pipeline layer index>.<rest>`, the tied embedding `tied_modules.embed.<rest>`: on the first
    stage it is the embedding; on the last stage a copy (its word embedding kept equal to the
    first stage's, its position embedding unused), left out when `owned`."""
    named = dict(engine.ds.module.named_parameters())
    if not engine.pipeline:
        return named
    from pretrain.model.pipeline import TIED_KEY, layer_name_prefix

    tied = f"tied_modules.{TIED_KEY}."
    num_layers = engine.ds.module._num_layers - (3 if any(n.startswith(tied) for n in named) else 2)
    out = {}
    for name, param in named.items():
        if name.startswith(tied):
            if not (owned and state.get_pipeline_model_parallel_rank() > 0):
                out["embedding." + name[len(tied) :]] = param
        else:
            index, rest = name.split(".", 1)
            out[layer_name_prefix(int(index), num_layers) + rest] = param
    return out


def _collect(engine: Engine, keep: Callable[[int], bool]) -> dict[str, dict]:
    """The entries of the parameters `keep(i)` selects (i: position in this rank's parameter
    order), on the CPU. Every rank gathers every parameter (ZeRO's gathers are collectives over
    DP), one at a time, and drops at once what it does not keep: the device holds one full
    parameter at a time, the CPU this rank's share."""
    zero = _zero_stage(engine)
    step = _zero_step(engine) if zero else None
    if step is not None and zero < 3:
        _relink(engine)
    entries = {}
    for i, (name, param) in enumerate(_named_parameters(engine, owned=True).items()):
        entry = {"partition": _partition(param)}
        if zero:
            entry["param"] = safe_get_full_fp32_param(param)
            if step is not None:
                entry.update({k: safe_get_full_optimizer_state(param, k) for k in MOMENTS})
                entry["step"] = step
        else:
            entry["param"] = param.detach()
            saved = engine.ds.optimizer.state.get(param, {})
            if "step" in saved:
                entry.update({k: saved[k] for k in MOMENTS}, step=int(saved["step"]))
        if keep(i):
            entries[name] = {
                k: v.detach().to("cpu", torch.float32, copy=True) if torch.is_tensor(v) else v
                for k, v in entry.items()
            }
    return entries


def save_full_state(
    engine: Engine, step_dir: str, write: Callable[[dict, str], None], stamp: dict
) -> None:
    """Write this rank's part of the layout-independent state into `step_dir` with
    `write(payload, path)` (collective over DP); `stamp` (the step's position) goes into its
    `extra`. The data-parallel ranks of one (TP rank, PP stage) share the writing: DP rank d
    writes every DP-th parameter, d, d + DP, ..., so each writes (and holds on the CPU) 1/DP of
    the state, all at once."""
    dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
    write_shard(
        step_dir,
        tp_rank=state.get_tensor_model_parallel_rank(),
        tp_size=state.get_tensor_model_parallel_world_size(),
        pp_stage=state.get_pipeline_model_parallel_rank(),
        dp_rank=dp_rank,
        entries=_collect(engine, keep=lambda i: i % dp == dp_rank),
        extra={"lr_scheduler": engine.scheduler.state_dict(), **stamp},
        write=write,
    )


def _init_zero_state(engine: Engine, step: int) -> None:
    """Create the ZeRO 1-3 Adam state (DeepSpeed makes it lazily at the first step) and (ZeRO 1/2)
    link each parameter's fragment to it, so that `safe_set_full_optimizer_state` can fill it."""
    zero_opt = engine.ds.optimizer
    stage3 = _zero_stage(engine) == 3
    flats = (
        zero_opt.fp32_partitioned_groups_flat
        if stage3
        else zero_opt.single_partition_of_fp32_groups
    )
    for flat in flats:
        zero_opt.optimizer.state[flat] = {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    if not stage3:
        _relink(engine)


def _set_module_weight(engine: Engine, param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Put `value` into the module's (low-precision) parameter; ZeRO-3 holds only a partition of
    it, so it is gathered, set on every rank alike, and partitioned again."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            with torch.no_grad():
                param.copy_(value.to(param.dtype))
        return
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def load_full_state(
    engine: Engine, step_dir: str, *, vocab_size: int, with_optimizer: bool
) -> None:
    """Set this rank's weights (and optimizer state, LR schedule) from `step_dir`'s full state."""
    full = FullState(step_dir, vocab_size)
    zero = _zero_stage(engine)
    tp_rank = state.get_tensor_model_parallel_rank()
    tp = state.get_tensor_model_parallel_world_size()
    named = _named_parameters(engine)
    if not named.keys() <= set(full.names()):
        raise UserError(
            f"{step_dir}: the saved parameters differ from this model's "
            f"({sorted(named.keys() - set(full.names()))[:4]})"
        )
    with_optimizer = with_optimizer and full.has_optimizer()
    if with_optimizer and zero:
        _init_zero_state(engine, max(full.step(n) for n in named))
    for name, param in named.items():
        local = full.local(
            name, tp_rank=tp_rank, tp_size=tp, padded_vocab_size=engine.padded_vocab_size
        )
        _set_module_weight(engine, param, local["param"])
        if zero:
            safe_set_full_fp32_param(param, local["param"])
            if with_optimizer:
                for key in MOMENTS:
                    safe_set_full_optimizer_state(param, local[key], key)
        elif with_optimizer:
            engine.ds.optimizer.state[param] = {
                "step": torch.tensor(float(full.step(name))),
                **{key: local[key].clone() for key in MOMENTS},
            }
    engine.scheduler.load_state_dict(full.extra["lr_scheduler"])
