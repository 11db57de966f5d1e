#!/usr/bin/env python
"""Summarise a Megatron .bin/.idx dataset (sequences, documents, tokens, dtype, length percentiles)
and decode documents back to text: `--document I` with the tokenizer flags used to preprocess it,
or without them the tokenizer the data's sidecar PREFIX.json names (made by preprocess_data.py);
else the ids are printed. Output piped into a reader that stops early (`| head`) ends quietly."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pretrain.data.files.fingerprint import read_sidecar, sidecar_path  # noqa: E402
from pretrain.data.files.indexed_dataset import IndexedDataset  # noqa: E402
from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.flag_help import RawDescriptionHelpFormatter  # noqa: E402
from pretrain.tokenizer import TokenizerConfig, add_tokenizer_args, build_tokenizer  # noqa: E402
from pretrain.tokenizer.fingerprint import same_tokenizer, tokenizer_fingerprint  # noqa: E402

PERCENTILES = (0, 50, 90, 99, 100)


def summary(ds: IndexedDataset) -> dict:
    """Counts and length percentiles of a dataset."""
    lengths = ds.sequence_lengths
    per_doc = np.diff(ds.document_indices)
    pct = (
        np.percentile(lengths, PERCENTILES).round().astype(int).tolist()
        if len(lengths)
        else [0] * len(PERCENTILES)
    )
    return {
        "sequences": len(ds),
        "documents": ds.num_documents,
        "empty_documents": int((per_doc == 0).sum()),
        "tokens": int(lengths.sum(dtype=np.int64)),
        "dtype": ds.dtype.name,
        "sequence_length_percentiles": dict(zip((f"p{p}" for p in PERCENTILES), pct, strict=False)),
    }


def document_tokens(ds: IndexedDataset, index: int) -> list[np.ndarray]:
    """The sequences of document `index` (UserError if out of range)."""
    if not 0 <= index < ds.num_documents:
        raise UserError(
            f"--document {index}: out of range (the dataset has {ds.num_documents} documents)"
        )
    start, end = int(ds.document_indices[index]), int(ds.document_indices[index + 1])
    return [ds[i] for i in range(start, end)]


def sidecar_tokenizer(prefix: str):
    """The tokenizer PREFIX.json names, or None and a note saying why it cannot decode (no
    sidecar, no tokenizer flags in it, files missing, or files changed since preprocessing)."""
    sidecar = read_sidecar(prefix)
    if sidecar is None or "tokenizer_flags" not in sidecar:
        return None, f"{sidecar_path(prefix)} names no tokenizer"
    cfg = TokenizerConfig.from_record(sidecar["tokenizer_flags"])
    try:
        tokenizer = build_tokenizer(cfg)
    except UserError as err:
        return None, f"the tokenizer {sidecar_path(prefix)} names cannot be loaded: {err}"
    if not same_tokenizer(tokenizer_fingerprint(cfg, tokenizer), sidecar["tokenizer"]):
        return None, f"the tokenizer files {sidecar_path(prefix)} names changed since preprocessing"
    return tokenizer, None


def _tokenizer(args):
    """The flags' tokenizer, else the sidecar's (a note on stderr when there is none)."""
    if args.tokenizer_type:
        return build_tokenizer(TokenizerConfig.from_args(args))
    tokenizer, why = sidecar_tokenizer(args.input)
    if tokenizer is None:
        print(f"note: printing token ids: {why} (give the tokenizer flags)", file=sys.stderr)
    return tokenizer


def main(argv: list[str] | None = None) -> dict:
    """Print the summary (and decoded documents) as JSON; returns it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", required=True, metavar="PREFIX", help="dataset prefix (PREFIX.bin / PREFIX.idx)"
    )
    p.add_argument(
        "--document", type=int, action="append", default=[], help="decode document N (repeatable)"
    )
    add_tokenizer_args(p)
    args = p.parse_args(argv)
    ds = IndexedDataset(args.input)
    info = summary(ds)
    pct = ", ".join(f"{k} {v:,}" for k, v in info["sequence_length_percentiles"].items())
    print(
        f"{args.input}: {info['sequences']:,} sequences, {info['documents']:,} documents "
        f"({info['empty_documents']:,} empty), {info['tokens']:,} tokens, dtype {info['dtype']}"
    )
    print(f"sequence length: {pct}")
    tokenizer = _tokenizer(args) if args.document else None
    for index in args.document:
        sequences = document_tokens(ds, index)
        print(
            f"--- document {index}: {len(sequences)} sequences, {sum(len(s) for s in sequences):,} tokens"
        )
        for seq in sequences:
            print(tokenizer.detokenize(seq) if tokenizer else " ".join(map(str, seq.tolist())))
    return info


if __name__ == "__main__":
    exit_on_user_error(main)()
