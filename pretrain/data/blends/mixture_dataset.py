"""A changing mixture's train split as a dataset, and the per-source counters a run records.

`build_mixture` turns a `MixturePlan` (pretrain/data/blends/mixture.py) into a `MixtureDataset`: each
source's own order (its GPTDataset, or a `SourceOrder` of several) and the phases' blend arrays
over them, read through the same batch code as Megatron's BlendedDataset. `MixtureCounter` says,
at any position of the train order, how many samples of each source's own order have been read,
and gives the record a checkpoint carries (`TrainState.data_mixture`); it works on Megatron's
own train datasets too (GPTDataset, BlendedDataset), so every run records its sources.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from pretrain.data.blends.blended_dataset import blend_items
from pretrain.data.blends.mixture import MixturePlan, Source, blend_arrays, order_identity
from pretrain.data.config import DataConfig
from pretrain.data.datasets.gpt_dataset import GPTDataset, split_ranges
from pretrain.data.files.fingerprint import PrefixFiles

log = logging.getLogger(__name__)


class SourceOrder(torch.utils.data.Dataset):
    """A source's own order made of several GPTDatasets (segments), read one after the other."""

    def __init__(self, segments: list[GPTDataset]):
        self.segments = segments
        first = segments[0]
        self.dataset_path, self.indexed = first.dataset_path, first.indexed
        self.cfg, self.extra_token = first.cfg, first.extra_token
        self.starts = np.cumsum([0] + [len(s) for s in segments])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, k: int) -> tuple[GPTDataset, int]:
        """(the segment holding sample `k` of the order, the sample's index in it)."""
        seg = int(np.searchsorted(self.starts, k, side="right")) - 1
        return self.segments[seg], k - int(self.starts[seg])

    def sample_tokens(self, k: int, out: np.ndarray | None = None) -> np.ndarray:
        """The S + x token ids of sample `k` of the order."""
        gpt, local = self.locate(k)
        return gpt.sample_tokens(local, out=out)

    def tensors(self, text: np.ndarray) -> dict[str, torch.Tensor]:
        """[b, S + x] ids -> the batch, as every GPTDataset of the run makes it."""
        return self.segments[0].tensors(text)


class UnbuiltSource:
    """A recorded source this run no longer draws from: its name, no data (its files may be gone)."""

    def __init__(self, prefix: str):
        self.dataset_path = prefix

    def __len__(self) -> int:
        return 0

    def sample_tokens(self, k: int, out=None):
        raise IndexError(f"{self.dataset_path} is not drawn from this part of the train order")


class MixtureDataset(torch.utils.data.Dataset):
    """The train order of a mixture plan: sample k is sample `dataset_sample_index[k]` of the
    own order of source `dataset_index[k]` (batches carry `dataset_id`, as a blend's)."""

    def __init__(self, datasets: list, dataset_index, dataset_sample_index, plan: MixturePlan):
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index
        self.plan = plan
        self.split = "train"
        # the source that makes the batches' tensors (None: nothing is left to draw)
        self._first = next((d for d in datasets if not isinstance(d, UnbuiltSource)), None)

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def samples_drawn(self) -> np.ndarray:
        """How many samples the train order takes from each source."""
        return np.bincount(self.dataset_index, minlength=len(self.datasets))

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """A whole micro-batch."""
        return blend_items(self, self._first, indices)

    def __getitem__(self, idx: int) -> dict:
        return {k: v[0] for k, v in self.__getitems__([idx]).items()}


def _segment(cfg: DataConfig, tokenizer, files: PrefixFiles, prefix: str, n, k: int):
    """Segment `k` of `prefix`'s own order: its train split's GPTDataset of `n` samples, seeded
    --seed + k (segment 0 is the dataset Megatron's builder makes)."""
    indexed = files.indexed(prefix)
    indices = split_ranges(len(indexed), [cfg.train_range, None, None])[0]
    seeded = cfg if k == 0 else replace(cfg, seed=cfg.seed + k)
    return GPTDataset(indexed, prefix, indices, n, "train", seeded, tokenizer)


def _order(source: Source, needed: int, cfg: DataConfig, tokenizer, files: PrefixFiles):
    """`source`'s own order, long enough for `needed` samples: its recorded segments and, if
    they fall short, one more; a source this run starts gets one GPTDataset of its planned size
    (rebuilt with `needed` samples when the greedy blend takes more, as the builder does)."""
    if not source.segments:
        gpt = _segment(cfg, tokenizer, files, source.prefix, source.size, 0)
        if len(gpt) < needed:
            gpt = _segment(cfg, tokenizer, files, source.prefix, needed, 0)
        return gpt
    segments = [
        _segment(cfg, tokenizer, files, source.prefix, n, k) for k, n in enumerate(source.segments)
    ]
    have = sum(len(s) for s in segments)
    if have < needed:
        more = _segment(cfg, tokenizer, files, source.prefix, needed - have, len(segments))
        log.info(
            "data mixture: %s needs %d samples of its own order, which holds %d: it goes on "
            "with %d more (seed %d)",
            source.prefix,
            needed,
            have,
            len(more),
            cfg.seed + len(segments),
        )
        segments.append(more)
    return segments[0] if len(segments) == 1 else SourceOrder(segments)


