"""Index cache: corrupted or mismatching caches are rebuilt, concurrent builders (real processes)
build once and all get the same arrays, a builder killed mid-build leaves nothing trusted, and a
node that does not see another node's cache builds its own."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from test_data_gpt_dataset import TOKENIZER, random_lengths, write_corpus

from pretrain.data.config import DataConfig
from pretrain.data.datasets import gpt_dataset
from pretrain.data.datasets.gpt_dataset import GPTDataset
from pretrain.data.files.indexed_dataset import IndexedDataset

NAMES = ("document_index", "sample_index", "shuffle_index")


def make(prefix, cache_dir, num_samples=200):
    indexed = IndexedDataset(prefix)
    cfg = DataConfig(
        seq_length=16, seed=7, blend=([prefix], None), split="1", data_cache_path=cache_dir
    )
    return GPTDataset(
        indexed,
        prefix,
        np.arange(len(indexed), dtype=np.int32),
        num_samples,
        "train",
        cfg,
        TOKENIZER,
    )


def arrays(ds):
    return {n: np.array(getattr(ds, n)) for n in NAMES}


def count_builds(monkeypatch):
    calls = []
    real = gpt_dataset.build_indices

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gpt_dataset, "build_indices", counting)
    return calls


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(str(tmp_path / "corpus"), random_lengths(80, seed=3))


def cache_file(cache_dir, suffix):
    (name,) = [f for f in os.listdir(cache_dir) if f.endswith(suffix)]
    return os.path.join(cache_dir, name)


@pytest.mark.parametrize(
    "damage", ["truncate_npy", "garbage_npy", "wrong_shape_npy", "other_description", "missing_npy"]
)
def test_damaged_cache_is_rebuilt_not_trusted(tmp_path, corpus, monkeypatch, damage):
    cache_dir = str(tmp_path / "cache")
    expected = arrays(make(corpus, cache_dir))
    sample_npy = cache_file(cache_dir, "sample_index.npy")
    if damage == "truncate_npy":
        with open(sample_npy, "r+b") as f:
            f.truncate(os.path.getsize(sample_npy) // 2)
    elif damage == "garbage_npy":
        with open(sample_npy, "wb") as f:
            f.write(b"\x00not an npy file")
    elif damage == "wrong_shape_npy":
        np.save(sample_npy, np.zeros((3, 2), np.int32))
    elif damage == "other_description":
        with open(cache_file(cache_dir, "description.txt"), "a") as f:
            f.write(" ")
    else:
        os.unlink(sample_npy)
    calls = count_builds(monkeypatch)
    rebuilt = make(corpus, cache_dir)
    assert len(calls) == 1
    for n in NAMES:
        np.testing.assert_array_equal(getattr(rebuilt, n), expected[n])
    # and now the cache is whole again: a third open loads without building
    make(corpus, cache_dir)
    assert len(calls) == 1


def _builder_process(prefix, cache_dir, barrier, results, slow):
    os.environ["OMP_NUM_THREADS"] = "1"
    calls = []
    real = gpt_dataset.build_indices

    def slow_build(*args, **kwargs):
        calls.append(1)
        time.sleep(slow)  # keep the lock held while the others arrive
        return real(*args, **kwargs)

    gpt_dataset.build_indices = slow_build
    barrier.wait(timeout=60)
    ds = make(prefix, cache_dir)
    results.put((os.getpid(), len(calls), {n: np.array(getattr(ds, n)).tobytes() for n in NAMES}))


@pytest.mark.timeout(120)
def test_concurrent_builders_build_once_and_agree(tmp_path, corpus):
    ctx = mp.get_context("fork")
    cache_dir = str(tmp_path / "shared_cache")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_builder_process, args=(corpus, cache_dir, barrier, results, 1.0))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    out = [results.get(timeout=100) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sum(built for _, built, _ in out) == 1
    first = out[0][2]
    assert all(o[2] == first for o in out)
    expected = arrays(make(corpus, str(tmp_path / "fresh")))
    assert first == {k: v.tobytes() for k, v in expected.items()}
    # no temporary files left behind
    assert not [f for f in os.listdir(cache_dir) if f.startswith(".")]


def _build_then_hang(prefix, cache_dir, started):
    real = gpt_dataset.build_indices

    def hang(*args, **kwargs):
        started.set()
        time.sleep(60)
        return real(*args, **kwargs)

    gpt_dataset.build_indices = hang
    make(prefix, cache_dir)


@pytest.mark.timeout(60)
def test_builder_killed_mid_build_leaves_no_trusted_cache(tmp_path, corpus, monkeypatch):
    cache_dir = str(tmp_path / "cache")
    expected = arrays(make(corpus, str(tmp_path / "reference")))
    # a complete cache with a *different* content is replaced: seed the dir with a valid cache first
    make(corpus, cache_dir)
    with open(cache_file(cache_dir, "description.txt"), "a") as f:
        f.write("stale")
    ctx = mp.get_context("fork")
    started = ctx.Event()
    p = ctx.Process(target=_build_then_hang, args=(corpus, cache_dir, started))
    p.start()
    assert started.wait(30)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    # the killed builder held the lock and had removed the stale description: nothing is trusted
    assert not [f for f in os.listdir(cache_dir) if f.endswith("description.txt")]
    calls = count_builds(monkeypatch)
    ds = make(corpus, cache_dir)  # the lock died with its holder; we build
    assert len(calls) == 1
    for n in NAMES:
        np.testing.assert_array_equal(getattr(ds, n), expected[n])


def test_node_without_the_shared_cache_builds_its_own(tmp_path, corpus, monkeypatch):
    # node A built into its node-local directory; node B's node-local directory is empty
    node_a, node_b = str(tmp_path / "nodeA"), str(tmp_path / "nodeB")
    a = arrays(make(corpus, node_a))
    calls = count_builds(monkeypatch)
    b = make(corpus, node_b)
    assert len(calls) == 1
    for n in NAMES:
        np.testing.assert_array_equal(getattr(b, n), a[n])
    assert sorted(os.listdir(node_a)) == sorted(os.listdir(node_b))


def test_unwritable_cache_dir_is_a_user_error(tmp_path, corpus):
    from pretrain.errors import UserError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="--data-cache-path"):
        make(corpus, str(blocker / "cache"))
