"""What a resume changes against the checkpoint: the tokenizer (refused) and the data (said).

The checkpoint's `pretrain_meta.json` records the tokenizer that trained it (`tokenizer`: its
config; `tokenizer_fingerprint`: type, SHA-256 of what it does, vocabulary size, EOD) and its data
(`data`: the `DataConfig`; `data_fingerprints`: each prefix's counts). `check_tokenizer` refuses
another tokenizer in one line naming both (token ids would mean other tokens; a NullTokenizer
with the same vocabulary size as GPT-2's is another tokenizer) unless `--allow-tokenizer-mismatch`.
`data_changes` says, in one line, what differs in the data (prefixes, weights, split, sequence
length, seed, a prefix's contents): continued pretraining does that, and it is allowed. What it
means is what the samplers do: they position this run's data order (built from the new data
alone) at the consumed-samples count, so the run reads sample C onwards of the new order.
"""

from __future__ import annotations

import dataclasses

from pretrain.checkpoint.format import json_safe
from pretrain.data.config import DataConfig
from pretrain.errors import UserError
from pretrain.tokenizer.fingerprint import describe_tokenizer, same_tokenizer

_TOKENIZER_FLAGS = (
    ("tokenizer_type", "--tokenizer-type"),
    ("vocab_file", "--vocab-file"),
    ("merge_file", "--merge-file"),
    ("tokenizer_model", "--tokenizer-model"),
    ("vocab_size", "--vocab-size"),
)
_BLEND_FIELDS = (
    ("blend", "data (--data-path)"),
    ("blend_per_split", "per-split data"),
    ("data_schedule", "--data-schedule"),
)
_ORDER_FIELDS = (
    *_BLEND_FIELDS,
    ("split", "--split"),
    ("seq_length", "--seq-length"),
    ("seed", "--seed"),
)


def _saved_tokenizer_flags(meta: dict) -> str:
    """The tokenizer flags the checkpoint was trained with, as a command-line fragment."""
    saved = meta.get("tokenizer") or {}
    return " ".join(f"{flag} {saved[key]}" for key, flag in _TOKENIZER_FLAGS if saved.get(key))


def check_tokenizer(meta: dict, given: dict, allow_mismatch: bool, path: str) -> str | None:
    """Refuse (one line) a checkpoint trained with another tokenizer than `given` (this run's
    `tokenizer_fingerprint`); with `allow_mismatch` return that line as a warning instead. A
    checkpoint without a recorded fingerprint (older, converted) is compared by tokenizer type,
    a converted (weights-only) one not at all: its recorded tokenizer is the source's."""
    recorded = meta.get("tokenizer_fingerprint")
    if recorded is not None:
        if same_tokenizer(recorded, given):
            return None
        saved = describe_tokenizer(recorded)
    else:
        saved_type = (meta.get("tokenizer") or {}).get("tokenizer_type")
        if meta.get("weights_only") or saved_type in (None, given["type"]):
            return None
        saved = saved_type
    line = (
        f"--load {path}: the checkpoint was trained with {saved}, this run uses "
        f"{describe_tokenizer(given)}: the same token ids would mean other tokens"
    )
    if allow_mismatch:
        return f"WARNING: {line}; continuing (--allow-tokenizer-mismatch)"
    raise UserError(
        f"{line}; pass the checkpoint's tokenizer ({_saved_tokenizer_flags(meta)}) or "
        f"--allow-tokenizer-mismatch"
    )


def _content_changes(saved: dict, current: dict) -> list[str]:
    """The prefixes read by both runs whose documents or tokens differ."""
    out = []
    for prefix, now in current.items():
        before = saved.get(prefix)
        keys = ("documents", "tokens")
        if before is not None and any(before.get(k) != now.get(k) for k in keys):
            out.append(
                f"{prefix} now has {now['documents']} documents / {now['tokens']} tokens "
                f"(was {before.get('documents')} / {before.get('tokens')})"
            )
    return out


def data_changes(
    meta: dict, data: DataConfig, fingerprints: dict[str, dict], path: str
) -> str | None:
    """One line saying what differs between the checkpoint's data and this run's (`data`, and
    `fingerprints` from `data_fingerprints`) and what that does to the sample order; None when
    nothing does. Old checkpoints that record no data config compare nothing."""
    saved = meta.get("data")
    if not isinstance(saved, dict):
        return None
    current = json_safe(dataclasses.asdict(data))
    changed = [
        (key, what)
        for key, what in _ORDER_FIELDS
        if key in saved and json_safe(saved[key]) != current[key]
    ]
    changes = [f"{what}: {saved.get(key)} -> {current[key]}" for key, what in changed]
    content = _content_changes(meta.get("data_fingerprints") or {}, fingerprints)
    changes += content
    if not changes:
        return None
    consumed = meta.get("consumed_train_samples", 0)
    blend_only = not content and all(field in _BLEND_FIELDS for field in changed)
    if blend_only and meta.get("data_mixture") and data.dataloader_type == "single":
        return (
            f"--load {path}: this run's blend differs from the checkpoint's "
            f"({'; '.join(changes)}); each source continues its own sample order where the "
            f"checkpoint stopped it (the 'data mixture' lines say where)"
        )
    return (
        f"--load {path}: this run's data differs from the checkpoint's ({'; '.join(changes)}); "
        f"the sample order is this run's, built from its data alone, and training continues at "
        f"its sample {consumed} (the consumed-samples count): its first {consumed} samples are "
        f"skipped, and the checkpoint's order does not continue"
    )
