"""A blend's plan before anything is trained: per prefix and split, what the run will draw.

For every split and data prefix: the tokens and documents the prefix holds in that split, the
requested weight, how many samples the blend will draw from it, how many epochs of it that is, and
its actual share of the split's tokens. Only the `.idx` files are read (sequence lengths); the
samples drawn come from the same greedy blending kernel and the same sizing rules as the builder
(`builder.py`, Megatron's), so they equal what the built BlendedDataset's `dataset_index` holds.
No index cache is built or read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretrain.data.blends.blended_dataset import normalize
from pretrain.data.blends.mixture import MixturePlan, phase_counts
from pretrain.data.blends.mixture_report import format_phases, phase_warnings
from pretrain.data.config import SPLIT_NAMES, Blend, DataConfig
from pretrain.data.datasets import helpers
from pretrain.data.datasets.gpt_dataset import split_ranges
from pretrain.data.files.fingerprint import PrefixFiles
from pretrain.data.files.notices import Notices
from pretrain.errors import UserError

DEFAULT_MAX_EPOCHS = 4.0
LOGGED_ROWS = 10  # prefixes per split the plan at the start of training shows
DEFAULT_MIN_EPOCHS = 0.5
EXTRA_TOKEN = 1  # each sample reads S + 1 tokens (the labels' shift), as the datasets do
FULL_RANGE = (0.0, 1.0)


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One data prefix in one split."""

    split: str
    """train, valid or test."""
    prefix: str
    """The data prefix as given on the command line."""
    tokens: int
    """Tokens of this prefix that fall into the split."""
    documents: int
    """Sequences (documents, for document-level data) of this prefix in the split."""
    weight: float | None
    """Requested weight, normalized over the blend (None: weighted by size, Megatron's default)."""
    samples: int
    """Samples of seq_length tokens the split draws from this prefix."""
    epochs: float
    """samples * seq_length / tokens: how many times the prefix's split is read."""
    token_share: float
    """Fraction of the split's trained tokens that come from this prefix."""


def to_sample_weights(weights: Sequence[float], unit: str, tokens_per_sample: Sequence[int]):
    """Blend weights in `unit` ("samples" or "tokens") -> Megatron's sample weights.

    A token share w_i needs w_i / tokens_per_sample_i as a sample weight. Every GPT sample is a
    window of seq_length tokens whatever its source, so for GPT data the two units give the same
    blend; the weights are then returned unchanged (not renormalized), so the index caches stay
    byte-identical to Megatron's.
    """
    if unit == "samples" or len(set(tokens_per_sample)) == 1:
        return list(weights)
    if unit != "tokens":
        raise UserError(f"--blend-weights-unit {unit}: choose samples or tokens")
    return [w / n for w, n in zip(weights, tokens_per_sample, strict=True)]


class _Sources:
    """Sequence lengths of each prefix, read once (the .idx only, opened through `files`)."""

    def __init__(self, files: PrefixFiles):
        self._files = files

    def lengths(self, prefix: str) -> np.ndarray:
        if not self._files.exists(prefix):
            raise UserError(
                f"{prefix}: no {prefix}.bin/{prefix}.idx pair (check the --data-path prefix)"
            )
        return self._files.indexed(prefix).sequence_lengths

    def split(self, prefix: str, matrix, split: int) -> tuple[int, int]:
        """(tokens, documents) of `prefix` in split `split` of `matrix`."""
        lengths = self.lengths(prefix)
        ids = split_ranges(len(lengths), matrix)[split]
        if ids is None or len(ids) == 0:
            return 0, 0
        return int(np.sum(lengths[ids], dtype=np.int64)), len(ids)


def _samples_per_epoch(tokens: int, seq_length: int) -> int:
    if tokens <= EXTRA_TOKEN:
        return 0
    return helpers.num_samples_in_sample_index(1, tokens, seq_length, True, EXTRA_TOKEN)


def _drawn(weights: Sequence[float], size: int) -> np.ndarray:
    """Samples the greedy blending kernel takes from each dataset for `size` samples."""
    index, _ = helpers.build_blending_indices(np.array(normalize(weights)), size)
    return np.bincount(index, minlength=len(weights))


