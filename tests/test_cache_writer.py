"""Megatron's per-prefix index caches of a blend are written on a thread of their own
(`pretrain/data/caches/cache_writer.py`): the builder hands back the blend (read from the consolidated
file) without waiting for them, no description is written before the arrays, and a writer that
fails is a warning for training but an error for `build_data_cache.py`, whose job the files are."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_data_cache_tool import run_tool
from test_data_gpt_dataset import TOKENIZER, random_lengths, write_corpus

from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.caches import cache_writer
from pretrain.data.config import DataConfig
from pretrain.data.datasets import gpt_dataset
from pretrain.errors import UserError

SAMPLES = 600
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def prefixes(tmp_path):
    return [
        write_corpus(str(tmp_path / f"part{i}"), random_lengths(60, seed=i), seed=i)
        for i in range(3)
    ]


def config(prefixes, cache) -> DataConfig:
    return DataConfig(
        seq_length=16,
        seed=3,
        blend=(prefixes, [0.5, 0.3, 0.2]),
        split="100,0,0",
        data_cache_path=str(cache),
    )


def per_prefix_files(cache, suffix):
    return sorted(f for f in os.listdir(cache) if "-GPTDataset-" in f and f.endswith(suffix))


def test_the_blend_is_ready_before_megatrons_files_and_descriptions_come_last(
    prefixes, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    release, first_written = threading.Event(), threading.Event()
    real = cache_writer.save_arrays
    niceness = []  # the writer's, as it writes

    def held(request, arrays, **kwargs):  # the first prefix's arrays go through, then wait
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if first_written.is_set():
            assert release.wait(60)
        real(request, arrays, **kwargs)
        first_written.set()

    monkeypatch.setattr(cache_writer, "save_arrays", held)
    try:
        train, valid, test = build_train_valid_test_datasets(
            config(prefixes, cache), TOKENIZER, [SAMPLES, 0, 0]
        )
        assert valid is None and test is None and len(train) == SAMPLES
        assert len(train[SAMPLES - 1]["tokens"]) == 16  # read through the consolidated file
        assert first_written.wait(60)
        assert len(per_prefix_files(cache, ".npy")) == 3  # one prefix's arrays: the writer is held
        assert per_prefix_files(cache, "-description.txt") == []  # none before the flush
        # the writer yields the CPU to the ranks' own work (nice + 10), the builder does not
        ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert niceness[0] == min(19, ours + 10), (niceness, ours)
        release.set()
        cache_writer.wait_all()
        assert len(per_prefix_files(cache, ".npy")) == 9
        assert len(per_prefix_files(cache, "-description.txt")) == 3
    finally:
        release.set()

    # the written caches are complete: without the consolidated file, the blend loads every
    # prefix's arrays from them
    (consolidated,) = [f for f in os.listdir(cache) if "-BlendCache-" in f and f.endswith(".bin")]
    os.remove(cache / consolidated)
    built = []
    real_build = gpt_dataset.build_indices
    monkeypatch.setattr(
        gpt_dataset, "build_indices", lambda *a, **k: built.append(1) or real_build(*a, **k)
    )
    again = build_train_valid_test_datasets(config(prefixes, cache), TOKENIZER, [SAMPLES, 0, 0])[0]
    cache_writer.wait_all()
    assert built == []
    for ours, theirs in zip(again.datasets, train.datasets, strict=True):
        np.testing.assert_array_equal(ours.sample_index, theirs.sample_index)


def blocked_cache(prefixes, tmp_path, name):
    """A cache folder where one prefix's document_index.npy cannot be written (a folder holds
    its name); returns (folder, the blocked path)."""
    probe = tmp_path / "probe"
    build_train_valid_test_datasets(config(prefixes, probe), TOKENIZER, [SAMPLES, 0, 0])
    cache_writer.wait_all()
    blocked = tmp_path / name / per_prefix_files(probe, "-document_index.npy")[1]
    os.makedirs(blocked)
    return tmp_path / name, str(blocked)


TRAINING_START = """
import logging, sys
sys.path.insert(0, {tests!r})
from test_cache_writer import SAMPLES, TOKENIZER, config
from pretrain.data.builder import build_train_valid_test_datasets
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
train = build_train_valid_test_datasets(config({prefixes!r}, {cache!r}), TOKENIZER,
                                        [SAMPLES, 0, 0])[0]
print("samples", len(train), len(train[SAMPLES - 1]["tokens"]))
"""


@pytest.mark.timeout(240)
def test_a_failing_writer_warns_training_and_fails_the_tool(prefixes, tmp_path):
    # training: the blend is served from its consolidated file, one warning names the file
    cache, blocked = blocked_cache(prefixes, tmp_path, "training")
    code = TRAINING_START.format(
        tests=os.path.dirname(__file__), prefixes=prefixes, cache=str(cache)
    )
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"samples {SAMPLES} 16" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "index caches for Megatron-LM not all written" in warnings[0]
    assert blocked in warnings[0] and "--data-cache-path" in warnings[0]
    assert "Traceback" not in proc.stderr

    # the tool: the error line naming the file (and no warning before it)
    cache, blocked = blocked_cache(prefixes, tmp_path, "tool")
    data = ["--data-path", "0.5", prefixes[0], "0.3", prefixes[1], "0.2", prefixes[2]]
    proc = run_tool(
        data
        + ["--split", "100,0,0", "--seq-length", "16", "--train-samples", str(SAMPLES)]
        + ["--global-batch-size", "1", "--eval-iters", "0", "--seed", "3"]
        + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
        + ["--data-cache-path", str(cache)]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "not all written" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and blocked in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_wait_all_raises_what_stopped_a_writer(tmp_path):
    from pretrain.data.caches.cache import CacheRequest

    (tmp_path / "x-a.npy").mkdir()  # the array's name is taken by a folder
    request = CacheRequest(
        directory=str(tmp_path),
        base_name="x",
        description="{}",
        expect={"a": (np.dtype("<i4"), (3,))},
        build=lambda: {},
    )
    writer = cache_writer.CacheWriter("test")
    writer.add(request, {"a": np.arange(3, dtype=np.int32)})
    writer.finish()
    with pytest.raises(UserError, match="x-a.npy"):
        cache_writer.wait_all()
    assert not os.path.exists(tmp_path / "x-description.txt")


def test_stray_temporaries_go_before_the_build_and_a_live_builders_stay(
    prefixes, tmp_path, monkeypatch
):
    # this host's hidden temporary of one of the blend's caches: a killed builder's before the
    # build (removed, under the blend's lock), a live builder's while the writer still runs
    # after the lock is released (left alone: removing it broke that builder's rename)
    probe = tmp_path / "probe"
    build_train_valid_test_datasets(config(prefixes, probe), TOKENIZER, [SAMPLES, 0, 0])
    cache_writer.wait_all()
    name = per_prefix_files(probe, "-sample_index.npy")[0]
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / f".{name}.{socket.gethostname()}.killed"
    stale.write_bytes(b"x")
    release = threading.Event()
    real = cache_writer.save_arrays

    def held(request, arrays, **kwargs):
        assert release.wait(60)
        real(request, arrays, **kwargs)

    monkeypatch.setattr(cache_writer, "save_arrays", held)
    try:
        build_train_valid_test_datasets(config(prefixes, cache), TOKENIZER, [SAMPLES, 0, 0])
        assert not stale.exists()
        live = cache / f".{name}.{socket.gethostname()}.live"
        live.write_bytes(b"x")
    finally:
        release.set()
    cache_writer.wait_all()
    assert live.exists()
    assert name in os.listdir(cache)
