"""Megatron-LM checkpoints of megatron-core GPT models -> one full, unpadded TP = 1 state dict.

What Megatron-LM's `--ckpt-format torch` writes (megatron/training/checkpointing.py):

    <load>/latest_checkpointed_iteration.txt               "<N>" or "release"
    <load>/iter_<N:07d>/ (or release/)
        PP = 1:  mp_rank_<tp:02d>/model_optim_rng.pt
        PP > 1:  mp_rank_<tp:02d>_<pp:03d>/model_optim_rng.pt
                 {"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": N,
                  "model": state dict (or "model0", "model1", ... per virtual pipeline chunk),
                  "optimizer", "opt_param_scheduler", "rng_state", ...}

`--ckpt-format torch_dist` (a torch.distributed.checkpoint folder: `.metadata`, `*.distcp`,
`common.pt`) is read by pretrain/convert/megatron_dist.py into the same megatron-core names as
full (TP = 1) tensors, then renamed here like the torch format's.

Each file is read with the safe loader (no pickled code runs; Megatron's enums in `args` become
inert stand-ins). Names are megatron-core's GPTModel names; a pipeline stage numbers its layers
from 0, so stage p (virtual chunk v) holds global layers from its offset on. Layer norms are
either modules of their own (`input_layernorm`, `pre_mlp_layernorm`: the local spec) or fused
into the following linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`:
Transformer Engine). The fused QKV (per query group: its query heads, then key, then value) and
SwiGLU's fc1 (per TP rank [gate_r; up_r]) have exactly our layouts, so TP shards merge with our
own partition rules. Optimizer state is not read (weights only).

MoE layers: `mlp.router.{weight,bias,expert_bias}` and `mlp.shared_experts.linear_fc{1,2}` are
renamed; each expert's `linear_fc1` / `linear_fc2` is stacked into our `mlp.experts.fc1` /
`fc2` [E, ...] from any of megatron-core's three layouts: SequentialMLP's
`mlp.experts.local_experts.<e>.linear_fc1.weight`, Transformer Engine's grouped GEMM
`mlp.experts.linear_fc1.weight<e>` (both in the torch format) and torch_dist's
`mlp.experts.experts.linear_fc1.weight` (both write that one key, the experts on a global axis).
GroupedMLP's `mlp.experts.weight1` / `weight2` (--moe-use-legacy-grouped-gemm) are split into
experts first (pretrain/convert/megatron_experts.py). Expert shards of TP ranks merge like ours
(expert TP 1: whole on every rank; = TP: split). At expert-parallel size EP > 1 the torch format
has one file per EP rank (pretrain/convert/megatron_files.py names them): EP rank r's local
expert e is global expert r x E/EP + e, and its dense weights, replicas of EP rank 0's, must equal
them (a mismatch is refused, naming the tensor and both files).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass

import torch

from pretrain.checkpoint import safe_load
from pretrain.convert import megatron_dist, megatron_experts, megatron_files
from pretrain.convert.megatron_args import model_config_from_args
from pretrain.convert.megatron_files import Layout
from pretrain.convert.state_dict import expert_tp_of, merge_tp, parameter_partitions, trim_vocab
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MIN_CHECKPOINT_VERSION = 2.0  # before 2.0, Megatron ordered the fused QKV rows differently
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(\d+)\.)?(?:experts\.)?linear_fc([12])\.(weight|bias)(\d*)$"
)
_LAYER_NAMES = {
    "mlp.router.": "mlp.router.",
    "mlp.shared_experts.linear_fc1.": "mlp.shared_experts.fc1.",
    "mlp.shared_experts.linear_fc2.": "mlp.shared_experts.fc2.",
    "input_layernorm.": "input_norm.",
    "self_attention.linear_qkv.layer_norm_": "input_norm.",
    "self_attention.linear_qkv.": "attention.qkv.",
    "self_attention.linear_proj.": "attention.proj.",
    "self_attention.q_layernorm.": "attention.q_norm.",
    "self_attention.k_layernorm.": "attention.k_norm.",
    "pre_mlp_layernorm.": "post_attention_norm.",
    "mlp.linear_fc1.layer_norm_": "post_attention_norm.",
    "mlp.linear_fc1.": "mlp.fc1.",
    "mlp.linear_fc2.": "mlp.fc2.",
}
_OTHER_NAMES = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "head.final_norm.weight",
    "decoder.final_layernorm.bias": "head.final_norm.bias",
    "output_layer.weight": "head.output_layer.weight",
}


@dataclass(frozen=True)
class MegatronCheckpoint:
    """A Megatron-LM checkpoint read into our terms."""

    path: str  # the iter_<N> (or release) directory
    iteration: int
    args: argparse.Namespace  # Megatron's saved args (its own enums as inert stand-ins)
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # full (TP = 1), our names, vocabulary padding removed
    layout: Layout  # the TP, PP and EP it was saved at
    checkpoint_format: str  # "torch" or "torch_dist"


def find_iteration_dir(load_dir: str, iteration: int | None = None) -> str:
    """The iter_<N> / release directory of a Megatron --save directory (or that directory)."""
    if not os.path.isdir(load_dir):
        raise UserError(f"--load {load_dir}: no such directory (point it at Megatron-LM's --save)")
    if iteration is not None:
        step = os.path.join(load_dir, f"iter_{iteration:07d}")
    elif os.path.basename(os.path.normpath(load_dir)).startswith(("iter_", "release")):
        return load_dir
    elif os.path.isfile(os.path.join(load_dir, TRACKER_FILE)):
        with open(os.path.join(load_dir, TRACKER_FILE)) as f:
            text = f.read().strip()
        if text != "release" and not text.isdigit():
            raise UserError(
                f"{os.path.join(load_dir, TRACKER_FILE)}: {text!r} is neither an iteration nor "
                f"'release' (the file is damaged; pick one with --iteration)"
            )
        step = os.path.join(load_dir, "release" if text == "release" else f"iter_{int(text):07d}")
    else:
        raise UserError(
            f"--load {load_dir}: no {TRACKER_FILE} and not an iter_<N> directory (point --load at "
            f"Megatron-LM's --save directory, or pass --iteration)"
        )
    if not os.path.isdir(step):
        found = sorted(d for d in os.listdir(load_dir) if d.startswith(("iter_", "release")))
        raise UserError(
            f"--load {load_dir}: there is no {os.path.basename(step)} (available: "
            f"{', '.join(found) or 'none'})"
        )
    return step


def _chunks(checkpoint: dict, path: str) -> list[dict]:
    """The model state dicts in one file: [model] or [model0, model1, ...] (virtual pipeline)."""
    if "model" in checkpoint:
        return [checkpoint["model"]]
    chunks = []
    while f"model{len(chunks)}" in checkpoint:
        chunks.append(checkpoint[f"model{len(chunks)}"])
    if not chunks:
        raise UserError(f"{path}: holds no 'model' entry (saved with --no-save-model weights?)")
    return chunks


def _rename(name: str, offset: int) -> str | None:
    """A megatron-core GPTModel name (local layer numbering) -> ours; None for non-weights."""
    if "._extra_state" in name:  # Transformer Engine's FP8 metadata, not a weight
        return None
    match = _LAYER.match(name)
    if match:
        layer, rest = int(match.group(1)) + offset, match.group(2)
        expert = _EXPERT.match(rest)
        if expert:  # one expert's (`#<e>`, stacked by stack_experts) or all of them
            local, fc, kind, grouped = expert.groups()
            index = local if local is not None else grouped
            return f"layers.{layer}.mlp.experts.fc{fc}.{kind}" + (f"#{index}" if index else "")
        for theirs, ours in _LAYER_NAMES.items():
            if rest.startswith(theirs):
                return f"layers.{layer}.{ours}{rest[len(theirs) :]}"
        return f"?{name}"  # unknown: reported with the others
    return _OTHER_NAMES.get(name, f"?{name}")


def _layers_per_chunk(config: ModelConfig, pp: int, chunks: int) -> int:
    if config.num_layers % (pp * chunks):
        raise UserError(
            f"{config.num_layers} layers do not split evenly over {pp} pipeline stages x {chunks} "
            f"virtual chunks (uneven splits are not supported)"
        )
    return config.num_layers // (pp * chunks)


def _tp_shards(files: dict, checkpoints: dict, config: ModelConfig, layout: Layout) -> list[dict]:
    """Per TP rank: the whole model (all stages, chunks and EP ranks) under our names, experts
    stacked [E, ...] in global order; `files` / `checkpoints` are keyed (tp, pp, ep) rank."""
    shards: list[dict] = [{} for _ in range(layout.tp)]
    unknown: set[str] = set()
    num_local = (config.num_moe_experts or 0) // layout.ep
    for (t, p, e), path in sorted(files.items()):  # EP rank 0 first: dense weights come from it
        chunks = _chunks(checkpoints[t, p, e], path)
        per_chunk = _layers_per_chunk(config, layout.pp, len(chunks))
        for v, chunk in enumerate(chunks):
            offset = (v * layout.pp + p) * per_chunk  # Megatron's interleaved virtual-stage order
            chunk = megatron_experts.split_grouped_mlp(chunk, num_local, config.hidden_size, path)
            for name, tensor in chunk.items():
                ours = _rename(name, offset)
                if ours is None:
                    continue
                if ours.startswith("?"):
                    unknown.add(ours[1:])
                    continue
                if ours == "head.output_layer.weight" and not (
                    config.untie_embeddings_and_output_weights
                ):
                    continue  # the last stage's copy of the tied embedding (PP > 1)
                ours = megatron_experts.expert_offset_name(ours, e * num_local)
                if e and ours in shards[t]:
                    _check_replica(shards[t][ours], tensor, ours, files[t, p, 0], path)
                    continue
                shards[t][ours] = tensor
    shards = [megatron_experts.stack_experts(s, config.num_moe_experts or 0) for s in shards]
    if unknown:
        raise UserError(
            f"{os.path.dirname(os.path.dirname(next(iter(files.values()))))}: tensors our model "
            f"does not have: {', '.join(sorted(unknown)[:6])}{' ...' if len(unknown) > 6 else ''} "
            f"(a megatron-core GPT with other modules cannot be converted)"
        )
    return shards


def _check_replica(
    kept: torch.Tensor, replica: torch.Tensor, name: str, kept_path: str, path: str
) -> None:
    """A dense weight saved by EP rank > 0 must equal EP rank 0's (both are DP replicas)."""
    if kept.shape != replica.shape or not torch.equal(kept, replica):
        raise UserError(
            f"{path}: {name} differs from its copy in {kept_path} (dense weights are replicas "
            f"across expert-parallel ranks; the checkpoint mixes files of different runs or "
            f"iterations: copy every rank's folder of one iteration)"
        )


