"""`TrainState`: where a run is (what a checkpoint must carry to resume the data exactly)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class TrainState:
    """Mutable progress of one run, saved in every checkpoint."""

    iteration: int = 0
    """Optimizer steps taken."""
    consumed_train_samples: int = 0
    """Training samples read (the train sampler's position)."""
    consumed_valid_samples: int = 0
    """Validation samples read (the validation sampler's position)."""
    skipped_train_samples: list[tuple[int, int]] = field(default_factory=list)
    """Training sample ranges [start, end) consumed without a step (--iterations-to-skip,
    --spiky-loss-policy)."""
    spike_loss_window: list[float] = field(default_factory=list)
    """The trailing losses --check-for-spiky-loss compares each new loss with."""
    spike_pending_skips: list[tuple[int, int]] = field(default_factory=list)
    """Training sample ranges [start, end) a spike rewind will skip when it reaches them."""
    data_mixture: dict = field(default_factory=dict)
    """The train split's phases and, per source (prefix), the samples of its own order read
    (`pretrain.data.blends.mixture`: the record); empty with --dataloader-type cyclic or mock data."""

    @classmethod
    def from_checkpoint(cls, client_state: dict) -> TrainState:
        """The state saved by `dataclasses.asdict` (checkpoints older than a field get its default)."""
        counters = {f.name: int(client_state[f.name]) for f in fields(cls) if f.type == "int"}
        return cls(
            **counters,
            skipped_train_samples=_ranges(client_state, "skipped_train_samples"),
            spike_loss_window=[float(x) for x in client_state.get("spike_loss_window", [])],
            spike_pending_skips=_ranges(client_state, "spike_pending_skips"),
            data_mixture=dict(client_state.get("data_mixture") or {}),
        )


def _ranges(client_state: dict, key: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in client_state.get(key, [])]
