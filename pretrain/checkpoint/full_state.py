"""The layout-independent training state: full tensors by GPTModel name, with their Adam state.

A checkpoint written at one (TP, PP, DP, ZeRO) layout can resume at another only through a form
that does not depend on the layout. This module is that form, and only the form (no training or
DeepSpeed imports); `pretrain/training/` fills it from a live engine and sets an engine from it.

On disk, beside DeepSpeed's files of a tag:

    <save>/global_step<N>/full_state_tp<t:02d>_pp<p:02d>.pt          DP rank 0 of (TP t, stage p)
    <save>/global_step<N>/full_state_tp<t:02d>_pp<p:02d>_dp<d:03d>.pt   DP rank d > 0

(flat in the step folder, so that the step's file list in its metadata covers them).

The files of one (TP rank t, PP stage p) together hold the parameters that stage owns, *TP-local*
but complete over data parallelism (ZeRO partitions already gathered), in fp32; its DP ranks
share them (each writes every DP-th parameter), so the writes run in parallel. Readers merge
every file of a TP rank by parameter name, whatever the split:

    {"format_version": 1, "tensor_parallel_size": T, "tensor_parallel_rank": t,
     "pipeline_stage": p, "data_parallel_rank": d,
     "extra": {plain values: "lr_scheduler" (the LR schedule position), "precision" ("fp32",
               "bf16", "fp16"), "fp32_masters" (true: "param" is the fp32 master in every
               precision), "loss_scaler" (fp16's loss scale and counters, else None), the step's
               iteration and consumed samples (pretrain.checkpoint.agreement.position_stamp)},
     "entries": {name: {"partition": [dim, stride] | None,   # None: replicated over TP
                        "param": fp32 master weight, "exp_avg": ..., "exp_avg_sq": ...,
                        "step": int,                         # moments/step absent: no optimizer
                        "buffer": true}}}                    # only for a persistent buffer

Persistent buffers (the MoE routers' `router.expert_bias`) are entries with `"buffer": true` and a
"param" only (no optimizer state). Experts are complete over expert parallelism (the engine
gathers them over EP): a file holds every expert of its TP rank, so EP is chosen at launch like
DP.

`read_full_state` merges the TP shards into full tensors and drops the padded vocabulary rows
(they depend on TP: Megatron pads to a multiple of divisible_by * TP; they are zero and never in
the softmax, so dropping and re-adding zero rows changes nothing). `local_shard` cuts the tensors
of one TP rank at the target layout, re-padding the vocabulary. Files are read with
`safe_load` (memory-mapped): loading one runs no pickled code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pretrain.atomic import atomic_write
from pretrain.checkpoint import safe_load
from pretrain.errors import UserError
from pretrain.parallel.sharding import merge_shards, shard_tensor

FULL_STATE_VERSION = 1
FULL_STATE_PREFIX = "full_state_"
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "head.output_layer.weight")
TENSOR_KEYS = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True)
class FullEntry:
    """One parameter at TP = 1 without vocabulary padding, with its Adam state."""

    partition: tuple[int, int] | None
    """(dim, stride) of its TP split; None when every TP rank holds all of it."""
    param: torch.Tensor
    """The fp32 master weight."""
    exp_avg: torch.Tensor | None = None
    """Adam's first moment (None: saved without optimizer state)."""
    exp_avg_sq: torch.Tensor | None = None
    """Adam's second moment."""
    step: int | None = None
    """Adam's step count for this parameter (bias correction)."""
    buffer: bool = False
    """A persistent buffer (no optimizer state), not a parameter."""


def shard_file(step_dir: str, tp_rank: int, pp_stage: int, dp_rank: int = 0) -> str:
    """The path of the file written by data-parallel rank `dp_rank` of model-parallel rank
    (tp_rank, pp_stage)."""
    part = f"_dp{dp_rank:03d}" if dp_rank else ""
    return os.path.join(step_dir, f"{FULL_STATE_PREFIX}tp{tp_rank:02d}_pp{pp_stage:02d}{part}.pt")


def has_full_state(step_dir: str) -> bool:
    """True when the tag folder holds a layout-independent state."""
    return bool(_shard_names(step_dir))