def _merge(shards: list[dict], config: ModelConfig, step_dir: str) -> dict[str, torch.Tensor]:
    expert_tp = expert_tp_of(shards[0], config)
    if expert_tp not in (1, len(shards)):
        raise UserError(
            f"{step_dir}: experts split over expert tensor-parallel size {expert_tp} at TP "
            f"{len(shards)} cannot be merged from the torch format (only 1 or the TP size; save "
            f"with --ckpt-format torch_dist)"
        )
    partitions = parameter_partitions(config, expert_tp)
    missing = sorted(partitions.keys() - shards[0].keys())
    extra = sorted(shards[0].keys() - partitions.keys())
    if missing or extra:
        listed = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise UserError(
            f"{step_dir}: the weights "
            + (f"lack {listed}, which the model in args has" if missing else "")
            + (" and " if missing and extra else "")
            + (f"hold {', '.join(extra[:6])}, which it has not" if extra else "")
            + " (incomplete checkpoint, or args that do not belong to these weights, e.g. "
            "another --moe-layer-freq)"
        )
    return trim_vocab(merge_tp(shards, partitions), config.vocab_size)


def _load(path: str) -> dict:
    checkpoint = safe_load.load(path, megatron=True)
    if not isinstance(checkpoint, dict) or "args" not in checkpoint:
        raise UserError(f"{path}: not a Megatron-LM checkpoint (no 'args' entry)")
    _check_version(checkpoint, path)
    return checkpoint


