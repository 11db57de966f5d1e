"""Blends of thousands of prefixes (issue 24): 2,000 Megatron-made prefixes (megatron-core's own
IndexedDatasetBuilder, so no sidecars) in three folders.

- `--data-args-path` and `--per-split-data-args-path` files with thousands of entries, globs and
  folders (one weight per folder, shared by tokens) parse to the expected blends;
- a blend given by globs (200 prefixes) equals megatron-core's, array for array, with
  Megatron's cache files beside our one file per split, and megatron-core's cache folder serves
  us without building anything (readable both ways);
- a training run of all 2,000 whose `--split 99,1,0` leaves most prefixes without validation data
  says so in a few summary lines before its first iteration, and the next start-up opens one
  cache file per split (plus the token-scan file), not several per prefix (counted in a fresh
  process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
from collections import OrderedDict

import numpy as np
import pytest
from test_data_builder import megatron_world  # noqa: F401  (fixture)
from test_data_gpt_dataset import TOKENIZER, assert_same_arrays, megatron_core_datasets
from training_fixtures import PYTHON, REPO, model_flags, run
from training_fixtures import test_env as clean_env  # (pytest would collect test_env)

from pretrain.cli import data_tool_parser, parse_data_tool_args
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.caches import blend_cache, cache_writer
from pretrain.data.caches.describe import describe, describe_blend
from pretrain.data.config import DataConfig
from pretrain.data.datasets import gpt_dataset
from pretrain.errors import UserError
from pretrain.launch import free_port

GPT_ARRAYS = ("document_index", "sample_index", "shuffle_index")
WEB, BOOKS, BIG = (
    1200,
    795,
    5,
)  # prefixes per folder; BIG ones have enough documents for --split 99,1,0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """{folder: [prefixes]}, {prefix: tokens}: 2,000 prefixes written by megatron-core."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    folders, tokens = {}, {}
    for folder, count, docs in (("web", WEB, 10), ("books", BOOKS, 10), ("big", BIG, 300)):
        os.makedirs(root / folder)
        folders[folder] = []
        for i in range(count):
            prefix = str(root / folder / f"part_{i:04d}")
            builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
            lengths = rng.integers(5, 40, docs)
            for n in lengths:
                builder.add_document(rng.integers(0, 100, n), [int(n)])
            builder.finalize(prefix + ".idx")
            folders[folder].append(prefix)
            tokens[prefix] = int(lengths.sum())
    return root, folders, tokens


def parse(argv: list[str]) -> DataConfig:
    ns = parse_data_tool_args(data_tool_parser("test"), argv + ["--seq-length", "32"])
    return DataConfig.from_args(ns)


def test_args_files_globs_and_folders_at_2000_prefixes(data, tmp_path):
    root, folders, tokens = data
    prefixes = folders["web"] + folders["books"] + folders["big"]
    weights = [float(w) for w in np.random.default_rng(1).integers(1, 10, len(prefixes))]
    args = tmp_path / "blend.txt"
    args.write_text("".join(f"{w:g} {p}\n" for w, p in zip(weights, prefixes, strict=True)))
    cfg = parse(["--data-args-path", str(args), "--split", "99,1,0"])
    assert cfg.blend == (prefixes, weights)

    per_split = tmp_path / "splits.json"
    spec = {"train": " ".join(prefixes), "valid": folders["books"], "test": f"{root}/big/*"}
    per_split.write_text(json.dumps(spec))
    cfg = parse(["--per-split-data-args-path", str(per_split)])
    assert cfg.blend_per_split == [
        (prefixes, None),
        (folders["books"], None),
        (folders["big"], None),
    ]

    # one weight per folder (or glob), shared by tokens: the folder reads as one merged prefix
    by_folder = parse(
        ["--data-path", "0.7", f"{root}/web/", "0.3", f"{root}/books", "--split", "1"]
    )
    by_glob = parse(["--data-path", "0.7", f"{root}/web/part_*", "0.3", f"{root}/books/*"])
    assert by_folder.blend == by_glob.blend
    got_prefixes, got_weights = by_folder.blend
    assert got_prefixes == folders["web"] + folders["books"]
    for folder, weight in (("web", 0.7), ("books", 0.3)):
        total = sum(tokens[p] for p in folders[folder])
        expected = [weight * tokens[p] / total for p in folders[folder]]
        got = [w for p, w in zip(got_prefixes, got_weights, strict=True) if p in folders[folder]]
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    # a glob with a recursive part, unweighted: every prefix under root, sorted
    assert parse(["--data-path", f"{root}/**/part_*", "--split", "1"]).blend == (
        sorted(prefixes),
        None,
    )
    with pytest.raises(
        UserError, match=r"--data-path: the pattern .*/web/nothing_\* names no prefix"
    ):
        parse(["--data-path", f"{root}/web/nothing_*", "--split", "1"])


