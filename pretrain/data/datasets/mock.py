"""`--mock-data`: Megatron's synthetic data, no files (docs/TRAINING.md, "Mock data").

megatron-core's `MockGPTLowLevelDataset` is 100,000 sequences whose lengths are drawn once from
`numpy.random.default_rng(0).integers(1, 4096, 100000, dtype=int32)`; sequence i of length L is
the ids 1, 2, ..., L-1 (mod the vocabulary size) followed by the tokenizer's EOD. `MockGPTDataset`
is its ordinary GPTDataset over those sequences, split "1,1,1" (a third per split, whatever
--split says) and shuffled with --seed, so the samples equal megatron-core's for the same seed,
sequence length and tokenizer. Index caches are written only with --data-cache-path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from pretrain.data.config import DataConfig, Split
from pretrain.data.datasets.gpt_dataset import GPTDataset, split_ranges

log = logging.getLogger(__name__)


class MockSequences:
    """The low-level mock corpus: `sequence_lengths` and `get(i, offset, length)` like an
    IndexedDataset, computed on demand (no file, no token array)."""

    seed = 0
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size = vocab_size
        self.eod = eod
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    @property
    def fingerprint(self) -> str:
        """What the index caches are bound to (an IndexedDataset hashes its .idx): the corpus is
        a function of these numbers only."""
        return (
            f"mock:{self.seed}:{self.size}:{self.max_sequence_length}:{self.vocab_size}:{self.eod}"
        )

    idx_modified = 0.0
    """No file: nothing can change under a cache built from it."""

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (int64), clipped to the sequence."""
        total = int(self.sequence_lengths[idx])
        end = total if length is None else min(total, offset + length)
        positions = np.arange(offset, max(offset, end), dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == total - 1] = self.eod
        return tokens

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)


class MockGPTDataset(GPTDataset):
    """A GPTDataset over `MockSequences` (its class name is part of the cache identity, as in
    Megatron)."""


def build_mock_datasets(
    cfg: DataConfig,
    tokenizer,
    num_samples: Sequence[int | None],
    progress: Callable[[str], None] | None = None,
) -> list[MockGPTDataset | None]:
    """[train, valid, test] mock datasets: a third of the mock sequences each."""
    sequences = MockSequences(tokenizer.vocab_size, tokenizer.eod)
    matrix = cfg.split_matrix
    out = []
    for split, indices in zip(Split, split_ranges(len(sequences), matrix), strict=True):
        if indices is None:
            out.append(None)
            continue
        out.append(
            MockGPTDataset(sequences, None, indices, num_samples[split], split.name, cfg, tokenizer)
        )
        if progress is not None:
            progress(f"{split.name} mock")
    log.info("mock data: %d synthetic sequences, split %s", len(sequences), cfg.split)
    return out
