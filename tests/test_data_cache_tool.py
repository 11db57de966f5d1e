"""tools/build_data_cache.py: accepts a whole training command line, builds every cache, and a
later build with the same flags loads them instead of building."""

import os
import subprocess
import sys

import pytest
from test_data_gpt_dataset import TOKENIZER, random_lengths, write_corpus

from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import DataConfig, train_valid_test_num_samples
from pretrain.data.datasets import gpt_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "build_data_cache.py")


def run_tool(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, TOOL, *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.timeout(180)
def test_tool_builds_caches_from_a_training_command_line(tmp_path, monkeypatch):
    a = write_corpus(str(tmp_path / "a"), random_lengths(1000, seed=1))
    b = write_corpus(str(tmp_path / "b"), random_lengths(1000, seed=2))
    cache = str(tmp_path / "cache")
    data_flags = [
        "--data-path",
        "0.6",
        a,
        "0.4",
        b,
        "--split",
        "949,50,1",
        "--seq-length",
        "64",
        "--train-iters",
        "30",
        "--global-batch-size",
        "8",
        "--eval-interval",
        "10",
        "--eval-iters",
        "2",
        "--data-cache-path",
        cache,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "1000",
    ]
    training_only = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--lr",
        "1e-4",
        "--bf16",
        "--tensor-model-parallel-size",
        "2",
        "--save",
        str(tmp_path / "ckpt"),
    ]
    proc = run_tool(training_only[:4] + data_flags + training_only[4:])
    assert proc.returncode == 0, proc.stderr
    assert "train: BlendedDataset with 240 samples (requested 240)" in proc.stdout
    assert "valid: BlendedDataset" in proc.stdout and "test : BlendedDataset" in proc.stdout
    assert "index caches" in proc.stderr  # the progress bar
    files = os.listdir(cache)
    assert sum(f.endswith("GPTDataset-train-sample_index.npy") for f in files) == 2
    assert sum(f.endswith("BlendedDataset-train-dataset_index.npy") for f in files) == 1

    # training with the same flags finds every cache: nothing is built again
    calls = []
    real = gpt_dataset.build_indices
    monkeypatch.setattr(
        gpt_dataset, "build_indices", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    cfg = DataConfig(
        seq_length=64, blend=([a, b], [0.6, 0.4]), split="949,50,1", data_cache_path=cache
    )
    counts = train_valid_test_num_samples(30, None, 10, 2, 8)
    train, valid, test = build_train_valid_test_datasets(cfg, TOKENIZER, counts)
    assert calls == [] and len(train) == 240


def test_tool_reports_user_errors_without_traceback(tmp_path):
    proc = run_tool(
        [
            "--data-path",
            str(tmp_path / "missing"),
            "--split",
            "1",
            "--seq-length",
            "8",
            "--train-iters",
            "1",
            "--global-batch-size",
            "1",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "10",
        ]
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(180)
def test_tool_refuses_a_flag_that_is_not_a_training_flag(tmp_path):
    """A typo of a data flag must not be skipped as 'some training flag' (caches for the wrong data)."""
    a = write_corpus(str(tmp_path / "a"), random_lengths(50, seed=1))
    base = ["--data-path", a, "--seq-length", "8", "--train-iters", "1", "--global-batch-size", "1"]
    base += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    proc = run_tool(base + ["--num-layers", "2", "--splt", "90,10,0"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: unrecognized argument(s): --splt 90,10,0"), last
    assert not os.path.exists(os.path.join(os.path.dirname(a), "cache")), "nothing was built"


def _builds_nothing(monkeypatch, cfg, counts, **resume):
    """Build the datasets as training does for `cfg` (and a resume); the build_indices calls."""
    from pretrain.data.blends.mixture import resolve_mixture
    from pretrain.data.files.fingerprint import PrefixFiles

    calls = []
    real = gpt_dataset.build_indices
    monkeypatch.setattr(
        gpt_dataset, "build_indices", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    files = PrefixFiles(cfg.data_cache_path)
    plan = resolve_mixture(cfg, counts[0], files, global_batch_size=8, **resume)
    assert plan is not None and not plan.megatron
    build_train_valid_test_datasets(cfg, TOKENIZER, counts, files=files, mixture=plan)
    monkeypatch.undo()
    return calls


@pytest.mark.timeout(300)
def test_tool_builds_the_train_split_of_a_schedule_and_of_a_reweighted_load(tmp_path, monkeypatch):
    """With --data-schedule, and with --load of a checkpoint re-weighted on resume, the tool builds
    the phases' sources: training then builds no index (before, it built the --data-path blend's
    and training built every source again, 'no cache with this description')."""
    import json

    from pretrain.data.blends.mixture import resolve_mixture
    from pretrain.data.blends.mixture_dataset import MixtureCounter
    from pretrain.data.files.fingerprint import PrefixFiles
    from pretrain.data.schedule import read_schedule

    a = write_corpus(str(tmp_path / "a"), random_lengths(300, seed=1))
    b = write_corpus(str(tmp_path / "b"), random_lengths(300, seed=2))
    counts = train_valid_test_num_samples(30, None, 1000, 0, 8)
    flags = ["--split", "100,0,0", "--seq-length", "64", "--train-iters", "30"]
    flags += ["--global-batch-size", "8", "--eval-iters", "0", "--tokenizer-type"]
    flags += ["NullTokenizer", "--vocab-size", "1000"]
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps([
        {"iteration": 0, "weights": {a: 0.5, b: 0.5}}, {"iteration": 10, "weights": {a: 0.1, b: 0.9}},
    ]))  # fmt: skip
    cache = str(tmp_path / "scheduled")
    proc = run_tool([*flags, "--data-path", a, b, "--data-schedule", str(schedule),
                     "--data-cache-path", cache])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "train: MixtureDataset with 240 samples" in proc.stdout, proc.stdout
    cfg = DataConfig(
        seq_length=64, blend=([a, b], None), split="100,0,0", data_cache_path=cache,
        data_schedule=read_schedule(str(schedule)),
    )  # fmt: skip
    assert _builds_nothing(monkeypatch, cfg, counts) == []

    # a run of 0.5/0.5 checkpointed at iteration 3, resumed with 0.1/0.9
    elsewhere = str(tmp_path / "first_run")  # the first run's caches are not the tool's
    first = DataConfig(
        seq_length=64, blend=([a, b], [0.5, 0.5]), split="100,0,0", data_cache_path=elsewhere
    )
    plan = resolve_mixture(first, counts[0], PrefixFiles(elsewhere), global_batch_size=8)
    built = build_train_valid_test_datasets(first, TOKENIZER, counts, mixture=plan)[0]
    record = MixtureCounter(built, plan, first).record(24)
    step = tmp_path / "ckpt" / "global_step3"
    step.mkdir(parents=True)
    meta = {"iteration": 3, "consumed_train_samples": 24, "data_mixture": record}
    (step / "pretrain_meta.json").write_text(json.dumps(meta))
    cache = str(tmp_path / "reweighted")
    proc = run_tool([*flags, "--data-path", "0.1", a, "0.9", b, "--data-cache-path", cache,
                     "--load", str(step)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "train: MixtureDataset" in proc.stdout, proc.stdout
    second = DataConfig(
        seq_length=64, blend=([a, b], [0.1, 0.9]), split="100,0,0", data_cache_path=cache
    )
    resume = {"record": record, "iteration": 3, "consumed": 24}
    assert _builds_nothing(monkeypatch, second, counts, **resume) == []
