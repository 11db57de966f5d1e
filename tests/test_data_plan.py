"""Blend plan (pretrain/data/blends/plan.py, tools/plan_blend.py): the samples drawn per prefix equal what
megatron-core's BlendedMegatronDatasetBuilder (test-only oracle) draws on the same files and flags,
and the tool prints, warns and plots."""

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

from pretrain.data.blends.plan import format_plan, plan_blend, plan_warnings, to_sample_weights
from pretrain.data.config import DataConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = 32


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """megatron-core's BlendedDataset asks torch.distributed for the rank: a world of one."""
    if torch.distributed.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("store") / "init"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    sizes = [("a", 150, 50), ("b", 90, 50), ("c", 60, 20)]
    return {
        name: write_corpus(str(d / name), random_lengths(n, seed=i, hi=hi), seed=i)
        for i, (name, n, hi) in enumerate(sizes)
    }


def megatron_datasets(tmp_path, sizes, blend=None, blend_per_split=None, split=None):
    return megatron_core_datasets(
        sizes,
        TOKENIZER,
        str(tmp_path / "theirs"),
        random_seed=7,
        sequence_length=S,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
    )


def expected_rows(theirs):
    """(split, prefix) -> (tokens, documents, samples drawn) read from megatron-core's datasets."""
    out = {}
    for ds in theirs:
        if ds is None:
            continue
        if hasattr(ds, "dataset_index"):
            drawn = np.bincount(np.asarray(ds.dataset_index), minlength=len(ds.datasets))
            parts = list(zip(ds.datasets, drawn.tolist(), strict=True))
        else:  # training reads the requested samples; the dataset holds whole epochs
            parts = [(ds, len(ds) if ds.num_samples is None else min(len(ds), ds.num_samples))]
        for gpt, n in parts:
            lengths = gpt.dataset.sequence_lengths[gpt.indices]
            key = (str(gpt.index_split.name), gpt.dataset_path)
            out[key] = (int(lengths.sum(dtype=np.int64)), len(gpt.indices), n)
    return out


