"""The data a run names, checked against its tokenizer before launch and summarised for its
checkpoints.

`check_data` refuses, in one line naming both sides, data whose largest token id does not fit the
vocabulary, or whose sidecar (`pretrain/data/files/fingerprint.py`) names another tokenizer than
the one given (`--allow-tokenizer-mismatch` overrides); `data_fingerprints` is what a checkpoint
records of each prefix, `tokens_seen` how many training tokens it read from each.
"""

from __future__ import annotations

import logging

import numpy as np

from pretrain.data.config import DataConfig
from pretrain.data.files.fingerprint import PrefixFiles, check_sidecar_matches, dataset_counts
from pretrain.data.files.indexed_dataset import IndexedDataset
from pretrain.data.gc_pause import gc_paused
from pretrain.errors import UserError
from pretrain.tokenizer.fingerprint import (
    describe_tokenizer,
    same_tokenizer,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)


def data_prefixes(cfg: DataConfig) -> list[str]:
    """Every prefix `cfg` reads, once each, in order of appearance."""
    blends = [cfg.blend] if cfg.blend is not None else list(cfg.blend_per_split or [])
    seen: dict[str, None] = {}
    for blend in blends:
        if blend is not None:
            seen.update(dict.fromkeys(blend[0]))
    return list(seen)


def check_prefix(
    prefix: str, given: dict, vocab_size: int, cfg: DataConfig, files: PrefixFiles | None = None
) -> None:
    """Refuse `prefix` if its tokens do not fit `vocab_size` or another tokenizer made it."""
    files = files or PrefixFiles(cfg.data_cache_path)
    sidecar = files.sidecar(prefix)
    if sidecar is not None:
        check_sidecar_matches(prefix, sidecar, files)
    made_by = None if sidecar is None else sidecar.get("tokenizer")
    if made_by is not None and not same_tokenizer(made_by, given):
        line = f"{prefix}: tokenized with {describe_tokenizer(made_by)}, but this run uses {describe_tokenizer(given)}"
        if not cfg.allow_tokenizer_mismatch:
            raise UserError(
                f"{line} (pass the tokenizer that made the data, or --allow-tokenizer-mismatch)"
            )
        log.warning("%s; continuing (--allow-tokenizer-mismatch)", line)
    largest = files.largest_token_id(prefix)
    if largest >= vocab_size:
        by = "" if made_by is None else f" (made by {describe_tokenizer(made_by)})"
        raise UserError(
            f"{prefix}: holds token id {largest}{by}, but the vocabulary of {describe_tokenizer(given)} has "
            f"{vocab_size} ids; tokenize the data with this run's tokenizer or use the data's"
        )


@gc_paused()
def check_data(
    cfg: DataConfig,
    tok_cfg,
    tokenizer,
    vocab_size: int,
    files: PrefixFiles | None = None,
    *,
    fingerprint: dict | None = None,
) -> None:
    """Check every prefix of `cfg` against the tokenizer given and a vocabulary of `vocab_size`
    ids (the model's, or the tokenizer's where there is no model). One-line UserError on a mismatch.
    `files`: the prefixes' files as already read (PrefixFiles(cfg.data_cache_path));
    `fingerprint`: the tokenizer's `tokenizer_fingerprint` where already made (hashed once)."""
    given = fingerprint or tokenizer_fingerprint(tok_cfg, tokenizer)
    files = files or PrefixFiles(cfg.data_cache_path)
    # a missing pair is reported by the builder
    prefixes = [p for p in data_prefixes(cfg) if files.exists(p)]
    files.largest_token_ids(prefixes)  # the scans of data without sidecars: together, once
    for prefix in prefixes:
        check_prefix(prefix, given, vocab_size, cfg, files)


def data_fingerprints(cfg: DataConfig, files: PrefixFiles | None = None) -> dict[str, dict]:
    """{prefix: summary} of every prefix `cfg` reads, for checkpoints and model cards: the
    sidecar's tokenizer, counts and largest token id, or the counts and largest id from the .idx
    and the cached scan for data without a sidecar. `files`: as for `check_data`."""
    files = files or PrefixFiles(cfg.data_cache_path)
    files.largest_token_ids(data_prefixes(cfg))
    out = {}
    for prefix in data_prefixes(cfg):
        sidecar = files.sidecar(prefix) or {}
        summary = dataset_counts(prefix, files)
        summary["max_token_id"] = files.largest_token_id(prefix)
        summary["tokenizer"] = sidecar.get("tokenizer")
        summary["sidecar"] = bool(sidecar)
        out[prefix] = summary
    return out


def check_recorded_data(
    data_meta: dict | None,
    tok_cfg,
    tokenizer,
    vocab_size: int,
    allow_mismatch: bool = False,
    *,
    fingerprint: dict | None = None,
) -> int:
    """`check_data` for the data a checkpoint records (its metadata's "data" entry): the prefixes
    still on disk are checked, the others skipped (an export may run elsewhere). Returns how many
    prefixes were checked. `fingerprint`: as for `check_data`."""
    if not data_meta or tokenizer is None:
        return 0
    blends = [data_meta.get("blend")] + list(data_meta.get("blend_per_split") or [])
    prefixes = dict.fromkeys(p for b in blends if b for p in b[0])
    here = [p for p in prefixes if IndexedDataset.exists(p)]
    cfg = DataConfig(
        seq_length=1, blend=(here, None), split="1", allow_tokenizer_mismatch=allow_mismatch
    )
    given = fingerprint or tokenizer_fingerprint(tok_cfg, tokenizer)
    for prefix in here:
        check_prefix(prefix, given, vocab_size, cfg)
    return len(here)


def tokens_seen(dataset, consumed_samples: int, seq_length: int) -> dict[str, int]:
    """{prefix: training tokens read from it} after the first `consumed_samples` samples of
    `dataset` in Megatron's sequential order (a GPTDataset, or a BlendedDataset whose blending
    index says which prefix each sample comes from)."""
    datasets = getattr(dataset, "datasets", None)
    if datasets is None:
        return {dataset.dataset_path: consumed_samples * seq_length}
    counts = np.bincount(
        np.asarray(dataset.dataset_index[:consumed_samples]), minlength=len(datasets)
    )
    seen: dict[str, int] = {}
    for ds, count in zip(datasets, counts, strict=True):
        seen[ds.dataset_path] = seen.get(ds.dataset_path, 0) + int(count) * seq_length
    return seen