def _blend_rows(
    cfg: DataConfig, src: _Sources, blend: Blend, matrix, split: int, size: int | None
) -> list[PlanRow]:
    """The rows of one split of one blend, sized as the builder sizes it."""
    prefixes, weights = blend
    stats = [src.split(p, matrix, split) for p in prefixes]
    present = [i for i, (tokens, _) in enumerate(stats) if tokens > 0]
    if not present:
        return []
    S = cfg.seq_length
    single = len(prefixes) == 1 and (weights is None or cfg.blend is None)
    if single:
        drawn = [size if size is not None else _samples_per_epoch(stats[0][0], S)]
        shown = [None if weights is None else 1.0]
    elif weights is not None:
        if size is None:
            raise ValueError("a weighted blend needs a sample count for every split it builds")
        weights = to_sample_weights(weights, cfg.blend_weights_unit, [S] * len(weights))
        normalized = normalize(weights)
        w = [normalized[i] for i in present]
        total = sum(math.ceil(size * normalized[i]) for i in present)
        drawn = _drawn(w, total).tolist()
        shown = normalize(w)
    else:
        per_epoch = [_samples_per_epoch(stats[i][0], S) for i in present]
        keep = [k for k, n in enumerate(per_epoch) if n > 0] or list(range(len(present)))
        present, per_epoch = [present[k] for k in keep], [per_epoch[k] for k in keep]
        if size is None:
            drawn = per_epoch  # exhaustive blending: every sample once
        else:
            drawn = _drawn(per_epoch, min(size, sum(per_epoch))).tolist()
        shown = [None] * len(present)
    total_drawn = max(1, sum(drawn))
    return [
        PlanRow(
            split=SPLIT_NAMES[split],
            prefix=prefixes[i],
            tokens=stats[i][0],
            documents=stats[i][1],
            weight=w,
            samples=int(n),
            epochs=n * S / stats[i][0],
            token_share=n / total_drawn,
        )
        for i, w, n in zip(present, shown, drawn, strict=True)
    ]


def plan_blend(
    cfg: DataConfig,
    num_samples: Sequence[int | None],
    files: PrefixFiles | None = None,
    mixture: MixturePlan | None = None,
) -> list[PlanRow]:
    """Rows for every split and prefix of `cfg`'s data, for `num_samples` [train, valid, test];
    `files`: the prefixes as already opened. `mixture`: the train split's phases
    (`resolve_mixture`): a changing mixture's train split has no rows here (`mixture_report`
    plans it per phase), Megatron's one phase is planned with its weights (`MixturePlan.blend`)."""
    src = _Sources(files or PrefixFiles(cfg.data_cache_path))
    rows = []
    for split, blend, matrix in _split_blends(cfg):
        if split == 0 and mixture is not None:
            if not mixture.megatron:
                continue
            blend = mixture.blend or blend
        rows += _blend_rows(cfg, src, blend, matrix, split, num_samples[split])
    return rows


def _split_blends(cfg: DataConfig):
    """(split, blend, split matrix) of every split the data flags give."""
    if cfg.blend is not None:
        for split in range(3):
            if cfg.split_matrix[split] is not None:
                yield split, cfg.blend, cfg.split_matrix
        return
    for split, blend in enumerate(cfg.blend_per_split):
        if blend is not None:
            matrix = [None] * 3
            matrix[split] = FULL_RANGE
            yield split, blend, matrix


def _warning_items(rows: Sequence[PlanRow], max_epochs: float, min_epochs: float):
    """(kind, row, line) per prefix that repeats more than max_epochs ("repeated"), or of which
    training reads less than min_epochs ("little used"; train split only: validation and test
    sets are small on purpose)."""
    alone = sum(r.split == "train" for r in rows) == 1
    fix = (
        "train longer (--train-iters / --train-samples) to read more of it"
        if alone
        else "raise its weight or drop it"
    )
    for r in rows:
        if r.epochs > max_epochs:
            yield (
                "repeated",
                r,
                (
                    f"warning: {r.split} {r.prefix}: read {r.epochs:.2f} times (> --max-epochs "
                    f"{max_epochs:g}); the model will see these documents repeatedly"
                ),
            )
        elif r.split == "train" and r.epochs < min_epochs:
            yield (
                "little used",
                r,
                (
                    f"warning: train {r.prefix}: only {100 * r.epochs:.1f}% of its {r.tokens:,} tokens "
                    f"are used (< --min-epochs {min_epochs:g}); {fix}"
                ),
            )


def plan_warnings(
    rows: Sequence[PlanRow],
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    min_epochs: float = DEFAULT_MIN_EPOCHS,
) -> list[str]:
    """One line per prefix that repeats more than max_epochs, or of which training reads less
    than min_epochs (train split only: validation and test sets are small on purpose); the fix
    it suggests for the latter is a weight in a blend, more training when the prefix is alone."""
    return [line for _, _, line in _warning_items(rows, max_epochs, min_epochs)]