@pytest.mark.usefixtures("megatron_world")
def test_blend_equals_megatron_and_megatron_caches_are_read_both_ways(data, tmp_path, monkeypatch):
    root, _, _ = data
    # 200 prefixes: 0.7 shared by 100 web parts, 0.3 by 100 book parts (by tokens)
    globs = ["0.7", f"{root}/web/part_00*", "0.3", f"{root}/books/part_00*"]
    blend = parse(["--data-path", *globs, "--split", "1"]).blend
    samples, ours_dir, theirs_dir = 3000, str(tmp_path / "ours"), str(tmp_path / "theirs")
    cfg = DataConfig(seq_length=32, seed=5, blend=blend, split="100,0,0", data_cache_path=ours_dir)
    train, valid, test = build_train_valid_test_datasets(cfg, TOKENIZER, [samples, 0, 0])
    (theirs, *_) = megatron_core_datasets(
        [samples, 0, 0], TOKENIZER, theirs_dir, random_seed=5, sequence_length=32, blend=blend,
        split="100,0,0",
    )  # fmt: skip
    assert valid is None and test is None and len(train.datasets) == len(theirs.datasets) == 200
    assert_same_arrays(train, theirs, ("dataset_index", "dataset_sample_index"))
    for ours_ds, their_ds in zip(train.datasets, theirs.datasets, strict=True):
        assert_same_arrays(ours_ds, their_ds, GPT_ARRAYS)
    for k in range(0, len(train), 97):
        np.testing.assert_array_equal(train[k]["tokens"].numpy(), theirs[k]["tokens"].numpy())
    # Megatron's files are all there once our writer is done, under its names (Megatron-LM finds
    # its caches in ours), and ours beside them: one file for the whole blend
    cache_writer.wait_all()
    assert set(os.listdir(theirs_dir)) <= set(os.listdir(ours_dir))
    consolidated = [f for f in os.listdir(ours_dir) if f.endswith(".bin") and "-BlendCache-" in f]
    assert len(consolidated) == 1 and consolidated[0].endswith("-BlendCache-train.bin")

    # megatron-core's cache folder serves us: every array loaded from its files, none built
    built = []
    real = gpt_dataset.build_indices
    monkeypatch.setattr(
        gpt_dataset, "build_indices", lambda *a, **k: built.append(1) or real(*a, **k)
    )
    from_theirs = dataclasses.replace(cfg, data_cache_path=theirs_dir)
    again = build_train_valid_test_datasets(from_theirs, TOKENIZER, [samples, 0, 0])[0]
    assert built == []
    for ours_ds, their_ds in zip(again.datasets, theirs.datasets, strict=True):
        assert_same_arrays(ours_ds, their_ds, GPT_ARRAYS)