def _shard_names(step_dir: str) -> list[str]:
    if not os.path.isdir(step_dir):
        return []
    return sorted(
        n for n in os.listdir(step_dir) if n.startswith(FULL_STATE_PREFIX) and n.endswith(".pt")
    )


def write_shard(
    step_dir: str,
    *,
    tp_rank: int,
    tp_size: int,
    pp_stage: int,
    entries: dict[str, dict],
    dp_rank: int = 0,
    extra: dict | None = None,
    write: Callable[[dict, str], None] | None = None,
) -> str:
    """Write one model-parallel rank's entries (see the module docstring); `extra` holds plain
    values (numbers, strings) that are the same on every rank (the LR schedule). `write(payload,
    path)` does the writing (training: its fsynced, fail-softly writer inside the step's
    temporary folder); by default an atomic torch.save."""
    path = shard_file(step_dir, tp_rank, pp_stage, dp_rank)
    payload = {
        "format_version": FULL_STATE_VERSION,
        "tensor_parallel_size": tp_size,
        "tensor_parallel_rank": tp_rank,
        "pipeline_stage": pp_stage,
        "data_parallel_rank": dp_rank,
        "entries": {name: _storable(entry) for name, entry in entries.items()},
        "extra": extra or {},
    }
    if write is None:
        atomic_write(path, lambda f: torch.save(payload, f))
    else:
        write(payload, path)
    return path


def _storable(entry: dict) -> dict:
    out = {"partition": list(entry["partition"]) if entry.get("partition") else None}
    for key in TENSOR_KEYS:
        if entry.get(key) is not None:
            out[key] = _standalone(entry[key].detach().to("cpu", torch.float32).contiguous())
    if entry.get("step") is not None:
        out["step"] = int(entry["step"])
    if entry.get("buffer"):
        out["buffer"] = True
    return out


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied only if it is a view of a larger storage (torch.save would write all of
    that storage)."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def _load_shard(path: str) -> dict:
    """One file, memory-mapped: its tensors are read from disk only when used, so a rank that
    needs a few parameters of a large state reads only their bytes."""
    payload = safe_load.load(path, mmap=True)  # allowlisted: a pickled global is refused by name
    if not isinstance(payload, dict) or payload.get("format_version") != FULL_STATE_VERSION:
        version = payload.get("format_version") if isinstance(payload, dict) else None
        raise UserError(
            f"{path}: full-state format_version {version}, this version reads {FULL_STATE_VERSION}"
        )
    return payload


def shard_payloads(step_dir: str) -> list[tuple[str, dict]]:
    """(path, payload) of every full-state file of the step, memory-mapped (the tensors are
    not read until used)."""
    paths = [os.path.join(step_dir, n) for n in _shard_names(step_dir)]
    return [(path, _load_shard(path)) for path in paths]


def _shards_by_tp_rank(step_dir: str) -> tuple[list[dict[str, dict]], dict]:
    """(each TP rank's entries, merged over its files; the `extra` values)."""
    payloads = [payload for _, payload in shard_payloads(step_dir)]
    if not payloads:
        raise UserError(
            f"{step_dir}: no {FULL_STATE_PREFIX}*.pt files: it was saved with "
            f"--no-save-full-state, by a converter or by an older version, and can be resumed "
            f"only at its own layout; resume it there and save once (the new step has them), or "
            f"go through tools/convert_to_hf.py and tools/convert_from_hf.py "
            f"--target-tensor-parallel-size (weights only)"
        )
    tp = payloads[0]["tensor_parallel_size"]
    per_rank: list[dict[str, dict]] = [{} for _ in range(tp)]
    for payload in payloads:
        per_rank[payload["tensor_parallel_rank"]].update(payload["entries"])
    names_of = [set(r) for r in per_rank]
    if any(n != names_of[0] for n in names_of) or not names_of[0]:
        counts = ", ".join(f"TP rank {t}: {len(n)}" for t, n in enumerate(names_of))
        raise UserError(
            f"{step_dir}: the TP ranks hold different parameters ({counts}); the checkpoint is "
            f"incomplete (copy every rank's full_state file)"
        )
    return per_rank, payloads[0].get("extra", {})  # the same in every file


