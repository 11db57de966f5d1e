"""The README.md (Hugging Face model card) of an export: how the checkpoint was trained and on
what data, from its metadata (the data fingerprints and the tokens read per source)."""

from __future__ import annotations

import os
import re

from pretrain.model.config import ModelConfig, model_flags

TITLE = "# {hf_class} trained with pretrain_gpt.py"
_TITLE = re.compile(re.escape(TITLE).replace(re.escape("{hf_class}"), r"\w+"))


def _data_rows(meta: dict) -> list[str]:
    fingerprints = meta.get("data_fingerprints") or {}
    seen = meta.get("tokens_seen") or {}
    rows = []
    for prefix in sorted(set(fingerprints) | set(seen)):
        fp = fingerprints.get(prefix, {})
        tokenizer = (fp.get("tokenizer") or {}).get("type", "(no sidecar)")
        tokens_seen = seen.get(prefix)
        rows.append(
            f"| `{prefix}` | {fp.get('documents', '?'):,} | {fp.get('tokens', '?'):,} | "
            f"{tokenizer} | {fp.get('max_token_id', '?')} | "
            f"{'?' if tokens_seen is None else f'{tokens_seen:,}'} |"
        )
    return rows


def model_card(meta: dict, config: ModelConfig, hf_class: str) -> str:
    """Markdown for the export's README.md."""
    lines = [
        TITLE.format(hf_class=hf_class),
        "",
        f"Exported from the checkpoint at iteration {meta.get('iteration', 0)} "
        f"({meta.get('consumed_train_samples', 0):,} training samples).",
        "",
        "## Architecture (pretrain_gpt.py flags)",
        "",
        "```",
        " ".join(model_flags(config)),
        "```",
        "",
    ]
    rows = _data_rows(meta)
    if rows:
        lines += [
            "## Training data",
            "",
            "Fingerprints recorded by the run, and the training tokens read from each source "
            "(Megatron's sequential sample order; `?` where the run did not record it).",
            "",
            "| data prefix | documents | tokens | tokenizer | largest id | tokens trained on |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    if meta.get("argv"):
        lines += ["## Command line", "", "```", " ".join(meta["argv"]), "```", ""]
    return "\n".join(lines)


def is_model_card(path: str) -> bool:
    """True when the file `path` starts with the title line `model_card` writes."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        return _TITLE.fullmatch(f.readline().rstrip("\n")) is not None
