"""One file per blend and split that holds every index array the blend needs.

Megatron's caches are files per prefix (a description and three `.npy` per GPTDataset, and one
more for our `.idx` fingerprint): a blend of 10,000 prefixes makes every rank open 50,000 files
at start-up, a metadata storm on a shared file system. This file holds the same arrays for all
of a split's prefixes plus the blend's own, so a rank opens one file per split and maps it once.
Megatron's per-prefix files are still written beside it (`pretrain/data/blends/blend_build.py`), so
Megatron-LM finds its caches, and ours are built from Megatron's where they exist.

Layout (`{dir}/{md5}-BlendCache-{split}.bin`, md5 of the request's description):

    MAGIC | <Q header bytes | header (JSON) | description (UTF-8) | zeros to a multiple of 64 |
    payload: arrays back to back, each at a multiple of 64

The header names the payload's arrays (dtype, shape, offset), its length and xxh3-128 digest,
and one part per blended dataset: its position in the blend's prefix list, its sample count, the
fingerprint of the `.idx` it was built from, and where its document, sample and shuffle indices
lie (arrays of one dtype are concatenated: `sample_index<i4` holds the rows of every prefix
whose sample index is int32, ...). A reader uses the file only if the description equals its own and
the payload's digest its bytes (written once, atomically; anything else is rebuilt); the caller
compares the parts with what it expects (positions, fingerprints, layouts).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from pretrain.atomic import atomic_write

MAGIC = b"PRETRAIN-BLEND-CACHE/1\n"
_LENGTH = struct.Struct("<Q")
_ALIGN = 64
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
BLEND_NAMES = ("dataset_index", "dataset_sample_index")
_JOIN_BYTES = 256 << 20


@dataclass(frozen=True)
class Part:
    """One blended GPTDataset as the file holds it."""

    position: int
    """Its prefix's position in the blend's prefix list."""
    num_samples: int | None
    """The samples it was built for (more than requested when the blend needed more)."""
    fingerprint: str
    """`IndexedDataset.fingerprint` of the `.idx` it was built from."""
    arrays: dict[str, np.ndarray]
    """document_index, sample_index, shuffle_index (views into the mapped file once read)."""


def path_for(directory: str, description_hash: str, split: str) -> str:
    """`{directory}/{md5}-BlendCache-{split}.bin`."""
    return os.path.join(directory, f"{description_hash}-BlendCache-{split}.bin")


def _group(arr: np.ndarray, name: str) -> str:
    """The payload array holding `arr`: one per index kind and dtype (`sample_index<i4`)."""
    return name + arr.dtype.str


def _layout(parts: Sequence[Part], blend: dict[str, np.ndarray]):
    """(header tables, [(offset, array)] in payload order, payload length): a group's pieces
    joined into one array (one copy in C, not thousands of small writes) up to `_JOIN_BYTES`,
    beyond that passed as they are (no second copy of a big blend's indices)."""
    groups: dict[str, list[np.ndarray]] = {}
    rows: dict[str, int] = {}  # rows of each group so far
    where = []
    for part in parts:
        spans = {}
        for name in INDEX_NAMES:
            arr = part.arrays[name]
            group = _group(arr, name)
            groups.setdefault(group, []).append(arr)
            start = rows.get(group, 0)
            rows[group] = start + len(arr)
            spans[name] = [group, start, start + len(arr)]
        where.append([part.position, part.num_samples, part.fingerprint, spans])
    for name in BLEND_NAMES:
        groups[name] = [blend[name]]
    tables, chunks, offset = {}, [], 0
    for group, pieces in groups.items():
        shape = [sum(len(piece) for piece in pieces), *pieces[0].shape[1:]]
        tables[group] = [pieces[0].dtype.str, shape, offset]
        if len(pieces) > 1 and sum(piece.nbytes for piece in pieces) <= _JOIN_BYTES:
            pieces = [np.concatenate(pieces)]
        for piece in pieces:
            chunks.append((offset, np.ascontiguousarray(piece)))
            offset += piece.nbytes
        offset = -(-offset // _ALIGN) * _ALIGN
    return {"arrays": tables, "parts": where}, chunks, offset


def _blocks(chunks, payload_bytes: int) -> list:
    """The payload as buffers for `f.write`: the arrays and the zeros between groups."""
    blocks, end = [], 0
    for offset, arr in chunks:
        blocks += [bytes(offset - end), memoryview(arr).cast("B")]
        end = offset + arr.nbytes
    return [*blocks, bytes(payload_bytes - end)]


def write(path: str, description: str, parts: Sequence[Part], blend: dict[str, np.ndarray]) -> None:
    """Write the file atomically (temporary name, fsync, rename)."""
    header, chunks, payload_bytes = _layout(parts, blend)
    blocks = _blocks(chunks, payload_bytes)
    digest = xxhash.xxh3_128()
    for block in blocks:
        digest.update(block)
    text = description.encode("utf-8")
    header.update(
        description_bytes=len(text), payload_bytes=payload_bytes, payload_xxh3=digest.hexdigest()
    )
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    start = len(MAGIC) + _LENGTH.size + len(head) + len(text)
    padding = -start % _ALIGN

    def fill(f) -> None:
        f.write(MAGIC + _LENGTH.pack(len(head)) + head + text + bytes(padding))
        for block in blocks:
            f.write(block)

    atomic_write(path, fill)


def _read_header(f, description: str) -> tuple[dict | None, str]:
    if f.read(len(MAGIC)) != MAGIC:
        return None, "not a blend cache file"
    (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
    try:
        header = json.loads(f.read(length))
    except (ValueError, UnicodeDecodeError):
        return None, "damaged header"
    text = f.read(header.get("description_bytes", -1))
    if text != description.encode("utf-8"):
        return None, "another description"
    header["payload_offset"] = -(-f.tell() // _ALIGN) * _ALIGN
    return header, ""


def read(path: str, description: str) -> tuple[tuple[list[Part], dict] | None, str]:
    """((parts, blend arrays), "") from the file at `path` if it holds `description` and its
    payload is intact, else (None, why not). The arrays are views into one read-only mapping."""
    try:
        with open(path, "rb") as f:
            header, why = _read_header(f, description)
            if header is None:
                return None, why
            start, size = header["payload_offset"], header["payload_bytes"]
            if os.fstat(f.fileno()).st_size != start + size:
                return None, "truncated"
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        return None, "no blend cache"
    except (OSError, ValueError, KeyError, struct.error) as err:
        return None, f"unreadable ({err})"
    payload = memoryview(mapped)[start : start + size]
    if xxhash.xxh3_128_hexdigest(payload) != header["payload_xxh3"]:
        return None, "its payload does not match its digest (damaged)"
    groups = {
        name: np.frombuffer(payload, np.dtype(dtype), int(np.prod(shape)), offset).reshape(shape)
        for name, (dtype, shape, offset) in header["arrays"].items()
    }
    parts = [
        Part(
            position=position,
            num_samples=num_samples,
            fingerprint=fingerprint,
            arrays={name: groups[group][lo:hi] for name, (group, lo, hi) in spans.items()},
        )
        for position, num_samples, fingerprint, spans in header["parts"]
    ]
    return (parts, {name: groups[name] for name in BLEND_NAMES}), ""