def _check_version(checkpoint: dict, path: str) -> None:
    version = checkpoint.get("checkpoint_version", 0)
    if version < MIN_CHECKPOINT_VERSION:
        raise UserError(
            f"{path}: checkpoint_version {version} (< {MIN_CHECKPOINT_VERSION}, a different QKV "
            f"layout): load and re-save it with a current Megatron-LM first"
        )


def read_megatron_checkpoint(
    load_dir: str, iteration: int | None = None, vocab_size: int | None = None
) -> MegatronCheckpoint:
    """Read a Megatron-LM checkpoint (torch or torch_dist format) into our full state dict."""
    step_dir = find_iteration_dir(load_dir, iteration)
    if megatron_dist.is_torch_dist(step_dir):
        return _read_torch_dist(step_dir, vocab_size)
    first_path = megatron_files.first_rank_file(step_dir)
    first = _load(first_path)
    args = first["args"]
    config = model_config_from_args(args, first_path, vocab_size)
    layout = megatron_files.layout_from_args(args, first_path)
    files = megatron_files.rank_files(step_dir, layout)
    checkpoints = {k: (first if p == first_path else _load(p)) for k, p in files.items()}
    state_dict = _merge(_tp_shards(files, checkpoints, config, layout), config, step_dir)
    return MegatronCheckpoint(
        path=step_dir,
        iteration=int(first.get("iteration", 0)),
        args=args,
        config=config,
        state_dict=state_dict,
        layout=layout,
        checkpoint_format="torch",
    )


