"""MoE expert tensors of Megatron-LM's torch format -> our stacked `mlp.experts.fc{1,2}` [E, ...].

megatron-core saves one layer's experts in one of three layouts in the torch format, each per TP
rank and, at expert-parallel size EP > 1, per EP rank with local numbering 0..E/EP-1:
- SequentialMLP: `mlp.experts.local_experts.<e>.linear_fc{1,2}.weight` (and `.bias`);
- Transformer Engine's grouped GEMM (TEGroupedMLP): `mlp.experts.linear_fc{1,2}.weight<e>`;
- the legacy GroupedMLP (`--moe-use-legacy-grouped-gemm`): two tensors for all local experts,
  `mlp.experts.weight1` [h, n x X] and `mlp.experts.weight2` [n x Y, h], that its forward views
  as [n, h, X] and [n, Y, h] (a view of the flat memory, not column blocks), X = this expert-TP
  rank's fc1 width (2 x f / TP with GLU, its [gate_r; up_r] halves in that order), Y = f / TP.
  `split_grouped_mlp` rewrites them as TEGroupedMLP's names (each expert transposed to
  [X, h] / [h, Y], SequentialMLP's shapes on that rank), so all three read alike.
`expert_offset_name` moves a local index to the global one (EP rank r holds experts
[r x E/EP, (r+1) x E/EP)); `stack_experts` stacks `<name>#<e>` into `<name>` in expert order.
"""

from __future__ import annotations

import re

import torch

from pretrain.errors import UserError

_GROUPED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])$")


def split_grouped_mlp(
    chunk: dict[str, torch.Tensor], num_local: int, hidden: int, path: str
) -> dict[str, torch.Tensor]:
    """`chunk` with each GroupedMLP `weight1`/`weight2` replaced by its `num_local` experts under
    TEGroupedMLP's names (`linear_fc1.weight<e>` [X, h], `linear_fc2.weight<e>` [h, Y])."""
    if not num_local:  # a dense model: such names are reported as unknown
        return chunk
    out = {}
    for name, tensor in chunk.items():
        match = _GROUPED.match(name)
        if not match:
            out[name] = tensor
            continue
        prefix, which = match.groups()
        for e, weight in enumerate(_per_expert(tensor, which, num_local, hidden, path, name)):
            out[f"{prefix}linear_fc{which}.weight{e}"] = weight
    return out


def _per_expert(
    tensor: torch.Tensor, which: str, num_local: int, hidden: int, path: str, name: str
) -> list[torch.Tensor]:
    """GroupedMLP's view of one of its weights, each expert as [out, in]."""
    fc1 = which == "1"
    rows, cols = tensor.shape if tensor.dim() == 2 else (0, 0)
    fits = (rows == hidden and cols % num_local == 0) if fc1 else (
        cols == hidden and rows % num_local == 0
    )  # fmt: skip
    if not fits:
        expected = "[hidden, experts x ffn]" if fc1 else "[experts x ffn, hidden]"
        raise UserError(
            f"{path}: {name} has shape {list(tensor.shape)}, not GroupedMLP's {expected} with "
            f"hidden={hidden} and {num_local} local experts (args num_experts / "
            f"expert_model_parallel_size do not belong to these weights)"
        )
    shape = (num_local, hidden, -1) if fc1 else (num_local, -1, hidden)
    experts = tensor.contiguous().view(shape).transpose(-1, -2)
    return [expert.contiguous() for expert in experts]


def expert_offset_name(name: str, offset: int) -> str:
    """`<name>#<local e>` -> `<name>#<offset + e>`; other names unchanged."""
    base, sep, index = name.partition("#")
    return f"{base}#{int(index) + offset}" if sep and index else name


def stack_experts(shard: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert tensors `<name>#<e>` -> `<name>` stacked [E, ...] (expert order)."""
    out, experts = {}, {}
    for name, tensor in shard.items():
        base, _, index = name.partition("#")
        if index:
            experts.setdefault(base, {})[int(index)] = tensor
        else:
            out[name] = tensor
    for base, found in experts.items():
        if sorted(found) != list(range(num_experts)):
            raise UserError(
                f"{base}: the checkpoint holds experts {sorted(found)}, but args say "
                f"num_experts={num_experts}"
            )
        out[base] = torch.stack([found[e] for e in range(len(found))])
    return out
