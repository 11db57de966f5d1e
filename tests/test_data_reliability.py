"""Damaged or mismatched data never trains: every interior `.idx` damage is found at open, a merge
never shifts data, index caches are bound to the `.idx` they came from and bounds-checked, empty
splits and malformed `--split`/weights are refused before launch, and cache building under a
file-size limit or after a killed builder leaves nothing behind (real processes, real files)."""

import multiprocessing as mp
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from test_data_gpt_dataset import TOKENIZER, random_lengths, write_corpus

from pretrain.data.blends.blended_dataset import BlendedDataset
from pretrain.data.config import DataConfig, parse_blend
from pretrain.data.datasets.gpt_dataset import GPTDataset
from pretrain.data.files.indexed_dataset import HEADER_SIZE, IndexedDataset, IndexedDatasetBuilder
from pretrain.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1")
NAMES = ("document_index", "sample_index", "shuffle_index")


def tool(name, args, limit_bytes=None, timeout=120):
    """Run tools/NAME with a file-size limit (SIGXFSZ ignored, so writes fail with EFBIG)."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        [PY, os.path.join(ROOT, "tools", name), *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        preexec_fn=limit if limit_bytes else None,
    )


def one_error_line(proc):
    """The run failed with exactly one `error:` line and no traceback; return that line."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


# --- .idx validation ----------------------------------------------------------------------------

LENGTHS = [5, 3, 7, 2, 6, 4]  # one sequence per document, uint16


def _dataset(prefix):
    return write_corpus(prefix, LENGTHS)


def _poke(path, offset, fmt, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


LEN_AT = HEADER_SIZE  # int32 lengths
PTR_AT = HEADER_SIZE + 4 * len(LENGTHS)  # int64 pointers
DOC_AT = HEADER_SIZE + 12 * len(LENGTHS)  # int64 document indices


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda p: _poke(p + ".idx", LEN_AT + 4 * 2, "<i", -3),
            "sequence 2 has negative length -3",
        ),
        # a huge interior length: the next pointer no longer follows
        (lambda p: _poke(p + ".idx", LEN_AT + 4 * 2, "<i", 1 << 30), "sequence 3 points to byte"),
        (lambda p: _poke(p + ".idx", PTR_AT + 8 * 4, "<q", 1 << 40), "sequence 4 points to byte"),
        (lambda p: _poke(p + ".idx", PTR_AT + 8 * 1, "<q", -8), "sequence 1 points to byte -8"),
        (lambda p: _poke(p + ".idx", DOC_AT + 8 * 3, "<q", 1), "decrease at position 3"),
        (lambda p: open(p + ".bin", "ab").write(b"\0\0"), "2 bytes at the end belong to no"),
        (lambda p: os.truncate(p + ".bin", 40), "truncated, 40 bytes"),
    ],
)
def test_interior_idx_damage_is_found_at_open(tmp_path, damage, message):
    prefix = _dataset(str(tmp_path / "d"))
    IndexedDataset(prefix)  # the undamaged pair opens
    damage(prefix)
    with pytest.raises(UserError, match=message) as err:
        IndexedDataset(prefix)
    assert str(err.value).startswith(str(tmp_path / "d"))


def test_merge_refuses_a_longer_bin_instead_of_shifting(tmp_path):
    os.makedirs(tmp_path / "in")
    a = write_corpus(str(tmp_path / "in" / "a"), random_lengths(30, seed=1), seed=1)
    b = write_corpus(str(tmp_path / "in" / "b"), random_lengths(30, seed=2), seed=2)
    with open(a + ".bin", "ab") as f:
        f.write(b"\x07\x00")  # one extra uint16 token: every sequence of b would shift by one
    proc = tool("merge_datasets.py", ["--prefixes", a, b, "--output-prefix", str(tmp_path / "m")])
    assert f"{a}.bin: " in one_error_line(proc)
    assert sorted(os.listdir(tmp_path)) == ["in"]  # no output, no temporary


# --- index caches -------------------------------------------------------------------------------


def _gpt(prefix, cache_dir, num_samples=300):
    indexed = IndexedDataset(prefix)
    cfg = DataConfig(
        seq_length=16, seed=5, blend=([prefix], None), split="1", data_cache_path=cache_dir
    )
    ids = np.arange(len(indexed), dtype=np.int32)
    return GPTDataset(indexed, prefix, ids, num_samples, "train", cfg, TOKENIZER)


def _arrays(ds):
    return {n: np.array(getattr(ds, n)) for n in NAMES}


def _samples(ds):
    return np.stack([ds.sample_tokens(i) for i in range(len(ds))])


