"""A live DeepSpeed engine <-> the layout-independent state of `pretrain.checkpoint.full_state`.

`save_full_state` runs on every rank after DeepSpeed's own save: each parameter's fp32 master
weight and Adam moments are gathered over data parallelism, wherever the engine's optimizer keeps
them (`masters.py`: ZeRO 1-3 and BF16_Optimizer partitions, the fp32 copies of
DeepSpeed's bf16/fp16 ZeRO-0 wrapper, or the fp32 module itself), and written, TP-local, by one
data-parallel rank of each TP rank (the DP ranks take turns); fp16's loss scale goes with them.
`load_full_state` does the reverse at another layout or precision, after the engine is built:
it cuts each parameter for this TP rank and puts it into the module (in the module's precision),
the fp32 master and the optimizer state.

Any TP, PP, DP and ZeRO stage 0-3 on either side (under the pipeline engine DeepSpeed allows
ZeRO 0-1), in fp32, bf16 or fp16; `compatible.relayout_possible` chooses this path over DeepSpeed's
own load. MoE: at expert-parallel size > 1 each expert tensor (weight and moments) is gathered
over the EP group along `expert_partition_dim` at save, so the state holds every expert and
any EP resumes it, each rank cutting its own experts at load; persistent buffers (the routers'
expert bias, replicated on every rank) are saved and set with the parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import deepspeed
import torch

from pretrain.checkpoint.full_state import TENSOR_KEYS, FullState
from pretrain.checkpoint.pipeline_layers import TIED_KEY, layer_name_prefix
from pretrain.errors import UserError
from pretrain.parallel import state
from pretrain.training.backends.deepspeed.masters import (
    loss_scale_state,
    masters,
    set_loss_scale_state,
)
from pretrain.training.engine import (
    Carried,
    all_experts,
    local_experts,
    set_buffers,
    split_over_ep,
    write_full_state_shard,
)

if TYPE_CHECKING:
    from pretrain.training.backends.deepspeed.held import Held


def _partition(param: torch.Tensor) -> tuple[int, int] | None:
    if getattr(param, "tensor_model_parallel", False):
        return (int(param.partition_dim), int(getattr(param, "partition_stride", 1)))
    return None


def _named_parameters(engine: Held, owned: bool = False) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by GPTModel name (`_gpt_names`)."""
    return _gpt_names(engine, dict(engine.ds.module.named_parameters()), owned)


def _named_buffers(engine: Held) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers (in the state dict, not parameters) by GPTModel name."""
    module = engine.ds.module
    params = dict(module.named_parameters())
    buffers = {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in params}
    return _gpt_names(engine, buffers, owned=True)


def _gpt_names(engine: Held, named: dict, owned: bool) -> dict:
    """`named` (the module's names) by GPTModel name. Under the pipeline engine DeepSpeed names
    them `<pipeline layer index>.<rest>`, the tied embedding `tied_modules.embed.<rest>`: on the
    first stage it is the embedding; on the last stage a copy (its word embedding kept equal to
    the first stage's, its position embedding unused), left out when `owned`."""
    if not engine.pipeline:
        return named
    tied = f"tied_modules.{TIED_KEY}."
    module = engine.ds.module
    with_tied = any(n.startswith(tied) for n in module.state_dict(keep_vars=True))
    num_layers = module._num_layers - (3 if with_tied else 2)
    out = {}
    for name, param in named.items():
        if name.startswith(tied):
            if not (owned and state.get_pipeline_model_parallel_rank() > 0):
                out["embedding." + name[len(tied) :]] = param
        else:
            index, rest = name.split(".", 1)
            out[layer_name_prefix(int(index), num_layers) + rest] = param
    return out


def _collect(engine: Held, keep: Callable[[int], bool]) -> dict[str, dict]:
    """The entries (fp32 master, moments) of the parameters, then the persistent buffers, that
    `keep(i)` selects (i: position in this rank's order), on the CPU. Every rank gathers every
    parameter (ZeRO's gathers are collectives over DP, the experts' over EP), one at a time, and
    drops at once what it does not keep: the device holds one full parameter at a time, the CPU
    this rank's share."""
    source = masters(engine)
    source.prepare_get()
    entries = {}
    params = _named_parameters(engine, owned=True)
    for i, (name, param) in enumerate(params.items()):
        entry = {"partition": _partition(param), **source.get(param)}
        if split_over_ep(param):
            entry.update({k: all_experts(entry[k]) for k in TENSOR_KEYS if k in entry})
        if keep(i):
            entries[name] = {
                k: v.detach().to("cpu", torch.float32, copy=True) if torch.is_tensor(v) else v
                for k, v in entry.items()
            }
    for i, (name, buffer) in enumerate(_named_buffers(engine).items(), start=len(params)):
        if keep(i):
            entries[name] = {"partition": None, "param": buffer.detach().cpu(), "buffer": True}
    return entries


def save_full_state(
    engine: Held, step_dir: str, write: Callable[[dict, str], None], stamp: dict
) -> None:
    """`Engine.save_full_state` on the DeepSpeed backend (`write_full_state_shard`: collective
    over DP, each DP rank writing 1/DP of the entries); `stamp` (the step's position) goes into
    its `extra`."""
    write_full_state_shard(
        step_dir,
        lambda keep: _collect(engine, keep=keep),
        extra={
            "lr_scheduler": engine.scheduler.state_dict(),
            "precision": engine.precision,
            "fp32_masters": True,
            "loss_scaler": loss_scale_state(engine),
            **stamp,
        },
        write=write,
    )


def _set_module_weight(engine: Held, param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Put `value` into the module's (low-precision) parameter; ZeRO-3 holds only a partition of
    it, so it is gathered, set on every rank alike, and partitioned again."""
    if hasattr(param, "ds_id"):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            with torch.no_grad():
                param.copy_(value.to(param.dtype))
        return
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def load_full_state(
    engine: Held, step_dir: str, *, vocab_size: int, with_optimizer: bool, with_schedule: bool
) -> Carried:
    """Set this rank's weights (and optimizer state, LR schedule position unless not
    `with_schedule` (--finetune), fp16 loss scale) from `step_dir`'s full state; say what was
    set."""
    full = FullState(step_dir, vocab_size)
    tp_rank = state.get_tensor_model_parallel_rank()
    tp = state.get_tensor_model_parallel_world_size()
    named = _named_parameters(engine)
    if not named.keys() <= set(full.names()):
        raise UserError(
            f"{step_dir}: the saved parameters differ from this model's "
            f"({sorted(named.keys() - set(full.names()))[:4]})"
        )
    with_optimizer = with_optimizer and full.has_optimizer()
    target = masters(engine)
    if with_optimizer:
        target.prepare_set(max(full.step(n) for n in named))
    for name, param in named.items():
        local = full.local(
            name, tp_rank=tp_rank, tp_size=tp, padded_vocab_size=engine.padded_vocab_size
        )
        if split_over_ep(param):
            local = local_experts(local)
        _set_module_weight(engine, param, local["param"])
        target.set(param, local, with_optimizer)
    set_buffers(_named_buffers(engine), full)
    if with_schedule:
        engine.scheduler.load_state_dict(full.extra["lr_scheduler"])
    return Carried(
        fp32_masters=bool(full.extra.get("fp32_masters")),
        adam_state=with_optimizer,
        loss_scale=set_loss_scale_state(engine, full.extra.get("loss_scaler")),
        precision=full.extra.get("precision"),
    )