def warning_summaries(
    rows: Sequence[PlanRow],
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    min_epochs: float = DEFAULT_MIN_EPOCHS,
    rest: str = "tools/plan_blend.py lists every one",
) -> list[str]:
    """`plan_warnings` with one line per kind instead of per prefix when a kind concerns more
    than one prefix: the count, the worst few (`pretrain/data/files/notices.py`) and `rest`, where
    the others are."""
    kinds: dict[str, list] = {}
    for kind, row, line in _warning_items(rows, max_epochs, min_epochs):
        kinds.setdefault(kind, []).append((row, line))
    out = []
    for kind, items in kinds.items():
        if len(items) == 1:
            out.append(items[0][1])
            continue
        notices = Notices()
        for row, _ in items:
            rank = row.epochs if kind == "repeated" else -row.epochs
            notices.add(f"{row.split} {row.prefix}", f"{row.epochs:.3g} epochs", rank)
        bound = (
            f"read more than --max-epochs {max_epochs:g} times (the model sees their documents "
            "repeatedly)"
            if kind == "repeated"
            else f"read less than --min-epochs {min_epochs:g} (raise their weights or drop them)"
        )
        headline = f"{len(items):,} prefixes are {bound}"
        out.append("warning: " + notices.line(headline, rest=rest))
    return out


def _shown(rows: Sequence[PlanRow], limit: int | None) -> tuple[list[PlanRow], dict[str, int]]:
    """(the rows to print: per split the `limit` drawing the most samples, in plan order;
    {split: rows left out})."""
    if limit is None:
        return list(rows), {}
    keep, hidden = set(), {}
    for split in SPLIT_NAMES:
        mine = [i for i, r in enumerate(rows) if r.split == split]
        top = sorted(mine, key=lambda i: -rows[i].samples)[:limit]
        keep.update(top)
        if len(mine) > len(top):
            hidden[split] = len(mine) - len(top)
    return [r for i, r in enumerate(rows) if i in keep], hidden


def format_plan(rows: Sequence[PlanRow], seq_length: int, limit: int | None = None) -> str:
    """The plan as an aligned text table, one line per split and prefix; with `limit`, only the
    `limit` prefixes of each split that draw the most samples, and a line saying how many more."""
    shown, hidden = _shown(rows, limit)
    width = max([len("prefix")] + [len(r.prefix) for r in shown])
    head = (
        f"{'split':5s}  {'prefix':{width}s}  {'tokens':>14s}  {'documents':>11s}  {'weight':>7s}  "
        f"{'samples':>11s}  {'epochs':>7s}  {'token share':>11s}"
    )
    lines = [head]
    for r in shown:
        weight = "size" if r.weight is None else f"{r.weight:.4f}"
        lines.append(
            f"{r.split:5s}  {r.prefix:{width}s}  {r.tokens:14,d}  {r.documents:11,d}  {weight:>7s}  "
            f"{r.samples:11,d}  {r.epochs:7.2f}  {100 * r.token_share:10.2f}%"
        )
    for split, n in hidden.items():
        lines.append(
            f"{split:5s}  ... and {n:,} more prefixes (tools/plan_blend.py lists every one)"
        )
    for split in SPLIT_NAMES:
        n = sum(r.samples for r in rows if r.split == split)
        if n:
            lines.append(f"{split}: {n:,} samples = {n * seq_length:,} tokens")
    return "\n".join(lines)


def log_plan(
    cfg: DataConfig,
    num_samples: Sequence[int | None],
    log: logging.Logger,
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    files: PrefixFiles | None = None,
    mixture: MixturePlan | None = None,
    counts: np.ndarray | None = None,
) -> list[PlanRow]:
    """Log the blend plan table and its warnings (once, at the start of training); return the rows
    (none where `log` does not print INFO: every rank calls this, only rank 0 logs, and a blend of
    thousands of prefixes is not planned on the others). A changing `mixture`'s train split is
    its phases' (`counts`: `phase_counts` of its built dataset), with their epoch warnings."""
    if cfg.mock or not log.isEnabledFor(
        logging.INFO
    ):  # mock data: pretrain.data.datasets.mock logs it
        return []
    rows = plan_blend(cfg, num_samples, files, mixture)
    # every row at --logging-level 10 (DEBUG)
    shown = None if log.isEnabledFor(logging.DEBUG) else LOGGED_ROWS
    text = [format_plan(rows, cfg.seq_length, shown)] if rows else []
    text += warning_summaries(rows, max_epochs)
    if mixture is not None and not mixture.megatron:
        counts = phase_counts(mixture) if counts is None else counts
        text += [format_phases(mixture, counts), *phase_warnings(mixture, counts, max_epochs)]
    log.info("data plan (seq length %d):\n%s", cfg.seq_length, "\n".join(text))
    return rows
