"""Every file of a step belongs to that step: a fingerprint of each file, recorded at commit.

A file copied in from another step has this step's name and, for weights or optimizer state, its
size too, so the completeness check (`integrity.step_problem`) passes it, and the files that
record no position of their own (DeepSpeed's `*_optim_states.pt`, DCP's `.metadata` and
`.distcp`) would load silently. So the saver records in `pretrain_meta.json`, beside each file's
size, its fingerprint (`record`), and every reader compares them before it opens any file of the
step (`mismatch`, `check`).

A fingerprint is a BLAKE2b-128 digest of the file's size and of `BLOCKS` blocks of `BLOCK` bytes
at offsets that depend only on the size: the first block, the last one and the others evenly
spaced between; a file of at most `BLOCKS * BLOCK` bytes (2 MiB) is digested whole. It costs at
most 2 MiB read per file, whatever its size, and needs nothing from the writer, so it covers the
files other libraries write (DeepSpeed's, DCP's, a background save's): rank 0 reads them back
once every rank's files are on disk.

What it proves: the size, and every sampled block (every byte of a small file), are what the save
wrote. Weights and optimizer state change almost everywhere from one step to the next, so a file
of another step differs in nearly every block. What it cannot see: a change confined to the bytes
between the sampled blocks (a flipped bit, a partial overwrite there), or another step's file
whose sampled blocks are byte for byte this step's (tensors that did not change). Checkpoints
written before fingerprints (no such entry) are not checked.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

from pretrain.checkpoint.format import FINGERPRINTS_KEY, META_FILE
from pretrain.errors import UserError

SCHEME = "blake2b128-size-32x64KiB"
"""The name recorded with the fingerprints (a reader refuses one it does not know)."""
BLOCK = 64 * 1024
BLOCKS = 32
_READERS = 8  # files read at once (a parallel file system serves several reads better than one)


def _offsets(size: int) -> list[int]:
    """Where the sampled blocks of a file of `size` bytes start: head, tail, evenly between."""
    span = size - BLOCK
    return [i * span // (BLOCKS - 1) for i in range(BLOCKS)]


def fingerprint(path: str) -> str:
    """The hex fingerprint of the file at `path` (see the module docstring)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
        if size <= BLOCK * BLOCKS:
            digest.update(f.read())
        else:
            for offset in _offsets(size):
                digest.update(os.pread(f.fileno(), BLOCK, offset))
    return digest.hexdigest()


def _fingerprints(step_dir: str, names: list[str]) -> list[str]:
    """The fingerprints of `names` in `step_dir`, in order, read a few files at a time."""
    paths = [os.path.join(step_dir, name) for name in names]
    with ThreadPoolExecutor(max_workers=max(1, min(_READERS, len(paths)))) as pool:
        return list(pool.map(fingerprint, paths))


def record(step_dir: str, names) -> dict:
    """The `pretrain_meta.json` entry for the files `names` of `step_dir` (at commit)."""
    names = sorted(names)
    return {
        "scheme": SCHEME,
        "files": dict(zip(names, _fingerprints(step_dir, names), strict=True)),
    }


def _recorded(entry, meta_path: str) -> dict[str, str]:
    """{file name: fingerprint} of a metadata's entry; `UserError` (one line) if it is damaged
    or of a scheme this version does not know."""
    files = entry.get("files") if isinstance(entry, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise UserError(
            f"{meta_path}: its {FINGERPRINTS_KEY!r} entry is damaged (restore the file, or resume "
            f"from another step)"
        )
    if entry.get("scheme") != SCHEME:
        raise UserError(
            f"{meta_path}: file fingerprints of scheme {entry.get('scheme')!r}, which this version "
            f"does not know ({SCHEME!r}); load it with the version that wrote it"
        )
    return files


def mismatch(step_dir: str, meta: dict, part: slice = slice(None)) -> str | None:
    """One line naming the first file (of the sorted recorded names, `part` of them: a rank's
    share) whose fingerprint is not the one `meta` recorded at save, or None when all agree or
    `meta` records none (a checkpoint from before fingerprints)."""
    entry = meta.get(FINGERPRINTS_KEY)
    if entry is None:
        return None
    meta_path = os.path.join(step_dir, META_FILE)
    try:
        recorded = _recorded(entry, meta_path)
        names = sorted(recorded)[part]
        actual = _fingerprints(step_dir, names)
    except UserError as err:
        return str(err)
    except OSError as err:
        return (
            f"{err.filename}: cannot be read ({err.strerror or err}); the checkpoint is damaged: "
            f"restore the file, or resume from another step"
        )
    for name, found in zip(names, actual, strict=True):
        if found != recorded[name]:
            return (
                f"{os.path.join(step_dir, name)}: not the file this step saved (its fingerprint "
                f"differs from the one {meta_path} recorded): it was copied in from another step "
                f"or changed since; put back this step's own file, or resume from another step"
            )
    return None


def check(step_dir: str, meta: dict) -> None:
    """`UserError` with `mismatch`'s line (the tools, one process reading every file)."""
    problem = mismatch(step_dir, meta)
    if problem is not None:
        raise UserError(problem)
