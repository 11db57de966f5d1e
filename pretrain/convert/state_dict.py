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
    """The same architecture (same parameter names and split rules) at toy sizes: one layer, or
    with MoE two (a dense one, then an MoE one)."""
    gqa = config.query_groups != config.num_attention_heads
    shared = config.moe_shared_expert_intermediate_size
    return dataclasses.replace(
        config,
        num_layers=2 if config.is_moe else 1,
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
        moe_layer_freq=(0, 1) if config.is_moe else config.moe_layer_freq,
        moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None if shared is None else 8,
        moe_grouped_gemm=False,
    )


def _partition(param: torch.nn.Parameter, expert_tp: int) -> Partition | None:
    if hasattr(param, "expert_tensor_partition_dim"):  # an expert matrix: split over expert TP
        if expert_tp == 1:
            return None
        return Partition(param.expert_tensor_partition_dim, param.partition_stride)
    if getattr(param, "tensor_model_parallel", False):
        return Partition(param.partition_dim, param.partition_stride)
    return None


def parameter_partitions(config: ModelConfig, expert_tp: int = 1) -> dict[str, Partition | None]:
    """Every full-model state-dict name (parameters and persistent buffers such as the expert
    bias) -> its TP split (None: replicated on every TP rank). Expert matrices are split when the
    experts' tensor-parallel size `expert_tp` (1 or the TP size) is above 1."""
    twin = GPTModel(_structural_twin(config))
    params = dict(twin.named_parameters())
    per_template = {
        name: _partition(params[name], expert_tp) if name in params else None
        for name in twin.state_dict()
    }
    templates = ("layers.1.", "layers.0.") if config.is_moe else ("layers.0.",)
    out = {}
    for template, partition in per_template.items():
        if not template.startswith("layers."):
            out[template] = partition
            continue
        for i, moe in enumerate(config.moe_layers):
            prefix = templates[0] if moe else templates[-1]
            if template.startswith(prefix):
                out[f"layers.{i}." + template[len(prefix) :]] = partition
    return out


def expert_tp_of(shard: dict[str, torch.Tensor], config: ModelConfig) -> int:
    """The experts' tensor-parallel size one TP rank's state dict was saved at (1 when its
    experts are whole), read from the width of an expert fc2."""
    for name, tensor in shard.items():
        if name.endswith("mlp.experts.fc2.weight"):
            return config.moe_ffn_size // tensor.shape[-1]
    return 1


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
