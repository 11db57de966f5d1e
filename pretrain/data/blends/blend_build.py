"""One split of a blend: its GPTDatasets and BlendedDataset, loaded with one file open.

Every process calls `build_blend_split`. It first reads the blend's consolidated cache
(`blend_cache.py`: one file for all of the split's index arrays), checked against what it expects
(the prefixes present in the split, the fingerprint of each `.idx`, each array's dtype and shape).
If there is none, the first process to take the file's lock builds it: each prefix's arrays come
from Megatron's per-prefix cache when a valid one exists, else are built and handed to a
`cache_writer.CacheWriter`, which writes Megatron's per-prefix files (and its BlendedDataset
cache, with --data-cache-path) on a thread of its own while the builder goes on; the builder
writes the consolidated file, reads it back like everyone else and releases the lock without
waiting for the writer (the others wait for the lock and read the file).

The per-prefix notices of a build (prefixes whose split is empty, prefixes the blend reads more
often than they were built for) are one summary line each (`pretrain/data/files/notices.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from filelock import FileLock, Timeout

from pretrain.data.blends.blended_dataset import BlendedDataset
from pretrain.data.caches import blend_cache
from pretrain.data.caches.cache import (
    NO_CACHE,
    load_or_build_all,
    remove_stray_temporaries_of,
    try_load,
)
from pretrain.data.caches.cache_writer import CacheWriter
from pretrain.data.config import DataConfig
from pretrain.data.datasets.gpt_dataset import GPTDataset, IndexSpec
from pretrain.data.files.notices import Notices
from pretrain.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BlendRequest:
    """One split of a blend as the builder asks for it."""

    split: str
    """train, valid or test."""
    prefixes: list[str]
    """Every prefix of the blend, in order."""
    specs: list[IndexSpec | None]
    """Each prefix's dataset as requested; None where the prefix gives the split no sequence."""
    weights: list[float] | None
    """Normalized weights of all prefixes (None: blended by size)."""
    targets: list[int | None] | None
    """Samples the blend takes from each prefix (ceil(N * w)), for weighted blends."""
    size: int | None
    """Samples requested for the split (None: every sample once)."""

    def present(self) -> list[int]:
        """Positions of the prefixes that take part (for a blend by size, those with a full
        sample, unless none has one)."""
        present = [p for p, spec in enumerate(self.specs) if spec is not None]
        if self.weights is None:
            present = [p for p in present if len(self.specs[p]) > 0] or present
        return present

    def blend_weights(self, present: Sequence[int]) -> tuple[list[float], int | None]:
        """(weights, size) of the BlendedDataset over `present`, Megatron's sizing."""
        if self.weights is not None:
            if self.size is None:
                raise ValueError("a weighted blend needs a sample count for every split it builds")
            return [self.weights[p] for p in present], sum(self.targets[p] for p in present)
        lengths = [len(self.specs[p]) for p in present]
        return lengths, None if self.size is None else min(self.size, sum(lengths))

    def description(self, present: Sequence[int]) -> str:
        """What the consolidated cache is built from: the request, not the data (which the
        `.idx` fingerprints inside the file stand for)."""
        first = self.specs[present[0]]
        common = {
            k: v for k, v in first.identifiers.items() if k not in ("dataset_path", "num_samples")
        }
        return json.dumps(
            {
                "class": "BlendCache",
                "common": common,
                "extra_token": first.extra_token,
                "drop_last": first.drop_last,
                "prefixes": self.prefixes,
                "num_samples": [None if s is None else s.num_samples for s in self.specs],
                "weights": self.weights,
                "size": self.size,
            }
        )


def _cache_dir(cfg: DataConfig, spec: IndexSpec) -> str:
    """--data-cache-path, else the first present prefix's Megatron cache folder."""
    return cfg.data_cache_path or spec.default_cache_dir()


def _from_parts(request: BlendRequest, present, parts, blend_arrays) -> list[GPTDataset] | str:
    """The datasets the file's parts describe, or why they are not the ones `request` expects."""
    if [part.position for part in parts] != present:
        return "it blends other prefixes (the data changed)"
    datasets = []
    for part in parts:
        spec = request.specs[part.position]
        if part.fingerprint != spec.indexed.fingerprint:
            return f"{spec.dataset_path}.idx changed since it was built"
        if part.num_samples != spec.num_samples:
            spec = spec.with_num_samples(part.num_samples)
        for name, (dtype, shape) in spec.expect.items():
            arr = part.arrays[name]
            if arr.dtype != dtype or arr.shape != shape:
                return f"{spec.dataset_path}: {name} is {arr.dtype}{arr.shape}, not {dtype}{shape}"
        datasets.append(GPTDataset.from_spec(spec, part.arrays))
    return datasets


def _load(path: str, description: str, request: BlendRequest, present):
    """(datasets, blend arrays) from the consolidated file, or (None, why not)."""
    loaded, why = blend_cache.read(path, description)
    if loaded is None:
        return None, why
    datasets = _from_parts(request, present, *loaded)
    if isinstance(datasets, str):
        return None, datasets
    return (datasets, loaded[1]), ""


