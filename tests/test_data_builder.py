"""Builder: every blend form gives the datasets, blend indices and samples megatron-core's
BlendedMegatronDatasetBuilder gives (test-only oracle), and extreme weights give a correct blend
where megatron-core raises IndexError."""

import logging
import math
import os

import numpy as np
import pytest
import torch
from test_data_gpt_dataset import (
    TOKENIZER,
    assert_same_arrays,
    assert_same_samples,
    megatron_core_datasets,
    random_lengths,
    write_corpus,
)

from pretrain.data.blends.blended_dataset import BlendedDataset
from pretrain.data.builder import build_train_valid_test_datasets, sizes_per_dataset
from pretrain.data.config import DataConfig
from pretrain.data.datasets.gpt_dataset import GPTDataset

GPT_ARRAYS = ["document_index", "sample_index", "shuffle_index"]
S = 32


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """megatron-core's BlendedDataset asks torch.distributed for the rank: a world of one."""
    if not torch.distributed.is_initialized():
        store = tmp_path_factory.mktemp("store") / "init"
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1
        )
        yield
        torch.distributed.destroy_process_group()
    else:
        yield


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    return {
        name: write_corpus(str(d / name), random_lengths(n, seed=i, hi=50), seed=i)
        for i, (name, n) in enumerate([("a", 150), ("b", 90), ("c", 60)])
    }


def build_both(tmp_path, sizes, blend=None, blend_per_split=None, split=None):
    cfg = DataConfig(
        seq_length=S,
        seed=99,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        data_cache_path=str(tmp_path / "ours"),
    )
    ours = build_train_valid_test_datasets(cfg, TOKENIZER, sizes)
    theirs = megatron_core_datasets(
        sizes,
        TOKENIZER,
        str(tmp_path / "theirs"),
        random_seed=99,
        sequence_length=S,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
    )
    return ours, theirs