def test_cache_of_a_reprocessed_prefix_is_rebuilt(tmp_path):
    """The same prefix re-written from another corpus (same sequence count, other lengths): the
    cache built from the old `.idx` must not be used (it would read across document ends)."""
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, random_lengths(60, seed=1), seed=1)
    old = _gpt(prefix, cache)
    old_samples = _samples(old)
    write_corpus(prefix, random_lengths(60, seed=2), seed=2)  # same path, new content
    reused = _gpt(prefix, cache)
    fresh = _gpt(prefix, str(tmp_path / "fresh"))  # the reference: built from the new data
    for n in NAMES:
        np.testing.assert_array_equal(getattr(reused, n), getattr(fresh, n))
    np.testing.assert_array_equal(_samples(reused), _samples(fresh))
    assert not np.array_equal(_samples(fresh)[: len(old_samples)], old_samples[: len(fresh)])
    # Megatron's own names are kept; our fingerprint sits beside them
    names = sorted(f.split("-", 1)[1] for f in os.listdir(cache) if not f.endswith(".lock"))
    assert names == [
        "GPTDataset-train-description.txt",
        "GPTDataset-train-document_index.npy",
        "GPTDataset-train-idx_fingerprint.txt",
        "GPTDataset-train-sample_index.npy",
        "GPTDataset-train-shuffle_index.npy",
    ]


def test_cache_without_fingerprint_is_used_only_if_newer_than_the_idx(tmp_path):
    """A cache Megatron-LM wrote has no fingerprint: adopted when built after the .idx, rebuilt when
    the .idx changed afterwards (re-preprocessed)."""
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, random_lengths(60, seed=8), seed=8)
    _gpt(prefix, cache)
    (fp,) = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("fingerprint.txt")]
    os.remove(fp)
    (sample,) = [
        os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("sample_index.npy")
    ]
    built = os.stat(sample).st_mtime_ns
    _gpt(prefix, cache)  # newer than the .idx: loaded as it is, fingerprint recorded
    assert os.stat(sample).st_mtime_ns == built and os.path.exists(fp)
    os.remove(fp)
    write_corpus(prefix, random_lengths(60, seed=9), seed=9)  # the .idx changes afterwards
    ds = _gpt(prefix, cache)
    np.testing.assert_array_equal(ds.sample_index, _gpt(prefix, str(tmp_path / "ref")).sample_index)
    assert os.stat(sample).st_mtime_ns != built


def _garble(path, value):
    """Keep the `.npy` header, replace every value with `value` (a valid file, garbage content)."""
    arr = np.load(path, mmap_mode="r+")
    arr[...] = value
    arr.flush()


@pytest.mark.parametrize(
    "name,value",
    [
        ("sample_index", 10**6),
        ("sample_index", -1),
        ("document_index", 999),
        ("shuffle_index", 10**6),
    ],
)
def test_cache_with_garbage_values_is_rebuilt(tmp_path, name, value):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, random_lengths(60, seed=3), seed=3)
    expected = _arrays(_gpt(prefix, cache))
    (path,) = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith(f"-{name}.npy")]
    _garble(path, value)
    ds = _gpt(prefix, cache)
    for n in NAMES:
        np.testing.assert_array_equal(getattr(ds, n), expected[n])
    np.testing.assert_array_equal(np.load(path), expected[name])  # the file itself was rebuilt


def test_blend_cache_with_garbage_values_is_rebuilt(tmp_path):
    a = write_corpus(str(tmp_path / "a"), random_lengths(60, seed=4), seed=4)
    b = write_corpus(str(tmp_path / "b"), random_lengths(60, seed=5), seed=5)
    cache = str(tmp_path / "cache")
    parts = [_gpt(a, cache, 100), _gpt(b, cache, 100)]
    first = BlendedDataset(parts, [0.3, 0.7], 120, cache)
    expected = np.array(first.dataset_index), np.array(first.dataset_sample_index)
    for suffix, value in (("-dataset_index.npy", 7), ("-dataset_sample_index.npy", 10**9)):
        (path,) = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith(suffix)]
        _garble(path, value)
        again = BlendedDataset(parts, [0.3, 0.7], 120, cache)
        np.testing.assert_array_equal(again.dataset_index, expected[0])
        np.testing.assert_array_equal(again.dataset_sample_index, expected[1])