def test_blend_cache_file_is_the_same_joined_or_one_by_one(tmp_path, monkeypatch):
    """A group's small pieces are joined before writing, big ones written as they are: the file,
    and what it reads back as, do not depend on which."""
    rng = np.random.default_rng(3)
    parts = [
        blend_cache.Part(
            position=i,
            num_samples=n,
            fingerprint=f"fp{i}",
            arrays={
                "document_index": rng.integers(0, 50, n + 3).astype(np.int32),
                "sample_index": rng.integers(0, 50, (n + 1, 2)).astype([np.int32, np.int64][i % 2]),
                "shuffle_index": rng.permutation(n).astype(np.uint32),
            },
        )
        for i, n in enumerate([5, 1, 9, 4])
    ]
    blend = {
        "dataset_index": rng.integers(0, 4, 19).astype(np.int16),
        "dataset_sample_index": rng.integers(0, 9, 19).astype(np.int64),
    }
    written = {}
    for join_bytes in (0, 1 << 30):
        monkeypatch.setattr(blend_cache, "_JOIN_BYTES", join_bytes)
        path = str(tmp_path / f"{join_bytes}-BlendCache-train.bin")
        blend_cache.write(path, "the description", parts, blend)
        written[join_bytes] = open(path, "rb").read()
        (got, got_blend), why = blend_cache.read(path, "the description")
        assert why == "" and [p.position for p in got] == [0, 1, 2, 3]
        for part, back in zip(parts, got, strict=True):
            assert (back.num_samples, back.fingerprint) == (part.num_samples, part.fingerprint)
            for name, arr in part.arrays.items():
                assert back.arrays[name].dtype == arr.dtype
                np.testing.assert_array_equal(back.arrays[name], arr)
        for name, arr in blend.items():
            np.testing.assert_array_equal(got_blend[name], arr)
    assert written[0] == written[1 << 30]


def training_argv(data_args: str, cache: str) -> list[str]:
    return model_flags("gpt2") + [
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
        "--data-args-path", data_args, "--split", "99,1,0", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--eval-interval", "1", "--eval-iters", "1", "--num-workers", "0",
        "--distributed-backend", "gloo", "--data-cache-path", cache,
    ]  # fmt: skip


# A rank's start-up after the caches exist (parse_args' checks, then the datasets), with every
# file it opens counted: cache files, and per kind of data file.
COUNT_OPENS = """
import collections, json, sys
from pretrain.cli import parse_args
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import train_valid_test_num_samples

argv, cache, data = json.load(open(sys.argv[1]))
opens = collections.Counter()

def count(event, args):
    if event == "open" and isinstance(args[0], str):
        if args[0].startswith(cache):
            opens["cache"] += 1
        elif args[0].startswith(data):
            opens[args[0].rsplit(".", 1)[-1]] += 1

sys.addaudithook(count)
cfg = parse_args(argv)
counts = train_valid_test_num_samples(1, None, 1, 1, 2)
p = cfg.prepared
train, valid, _ = build_train_valid_test_datasets(cfg.data, p.tokenizer, counts, files=p.files)
print(json.dumps({"opens": opens, "parts": [len(train.datasets), len(valid.datasets)]}))
"""


