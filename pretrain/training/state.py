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
    """Training sample ranges [start, end) consumed without a step (--iterations-to-skip)."""

    @classmethod
    def from_checkpoint(cls, client_state: dict) -> TrainState:
        """The state saved by `dataclasses.asdict` (checkpoints older than a field get its default)."""
        counters = {f.name: int(client_state[f.name]) for f in fields(cls) if f.type == "int"}
        ranges = client_state.get("skipped_train_samples", [])
        return cls(**counters, skipped_train_samples=[(int(a), int(b)) for a, b in ranges])
