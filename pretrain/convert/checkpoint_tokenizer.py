"""The tokenizer of a checkpoint, for the tools that read one (tools/convert_to_hf.py).

A checkpoint's `pretrain_meta.json` records the tokenizer config (`tokenizer`: absolute paths
since content fingerprints; older checkpoints hold the paths as given, maybe relative) and its
`tokenizer_fingerprint` (`pretrain.tokenizer.fingerprint`). The tool rebuilds the tokenizer from
the recorded config, with `--tokenizer-type/--tokenizer-model/--vocab-file/--merge-file` taking
the place of recorded entries (a checkpoint moved to another machine, a tokenizer moved).
Whatever is built is checked against the recorded fingerprint: another tokenizer is refused in
one line naming both (`--allow-tokenizer-mismatch`: a warning); a recorded file that is not
there is one line naming the flag that replaces it. A checkpoint without a fingerprint (a
converted one) is not checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from pretrain.errors import UserError
from pretrain.tokenizer import Tokenizer, TokenizerConfig, build_tokenizer
from pretrain.tokenizer.fingerprint import describe_tokenizer, same_tokenizer, tokenizer_fingerprint

# TokenizerConfig field -> the flag that overrides it
OVERRIDES = {
    "tokenizer_type": "--tokenizer-type",
    "tokenizer_model": "--tokenizer-model",
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
}
_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "NullTokenizer": ()}


def add_override_args(parser: argparse.ArgumentParser) -> None:
    """The flags that replace the checkpoint's recorded tokenizer entries."""
    g = parser.add_argument_group(
        "tokenizer (default: the one the checkpoint records; checked against its fingerprint)"
    )
    g.add_argument("--tokenizer-type", help="instead of the recorded type")
    g.add_argument("--tokenizer-model", help="instead of the recorded tokenizer.json/folder/model")
    g.add_argument("--vocab-file", help="instead of the recorded GPT-2 vocab.json")
    g.add_argument("--merge-file", help="instead of the recorded GPT-2 merges.txt")


def overrides_from_args(ns: argparse.Namespace) -> dict[str, str]:
    """{field: value} of the override flags given."""
    return {key: getattr(ns, key) for key in OVERRIDES if getattr(ns, key, None) is not None}


def _recorded_flags(cfg: TokenizerConfig) -> str:
    return " ".join(
        f"{flag} {getattr(cfg, key)}" for key, flag in OVERRIDES.items() if getattr(cfg, key)
    )


def _check_files_here(cfg: TokenizerConfig, overrides: dict, load: str) -> None:
    """One line naming the flag for a recorded tokenizer file that is not here."""
    for key in _FILES.get(cfg.tokenizer_type, ("tokenizer_model",)):
        path = getattr(cfg, key)
        if key not in overrides and path and not os.path.exists(path):
            flag = OVERRIDES[key]
            raise UserError(
                f"--load {load}: the checkpoint's tokenizer file {path} (recorded {flag}) is not "
                f"here; pass {flag} PATH to the same tokenizer (it is checked against the "
                f"checkpoint's fingerprint)"
            )


def checkpoint_tokenizer(
    recorded: TokenizerConfig,
    meta: dict,
    load: str,
    overrides: dict | None = None,
    allow_mismatch: bool = False,
) -> tuple[TokenizerConfig, Tokenizer | None, dict | None]:
    """(config, tokenizer, fingerprint) of the checkpoint at `load` (its `meta`): `recorded` with
    `overrides` ({field: value}) replacing entries, built and checked against the recorded
    fingerprint; (config, None, None) when no tokenizer is recorded or given."""
    overrides = overrides or {}
    cfg = dataclasses.replace(recorded, **overrides)
    if cfg.tokenizer_type is None:
        return cfg, None, None
    _check_files_here(cfg, overrides, load)
    try:
        tokenizer = build_tokenizer(cfg)
    except UserError as err:
        what = "the tokenizer given" if overrides else "the checkpoint's tokenizer"
        raise UserError(f"--load {load}: {what} cannot be loaded: {err}") from None
    given = tokenizer_fingerprint(cfg, tokenizer)
    saved = meta.get("tokenizer_fingerprint")
    if saved is not None and not same_tokenizer(saved, given):
        flags = _recorded_flags(cfg) if overrides else "the recorded files"
        line = (
            f"--load {load}: the checkpoint was trained with {describe_tokenizer(saved)}, but "
            f"{flags} give {describe_tokenizer(given)}"
        )
        if not allow_mismatch:
            raise UserError(
                f"{line}; pass the training tokenizer's files ({_recorded_flags(recorded)}) or "
                f"--allow-tokenizer-mismatch"
            )
        print(f"WARNING: {line}; continuing (--allow-tokenizer-mismatch)")
    return cfg, tokenizer, given
