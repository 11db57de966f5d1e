"""The checks of the launch-script flags that are accepted only with the value that describes this
project: a parallelism it lacks at size 1, the checkpoint formats it writes, the recompute module
it has (the virtual pipeline flags: `pretrain.training.backends.torch.pipeline_flags`). Anything else is one UserError naming the flag,
the value and what exists instead (docs/COMPATIBILITY.md, "Flags of the launch scripts").
"""

from __future__ import annotations

import argparse

from pretrain.errors import UserError

# flag -> (namespace dest, what exists instead)
_SIZE_ONE = {
    "--context-parallel-size": (
        "context_parallel_size",
        "there is no context parallelism; the parallelisms are --tensor-model-parallel-size, "
        "--pipeline-model-parallel-size and data parallelism (+ --sequence-parallel with TP)",
    ),
    "--ds-sequence-parallel-size": (
        "ds_sequence_parallel_size",
        "there is no DeepSpeed-Ulysses sequence parallelism; use --tensor-model-parallel-size "
        "with --sequence-parallel",
    ),
}

CKPT_FORMATS = ("torch", "torch_dist")
"""The `--ckpt-format`s that describe what is written here: DeepSpeed's per-rank `torch.save`
files, or (--use-torch-fsdp2) torch.distributed.checkpoint folders."""


def check_script_flags(ns: argparse.Namespace) -> None:
    """Refuse, in one line, a launch-script flag set to a value this project cannot honour."""
    for flag, (dest, instead) in _SIZE_ONE.items():
        size = getattr(ns, dest)
        if size is not None and size != 1:
            raise UserError(f"{flag} {size}: only 1 is accepted ({instead})")
    if ns.ckpt_format not in (None, *CKPT_FORMATS):
        raise UserError(
            f"--ckpt-format {ns.ckpt_format}: checkpoints here are DeepSpeed's per-rank torch files "
            f"(--ckpt-format torch) or, with --use-torch-fsdp2, DCP folders (torch_dist), which "
            f"resume at any layout from their full state; use one of them or drop the flag "
            f"(tools/convert_to_hf.py exports)"
        )
    modules = ns.recompute_modules or []
    if set(modules) - {"core_attn"}:
        raise UserError(
            f"--recompute-modules {' '.join(modules)}: only core_attn is implemented (selective "
            f"recompute of the attention core; use --recompute-granularity full for whole layers)"
        )


def check_position_embedding(ns: argparse.Namespace, position_embedding_type: str) -> None:
    """--no-position-embedding describes a RoPE model; a model with no position information at
    all is not implemented."""
    if ns.no_position_embedding and position_embedding_type != "rope":
        raise UserError(
            f"--no-position-embedding with --position-embedding-type {position_embedding_type}: "
            f"a model without position information is not implemented (add "
            f"--position-embedding-type rope, or drop the flag)"
        )
