#!/usr/bin/env python
"""Merge Megatron .bin/.idx datasets into one: `--input DIR` (Megatron's flag: every pair in DIR, in
lexicographic order) or `--prefixes P1 P2 ...` (in the order given). The `.bin` files are copied
verbatim and the index shifted, so the result equals preprocessing the concatenated inputs."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pretrain.data.files.fingerprint import (  # noqa: E402
    dataset_counts,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from pretrain.data.files.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    remove_stray_temporaries,
)
from pretrain.data.files.output_lock import lock_output  # noqa: E402
from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import ignore_file_size_signal, refuse_output  # noqa: E402
from pretrain.tokenizer.fingerprint import describe_tokenizer, same_tokenizer  # noqa: E402


def prefixes_in_dir(directory: str) -> list[str]:
    """Every `.bin/.idx` pair in `directory`, sorted; any other file (but a `.lock`) is an error."""
    if not os.path.isdir(directory):
        raise UserError(f"--input {directory}: not a directory (pass a folder of .bin/.idx pairs)")
    names = sorted(f for f in os.listdir(directory) if os.path.isfile(os.path.join(directory, f)))
    stems = {}
    for name in names:
        stem, ext = os.path.splitext(name)
        if ext == ".lock":
            continue  # the lock file of a preprocess_data.py that runs or failed
        if ext == ".json" and os.path.isfile(os.path.join(directory, stem + ".idx")):
            continue  # a fingerprint sidecar (PREFIX.json), merged separately
        if ext not in (".bin", ".idx"):
            raise UserError(
                f"{os.path.join(directory, name)}: not a .bin/.idx file (move it out of --input)"
            )
        stems.setdefault(stem, set()).add(ext)
    for stem, exts in stems.items():
        if exts != {".bin", ".idx"}:
            missing = ({".bin", ".idx"} - exts).pop()
            raise UserError(
                f"{os.path.join(directory, stem)}{missing}: missing (each dataset needs .bin and .idx)"
            )
    if not stems:
        raise UserError(f"--input {directory}: no .bin/.idx pairs found")
    return [os.path.join(directory, s) for s in sorted(stems)]


def merge(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Concatenate the datasets into `output_prefix` (validated first, written atomically)."""
    from tqdm import tqdm

    datasets = [IndexedDataset(p) for p in prefixes]  # every input is validated before writing
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    lock = lock_output(output_prefix)
    try:
        for path in (get_bin_path(output_prefix), get_idx_path(output_prefix)):
            remove_stray_temporaries(path)
        builder = IndexedDatasetBuilder(get_bin_path(output_prefix), datasets[0].dtype)
        try:
            for ds in tqdm(datasets, desc="merge", unit="dataset", file=sys.stderr, disable=None):
                builder.add_index(ds)  # already validated: the exact bytes are copied
            builder.finalize(get_idx_path(output_prefix))
        except BaseException:
            builder.abort()
            raise
    finally:
        lock.remove()  # finished or failed: no lock file left
    return IndexedDataset(output_prefix)


def merged_sidecar(prefixes: list[str]) -> dict | None:
    """The inputs' fingerprints merged (None if one has none); different tokenizers: UserError."""
    sidecars = [read_sidecar(p) for p in prefixes]
    if any(s is None for s in sidecars):
        return None
    first = sidecars[0]["tokenizer"]
    for prefix, sidecar in zip(prefixes, sidecars, strict=True):
        other = sidecar["tokenizer"]
        if not same_tokenizer(other, first):
            raise UserError(
                f"{prefix}: tokenized with {describe_tokenizer(other)}, "
                f"but {prefixes[0]} with {describe_tokenizer(first)}; "
                "merge only datasets made by one tokenizer (nothing was written)"
            )
    merged = {
        "tokenizer": first,
        "json_keys": sorted({k for s in sidecars for k in s.get("json_keys", [])}),
        "inputs": [i for s in sidecars for i in s.get("inputs", [])],
        "merged_from": [os.path.abspath(p) for p in prefixes],
        "max_token_id": max(int(s["max_token_id"]) for s in sidecars),
    }
    if "tokenizer_flags" in sidecars[0]:  # same tokenizer (checked above): the first's flags
        merged["tokenizer_flags"] = sidecars[0]["tokenizer_flags"]
    return merged


def build_parser() -> argparse.ArgumentParser:
    """The merge tool's flags (Megatron's --input, or --prefixes)."""
    p = argparse.ArgumentParser(description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--input", help="directory holding only .bin/.idx pairs (merged in lexicographic order)"
    )
    src.add_argument("--prefixes", nargs="+", help="dataset prefixes, merged in the order given")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    return p


def main(argv: list[str] | None = None) -> IndexedDataset:
    """Merge the datasets the flags name; print a summary."""
    ignore_file_size_signal()
    args = build_parser().parse_args(argv)
    prefixes = prefixes_in_dir(args.input) if args.input else args.prefixes
    source = "--input" if args.input else "--prefixes"
    for ext in (".bin", ".idx", ".json"):
        inputs = [(source, p + ext) for p in prefixes]
        refuse_output("--output-prefix", args.output_prefix + ext, inputs)
    sidecar = merged_sidecar(prefixes)  # before writing: different tokenizers are refused
    if os.path.exists(sidecar_path(args.output_prefix)):  # never describe the new data with it
        os.remove(sidecar_path(args.output_prefix))
    ds = merge(prefixes, args.output_prefix)
    if sidecar is not None:
        write_sidecar(args.output_prefix, {**sidecar, **dataset_counts(args.output_prefix)})
    tokens = int(ds.sequence_lengths.sum(dtype="int64"))
    print(
        f"merged {len(prefixes)} datasets: {len(ds):,} sequences, {ds.num_documents:,} documents, "
        f"{tokens:,} tokens ({ds.dtype.name})"
    )
    print(f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx")
    if sidecar is not None:
        print(f"wrote {args.output_prefix}.json (the inputs' fingerprints merged)")
    else:
        print("no fingerprint written: some inputs have no PREFIX.json (e.g. made by Megatron-LM)")
    return ds


if __name__ == "__main__":
    exit_on_user_error(main)()
