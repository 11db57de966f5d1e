"""Blend entries that name many prefixes at once: a glob, or a folder, with one weight for all.

In `--data-path`, `--data-args-path`, the per-split flags and `--per-split-data-args-path`, an
entry that is not a prefix itself (no `ENTRY.idx`) and

- holds a glob pattern (`*`, `?`, `[...]`, and `**` for any depth) names every prefix whose
  `.idx` matches `ENTRY.idx` (`data/web/*` -> every `data/web/X.idx`);
- is a folder names every prefix whose `.idx` is directly in it (`data/web/`),

in sorted order (the blend, hence the sample order, does not depend on the file system's). A
weight given before such an entry is shared among its prefixes in proportion to their tokens
(`.bin` size / token size), so the prefixes of a folder are read as if they were one merged
prefix: `0.7 data/web/ 0.3 data/books/` gives web 70% of the samples. Megatron-LM takes every
entry as one prefix; a blend of plain prefixes is unchanged here.
"""

from __future__ import annotations

import glob
import os
import re

from pretrain.data.files.indexed_dataset import get_bin_path, get_idx_path, read_index_header
from pretrain.errors import UserError

_MAGIC = re.compile(r"[*?[]")


def _matches(entry: str, source: str) -> list[str] | None:
    """The prefixes `entry` names, or None when it is a plain prefix (or names nothing we can
    tell: a missing prefix is reported later, naming its files)."""
    if os.path.exists(get_idx_path(entry)):
        return None
    if _MAGIC.search(entry):
        found = glob.glob(get_idx_path(entry), recursive=True)
        what = f"the pattern {entry}"
    elif os.path.isdir(entry):
        found = glob.glob(os.path.join(glob.escape(entry), "*.idx"))
        what = f"the folder {entry}"
    else:
        return None
    if not found:
        raise UserError(
            f"{source}: {what} names no prefix (no PREFIX.idx matches {get_idx_path(entry)}); "
            "check the path"
        )
    return sorted(path[: -len(".idx")] for path in found)


def _tokens(prefix: str) -> int:
    """Tokens of `prefix` from its `.bin` size and the token size its `.idx` header names."""
    dtype = read_index_header(get_idx_path(prefix))[0]
    try:
        return os.path.getsize(get_bin_path(prefix)) // dtype.itemsize
    except OSError as err:
        raise UserError(
            f"{get_bin_path(prefix)}: cannot read ({err.strerror}); every PREFIX.idx needs its "
            "PREFIX.bin"
        ) from None


def _shares(weight: float, prefixes: list[str], source: str) -> list[float]:
    """`weight` split among `prefixes` in proportion to their tokens."""
    tokens = [_tokens(p) for p in prefixes]
    total = sum(tokens)
    if total == 0:
        raise UserError(
            f"{source}: the prefixes {prefixes[0]}... hold no tokens to share weight {weight:g} by"
        )
    return [weight * t / total for t in tokens]


def expand(prefixes: list[str], weights: list[float] | None, source: str):
    """(prefixes, weights or None) with every glob or folder entry replaced by the prefixes it
    names, its weight shared among them by tokens."""
    out_prefixes: list[str] = []
    out_weights: list[float] = []
    for i, entry in enumerate(prefixes):
        named = _matches(entry, source)
        if named is None:
            out_prefixes.append(entry)
            if weights is not None:
                out_weights.append(weights[i])
            continue
        out_prefixes += named
        if weights is not None:
            out_weights += _shares(weights[i], named, source)
    return out_prefixes, (out_weights if weights is not None else None)