def _build_and_hang_mid_write(prefix, cache_dir, started):
    """A cache builder stopped inside the write of its first array (then killed by the test)."""
    from pretrain.data.caches import cache

    real_write = cache._write_chunks

    def write_half_then_hang(f, chunks):
        data = b"".join(bytes(c) for c in chunks)
        real_write(f, [data[: len(data) // 2]])
        f.flush()
        started.set()
        time.sleep(60)

    cache._write_chunks = write_half_then_hang
    _gpt(prefix, cache_dir)


@pytest.mark.timeout(60)
def test_temporaries_of_a_killed_cache_builder_are_removed(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, random_lengths(60, seed=6), seed=6)
    ctx = mp.get_context("fork")
    started = ctx.Event()
    p = ctx.Process(target=_build_and_hang_mid_write, args=(prefix, cache, started))
    p.start()
    assert started.wait(30)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert [f for f in os.listdir(cache) if f.startswith(".")]  # a hidden temporary was left
    ds = _gpt(prefix, cache)
    np.testing.assert_array_equal(ds.sample_index, _gpt(prefix, str(tmp_path / "ref")).sample_index)
    assert not [f for f in os.listdir(cache) if f.startswith(".")]


CACHE_FLAGS = ["--seq-length", "16", "--global-batch-size", "4", "--eval-interval", "10"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def test_cache_building_under_a_file_size_limit(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    write_corpus(prefix, random_lengths(2000, seed=7), seed=7)
    args = ["--data-path", prefix, "--split", "1", "--data-cache-path", cache, "--train-iters"]
    args += ["20000", "--eval-iters", "0", *CACHE_FLAGS, *NULL_TOKENIZER]
    proc = tool("build_data_cache.py", args, limit_bytes=64 * 1024)
    line = one_error_line(proc)
    assert cache in line and "bytes needed" in line and "file too large" in line
    left = os.listdir(cache)  # no temporary, and no part of the index cache
    assert not [f for f in left if f.startswith(".") or f.endswith((".npy", "description.txt"))]
    ok = tool("build_data_cache.py", args)  # without the limit the same command works
    assert ok.returncode == 0, ok.stderr


# --- splits and flags -----------------------------------------------------------------------------


def _cache_tool(prefix, *extra, eval_iters="0"):
    args = ["--data-path", prefix, "--train-iters", "5", "--eval-iters", eval_iters]
    return tool("build_data_cache.py", [*args, *CACHE_FLAGS, *NULL_TOKENIZER, *extra])


def _empty_dataset(prefix, documents):
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(documents):
        b.end_document()  # a document without tokens, as preprocessing writes an empty text
    b.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize(
    "make,split,message",
    [
        (lambda p: write_corpus(p, [20] * 10), "0,0,100", "--split 0,0,100 gives it 0%"),
        (lambda p: _empty_dataset(p, 0), "1", "holds 0 documents"),
        (lambda p: _empty_dataset(p, 12), "1", "holds 12 documents but 0 tokens"),
        (lambda p: write_corpus(p, [20] * 3), "1,99,0", "gives it 0 of the 3 sequences"),
    ],
)
def test_empty_train_split_is_one_line_before_launch(tmp_path, make, split, message):
    prefix = make(str(tmp_path / "d"))
    line = one_error_line(_cache_tool(prefix, "--split", split))
    assert "the train split is empty" in line and message in line
    cache = os.path.join(prefix, "cache")
    built = [f for _, _, files in os.walk(cache) for f in files if f.endswith(".npy")]
    assert built == []  # no index was built


def test_training_refuses_an_empty_train_split_before_launch(tmp_path):
    from training_fixtures import model_flags, train_flags

    from pretrain.cli import parse_args

    prefix = write_corpus(str(tmp_path / "d"), [20] * 10)
    argv = (
        model_flags("gpt2") + train_flags(prefix) + ["--split", "0,0,100", "--vocab-size", "1001"]
    )
    with pytest.raises(UserError, match="the train split is empty: --split 0,0,100"):
        parse_args(argv, env={})


def test_no_validation_split_with_eval_iters_is_said_once(tmp_path):
    prefix = write_corpus(str(tmp_path / "d"), [20] * 10)
    proc = _cache_tool(prefix, "--split", "100,0,0", eval_iters="3")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "no validation data" in line]
    assert len(said) == 1 and "--eval-iters is 3" in said[0] and "0%" in said[0]
    quiet = _cache_tool(prefix, "--split", "100,0,0", eval_iters="0")
    assert "no validation data" not in quiet.stderr


@pytest.mark.parametrize("split", ["1.2.3,1,0", "-1,2,0", "inf,1,0", "nan,1,0", "1e5,1,0", "1,,0"])
def test_split_strings_that_are_not_numbers_are_refused(split):
    with pytest.raises(
        UserError, match=f"--split '{re.escape(split)}': .* not a non-negative number"
    ):
        DataConfig(seq_length=8, blend=(["d"], None), split=split)


def test_bad_split_is_one_line_from_the_tool(tmp_path):
    prefix = write_corpus(str(tmp_path / "d"), [20] * 10)
    line = one_error_line(_cache_tool(prefix, "--split=1.2.3,1,0"))  # today: a ValueError traceback
    assert "--split '1.2.3,1,0': '1.2.3' is not a non-negative number" in line


def test_blend_weights_that_overflow_are_refused():
    with pytest.raises(UserError, match="--data-path: the weights 1e308 1e308 overflow"):
        parse_blend(["1e308", "a", "1e308", "b"], "--data-path")
    with pytest.raises(UserError, match="--data-path: weight inf"):
        parse_blend(["1e999", "a", "1", "b"], "--data-path")