class FullState:
    """The full state of one step folder, opened lazily.

    The files are memory-mapped and a parameter's TP shards are merged only when it is asked
    for, so each rank of a resume reads and builds only the parameters it owns. When the saved
    TP size equals the reader's, `local` hands out the saved shard itself: no merge, no copy.
    """

    def __init__(self, step_dir: str, vocab_size: int):
        self.step_dir, self.vocab_size = step_dir, vocab_size
        # extra: the plain values saved with the state (the LR schedule position)
        self._per_rank, self.extra = _shards_by_tp_rank(step_dir)

    @property
    def tensor_parallel_size(self) -> int:
        """The TP size the state was saved at."""
        return len(self._per_rank)

    def names(self) -> list[str]:
        """Every parameter's and persistent buffer's GPTModel name."""
        return list(self._per_rank[0])

    def is_buffer(self, name: str) -> bool:
        """True for a persistent buffer (no optimizer state)."""
        return bool(self._per_rank[0][name].get("buffer"))

    def has_optimizer(self) -> bool:
        """True when every parameter carries Adam moments and a step count."""
        entries = self._per_rank[0].values()
        return all("step" in e and "exp_avg" in e for e in entries if not e.get("buffer"))

    def entry(self, name: str) -> FullEntry:
        """`name` at TP = 1 without vocabulary padding."""
        first = self._per_rank[0][name]
        partition = tuple(first["partition"]) if first["partition"] else None
        tensors = {}
        for key in TENSOR_KEYS:
            if key not in first:
                continue
            if partition is None:
                tensor = first[key]
            else:
                tensor = merge_shards([r[name][key] for r in self._per_rank], *partition)
            tensors[key] = tensor[: self.vocab_size] if name in VOCAB_PARAMS else tensor
        return FullEntry(
            partition=partition, step=first.get("step"), buffer=self.is_buffer(name), **tensors
        )

    def local(
        self, name: str, *, tp_rank: int, tp_size: int, padded_vocab_size: int
    ) -> dict[str, torch.Tensor]:
        """The tensors (param and moments present) of `name` on `tp_rank` of a TP = `tp_size`
        run (see `local_shard`)."""
        if tp_size == self.tensor_parallel_size:
            saved = self._per_rank[tp_rank][name]
            split_rows = saved["partition"] is not None and saved["partition"][0] == 0
            rows = saved["param"].shape[0] * (tp_size if split_rows else 1)
            if name not in VOCAB_PARAMS or rows == padded_vocab_size:
                return {k: saved[k] for k in TENSOR_KEYS if k in saved}
        return local_shard(
            self.entry(name),
            name,
            tp_rank=tp_rank,
            tp_size=tp_size,
            padded_vocab_size=padded_vocab_size,
        )

    def partition(self, name: str) -> tuple[int, int] | None:
        """(dim, stride) of `name`'s TP split; None when replicated over TP."""
        saved = self._per_rank[0][name]["partition"]
        return tuple(saved) if saved else None

    def step(self, name: str) -> int | None:
        """Adam's step count of `name` (None: saved without optimizer state)."""
        return self._per_rank[0][name].get("step")


def read_full_state(step_dir: str, vocab_size: int) -> dict[str, FullEntry]:
    """Every parameter of the checkpoint in `step_dir` at TP = 1, vocabulary padding dropped."""
    state = FullState(step_dir, vocab_size)
    return {name: state.entry(name) for name in state.names()}


def local_shard(
    entry: FullEntry, name: str, *, tp_rank: int, tp_size: int, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The tensors (param and moments present) of `name` on `tp_rank` of a TP = `tp_size` run."""
    out = {}
    for key in TENSOR_KEYS:
        tensor = getattr(entry, key)
        if tensor is None:
            continue
        if name in VOCAB_PARAMS and tensor.shape[0] < padded_vocab_size:
            pad = tensor.new_zeros((padded_vocab_size - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        if entry.partition is not None:
            tensor = shard_tensor(tensor, entry.partition[0], tp_rank, tp_size, entry.partition[1])
        out[key] = tensor.contiguous()
    return out
