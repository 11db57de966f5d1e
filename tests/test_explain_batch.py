"""tools/explain_batch.py: on index caches megatron-core built (test-only oracle), every sample of an
iteration's batch names the prefix, the prefix's sample and the documents and token ranges that
megatron-core's own BlendedDataset/GPTDataset arrays give, in Megatron's sampler order (micro-batch
m of DP rank r at iteration N = (N-1)*G + m*mbs*dp + r*mbs + [0, mbs)); the caches are opened, not
rebuilt; --grep finds the iterations that hold a document."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_data_gpt_dataset import (
    TOKENIZER,
    megatron_core_datasets,
    random_lengths,
    write_corpus,
)

from pretrain.data.config import train_valid_test_num_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "explain_batch.py")
S, GBS, MBS, DP, ITERS = 32, 8, 2, 2, 20


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """Two prefixes blended 0.4/0.6; megatron-core builds the caches in `cache`."""
    d = tmp_path_factory.mktemp("explain")
    a = write_corpus(str(d / "a"), random_lengths(120, seed=1, hi=50), seed=1)
    b = write_corpus(str(d / "b"), random_lengths(80, seed=2, hi=70), seed=2)
    cache = str(d / "cache")
    sizes = list(train_valid_test_num_samples(ITERS, None, 10, 1, GBS))
    store = d / "store"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    try:
        train = megatron_core_datasets(
            sizes,
            TOKENIZER,
            cache,
            random_seed=7,
            sequence_length=S,
            blend=([a, b], [0.4, 0.6]),
            split="90,10,0",
        )[0]
    finally:
        torch.distributed.destroy_process_group()
    flags = ["--data-path", "0.4", a, "0.6", b, "--split", "90,10,0", "--seq-length", str(S)]
    flags += ["--seed", "7", "--train-iters", str(ITERS), "--global-batch-size", str(GBS)]
    flags += ["--micro-batch-size", str(MBS), "--eval-interval", "10", "--eval-iters", "1"]
    flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    flags += ["--data-cache-path", cache, "--num-layers", "2", "--lr", "1e-3"]  # training-only
    return {"train": train, "cache": cache, "flags": flags, "prefixes": (a, b)}


def run_tool(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, TOOL, *args], capture_output=True, text=True, env=env, timeout=180
    )
    assert r.returncode in (0, 1), r.stderr
    return r


def megatron_sample(train, k):
    """(prefix, dataset sample, document ids, token ids) of sample k, from megatron-core alone."""
    d, j = int(train.dataset_index[k]), int(train.dataset_sample_index[k])
    gpt = train.datasets[d]
    text, docs = gpt._query_document_sample_shuffle_indices(j)
    return gpt.dataset_path, j, [int(x) for x in docs], np.asarray(text)


def index_files(cache):
    return {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in os.listdir(cache)
            if f.endswith((".npy", "-description.txt"))}  # fmt: skip


@pytest.mark.timeout(400)
def test_json_samples_equal_megatron_arrays_in_sampler_order(megatron_run):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    train, cache = megatron_run["train"], megatron_run["cache"]
    before = index_files(cache)
    r = run_tool(
        [*megatron_run["flags"], "--iteration", "3-4", "--data-parallel-size", str(DP), "--json"]
    )
    assert index_files(cache) == before  # megatron's caches were loaded, nothing rebuilt
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 * GBS
    indexed = {p: IndexedDataset(p) for p in megatron_run["prefixes"]}
    expected_positions = []
    for it in (3, 4):
        for r_ in range(DP):
            for m in range(GBS // (MBS * DP)):
                for i in range(MBS):
                    expected_positions.append(
                        (it, r_, m, (it - 1) * GBS + m * MBS * DP + r_ * MBS + i)
                    )
    for row, (it, rank, m, k) in zip(rows, expected_positions, strict=True):
        assert list(row) == ["iteration", "dp_rank", "micro_batch", "sample", "dataset",
                             "dataset_sample", "documents"]  # fmt: skip
        assert (row["iteration"], row["dp_rank"], row["micro_batch"], row["sample"]) == (
            it,
            rank,
            m,
            k,
        )
        prefix, j, docs, text = megatron_sample(train, k)
        assert (row["dataset"], row["dataset_sample"]) == (prefix, j)
        assert [d for d, _, _ in row["documents"]] == docs
        ours = np.concatenate([indexed[prefix][d][a:b] for d, a, b in row["documents"]])
        assert np.array_equal(ours, text[: len(ours)]) and len(ours) == S + 1  # no padding in train


@pytest.mark.timeout(400)
def test_text_output_one_rank_and_grep(megatron_run):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    train = megatron_run["train"]
    r = run_tool([*megatron_run["flags"], "--iteration", "5", "--data-parallel-size", str(DP),
                  "--dp-rank", "1"])  # fmt: skip
    lines = r.stdout.splitlines()
    heads = [line for line in lines if line.startswith("iteration ")]
    assert len(heads) == GBS // DP and all(" dp_rank 1 " in h for h in heads)
    first = heads[0]
    k = int(first.split(" sample ")[1].split()[0])
    assert k == 4 * GBS + MBS  # iteration 5, rank 1, micro-batch 0
    prefix, _, docs, _ = megatron_sample(train, k)
    # keep the reader alive: megatron-core closes its mmap when it is collected
    data = IndexedDataset(prefix)
    preview = lines[lines.index(first) + 1]
    start = " ".join(str(int(t)) for t in data[docs[0]][:5])
    assert preview.startswith(f"    document {docs[0]}: '{start}")
    # --grep: the whole text of a long document of sample k; the iterations that hold it, from
    # megatron's arrays, are exactly the ones reported
    doc = next(d for d in docs if len(data[d]) >= 12)
    needle = " ".join(str(int(t)) for t in data[doc])
    r = run_tool([*megatron_run["flags"], "--grep", needle, "--max-iterations", "15", "--json"])
    found = sorted({json.loads(line)["iteration"] for line in r.stdout.splitlines()})
    holds = [
        it
        for it in range(1, 16)
        if any(
            megatron_sample(train, k)[0] == prefix and doc in megatron_sample(train, k)[2]
            for k in range((it - 1) * GBS, it * GBS)
        )
    ]
    assert found == holds and 5 in found
    assert f"{len(holds)} of iterations 1-15" in r.stderr


def test_bad_iteration_is_one_line(megatron_run):
    r = subprocess.run(
        [sys.executable, TOOL, *megatron_run["flags"], "--iteration", "21"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("error: --iteration 21")
    assert len(r.stderr.strip().splitlines()) == 1