def _lock(path: str, what: str) -> FileLock:
    lock = FileLock(f"{path}.lock")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info("waiting for another process to finish building the index caches of %s", what)
            lock.acquire()
    except OSError as err:
        raise UserError(
            f"cannot write the index cache in {os.path.dirname(path)} ({err.strerror}); pass "
            "--data-cache-path DIR pointing to a writable directory (node-local is fine)"
        ) from err
    return lock


def _fix_oversampled(
    blended: BlendedDataset, datasets: list, threads: int, split: str, writer: CacheWriter
) -> None:
    """Datasets the blend reads past their end, built longer (Megatron raises IndexError here,
    issues #705, PR #1007; the blend's indices depend only on weights and size), handed to
    `writer`."""
    short = blended.oversampled()
    if not short:
        return
    notices = Notices()
    specs = []
    for p, needed in short.items():
        notices.add(datasets[p].dataset_path, f"{needed} of {len(datasets[p])}", needed)
        specs.append(datasets[p].spec.with_num_samples(needed))
    requests = [s.cache_request(s.default_cache_dir()) for s in specs]
    batch = load_or_build_all(requests, threads, writer.add)
    for (p, _), spec, arrays in zip(short.items(), specs, batch.arrays, strict=True):
        datasets[p] = GPTDataset.from_spec(spec, arrays)
    notices.log(
        log,
        logging.WARNING,
        f"{split} split: the blend takes more samples from {len(notices)} prefixes than they were "
        "built for; they are built with the samples it takes",
    )


def _build(request: BlendRequest, present, cfg: DataConfig, path: str, description: str):
    """Build and write the consolidated cache (holding its lock); Megatron's per-prefix files
    are left to a `CacheWriter` still running."""
    start = time.perf_counter()
    specs = [request.specs[p] for p in present]
    threads = max(1, cfg.num_dataset_builder_threads)
    writer = CacheWriter(f"{request.split} split")
    try:
        requests = [s.cache_request(s.default_cache_dir()) for s in specs]
        remove_stray_temporaries_of(requests)  # left by killed builders (we hold the lock)
        batch = load_or_build_all(requests, threads, writer.add)
        datasets = [GPTDataset.from_spec(s, a) for s, a in zip(specs, batch.arrays, strict=True)]
        weights, size = request.blend_weights(present)
        blended = BlendedDataset(datasets, weights, size, None)  # in memory
        _fix_oversampled(blended, datasets, threads, request.split, writer)
        blend_arrays = {
            "dataset_index": np.asarray(blended.dataset_index),
            "dataset_sample_index": np.asarray(blended.dataset_sample_index),
        }
        if cfg.data_cache_path is not None:  # Megatron's BlendedDataset cache
            final = BlendedDataset(datasets, weights, size, None, arrays=blend_arrays)
            megatron = final.cache_request(cfg.data_cache_path)
            if try_load(megatron)[0] is None:
                writer.add(megatron, blend_arrays)
    finally:
        writer.finish()
    parts = [
        blend_cache.Part(
            position=p,
            num_samples=d.num_samples,
            fingerprint=d.indexed.fingerprint,
            arrays={name: getattr(d, name) for name in blend_cache.INDEX_NAMES},
        )
        for p, d in zip(present, datasets, strict=True)
    ]
    blend_cache.write(path, description, parts, blend_arrays)
    rebuilt = {why: n for why, n in batch.reasons.items() if why != NO_CACHE}
    why = "".join(f"; {n:,} rebuilt: {why}" for why, n in sorted(rebuilt.items()))
    log.info(
        "%s split: index caches of %s prefixes ready in %.1f s (%s built, %s loaded%s), in one "
        "file: %s",
        request.split,
        f"{len(present):,}",
        time.perf_counter() - start,
        f"{batch.built:,}",
        f"{len(specs) - batch.built:,}",
        why,
        path,
    )


def build_blend_split(
    request: BlendRequest, cfg: DataConfig, progress: Callable[[str], None]
) -> BlendedDataset | None:
    """The split's BlendedDataset (None when no prefix gives it a sequence)."""
    present = request.present()
    if not present:
        return None
    description = request.description(present)
    digest = hashlib.md5(description.encode("utf-8")).hexdigest()
    path = blend_cache.path_for(_cache_dir(cfg, request.specs[present[0]]), digest, request.split)
    loaded, why = _load(path, description, request, present)
    if loaded is None:
        lock = _lock(path, f"the {request.split} blend of {len(present)} prefixes")
        try:
            loaded, why = _load(path, description, request, present)
            if loaded is None:
                log.info("%s split: building its index caches (%s)", request.split, why)
                _build(request, present, cfg, path, description)
                loaded, why = _load(path, description, request, present)
                assert loaded is not None, why
        finally:
            lock.release()
    datasets, blend_arrays = loaded
    weights, size = request.blend_weights(present)
    for dataset in datasets:
        progress(f"{request.split} {dataset.dataset_path}")
    progress(f"{request.split} blend of {len(datasets)}")
    return BlendedDataset(datasets, weights, size, None, arrays=blend_arrays)
