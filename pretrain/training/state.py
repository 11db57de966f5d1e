"""`TrainState`: where a run is (what a checkpoint must carry to resume the data exactly)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Mutable progress of one run, saved in every checkpoint."""

    iteration: int = 0
    """Optimizer steps taken."""
    consumed_train_samples: int = 0
    """Training samples read (the train sampler's position)."""
    consumed_valid_samples: int = 0
    """Validation samples read (the validation sampler's position)."""