FORMS = {
    "single": lambda a, b, c: ([a], None),
    "weighted": lambda a, b, c: ([a, b, c], [0.3, 0.5, 0.2]),
    "unweighted": lambda a, b, c: ([a, b, c], None),
    "one_weighted": lambda a, b, c: ([b], [1.0]),
    "extreme": lambda a, b, c: ([a, c], [0.001, 0.999]),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_plan_equals_megatron_blend(tmp_path, corpora, megatron_world, form):
    blend = FORMS[form](corpora["a"], corpora["b"], corpora["c"])
    sizes = [300, 40, 12]
    # unweighted: megatron-core asserts on a prefix with no sample in a split (c's test split)
    split = "90,10,0" if form == "unweighted" else "80,15,5"
    cfg = DataConfig(seq_length=S, seed=7, blend=blend, split=split)
    rows = plan_blend(cfg, sizes)
    want = expected_rows(megatron_datasets(tmp_path, sizes, blend=blend, split=split))
    got = {(r.split, r.prefix): (r.tokens, r.documents, r.samples) for r in rows}
    assert got == want
    for split_name in ("train", "valid", "test"):
        mine = [r for r in rows if r.split == split_name]
        if mine:
            assert sum(r.token_share for r in mine) == pytest.approx(1.0)
        for r in mine:
            assert r.epochs == pytest.approx(r.samples * S / r.tokens)
    if form == "weighted":
        assert [r.weight for r in rows if r.split == "train"] == pytest.approx([0.3, 0.5, 0.2])


def test_per_split_plan_equals_megatron(tmp_path, corpora, megatron_world):
    a, b, c = corpora["a"], corpora["b"], corpora["c"]
    per_split = [([a, b], [0.7, 0.3]), ([c], None), ([a, c], None)]
    sizes = [200, 30, 10]
    rows = plan_blend(DataConfig(seq_length=S, seed=7, blend_per_split=per_split), sizes)
    want = expected_rows(megatron_datasets(tmp_path, sizes, blend_per_split=per_split))
    assert {(r.split, r.prefix): (r.tokens, r.documents, r.samples) for r in rows} == want


def test_tokens_unit_gives_megatrons_sample_blend(tmp_path, corpora, megatron_world):
    """Every sample is S tokens from one prefix, so token shares are sample shares: the 'tokens'
    unit yields the same drawn samples (and the weights unchanged, so the same caches)."""
    blend = ([corpora["a"], corpora["b"]], [0.25, 0.75])
    cfg = DataConfig(seq_length=S, blend=blend, split="1", blend_weights_unit="tokens")
    rows = plan_blend(cfg, [400, 0, 0])
    want = expected_rows(megatron_datasets(tmp_path, [400, 0, 0], blend=blend, split="1"))
    assert {(r.split, r.prefix): (r.tokens, r.documents, r.samples) for r in rows} == want
    shares = [r.token_share for r in rows]
    assert shares == pytest.approx([0.25, 0.75], abs=1 / 400)
    assert to_sample_weights([0.25, 0.75], "tokens", [S, S]) == [0.25, 0.75]
    assert to_sample_weights([0.5, 0.5], "tokens", [10, 30]) == [0.05, 0.5 / 30]


def test_warnings_name_repeated_and_unused_sources(corpora):
    a, c = corpora["a"], corpora["c"]
    cfg = DataConfig(seq_length=S, blend=([a, c], [0.02, 0.98]), split="1")
    rows = plan_blend(cfg, [400, 0, 0])
    warnings = plan_warnings(rows, max_epochs=4)
    assert len(warnings) == 2
    assert a in warnings[0] and "are used" in warnings[0]
    assert c in warnings[1] and "> --max-epochs 4" in warnings[1]
    assert "raise its weight or drop it" in warnings[0]
    alone = plan_blend(DataConfig(seq_length=S, blend=([a], None), split="1"), [4, 0, 0])
    (warning,) = plan_warnings(alone)  # one dataset: no weight to raise, and nothing to drop to
    assert a in warning and "are used" in warning and "weight" not in warning
    assert "train longer (--train-iters / --train-samples)" in warning
    table = format_plan(rows, S)
    assert table.splitlines()[0].split() == [
        "split",
        "prefix",
        "tokens",
        "documents",
        "weight",
        "samples",
        "epochs",
        "token",
        "share",
    ]


def run_tool(script, args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.timeout(240)
def test_plan_blend_tool_and_build_data_cache_plan(tmp_path, corpora):
    from PIL import Image

    a, c = corpora["a"], corpora["c"]
    flags = ["--data-path", "0.02", a, "0.98", c, "--split", "90,10,0", "--seq-length", str(S)]
    flags += ["--train-iters", "50", "--global-batch-size", "8", "--eval-interval", "25"]
    flags += ["--eval-iters", "2", "--num-layers", "2", "--lr", "1e-3"]  # training-only: ignored
    png = tmp_path / "plan.png"
    out = run_tool("plan_blend.py", [*flags, "--plot", str(png)])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = plan_blend(
        DataConfig(seq_length=S, blend=([a, c], [0.02, 0.98]), split="90,10,0"), [400, 48, 16]
    )
    assert lines[: len(rows) + 1] == format_plan(rows, S).splitlines()[: len(rows) + 1]
    # the prefixes read too often in one line, as training logs it (was a line per prefix)
    (often,) = [line for line in lines if line.startswith("warning: 2 prefixes are read more")]
    assert f"train {c} (" in often and f"valid {c} (" in often
    assert len([line for line in lines if line.startswith("warning: ")]) == 2  # + a: little used
    image = np.asarray(Image.open(png).convert("RGB"))
    assert image.shape[0] > 200 and image.shape[1] > 400
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 20  # bars, text, not a blank canvas
    cached = run_tool(
        "build_data_cache.py",
        [*flags, "--plan", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"],
    )
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout.splitlines()[: len(lines) - 1] == lines[:-1]  # same table, no 'wrote'
    assert not os.path.exists(os.path.join(a, "cache"))  # --plan builds nothing
