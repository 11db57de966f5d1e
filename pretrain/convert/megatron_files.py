"""Which files make up one iteration of a Megatron-LM `--ckpt-format torch` checkpoint.

Megatron-LM (megatron/training/checkpointing.py, `get_checkpoint_name`) writes one file per
model-parallel rank, `iter_<N:07d>/<folder>/model_optim_rng.pt`, the folder named

    mp_rank_<tp:02d>                  PP = 1, EP = 1
    mp_rank_<tp:02d>_<pp:03d>         PP > 1, EP = 1
    mp_rank_<tp:02d>_<ep:03d>         PP = 1, EP > 1   (the same shape as the line above)
    mp_rank_<tp:02d>_<pp:03d>_<ep:03d> PP > 1, EP > 1

so a two-number name means (tp, pp) or (tp, ep) depending on the saved `args`: rank 0's file is
found first (the four shapes with all ranks 0, as Megatron's own `find_checkpoint_rank_0`), its
`args` give TP/PP/EP, and every expected name is then checked. With EP > 1, the ranks whose
expert-data-parallel rank is 0 save, each with its EP rank's local experts (numbered from 0) and
a replica of every dense weight.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pretrain.errors import UserError

MODEL_FILE = "model_optim_rng.pt"
RANK_PREFIX = "mp_rank_"


@dataclass(frozen=True)
class Layout:
    """The model-parallel sizes a torch-format checkpoint was saved at."""

    tp: int
    pp: int
    ep: int  # expert-parallel size (1 without MoE or without expert parallelism)

    def folder(self, tp_rank: int, pp_rank: int, ep_rank: int) -> str:
        """The rank folder's name, as Megatron-LM's get_checkpoint_name makes it."""
        name = f"{RANK_PREFIX}{tp_rank:02d}"
        name += f"_{pp_rank:03d}" if self.pp > 1 else ""
        return name + (f"_{ep_rank:03d}" if self.ep > 1 else "")

    def ranks(self) -> list[tuple[int, int, int]]:
        """Every (tp rank, pp rank, ep rank) that saves a file, EP rank fastest."""
        return [(t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)]

    def describe(self) -> str:
        """`TP=.., PP=..` (and `, EP=..` when experts are split)."""
        return f"TP={self.tp}, PP={self.pp}" + (f", EP={self.ep}" if self.ep > 1 else "")


def first_rank_file(step_dir: str) -> str:
    """Rank 0's model_optim_rng.pt in whichever of the four folder shapes exists."""
    for folder in ("00", "00_000", "00_000_000"):
        path = os.path.join(step_dir, f"{RANK_PREFIX}{folder}", MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise UserError(
        f"{step_dir}: no {RANK_PREFIX}00[_000[_000]]/{MODEL_FILE} and no .metadata (not a "
        f"Megatron-LM checkpoint in the torch or torch_dist format)"
    )


def layout_from_args(args: argparse.Namespace, source: str) -> Layout:
    """TP/PP/EP from Megatron's saved args; expert TP other than TP is refused at EP > 1."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    if ep > 1 and etp != tp:
        raise UserError(
            f"{source}: expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size"
            f"={tp} at expert_model_parallel_size={ep}: Megatron-LM's torch format names files by "
            f"TP rank and saves only expert-data-parallel rank 0, so some expert shards are not "
            f"in it (save with --ckpt-format torch_dist, which holds every tensor whole)"
        )
    experts = getattr(args, "num_experts", None) or 0
    if ep > 1 and experts % ep:
        raise UserError(
            f"{source}: num_experts={experts} is not a multiple of expert_model_parallel_size="
            f"{ep} (these args do not describe a model Megatron-LM could have saved)"
        )
    return Layout(tp=tp, pp=pp, ep=ep)


def rank_files(step_dir: str, layout: Layout) -> dict[tuple[int, int, int], str]:
    """(tp rank, pp rank, ep rank) -> its model_optim_rng.pt; every file must exist and no other
    rank folder may be there (another layout's leftovers would be silently ignored)."""
    files = {key: os.path.join(step_dir, layout.folder(*key), MODEL_FILE) for key in layout.ranks()}
    missing = [layout.folder(*key) for key, path in files.items() if not os.path.isfile(path)]
    expected = {layout.folder(*key) for key in files}
    extra = sorted(
        name
        for name in os.listdir(step_dir)
        if name.startswith(RANK_PREFIX)
        and os.path.isdir(os.path.join(step_dir, name))
        and name not in expected
    )
    if missing or extra:
        raise UserError(
            f"{step_dir}: args say {layout.describe()}, but "
            + (f"{MODEL_FILE} is missing in {', '.join(missing)}" if missing else "")
            + (" and " if missing and extra else "")
            + (f"there are extra rank folders {', '.join(extra)}" if extra else "")
            + " (copy every rank's folder of this iteration)"
        )
    return files