def _read_torch_dist(step_dir: str, vocab_size: int | None) -> MegatronCheckpoint:
    """A torch_dist folder: tensors are already global, so only names and the vocabulary change."""
    common = megatron_dist.read_common(step_dir)
    _check_version(common, os.path.join(step_dir, megatron_dist.COMMON_FILE))
    args = common["args"]
    config = model_config_from_args(args, os.path.join(step_dir, "common.pt"), vocab_size)
    tensors = megatron_dist.read_model_tensors(step_dir, config.num_layers)
    whole = {(0, 0, 0): {"model": tensors}}  # global tensors: one "rank" holds them all
    shards = _tp_shards({(0, 0, 0): step_dir + "/x"}, whole, config, Layout(1, 1, 1))
    return MegatronCheckpoint(
        path=step_dir,
        iteration=int(common.get("iteration", 0)),
        args=args,
        config=config,
        state_dict=_merge(shards, config, step_dir),
        layout=Layout(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            getattr(args, "expert_model_parallel_size", None) or 1,
        ),
        checkpoint_format="torch_dist",
    )


def with_vocab_size(ck: MegatronCheckpoint, vocab_size: int) -> MegatronCheckpoint:
    """`ck` with the padded vocabulary rows beyond the tokenizer's `vocab_size` dropped."""
    padded = ck.args.padded_vocab_size
    if vocab_size > padded:
        raise UserError(
            f"vocabulary size {vocab_size} is larger than the checkpoint's padded vocabulary "
            f"({padded}); give the tokenizer's size with --vocab-size"
        )
    config = dataclasses.replace(ck.config, vocab_size=vocab_size)
    return dataclasses.replace(ck, config=config, state_dict=trim_vocab(ck.state_dict, vocab_size))
