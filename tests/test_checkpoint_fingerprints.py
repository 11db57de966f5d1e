"""File fingerprints (pretrain/checkpoint/fingerprints.py) on real files: what a change they see,
what they cannot, and the one line a reader gets. The runs that record and check them at save and
load are tests/test_load_intent.py's."""

import hashlib
import os

import pytest

from pretrain.checkpoint import fingerprints
from pretrain.checkpoint.fingerprints import BLOCK, BLOCKS, SCHEME, mismatch, record
from pretrain.checkpoint.format import FINGERPRINTS_KEY, META_FILE
from pretrain.errors import UserError

SMALL = BLOCK * BLOCKS  # digested whole up to here
BIG = SMALL + 7 * BLOCK + 12345  # blocks sampled: gaps between them


def _write(path, size: int, seed: int = 0) -> None:
    """`size` bytes that differ everywhere from another seed's."""
    out, counter = bytearray(), 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}-{counter}".encode()).digest()
        counter += 1
    path.write_bytes(bytes(out[:size]))


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _step(tmp_path, sizes: dict[str, int]) -> dict:
    """A step folder with files of `sizes` and the metadata entry the saver records."""
    for seed, (name, size) in enumerate(sorted(sizes.items())):
        _write(tmp_path / name, size, seed)
    return {FINGERPRINTS_KEY: record(str(tmp_path), sizes)}


def test_a_file_of_another_step_with_the_same_name_and_size_is_named(tmp_path):
    meta = _step(tmp_path, {"a.pt": 100, "b.distcp": BIG, "c.pt": 10})
    assert meta[FINGERPRINTS_KEY]["scheme"] == SCHEME
    assert mismatch(str(tmp_path), meta) is None
    _write(tmp_path / "b.distcp", BIG, seed=99)  # another step's: same size, other bytes
    line = mismatch(str(tmp_path), meta)
    assert line.startswith(f"{tmp_path / 'b.distcp'}: not the file this step saved"), line
    assert f"the one {tmp_path / META_FILE} recorded" in line
    assert "put back this step's own file, or resume from another step" in line


@pytest.mark.parametrize("offset", [0, SMALL // 2, SMALL - 1])
def test_every_byte_of_a_small_file_counts(tmp_path, offset):
    meta = _step(tmp_path, {"f": SMALL})
    _flip(tmp_path / "f", offset)
    assert str(tmp_path / "f") in mismatch(str(tmp_path), meta)


def test_a_big_file_is_sampled_head_tail_and_between(tmp_path):
    """Every sampled block counts; a byte between two blocks is what a fingerprint cannot see
    (docs/RELIABILITY.md says so)."""
    meta = _step(tmp_path, {"f": BIG})
    span = BIG - BLOCK
    starts = [i * span // (BLOCKS - 1) for i in range(BLOCKS)]
    assert starts[0] == 0 and starts[-1] + BLOCK == BIG
    for offset in (0, BIG - 1, starts[5] + BLOCK // 2):
        _flip(tmp_path / "f", offset)
        assert mismatch(str(tmp_path), meta) is not None, offset
        _flip(tmp_path / "f", offset)  # back
    assert mismatch(str(tmp_path), meta) is None
    gap = starts[5] + BLOCK  # the first byte after block 5, before block 6
    assert gap < starts[6]
    _flip(tmp_path / "f", gap)
    assert mismatch(str(tmp_path), meta) is None


def test_ranks_share_the_files(tmp_path):
    """A rank's part (every world-th sorted name) reads only its files."""
    meta = _step(tmp_path, {"a": 10, "b": 10, "c": 10})
    _write(tmp_path / "b", 10, seed=7)
    assert mismatch(str(tmp_path), meta, slice(0, None, 2)) is None  # a, c
    assert str(tmp_path / "b") in mismatch(str(tmp_path), meta, slice(1, None, 2))


def test_older_checkpoints_and_damaged_entries(tmp_path):
    """No entry: nothing to compare (a checkpoint from before fingerprints). A damaged entry, a
    scheme this version does not know, or a file that went missing: one line."""
    meta = _step(tmp_path, {"a": 10})
    assert mismatch(str(tmp_path), {}) is None
    meta_path = tmp_path / META_FILE
    damaged = {FINGERPRINTS_KEY: {"scheme": SCHEME, "files": {"a": 3}}}
    assert mismatch(str(tmp_path), damaged) == (
        f"{meta_path}: its 'fingerprints' entry is damaged (restore the file, or resume from "
        f"another step)"
    )
    newer = {FINGERPRINTS_KEY: {**meta[FINGERPRINTS_KEY], "scheme": "sha256-all"}}
    assert "scheme 'sha256-all', which this version does not know" in mismatch(str(tmp_path), newer)
    os.remove(tmp_path / "a")
    assert mismatch(str(tmp_path), meta).startswith(f"{tmp_path / 'a'}: cannot be read")
    with pytest.raises(UserError, match="cannot be read"):
        fingerprints.check(str(tmp_path), meta)
