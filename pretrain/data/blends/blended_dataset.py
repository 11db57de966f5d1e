"""BlendedDataset: interleave several datasets by weight (greedy, no RNG), as megatron-core.

Sample k is sample `dataset_sample_index[k]` of dataset `dataset_index[k]`. With a size the weights
are normalized and the greedy kernel keeps every dataset as close as possible to its share; without
a size every sample of every dataset is used exactly once (exhaustive blending).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from pretrain.data.caches.cache import CacheRequest, load_or_build
from pretrain.data.caches.describe import describe_blend
from pretrain.data.datasets import helpers
from pretrain.errors import UserError

MAX_DATASETS = 32767  # dataset ids are int16


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights scaled to sum to 1 (float64, as Megatron normalises them)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blend_items(blend, first, indices: list[int]) -> dict[str, torch.Tensor]:
    """Samples `indices` of a blend (`datasets`, `dataset_index`, `dataset_sample_index`) as one
    batch with their `dataset_id`s; `first`, any of its datasets, makes the tensors (all share
    one config and tokenizer)."""
    ids = blend.dataset_index[indices].tolist()
    samples = blend.dataset_sample_index[indices].tolist()
    text = np.empty((len(indices), first.cfg.seq_length + first.extra_token), dtype=np.int64)
    for row, (d, k) in enumerate(zip(ids, samples, strict=False)):
        blend.datasets[d].sample_tokens(k, out=text[row])
    return {"dataset_id": torch.tensor(ids, dtype=torch.int64), **first.tensors(text)}


class BlendedDataset(torch.utils.data.Dataset):
    def __init__(
        self,
        datasets: list,
        weights: Sequence[float],
        size: int | None,
        cache_dir: str | None,
        *,
        arrays: dict[str, np.ndarray] | None = None,
    ):
        """`arrays`: the blending indices, already loaded or built and checked (by a blend's
        consolidated cache); None: from the cache in `cache_dir`, or built."""
        if not datasets or len(datasets) != len(weights):
            raise ValueError("BlendedDataset needs one weight per dataset")
        if len(datasets) >= MAX_DATASETS:
            raise UserError(
                f"{len(datasets)} datasets in one blend; at most {MAX_DATASETS - 1} are supported "
                "(merge small prefixes with tools/merge_datasets.py)"
            )
        if any(not w > 0 for w in weights):
            raise UserError(
                f"{datasets[0].index_split} blend: weights must all be > 0, got {list(weights)} "
                "(unweighted blends weigh prefixes by their sample counts; use more data or another --split)"
            )
        if len({d.index_split for d in datasets}) != 1:
            raise ValueError("all blended datasets must come from the same split")
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = normalize(weights) if size is not None else list(weights)
        self.size = size
        if arrays is None:
            arrays = load_or_build(self.cache_request(cache_dir))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    @functools.cached_property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [
                ("class", "BlendedDataset"),
                ("datasets", [d.unique_identifiers for d in self.datasets]),
                ("split", self.split),
                ("weights", self.weights),
                ("size", self.size),
            ]
        )

    @functools.cached_property
    def unique_description(self) -> str:
        return describe_blend(
            self.unique_identifiers, [d.unique_description for d in self.datasets]
        )

    @functools.cached_property
    def unique_description_hash(self) -> str:
        return hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()

    def cache_request(self, cache_dir: str | None) -> CacheRequest:
        """Megatron's cache of the blending indices in `cache_dir` (None: built in memory)."""
        n = self.size if self.size is not None else int(sum(self.weights))
        cached = cache_dir is not None  # else the (long) description is never needed
        return CacheRequest(
            directory=cache_dir,
            base_name=f"{self.unique_description_hash}-BlendedDataset-{self.split}"
            if cached
            else "",
            description=self.unique_description if cached else "",
            expect={
                "dataset_index": (np.dtype(np.int16), (n,)),
                "dataset_sample_index": (np.dtype(np.int64), (n,)),
            },
            build=self._build,
            check=self._index_problem,
        )

    def _build(self) -> dict[str, np.ndarray]:
        if self.size is not None:
            di, dsi = helpers.build_blending_indices(np.array(self.weights), self.size)
        else:
            di, dsi = helpers.build_exhaustive_blending_indices(
                np.array(self.weights, dtype=np.int64)
            )
        return {"dataset_index": di, "dataset_sample_index": dsi}

    def _index_problem(self, arrays: dict[str, np.ndarray]) -> str | None:
        """Bounds of loaded blend indices (a damaged cache): dataset ids exist, and sample k of
        dataset d is below the number of samples the blend draws from d."""
        di, dsi = arrays["dataset_index"], arrays["dataset_sample_index"]
        if len(di) == 0:
            return None
        if di.min() < 0 or di.max() >= len(self.datasets):
            return f"dataset_index holds ids outside 0..{len(self.datasets) - 1}"
        drawn = np.bincount(di, minlength=len(self.datasets))
        if dsi.min() < 0 or np.any(dsi >= drawn[di]):
            return "dataset_sample_index holds samples the blend never draws"
        return None

    def samples_drawn(self) -> np.ndarray:
        """How many samples the blend takes from each dataset."""
        return np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))

    def oversampled(self) -> dict[int, int]:
        """{dataset position: samples the blend needs} for datasets shorter than what the blend takes."""
        drawn = self.samples_drawn()
        return {i: int(n) for i, n in enumerate(drawn) if n > len(self.datasets[i])}

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """A whole micro-batch; all blended datasets share one config and tokenizer."""
        return blend_items(self, self.datasets[0], indices)

    def __getitem__(self, idx: int) -> dict:
        return {k: v[0] for k, v in self.__getitems__([idx]).items()}
