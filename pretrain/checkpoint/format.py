"""File names, tags, `latest` and the metadata schema of a pretrain_gpt.py checkpoint.

Layout (details in docs/CHECKPOINTS.md):

    <save>/latest                                   "global_step<N>", written last (rename)
    <save>/latest_checkpointed_iteration.txt        "<N>" (Megatron's name, same commit point)
    <save>/global_step<N>/                          DeepSpeed's files for every rank
    <save>/global_step<N>/rng_state_<rank>.pt       python/numpy/torch/CUDA/TP-dropout RNG per rank
    <save>/global_step<N>/pretrain_meta.json        our metadata (`build_metadata`), with the
                                                    name, size and fingerprint of every file of
                                                    the step
    <save>/.global_step<N>.tmp-<id>/                a save in progress (renamed when complete)

Training (`pretrain.training.checkpoints.checkpointing`) writes it; the converters (`pretrain.convert`) read
and write it. Both use this module only, so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass

import torch

from pretrain.errors import UserError, check_json_types
from pretrain.model.config import ModelConfig, shape_mismatches
from pretrain.parallel.config import ParallelConfig

FORMAT_VERSION = 1
META_FILE = "pretrain_meta.json"
LATEST_FILE = "latest"
MEGATRON_LATEST_FILE = "latest_checkpointed_iteration.txt"
FILES_KEY = "files"
FINGERPRINTS_KEY = "fingerprints"  # pretrain.checkpoint.fingerprints
FULL_STATE_ONLY = "full_state_only"  # pretrain.checkpoint.relayout: a reshard_checkpoint output
_TAG = re.compile(r"^global_step(\d+)$")
_TEMPORARY = re.compile(r"^\.global_step\d+\.(tmp|old)-(.+)$")


def tag_for(iteration: int) -> str:
    """The folder name of the checkpoint at `iteration` (DeepSpeed's convention)."""
    return f"global_step{iteration}"


def iteration_of(tag: str) -> int | None:
    """N for "global_step<N>", else None."""
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def temporary_name(tag: str, kind: str, unique: str) -> str:
    """The hidden folder a save is written into (`kind` "tmp") or an old step is moved to before
    it is deleted ("old"): `.global_step<N>.<kind>-<unique>`, never matched by `available_tags`."""
    return f".{tag}.{kind}-{unique}"


def temporary_owner(name: str) -> str | None:
    """The `unique` part of a `temporary_name`, or None if `name` is not one."""
    match = _TEMPORARY.match(name)
    return match.group(2) if match else None


def available_tags(load_dir: str) -> list[str]:
    """The global_step<N> folders in `load_dir`, oldest first."""
    tags = [
        d
        for d in os.listdir(load_dir)
        if _TAG.match(d) and os.path.isdir(os.path.join(load_dir, d))
    ]
    return sorted(tags, key=lambda t: int(_TAG.match(t).group(1)))


def json_safe(value):
    """`value` with torch dtypes as strings ("float32"), tuples as lists: storable as JSON."""
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value


def parallel_record(parallel: ParallelConfig, pipeline_engine: bool) -> dict:
    """The layout a checkpoint was written at (its "parallel" entry)."""
    return {
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "world_size": parallel.world_size,
        "zero_stage": parallel.zero_stage,
        "pipeline_engine": pipeline_engine,
        "backend": parallel.backend,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
    }


def saved_backend(meta: dict) -> str:
    """The backend that wrote a checkpoint: "torch" or "deepspeed" (older checkpoints, which do
    not say, and converted ones are DeepSpeed's layout)."""
    return meta["parallel"].get("backend", "deepspeed")


@dataclass(frozen=True, kw_only=True)
class ResumeRecord:
    """What a resume decides by, read from a checkpoint's metadata in one call
    (`resume_record`): the layout and backend it was saved at, its precision, what it holds."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    expert_model_parallel_size: int
    """1 for checkpoints written before MoE."""
    backend: str
    """"torch" or "deepspeed" (`saved_backend`)."""
    precision: str | None
    """"bf16", "fp16" or "fp32"; None where the metadata does not say (converted checkpoints)."""
    full_state: bool
    """It holds the layout-independent state (False: saved with --no-save-full-state)."""
    full_state_only: bool
    """It holds only that state (`tools/reshard_checkpoint.py`'s output, no backend files)."""
    weights_only: bool
    """Converted: no optimizer state or data position (`--finetune` only)."""
    padded_vocab_size: int | None
    vocab_size: int
    make_vocab_size_divisible_by: int | None

    @property
    def sharding(self) -> str:
        """How the optimizer state was split: "FSDP2" or "ZeRO-<stage>"."""
        return "FSDP2" if self.backend == "torch" else f"ZeRO-{self.zero_stage}"


def resume_record(meta: dict) -> ResumeRecord:
    """The `ResumeRecord` of a checkpoint's metadata (`read_meta`'s)."""
    saved, precision = meta["parallel"], meta.get("precision")
    if isinstance(precision, dict):
        precision = (
            "bf16" if precision.get("bf16") else ("fp16" if precision.get("fp16") else "fp32")
        )
    else:
        precision = None
    return ResumeRecord(
        tensor_model_parallel_size=saved["tensor_model_parallel_size"],
        pipeline_model_parallel_size=saved["pipeline_model_parallel_size"],
        data_parallel_size=saved["data_parallel_size"],
        zero_stage=saved["zero_stage"],
        expert_model_parallel_size=saved.get("expert_model_parallel_size") or 1,
        backend=saved_backend(meta),
        precision=precision,
        full_state=bool(meta.get("full_state", True)),
        full_state_only=bool(meta.get(FULL_STATE_ONLY)),
        weights_only=bool(meta.get("weights_only")),
        padded_vocab_size=meta.get("padded_vocab_size"),
        vocab_size=meta["model"]["vocab_size"],
        make_vocab_size_divisible_by=meta["model"].get("make_vocab_size_divisible_by"),
    )


def build_metadata(
    *,
    iteration: int,
    consumed_train_samples: int,
    consumed_valid_samples: int,
    model: ModelConfig,
    parallel: ParallelConfig,
    pipeline_engine: bool,
    tokenizer: dict,
    **extra,
) -> dict:
    """The `pretrain_meta.json` of one checkpoint: the fields every reader relies on, plus
    `extra` (the data/training settings and argv of a training run; `weights_only` and
    `converted_from` of a converted checkpoint)."""
    return {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "model": json_safe(dataclasses.asdict(model)),
        "padded_vocab_size": model.padded_vocab_size(parallel.tensor_model_parallel_size),
        "parallel": parallel_record(parallel, pipeline_engine),
        "tokenizer": json_safe(tokenizer),
        **json_safe(extra),
    }


_MEGATRON_ITER = re.compile(r"^iter_\d{7}$")


def refuse_foreign_checkpoint(load_dir: str) -> None:
    """One line naming the converter when `load_dir` holds a Megatron-LM or Megatron-DeepSpeed
    checkpoint rather than ours (training would otherwise start from scratch over it)."""
    if not os.path.isdir(load_dir):
        return
    entries = os.listdir(load_dir)
    if any(_MEGATRON_ITER.match(e) for e in entries):
        raise UserError(
            f"--load {load_dir} holds a Megatron-LM checkpoint (iter_NNNNNNN folders); convert it "
            f"with tools/convert_from_megatron.py --load {load_dir} --save NEW_DIR, then train "
            f"with --load NEW_DIR --finetune"
        )
    ours = [
        t for t in available_tags(load_dir) if os.path.isfile(os.path.join(load_dir, t, META_FILE))
    ]
    theirs = [t for t in available_tags(load_dir) if t not in ours]
    if theirs and not ours:
        raise UserError(
            f"--load {load_dir} holds DeepSpeed checkpoints without {META_FILE} ({theirs[-1]}: "
            f"Megatron-DeepSpeed's format?); convert it to Megatron-LM's format with "
            f"Megatron-DeepSpeed's tools/convert_checkpoint/deepspeed_to_megatron.py, then with "
            f"tools/convert_from_megatron.py"
        )


class OutsideLoadDir(UserError):
    """`latest` names something other than a folder inside the checkpoint directory."""


def read_latest_tag(load_dir: str) -> str | None:
    """The tag `load_dir/latest` names, or None if there is no `latest` file.

    Refused (one line naming the file): undecodable or empty text, and anything but a plain
    folder name inside `load_dir` (`../x`, `/abs/path`, `a/b`): `--load` must never resume from
    a folder outside the one it was given.
    """
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            tag = f.read(4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: unreadable ({err}); the file is damaged") from None
    if not tag:
        raise UserError(f"{path}: empty; the file is damaged")
    if tag in (".", "..") or os.sep in tag or "/" in tag or "\0" in tag or "\n" in tag:
        raise OutsideLoadDir(
            f"{path}: names {tag!r}, which is not a checkpoint folder inside {load_dir}; refusing "
            f"to load from outside --load (write a global_step<N> name into {path})"
        )
    return tag


def read_meta(step_dir: str) -> dict:
    """The parsed `pretrain_meta.json` of one step; `UserError` naming the file if it is
    missing, unreadable, not JSON, or lacks the entries every reader relies on."""
    path = os.path.join(step_dir, META_FILE)
    if not os.path.isfile(path):
        raise UserError(
            f"{path} is missing (an incomplete save, or not a checkpoint written by pretrain_gpt.py)"
        )
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UserError(f"{path}: unreadable ({err}); the file is damaged") from None
    missing = [
        k for k in ("iteration", "model", "parallel") if not isinstance(meta, dict) or k not in meta
    ]
    if missing:
        raise UserError(f"{path}: no {', '.join(missing)} entry; the file is damaged")
    _check_types(meta, path)
    return meta


# the entries readers use -> the JSON types they must have (None: may be null)
_META_TYPES = {
    "format_version": (int,),
    "iteration": (int,),
    "consumed_train_samples": (int,),
    "consumed_valid_samples": (int,),
    "padded_vocab_size": (int,),
    "model": (dict,),
    "parallel": (dict,),
    "tokenizer": (dict,),
    FILES_KEY: (dict,),
    FINGERPRINTS_KEY: (dict,),
    "full_state": (bool,),
    "full_state_only": (bool,),
    "weights_only": (bool,),
    "skipped_train_samples": (list,),
    "data": (dict, None),
    "tokens_seen": (dict, None),
    "data_mixture": (dict, None),
    "data_fingerprints": (dict, None),
    "argv": (list, None),
}
_PARALLEL_TYPES = {  # null in a checkpoint of tools/reshard_checkpoint.py (no DP, no ZeRO)
    "tensor_model_parallel_size": (int,),
    "pipeline_model_parallel_size": (int,),
    "data_parallel_size": (int, None),
    "world_size": (int, None),
    "zero_stage": (int, None),
    "pipeline_engine": (bool,),
    "expert_model_parallel_size": (int, None),  # absent before MoE: 1
}


def _json_type(hint):
    """The JSON type a ModelConfig field type is stored as (a torch dtype as its name, a tuple
    such as an MoE layer pattern as a list)."""
    if hint is torch.dtype:
        return str
    if hint is type(None):
        return None
    return list if typing.get_origin(hint) in (tuple, list) else hint


def _model_types() -> dict[str, tuple]:
    """ModelConfig's fields -> their JSON types."""
    hints = typing.get_type_hints(ModelConfig)
    out = {}
    for field in dataclasses.fields(ModelConfig):
        args = typing.get_args(hints[field.name]) or (hints[field.name],)
        out[field.name] = tuple(_json_type(a) for a in args)
    return out


def _json_type(annotation) -> type | None:
    """The JSON type a field annotated `annotation` is stored as (a dtype by its name, a tuple
    such as `tuple[int, ...]` as a list; None for None)."""
    if annotation is torch.dtype:
        return str
    if annotation is type(None):
        return None
    origin = typing.get_origin(annotation)
    return list if origin in (tuple, list) else origin or annotation


def _check_types(meta: dict, path: str) -> None:
    """Refuse (one line naming the file, the entry and the type it needs) an entry of the wrong
    JSON type, where readers would otherwise fail with a TypeError later."""
    files = meta.get(FILES_KEY)
    sections = [("", meta, _META_TYPES), ("parallel.", meta["parallel"], _PARALLEL_TYPES)]
    sections.append(("model.", meta["model"], _model_types()))
    if isinstance(files, dict):
        sections.append((f"{FILES_KEY}.", files, dict.fromkeys(files, (int,))))
    fix = "the file is damaged (restore it, or resume from another step)"
    for prefix, values, types in sections:  # "parallel" and "model" are objects when reached
        check_json_types(values, types, path=path, fix=fix, prefix=prefix)


def model_config_from_meta(model: dict) -> ModelConfig:
    """The ModelConfig saved in `pretrain_meta.json` (its "model" entry)."""
    values = {f.name: model[f.name] for f in dataclasses.fields(ModelConfig) if f.name in model}
    if isinstance(values.get("params_dtype"), str):
        values["params_dtype"] = getattr(torch, values["params_dtype"])
    return ModelConfig(**values)


def check_same_model(meta: dict, ours: ModelConfig, path: str) -> None:
    """Refuse (one line) a checkpoint whose parameter shapes differ from the model `ours`."""
    problems = shape_mismatches(model_config_from_meta(meta["model"]), ours)
    if problems:
        raise UserError(
            f"--load {path}: the checkpoint has {problems[0]}; use the checkpoint's model flags"
        )
