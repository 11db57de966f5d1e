"""The full model state dict: how it splits over TP ranks and PP stages, and its vocabulary padding.

A *full* state dict has GPTModel's names (`embedding.*`, `layers.<i>.*`, `head.*`) and TP = 1
shapes. Converters keep it *unpadded*: the word embedding and the untied output layer have exactly
`config.vocab_size` rows. Training pads them to `padded_vocab_size(tp)` (Megatron's rule), so:
- reading a checkpoint drops the padding rows (`trim_vocab`),
- writing one adds them back (`pad_vocab`) as zeros, as training initialises them. Padding rows
  never enter our softmax (their logits are -inf), so the padded size changes nothing.

Which dimension a parameter is split along over TP is read from the model itself: every sharded
parameter carries `partition_dim` and `partition_stride` (pretrain/parallel/sharding.py). A
one-layer copy of the architecture with tiny sizes tells them for every name, without building
(and initialising) the real model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel
from pretrain.parallel.sharding import merge_shards, shard_tensor

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "head.output_layer.weight")


@dataclass(frozen=True)
class Partition:
    dim: int
    stride: int


def _structural_twin(config: ModelConfig) -> ModelConfig:
    """The same architecture (same parameter names and split rules) at toy sizes: one layer,
    or every layer of an MoE model (its layers differ: `moe_layer_freq`)."""
    gqa = config.query_groups != config.num_attention_heads
    return dataclasses.replace(
        config,
        num_layers=config.num_layers if config.is_moe else 1,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1 if gqa else None,
        kv_channels=None,
        ffn_hidden_size=8,
        vocab_size=8,
        seq_length=4,
        max_position_embeddings=4,
        make_vocab_size_divisible_by=8,
        params_dtype=torch.float32,
    )


def parameter_partitions(config: ModelConfig) -> dict[str, Partition | None]:
    """Every full-model parameter (and persistent buffer: an MoE router's expert bias) name ->
    its TP split (None: replicated on every TP rank)."""
    twin = GPTModel(_structural_twin(config))
    per_template = {
        name: (
            Partition(p.partition_dim, p.partition_stride)
            if getattr(p, "tensor_model_parallel", False)
            else None
        )
        for name, p in twin.state_dict(keep_vars=True).items()
    }
    if config.is_moe:  # the twin has every layer
        return per_template
    out = {}
    for template, partition in per_template.items():
        if template.startswith("layers.0."):
            for i in range(config.num_layers):
                out[f"layers.{i}." + template[len("layers.0.") :]] = partition
        else:
            out[template] = partition
    return out


def trim_vocab(state_dict: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Drop the padded vocabulary rows (embedding and untied head)."""
    return {k: (v[:vocab_size] if k in VOCAB_PARAMS else v) for k, v in state_dict.items()}


def pad_vocab(state_dict: dict[str, torch.Tensor], padded_size: int) -> dict[str, torch.Tensor]:
    """Append zero rows to the vocabulary tensors up to `padded_size`."""
    out = {}
    for name, tensor in state_dict.items():
        if name in VOCAB_PARAMS and tensor.shape[0] < padded_size:
            pad = tensor.new_zeros((padded_size - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        out[name] = tensor
    return out


def merge_tp(
    shards: list[dict[str, torch.Tensor]], partitions: dict[str, Partition | None]
) -> dict:
    """Per-TP-rank state dicts (rank order) -> one full state dict."""
    out = {}
    for name in shards[0]:
        part = partitions.get(name)
        if part is None:
            out[name] = shards[0][name]
        else:
            out[name] = merge_shards([s[name] for s in shards], part.dim, part.stride)
    return out


def split_tp(
    full: dict[str, torch.Tensor], partitions: dict[str, Partition | None], tp: int
) -> list[dict]:
    """One full state dict -> per-TP-rank state dicts (contiguous copies, ready to save)."""
    out = []
    for rank in range(tp):
        shard = {}
        for name, tensor in full.items():
            part = partitions.get(name)
            local = (
                tensor if part is None else shard_tensor(tensor, part.dim, rank, tp, part.stride)
            )
            shard[name] = local.clone().contiguous()
        out.append(shard)
    return out