def test_split_99_1_0_start_up_says_it_in_a_few_lines_and_opens_one_cache_file_per_split(
    data, tmp_path
):
    """Before: 4 lines per prefix before the first iteration (an empty-split notice, a plan row,
    a plan warning, an index-cache line), one line listing every prefix's reason, and 5 cache
    files opened per prefix and rank (Megatron: 4)."""
    root, folders, _ = data
    every = folders["web"] + folders["books"] + folders["big"]
    args, cache = tmp_path / "blend.txt", str(tmp_path / "cache")
    args.write_text("".join(f"1 {p}\n" for p in every))
    env = clean_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    argv = training_argv(str(args), cache)
    out = run([PYTHON, str(REPO / "pretrain_gpt.py"), *argv], timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-4000:]
    before = out.stdout[: out.stdout.index(" iteration ")].splitlines()
    naming = [line for line in before if "part_" in line]
    # the plan table's 10 largest rows per split, and one line per kind of notice
    assert len(naming) <= 30, "\n".join(naming[:40])
    assert len(before) < 120, len(before)
    assert sum("gets no sequence from 1,995 of 2,000 prefixes" in line for line in before) == 1
    assert sum("split of 1,995 of 2,000 blend parts is empty" in line for line in before) == 1
    assert sum("... and 1,990 more prefixes" in line for line in before) == 1  # the plan, train
    assert sum("2,000 prefixes are read less than --min-epochs" in line for line in before) == 1

    # the next start-up opens the token-scan file and one cache file per split, each .idx once,
    # looks for each sidecar once (none exists), and maps no .bin
    (tmp_path / "argv.json").write_text(json.dumps([argv, cache, str(root)]))
    counted = subprocess.run(
        [PYTHON, "-c", COUNT_OPENS, str(tmp_path / "argv.json")],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )  # fmt: skip
    assert counted.returncode == 0, counted.stdout[-2000:] + counted.stderr[-3000:]
    result = json.loads(counted.stdout.strip().splitlines()[-1])
    assert result["parts"] == [2000, BIG]
    assert result["opens"] == {"cache": 3, "idx": 2000, "json": 2000}, result


def test_descriptions_are_json_dumps_indent_4():
    """Megatron's cache names are md5s of `json.dumps(identifiers, indent=4)`; ours are made from
    templates (pretrain/data/caches/describe.py) and must be that text to the byte."""
    rng = np.random.default_rng(3)
    tokenizer = OrderedDict([("class", "X"), ("tokenizer_path", ['a"b\\c', "ü"]), ("n", 2.5)])
    for _ in range(50):
        datasets = [
            OrderedDict(
                [
                    ("class", "GPTDataset"),
                    ("dataset_path", str(rng.choice(["/d/p", 'we"ird\\path', "ü/x"]))),
                    ("num_samples", None if rng.random() < 0.3 else int(rng.integers(0, 10**9))),
                    ("index_split", "valid"),
                    ("random_seed", 1234),
                    ("sequence_length", 2048),
                    ("split", "99,1,0"),
                    ("split_matrix", [(0, 0.99), (0.99, 1.0), None]),
                    ("tokenizer", None if rng.random() < 0.3 else tokenizer),
                ]
            )
            for _ in range(int(rng.integers(1, 6)))
        ]
        for identifiers in datasets:
            assert describe(identifiers) == json.dumps(identifiers, indent=4)
        blend = OrderedDict(
            [
                ("class", "BlendedDataset"),
                ("datasets", datasets),
                ("split", "valid"),
                ("weights", rng.random(len(datasets)).tolist()),
                ("size", None if rng.random() < 0.3 else 77),
            ]
        )
        texts = [describe(d) for d in datasets]
        assert describe_blend(blend, texts) == json.dumps(blend, indent=4)


MAP_MANY = """
import resource, sys
from pretrain.data.files.indexed_dataset import IndexedDataset
from pretrain.errors import UserError

soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    datasets = [IndexedDataset(p) for p in sys.argv[3:]]  # kept: each keeps its mapping
    mapped = [len(d.tokens) > 0 for d in datasets]
    print("mapped", sum(mapped), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
except UserError as err:
    print("error:", err)
"""


def test_a_blend_past_the_open_file_limit_raises_it_or_says_so(data):
    """Each .bin a blend reads stays mapped (a file descriptor): past the soft limit it is raised
    to the hard one; past the hard one, one line names `ulimit -n` (not an OSError traceback)."""
    _, folders, _ = data
    prefixes = folders["web"][:300]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for soft, limit, expected in ((128, hard, f"mapped 300 {hard}"), (128, 128, "error:")):
        out = subprocess.run(
            [PYTHON, "-c", MAP_MANY, str(soft), str(limit), *prefixes],
            capture_output=True, text=True, timeout=120, env=clean_env(), cwd=REPO,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith(expected), out.stdout
    assert "too many open files (limit 128)" in out.stdout and "ulimit -n" in out.stdout
