"""Tokenizer fingerprints: which tokenizer made a dataset or trained a checkpoint, by what it does.

`tokenizer_fingerprint` -> {type, kind, sha256, vocab_size, eod, files, file_sha256}:

- `sha256` (`kind` "content/1"): SHA-256 of the canonical JSON (sorted keys) of the tokenizer's
  `behaviour()` (vocabulary, merges, normaliser, pre-tokeniser, added and special tokens: see
  `pretrain.tokenizer.behaviour`), its vocabulary size and EOD id. It is the same for the same
  tokenizer saved twice, exported by tools/convert_to_hf.py and loaded again, or given as
  GPT2BPETokenizer files and as the tokenizer.json an export wrote for them (the type is not in
  it); one changed merge, vocabulary entry or special token changes it.
- `files` ({role: SHA-256 of the file's bytes}) and `file_sha256`: the digest versions before
  content fingerprints recorded as `sha256` (their records have no `kind`).

`same_tokenizer` compares two content fingerprints by `sha256`; a record without `kind` (an older
sidecar or checkpoint) is compared as those versions did, by file bytes: equal bytes are the same
tokenizer, other bytes are refused as before (the message says it is a byte hash; re-running
preprocess_data.py, or training one checkpoint, records a content fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import os

from pretrain.errors import UserError

KIND = "content/1"


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_files(tok_cfg, tokenizer) -> dict[str, str]:
    """{role: path} of the files that define the tokenizer."""
    kind = tok_cfg.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return {"vocab_file": tok_cfg.vocab_file, "merge_file": tok_cfg.merge_file}
    if kind == "HuggingFaceTokenizer":
        files = {"tokenizer.json": tokenizer.path}
        config = os.path.join(os.path.dirname(tokenizer.path), "tokenizer_config.json")
        if os.path.isfile(config):  # it can choose the EOD token
            files["tokenizer_config.json"] = config
        return files
    if kind == "TikTokenizer":
        return {"tokenizer_model": tok_cfg.tokenizer_model}
    return {}


def _eod(tokenizer) -> int | None:
    try:
        return int(tokenizer.eod)
    except UserError:  # a tokenizer without an end-of-document token (fine without --append-eod)
        return None


def _digest(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_sha256(tokenizer) -> str:
    """SHA-256 of what `tokenizer` does: its `behaviour()`, vocabulary size and EOD id."""
    behaviour = tokenizer.behaviour()
    return _digest(
        {"behaviour": behaviour, "vocab_size": int(tokenizer.vocab_size), "eod": _eod(tokenizer)}
    )


def tokenizer_fingerprint(tok_cfg, tokenizer) -> dict:
    """{type, kind, sha256, vocab_size, eod, files, file_sha256} of a built tokenizer (see the
    module doc): equal `sha256` for tokenizers that give the same ids."""
    files = {role: file_sha256(path) for role, path in tokenizer_files(tok_cfg, tokenizer).items()}
    legacy = {  # exactly what versions before content fingerprints hashed
        "type": tok_cfg.tokenizer_type,
        "files": files,
        "vocab_size": int(tokenizer.vocab_size),
        "eod": _eod(tokenizer),
        "tiktoken_pattern": tok_cfg.tiktoken_pattern,
        "include_special_tokens": tok_cfg.hf_include_special_tokens,
    }
    legacy_sha = hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()
    return {
        "type": tok_cfg.tokenizer_type,
        "kind": KIND,
        "sha256": content_sha256(tokenizer),
        "vocab_size": int(tokenizer.vocab_size),
        "eod": _eod(tokenizer),
        "files": files,
        "file_sha256": legacy_sha,
    }


def _bytes_digest(fp: dict) -> str | None:
    """The file-bytes digest of a fingerprint: an old record's `sha256`, a new one's `file_sha256`."""
    return fp.get("sha256") if "kind" not in fp else fp.get("file_sha256")


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two fingerprints name the same tokenizer: by content when both have it (the same
    `kind`), else by file bytes (a record of an older version)."""
    if a.get("kind") == b.get("kind") == KIND:
        return a.get("sha256") == b.get("sha256")
    x, y = _bytes_digest(a), _bytes_digest(b)
    return x is not None and x == y


def describe_tokenizer(tok: dict) -> str:
    """ "TYPE (sha256 <12 hex>, vocab N)" for a fingerprint, in messages; an older version's
    record says "file sha256" (a hash of its files' bytes)."""
    what = "sha256" if "kind" in tok else "file sha256"
    return (
        f"{tok.get('type')} ({what} {str(tok.get('sha256'))[:12]}, vocab {tok.get('vocab_size')})"
    )
