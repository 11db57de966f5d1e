"""Every file of a step belongs to that step: its recorded position agrees with the metadata.

A file copied in from another step has the right name and often the right size, so "complete"
(pretrain.checkpoint.integrity) cannot see it, and it would load silently: weights or an LR
schedule of iteration 4 inside the step of iteration 2. So the files that carry a position say
which one: DeepSpeed's `mp_rank_*` files through our client state, and, since this version, every
`rng_state_<rank>.pt` and `full_state_*.pt` file (`position_stamp`: iteration and consumed
samples); `disagreement` compares such a record with the step's `pretrain_meta.json` and names
the file. Files written before the stamps (no such keys) have nothing to compare.
"""

from __future__ import annotations

import os

from pretrain.checkpoint.format import META_FILE

STAMP_KEYS = ("iteration", "consumed_train_samples")


def position_stamp(iteration: int, consumed_train_samples: int) -> dict[str, int]:
    """What a step's files record of their position (the metadata's values at save)."""
    return {"iteration": int(iteration), "consumed_train_samples": int(consumed_train_samples)}


def _position(record: dict) -> str:
    return f"iteration {record['iteration']} ({record['consumed_train_samples']} consumed samples)"


def disagreement(path: str, record: dict | None, meta: dict, step_dir: str) -> str | None:
    """One line when the position `record` (a file's stamp or client state) read from `path`
    differs from the metadata's; None when they agree or `record` holds no position."""
    if not isinstance(record, dict) or any(k not in record for k in STAMP_KEYS):
        return None
    if all(int(record[k]) == int(meta.get(k, -1)) for k in STAMP_KEYS):
        return None
    return (
        f"{path}: holds {_position(record)}, but {os.path.join(step_dir, META_FILE)} says "
        f"{_position(meta)}: the file comes from another step; put back this step's own file, "
        f"or resume from the step it came from"
    )


def layout_disagreement(path: str, tp_size: int, meta: dict, step_dir: str) -> str | None:
    """One line when a full-state file was written at another TP size than the step's."""
    saved = meta["parallel"]["tensor_model_parallel_size"]
    if tp_size == saved:
        return None
    return (
        f"{path}: written at --tensor-model-parallel-size {tp_size}, but "
        f"{os.path.join(step_dir, META_FILE)} says {saved}: the file comes from another "
        f"checkpoint; put back this step's own file"
    )