def build_mixture(
    plan: MixturePlan,
    cfg: DataConfig,
    tokenizer,
    files: PrefixFiles,
    from_sample: int | None = None,
) -> MixtureDataset:
    """The train order of `plan`; only the sources drawn from `from_sample` on (default: where
    the run starts) are built, the others stay names (`UnbuiltSource`)."""
    di, dsi = blend_arrays(plan)
    start = plan.start if from_sample is None else from_sample
    needed = np.bincount(di, minlength=len(plan.sources))
    later = np.bincount(di[start:], minlength=len(plan.sources))
    orders = [
        _order(s, int(n), cfg, tokenizer, files) if k else UnbuiltSource(s.prefix)
        for s, n, k in zip(plan.sources, needed, later, strict=True)
    ]
    return MixtureDataset(orders, di, dsi, plan)


def _segments_of(order) -> list:
    """num_samples of each GPTDataset of a built order."""
    return [s.num_samples for s in getattr(order, "segments", [order])]


def _entry(order, source: Source | None) -> dict:
    """A source's record entry without its counter: prefix, train tokens, segments."""
    if isinstance(order, UnbuiltSource):
        return {"prefix": source.prefix, "tokens": source.tokens, "segments": list(source.segments)}
    gpt = getattr(order, "segments", [order])[0]
    tokens = int(gpt.indexed.sequence_lengths[gpt.indices].sum(dtype=np.int64))
    return {"prefix": order.dataset_path, "tokens": tokens, "segments": _segments_of(order)}


class MixtureCounter:
    """Samples of each source's own order read at a position of the train order, and the
    record of a checkpoint there. Positions only grow in a run, except after a rewind (recounted)."""

    def __init__(self, dataset, plan: MixturePlan, cfg: DataConfig):
        self.identity = order_identity(cfg)
        self.plan = plan
        self.dataset_index = getattr(dataset, "dataset_index", None)
        self.mixture = isinstance(dataset, MixtureDataset)
        sources = getattr(dataset, "datasets", [dataset])
        planned = plan.sources if isinstance(dataset, MixtureDataset) else [None] * len(sources)
        self.entries = [_entry(d, s) for d, s in zip(sources, planned, strict=True)]
        self._at, self._counts = 0, np.zeros(len(sources), dtype=np.int64)
        self._announced = plan.start

    def counts(self, consumed: int) -> np.ndarray:
        """[source] samples of its own order read in the first `consumed` samples."""
        if self.dataset_index is None:  # one GPTDataset: its own order is the train order
            return np.array([consumed], dtype=np.int64)
        if consumed < self._at:
            self._at, self._counts = 0, np.zeros_like(self._counts)
        step = np.asarray(self.dataset_index[self._at : consumed])
        self._counts = self._counts + np.bincount(step, minlength=len(self._counts))
        self._at = consumed
        return self._counts

    def record(self, consumed: int) -> dict:
        """`TrainState.data_mixture` at `consumed` (logs each phase the run has entered since
        the last call)."""
        self._announce(consumed)
        counts = self.counts(consumed)
        return {
            "order": self.identity,
            "phases": [p.as_record() for p in self.plan.phases],
            "sources": [
                {**e, "consumed": int(n)} for e, n in zip(self.entries, counts, strict=True)
            ],
            "mixture": self.mixture,
        }

    def _announce(self, consumed: int) -> None:
        for phase in self.plan.phases:
            if self._announced < phase.sample <= consumed:
                shares = ", ".join(f"{p} {w:.4f}" for p, w in phase.weights)
                log.info(
                    "data mixture: phase from iteration %d (sample %d): %s",
                    phase.iteration,
                    phase.sample,
                    shares,
                )
        self._announced = max(self._announced, consumed)


def consumed_tokens(record: dict, seq_length: int) -> dict[str, int]:
    """{prefix: training tokens read from it} of a `data_mixture` record (a prefix listed twice
    in a blend: its listings added)."""
    out: dict[str, int] = {}
    for s in record.get("sources", []):
        out[s["prefix"]] = out.get(s["prefix"], 0) + int(s["consumed"]) * seq_length
    return out
