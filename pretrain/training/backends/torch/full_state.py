"""FSDP2's DTensor shards <-> the layout-independent state of `pretrain.checkpoint.full_state`.

The same files as the DeepSpeed backend's (`full_state_tp<t>_pp<p>[_dp<d>].pt`), so a checkpoint
of either backend resumes on the other at any layout. `save_full_state` gathers each parameter's
fp32 master and Adam moments over the data-parallel ranks (`full_tensor()`, one parameter at a
time) into TP-local tensors; data-parallel rank d keeps and writes every DP-th parameter.
`load_full_state` cuts each saved parameter for this TP rank, then for this rank's dim-0 shard
of the data-parallel mesh (no communication: every rank reads the files), into the parameter and
into Adam's state, which it creates where no step has yet.

MoE (`experts.py`): at expert-parallel size > 1 each expert tensor (weight and moments), whole
over expert DP after `full_tensor()`, is all-gathered over EP along dim 0, so the state holds
every expert, as the DeepSpeed backend's does; at load each rank cuts its EP rank's experts, then
its shard over the expert-data-parallel mesh. Persistent buffers (the routers' expert bias,
replicated) are saved and set beside the parameters (`"buffer": true` entries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pretrain.checkpoint.full_state import FullState
from pretrain.errors import UserError
from pretrain.parallel import state
from pretrain.training.backends.torch.stages import saved_name
from pretrain.training.engine import (
    Carried,
    Write,
    all_experts,
    local_experts,
    set_buffers,
    split_over_ep,
    write_full_state_shard,
)

if TYPE_CHECKING:
    from pretrain.training.backends.torch.held import Held

MOMENTS = ("exp_avg", "exp_avg_sq")


def _partition(param: torch.Tensor) -> tuple[int, int] | None:
    if getattr(param, "tensor_model_parallel", False):
        return (int(param.partition_dim), int(getattr(param, "partition_stride", 1)))
    return None


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole (TP-local) tensor on the CPU in fp32, a copy the caller owns."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", torch.float32, copy=True)


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of `model` a state dict holds (the routers' expert bias), by GPTModel name."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def _collect(engine: Held, keep) -> dict[str, dict]:
    """The entries (fp32 master, moments, step) of the parameters, then the persistent buffers,
    that `keep(i)` selects; every rank joins every gather (collectives over DP, expert DP and
    EP) and drops at once what it does not keep."""
    entries = {}
    params = list(engine.model.named_parameters())
    for i, (name, param) in enumerate(params):
        if getattr(param, "shared", False):  # the tied copy (PP > 1): saved from the first stage
            continue
        adam = engine.optimizer.state.get(param, {})
        entry = {"partition": _partition(param), "param": _gathered(param)}
        for key in MOMENTS:
            if key in adam:
                entry[key] = _gathered(adam[key])
        if split_over_ep(param):
            entry.update({k: all_experts(entry[k]) for k in ("param", *MOMENTS) if k in entry})
        if "step" in adam:
            entry["step"] = int(adam["step"])
        if keep(i):
            entries[name] = entry
    buffers = persistent_buffers(engine.model).items()
    for i, (name, buffer) in enumerate(buffers, start=len(params)):
        if keep(i):
            entries[name] = {"partition": None, "param": _gathered(buffer), "buffer": True}
    return entries


def save_full_state(engine: Held, step_dir: str, write: Write, stamp: dict) -> None:
    """`Engine.save_full_state` on the torch backend (collective over DP)."""
    write_full_state_shard(
        step_dir,
        lambda keep: _collect(engine, keep=keep),
        extra={
            "lr_scheduler": engine.scheduler.state_dict(),
            "precision": engine.precision,
            "fp32_masters": True,
            "loss_scaler": None,
            **stamp,
        },
        write=write,
    )


def _like(param: DTensor, value: torch.Tensor) -> DTensor:
    """`value` (the whole TP-local tensor) as a DTensor placed as `param` is, cut locally."""
    return distribute_tensor(
        value.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
    )


def load_full_state(
    engine: Held,
    step_dir: str,
    *,
    vocab_size: int,
    with_optimizer: bool,
    with_schedule: bool,
) -> Carried:
    """`Engine.load_full_state` on the torch backend."""
    full = FullState(step_dir, vocab_size)
    # (saved name, parameter): the tied copy of PP > 1 loads from the word embedding
    named = [(saved_name(n), p) for n, p in engine.model.named_parameters()]
    if missing := {n for n, _ in named} - set(full.names()):
        raise UserError(
            f"{step_dir}: the saved parameters differ from this model's ({sorted(missing)[:4]})"
        )
    with_optimizer = with_optimizer and full.has_optimizer()
    tp_rank = state.get_tensor_model_parallel_rank()
    tp = state.get_tensor_model_parallel_world_size()
    for name, param in named:
        local = full.local(
            name, tp_rank=tp_rank, tp_size=tp, padded_vocab_size=engine.padded_vocab_size
        )
        if split_over_ep(param):
            local = local_experts(local)
        with torch.no_grad():
            param.to_local().copy_(_like(param, local["param"]).to_local())
        if with_optimizer:
            engine.optimizer.state[param] = {
                "step": torch.tensor(float(full.step(name))),
                **{key: _like(param, local[key]) for key in MOMENTS},
            }
    set_buffers(persistent_buffers(engine.model), full)
    if with_schedule:
        engine.scheduler.load_state_dict(full.extra["lr_scheduler"])
    return Carried(
        fp32_masters=bool(full.extra.get("fp32_masters")),
        adam_state=with_optimizer,
        loss_scale=False,
        precision=full.extra.get("precision"),
    )