def assert_same_dataset(ours, theirs):
    if theirs is None:
        assert ours is None
        return
    assert type(ours).__name__ == type(theirs).__name__
    assert ours.unique_description_hash == theirs.unique_description_hash
    assert len(ours) == len(theirs)
    if isinstance(ours, BlendedDataset):
        assert_same_arrays(ours, theirs, ["dataset_index", "dataset_sample_index"])
        for a, b in zip(ours.datasets, theirs.datasets, strict=False):
            assert_same_arrays(a, b, GPT_ARRAYS)
    else:
        assert isinstance(ours, GPTDataset)
        assert_same_arrays(ours, theirs, GPT_ARRAYS)
    assert_same_samples(ours, theirs, range(0, len(ours), max(1, len(ours) // 40)))


@pytest.mark.parametrize("form", ["single", "weighted", "unweighted", "one_weighted", "extreme"])
def test_blends_equal_megatron(tmp_path, corpora, megatron_world, form):
    a, b, c = corpora["a"], corpora["b"], corpora["c"]
    blend = {
        "single": ([a], None),
        "weighted": ([a, b, c], [0.3, 0.5, 0.2]),
        "unweighted": ([a, b], None),
        "one_weighted": ([b], [1.0]),
        "extreme": ([a, b], [0.001, 0.999]),
    }[form]
    split = "90,10,0" if form == "unweighted" else "80,15,5"
    ours, theirs = build_both(tmp_path, [300, 40, 12], blend=blend, split=split)
    for o, t in zip(ours, theirs, strict=False):
        assert_same_dataset(o, t)
    if form == "weighted":  # today's sizing: size = sum ceil(N*w), mid-level ceil(ceil(N*w)*1.005)
        assert len(ours[0]) == sum(math.ceil(300 * w) for w in (0.3, 0.5, 0.2))
        assert [d.num_samples for d in ours[0].datasets] == [
            r[0] for r in sizes_per_dataset([0.3, 0.5, 0.2], [300], 0.005)
        ]
    # blend caches use megatron's names: {md5}-BlendedDataset-{split}-...
    if form in ("weighted", "extreme"):
        names = {f for f in os.listdir(tmp_path / "theirs") if "Blended" in f}
        assert names and names <= set(os.listdir(tmp_path / "ours"))


def test_per_split_blends_equal_megatron(tmp_path, corpora, megatron_world):
    a, b, c = corpora["a"], corpora["b"], corpora["c"]
    per_split = [([a, b], [0.7, 0.3]), ([c], None), None]
    ours, theirs = build_both(tmp_path, [200, 30, 10], blend_per_split=per_split)
    assert ours[2] is None and isinstance(ours[1], GPTDataset)
    for o, t in zip(ours, theirs, strict=False):
        assert_same_dataset(o, t)


def test_extreme_weights_oversampling_is_fixed_not_an_index_error(tmp_path, megatron_world):
    """weights 0.001/3/0.001/0.001 and N=159 over prefixes of 33 tokens (S=8): the greedy blend takes
    161 samples from the big prefix, whose mid-level dataset has ceil(159*1.005)=160. megatron-core
    raises IndexError; we build that prefix with the samples the blend needs."""
    from megatron.core.datasets import helpers_cpp

    prefixes = [write_corpus(str(tmp_path / n), [10, 12, 11], seed=i) for i, n in enumerate("pqrs")]
    raw = [0.001, 3, 0.001, 0.001]
    per_split = [(prefixes, raw), None, None]
    sizes = [159, 0, 0]
    with pytest.raises(IndexError, match="oversamples"):
        megatron_core_datasets(
            sizes,
            TOKENIZER,
            str(tmp_path / "theirs"),
            random_seed=1,
            sequence_length=8,
            blend_per_split=per_split,
        )

    cfg = DataConfig(
        seq_length=8, seed=1, blend_per_split=per_split, data_cache_path=str(tmp_path / "ours")
    )
    train, valid, test = build_train_valid_test_datasets(cfg, TOKENIZER, sizes)
    assert valid is None and test is None
    targets = [math.ceil(159 * w / sum(raw)) for w in raw]
    assert len(train) == sum(targets) == 162
    # the blend order is still megatron's greedy order for these weights and size
    w = np.array(raw) / np.sum(raw)
    w = w / w.sum()
    di, dsi = np.zeros(162, np.int16), np.zeros(162, np.int64)
    helpers_cpp.build_blending_indices(di, dsi, w, 4, 162, False)
    np.testing.assert_array_equal(train.dataset_index, di)
    np.testing.assert_array_equal(train.dataset_sample_index, dsi)
    drawn = np.bincount(di, minlength=4)
    assert drawn[1] == 161 and len(train.datasets[1]) >= 161
    for k in range(len(train)):  # every sample is readable
        assert train[k]["tokens"].shape == (8,)


def test_missing_prefix_is_a_user_error(tmp_path):
    from pretrain.errors import UserError

    cfg = DataConfig(seq_length=8, blend=([str(tmp_path / "nope")], None), split="1")
    with pytest.raises(UserError, match="no .*nope.bin"):
        build_train_valid_test_datasets(cfg, TOKENIZER, [10, 0, 0])


def test_empty_split_is_skipped_with_a_message_not_a_hang(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    # 20 sequences, 949,50,1: test = [round(0.999*20), 20) = [20, 20) is empty (megatron loops forever)
    prefix = write_corpus(str(tmp_path / "small"), random_lengths(20, seed=4))
    other = write_corpus(str(tmp_path / "big"), random_lengths(2000, seed=5, hi=10))
    cfg = DataConfig(
        seq_length=8, blend=([prefix], None), split="949,50,1", data_cache_path=str(tmp_path / "c")
    )
    train, valid, test = build_train_valid_test_datasets(cfg, TOKENIZER, [20, 4, 2])
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None
    assert "the test split gets 0 of 20 sequences" in caplog.text
    # in a blend the empty member is left out of that split only
    cfg = DataConfig(
        seq_length=8,
        blend=([prefix, other], [0.5, 0.5]),
        split="949,50,1",
        data_cache_path=str(tmp_path / "c"),
    )
    train, valid, test = build_train_valid_test_datasets(cfg, TOKENIZER, [20, 4, 2])
    assert len(train.datasets) == 2 and len(test.datasets) == 1
    assert test.datasets[0].dataset_path == other and len(test) == 1  # ceil(2 * 0.5)
