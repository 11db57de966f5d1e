"""The tokenizer interface, and the identity Megatron-LM records for a tokenizer in cache names."""

from __future__ import annotations

import os
from collections import OrderedDict

from pretrain.errors import UserError

# Megatron-LM main builds every text tokenizer as this class (megatron.core.tokenizers); its
# `unique_identifiers` (part of every index-cache description) names it, not the backend library.
MEGATRON_TEXT_TOKENIZER = "megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText"


def megatron_identity(tokenizer_path: str | None, kwargs: list[tuple[str, object]]) -> OrderedDict:
    """What Megatron-LM main's tokenizer reports as `unique_identifiers`: its class, the path it
    was built from, then every keyword argument its `build_tokenizer` passed, in order, as str()."""
    ids = OrderedDict()
    ids["class"] = MEGATRON_TEXT_TOKENIZER
    ids["tokenizer_path"] = tokenizer_path
    for name, value in kwargs:
        ids[name] = str(value)
    return ids


class Tokenizer:
    """Interface: `vocab_size` (unpadded), `eod`, `pad`, `tokenize`, `tokenize_batch`, `detokenize`,
    `unique_identifiers` (Megatron-LM main's, for cache names)."""

    vocab_size: int
    pad: int | None = None

    @property
    def eod(self) -> int:
        """The end-of-document id."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Do the one-time work tokenizing needs (called before preprocessing workers fork)."""

    def tokenize(self, text: str) -> list[int]:
        """The ids of one text."""
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text."""
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        """The text of `ids`."""
        raise NotImplementedError

    def behaviour(self) -> dict:
        """What turns text into ids, as JSON data (`pretrain.tokenizer.behaviour`): equal for the
        same tokenizer however its files were written; its content fingerprint hashes it."""
        raise NotImplementedError

    @property
    def unique_identifiers(self) -> OrderedDict:
        """The identity Megatron-LM main records for the same flags (see `megatron_identity`)."""
        raise NotImplementedError

    def save_pretrained(self, out_dir: str) -> None:
        """Write Hugging Face tokenizer files to `out_dir`."""
        raise UserError(f"{type(self).__name__} cannot be exported to Hugging Face files")


def require_file(path: str | None, flag: str, what: str) -> str:
    """`path` if it names a file; else a UserError naming `flag`."""
    if not path:
        raise UserError(f"{flag} is required: {what}")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: file not found ({what})")
    return path
