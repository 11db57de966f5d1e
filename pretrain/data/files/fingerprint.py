"""Data fingerprints: which tokenizer made a dataset, what it holds, and the files of a prefix.

`tools/preprocess_data.py` writes a sidecar `PREFIX.json` beside `PREFIX.bin`/`PREFIX.idx` (which
stay byte-identical to Megatron's): the tokenizer (its `pretrain.tokenizer.fingerprint`: type, a
SHA-256 of what it does, vocabulary size, EOD id; and whether EOD was appended), its flags
(`tokenizer_flags`, absolute paths), the JSON keys, the input files with their sizes, the counts and
the largest token id. `PrefixFiles` reads a prefix's files once for everyone at start-up;
`pretrain/data/checks.py` checks them against a run's tokenizer. Megatron-made data has no
sidecar: its largest token id is computed once in one streaming pass over the `.bin` and kept, for
all such prefixes together, in one file beside the index caches
(`pretrain/data/files/token_stats.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from pretrain.atomic import atomic_write_bytes
from pretrain.data.files import token_stats
from pretrain.data.files.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from pretrain.errors import UserError, check_json_types

FORMAT = "pretrain-data-fingerprint/1"


def sidecar_path(prefix: str) -> str:
    """`PREFIX.json`, beside `PREFIX.bin` and `PREFIX.idx`."""
    return f"{prefix}.json"


_SAMPLE_BLOCKS, _SAMPLE_BYTES = 16, 4096


def bin_sample(prefix: str) -> str:
    """`sha256:HEX` of 16 blocks of 4 KiB at evenly spaced offsets of `PREFIX.bin` (all of a
    smaller file) and its size: 64 KiB read whatever the size, enough to tell the `.bin` a
    sidecar was written for from another file of the same size (not a change of a few bytes)."""
    path = get_bin_path(prefix)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(str(size).encode())
        span = max(size - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLE_BLOCKS):
            digest.update(os.pread(f.fileno(), _SAMPLE_BYTES, span * i // (_SAMPLE_BLOCKS - 1)))
    return f"sha256:{digest.hexdigest()}"


def write_sidecar(prefix: str, sidecar: dict) -> None:
    """Write `PREFIX.json` atomically (a reader sees the old file or the whole new one), with
    the `bin_sample` of the `.bin` it describes."""
    body = {"format": FORMAT, **sidecar, "bin_sample": bin_sample(prefix)}
    data = json.dumps(body, indent=2, sort_keys=False) + "\n"
    atomic_write_bytes(sidecar_path(prefix), data.encode("utf-8"))


def read_sidecar(prefix: str) -> dict | None:
    """The sidecar of `prefix`, or None when there is none (Megatron-made data)."""
    path = sidecar_path(prefix)
    try:
        with open(path, encoding="utf-8") as f:
            sidecar = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(
            f"{path}: unreadable data fingerprint ({err}); delete it or re-run preprocess_data.py"
        ) from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        raise UserError(f"{path}: not a {FORMAT} file (delete it or re-run preprocess_data.py)")
    _check_types(sidecar, path)
    return sidecar


# the entries readers use -> their JSON types (None: may be null)
_SIDECAR_TYPES = {
    "tokenizer": (dict,),
    "tokenizer_flags": (dict,),
    "max_token_id": (int,),
    "documents": (int,),
    "sequences": (int,),
    "tokens": (int,),
    "dtype": (str,),
    "json_keys": (list,),
    "inputs": (list,),
    "bin_sample": (str,),
}
_TOKENIZER_TYPES = {"type": (str,), "sha256": (str,), "vocab_size": (int,), "eod": (int, None)}


def _check_types(sidecar: dict, path: str) -> None:
    """Refuse (one line naming the file, the entry and the type it needs) an entry of the wrong
    JSON type."""
    fix = "delete it or re-run preprocess_data.py"
    check_json_types(sidecar, _SIDECAR_TYPES, path=path, fix=fix)
    if "tokenizer" in sidecar:
        check_json_types(
            sidecar["tokenizer"], _TOKENIZER_TYPES, path=path, fix=fix, prefix="tokenizer."
        )


def check_sidecar_matches(prefix: str, sidecar: dict, files: PrefixFiles) -> None:
    """Refuse a sidecar that describes other data than `prefix`'s .bin/.idx (they were replaced
    after it was written): its counts and dtype must be those of the index, its `bin_sample`
    (sidecars written before it existed have none) that of the `.bin`."""
    actual = dataset_counts(prefix, files)
    for key, value in actual.items():
        if key in sidecar and sidecar[key] != value:
            raise UserError(
                f"{sidecar_path(prefix)}: records {key} {sidecar[key]}, but {get_idx_path(prefix)} "
                f"has {value}: the .bin/.idx were replaced after the fingerprint was written; "
                f"delete {sidecar_path(prefix)} (the data is then checked by a scan) or re-run "
                f"preprocess_data.py"
            )
    if "bin_sample" in sidecar and sidecar["bin_sample"] != bin_sample(prefix):
        raise UserError(
            f"{get_bin_path(prefix)}: is not the file {sidecar_path(prefix)} describes (its "
            f"sampled bytes differ): the .bin was replaced or damaged after the fingerprint was "
            "written; restore it or re-run preprocess_data.py"
        )


def input_files(sources: Iterable[str]) -> list[dict]:
    """[{path, bytes}] of the preprocessing inputs (folders: the sum of their files)."""
    out = []
    for path in sources:
        if os.path.isdir(path):
            size = sum(
                os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(path) for f in fs
            )
        else:
            size = os.path.getsize(path)
        out.append({"path": os.path.abspath(path), "bytes": size})
    return out


def dataset_counts(prefix: str, files: PrefixFiles | None = None) -> dict:
    """{documents, sequences, tokens, dtype} of a written dataset, from its .idx."""
    ds = (files or PrefixFiles()).indexed(prefix)
    return {
        "documents": ds.num_documents,
        "sequences": len(ds),
        "tokens": int(ds.sequence_lengths.sum(dtype=np.int64)),
        "dtype": ds.dtype.name,
    }


def largest_token_id(prefix: str, cache_dir: str | None = None) -> int:
    """From the sidecar, else from a cached streaming pass over the .bin (computed once)."""
    return PrefixFiles(cache_dir).largest_token_id(prefix)


class PrefixFiles:
    """The files of data prefixes, each opened or read at most once per instance.

    Start-up shares one instance between the checks before launch (`check_data`,
    `check_splits_before_launch`), the blend plan, the dataset builder and the checkpoints'
    `data_fingerprints`, so that each prefix's O(sequences) `.idx` validation, its sidecar and
    its largest token id (a scan of the `.bin` without a sidecar, kept in one file for all
    prefixes: `pretrain/data/files/token_stats.py`) are done once per process.
    A caller checks that the pair exists first, with its own message.
    """

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir
        """Where scans of data without a sidecar are cached (--data-cache-path)."""
        self._indexed: dict[str, IndexedDataset] = {}
        self._sidecars: dict[str, dict | None] = {}
        self._largest: dict[str, int] = {}

    def exists(self, prefix: str) -> bool:
        """Whether `prefix`'s `.bin`/`.idx` pair exists (no file-system lookup once opened)."""
        return prefix in self._indexed or IndexedDataset.exists(prefix)

    def indexed(self, prefix: str) -> IndexedDataset:
        """`prefix`'s dataset, opened (so validated) on first use."""
        if prefix not in self._indexed:
            self._indexed[prefix] = IndexedDataset(prefix)
        return self._indexed[prefix]

    def sidecar(self, prefix: str) -> dict | None:
        """`read_sidecar(prefix)`, read on first use (treat it as read-only)."""
        if prefix not in self._sidecars:
            self._sidecars[prefix] = read_sidecar(prefix)
        return self._sidecars[prefix]

    def largest_token_id(self, prefix: str) -> int:
        """From the sidecar, else from a cached streaming pass over the .bin (computed once)."""
        return self.largest_token_ids([prefix])[prefix]

    def largest_token_ids(self, prefixes: Sequence[str]) -> dict[str, int]:
        """{prefix: largest token id} from the sidecars, else from the scans of the .bin files
        kept in one file (`pretrain/data/files/token_stats.py`), scanning the new ones once."""
        unknown = [p for p in dict.fromkeys(prefixes) if p not in self._largest]
        scan = {}
        for prefix in unknown:
            sidecar = self.sidecar(prefix)
            if sidecar is not None and "max_token_id" in sidecar:
                self._largest[prefix] = int(sidecar["max_token_id"])
            else:
                scan[prefix] = self.indexed(prefix)
        if scan:
            path = token_stats.stats_path(self.cache_dir, next(iter(scan)))
            self._largest.update(token_stats.largest_token_ids(scan, path))
        return {p: self._largest[p] for p in prefixes}
