"""Pretraining samplers: Megatron's order (spec §5), DP-size independence, resume, and the loader."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_gpt_dataset import TOKENIZER, random_lengths, write_corpus

from pretrain.data.config import DataConfig
from pretrain.data.datasets.gpt_dataset import GPTDataset
from pretrain.data.datasets.samplers import (
    PretrainingRandomSampler,
    PretrainingSampler,
    build_pretraining_data_loader,
)
from pretrain.data.files.indexed_dataset import IndexedDataset
from pretrain.errors import UserError


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 200), mbs=st.integers(1, 4), dp=st.sampled_from([1, 2, 4]), data=st.data()
)
def test_single_sampler_matches_spec_formula(total, mbs, dp, data):
    block = mbs * dp
    consumed = data.draw(st.integers(0, max(0, total - 1)))
    for r in range(dp):
        got = list(PretrainingSampler(total, consumed, mbs, r, dp))
        steps = (total - consumed) // block  # trailing partial block dropped
        assert got == [
            [consumed + m * block + r * mbs + j for j in range(mbs)] for m in range(steps)
        ]


@settings(max_examples=40, deadline=None)
@given(total=st.integers(16, 300), mbs=st.integers(1, 3), data=st.data())
def test_single_sampler_global_order_does_not_depend_on_dp(total, mbs, data):
    """For DP = 1, 2, 4 with the same global batch, each step's union of micro-batches is the DP=1 batch."""
    gbs = mbs * 4
    consumed = data.draw(st.integers(0, total // gbs - 1)) * gbs  # at least one global batch left
    steps = {}
    for dp in (1, 2, 4):
        per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
        micro_per_step = gbs // (mbs * dp)
        n_steps = len(per_rank[0]) // micro_per_step
        steps[dp] = [
            sorted(
                itertools.chain.from_iterable(
                    per_rank[r][s * micro_per_step + k]
                    for r in range(dp)
                    for k in range(micro_per_step)
                )
            )
            for s in range(n_steps)
        ]
    assert steps[1] == steps[2] == steps[4]
    assert steps[1] and steps[1][0] == list(range(consumed, consumed + gbs))


def test_single_sampler_rejects_exhausted_dataset():
    with pytest.raises(UserError, match="consumed samples 10 >= dataset size 10"):
        PretrainingSampler(10, 10, 2, 0, 1)


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_sampler_first_epoch_matches_spec(sharding):
    total, mbs, dp = 23, 2, 2
    block = mbs * dp
    g = torch.Generator()
    g.manual_seed(0)  # epoch 0: seeded with the epoch number
    if sharding:
        bucket = (total // block) * mbs
        perm = torch.randperm(bucket, generator=g).tolist()
        for r in range(dp):
            got = _take(PretrainingRandomSampler(total, 0, mbs, r, dp, True), bucket // mbs)
            assert got == [
                [r * bucket + perm[k + j] for j in range(mbs)] for k in range(0, bucket, mbs)
            ]
    else:
        perm = torch.randperm((total // mbs) * mbs, generator=g).tolist()
        for r in range(dp):
            got = _take(PretrainingRandomSampler(total, 0, mbs, r, dp, False), 5)
            assert sum(got, []) == perm[r::dp][:10]


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_sampler_epochs_cover_each_sample_once_and_resume(sharding):
    total, mbs, dp = 50, 3, 2
    active = total - total % (mbs * dp)
    per_epoch = active // (mbs * dp)
    runs = [
        _take(PretrainingRandomSampler(total, 0, mbs, r, dp, sharding), 3 * per_epoch)
        for r in range(dp)
    ]
    for e in range(3):
        seen = sorted(
            i for r in range(dp) for b in runs[r][e * per_epoch : (e + 1) * per_epoch] for i in b
        )
        assert len(seen) == len(set(seen)) == active
        assert all(0 <= i < total for i in seen)
    assert runs[0][:per_epoch] != runs[0][per_epoch : 2 * per_epoch]  # a new order each epoch
    # resume at any step (also across an epoch boundary) continues the exact sequence
    for step in (1, per_epoch - 1, per_epoch, per_epoch + 2):
        for r in range(dp):
            resumed = _take(
                PretrainingRandomSampler(total, step * mbs * dp, mbs, r, dp, sharding), 5
            )
            assert resumed == runs[r][step : step + 5]


def test_cyclic_sampler_rejects_misaligned_resume():
    with pytest.raises(UserError, match="not a multiple"):
        next(iter(PretrainingRandomSampler(40, 3, 2, 0, 2)))


@pytest.mark.timeout(120)
def test_loader_resume_continues_exact_sequence(tmp_path):
    prefix = write_corpus(str(tmp_path / "c"), random_lengths(60, seed=5))
    cfg = DataConfig(
        seq_length=16,
        blend=([prefix], None),
        split="1",
        data_cache_path=str(tmp_path / "cache"),
        num_workers=1,
    )
    indexed = IndexedDataset(prefix)
    ds = GPTDataset(
        indexed, prefix, np.arange(len(indexed), dtype=np.int32), 64, "train", cfg, TOKENIZER
    )
    mbs, dp = 2, 2
    full = [list(build_pretraining_data_loader(ds, 0, mbs, r, dp, cfg)) for r in range(dp)]
    batch = full[0][0]
    assert batch["tokens"].shape == (mbs, 16) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    # causal attention needs no tensor: no attention_mask, no document_ids without the reset flag
    assert list(batch) == ["tokens", "labels", "loss_mask", "position_ids"]
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(mbs, 16))
    # micro-batch m on rank r is samples consumed + m*mbs*dp + r*mbs + [0, mbs)
    assert torch.equal(
        full[1][3]["tokens"], torch.stack([ds[3 * 4 + 2]["tokens"], ds[3 * 4 + 3]["tokens"]])
    )
    consumed = 5 * mbs * dp
    for r in range(dp):
        resumed = list(build_pretraining_data_loader(ds, consumed, mbs, r, dp, cfg))
        assert len(resumed) == len(full[r]) - 5
        for a, b in zip(resumed, full[r][5:], strict=False):
            assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(120)
def test_loader_with_document_flags_carries_o_of_s_document_ids(tmp_path):
    """Through a worker process and a blend: document ids, reset positions and the EOD loss mask
    follow the EODs of each sample's tokens; no tensor is [S, S]."""
    from pretrain.data.builder import build_train_valid_test_datasets

    prefixes = [
        write_corpus(str(tmp_path / f"c{i}"), random_lengths(80, seed=i, hi=12)) for i in range(2)
    ]
    S, mbs = 32, 4
    cfg = DataConfig(
        seq_length=S,
        blend=(prefixes, [0.6, 0.4]),
        split="1",
        data_cache_path=str(tmp_path / "cache"),
        num_workers=1,
        eod_mask_loss=True,
        reset_position_ids=True,
        reset_attention_mask=True,
    )
    train, _, _ = build_train_valid_test_datasets(cfg, TOKENIZER, [5 * mbs, 0, 0])
    for batch in itertools.islice(build_pretraining_data_loader(train, 0, mbs, 0, 1, cfg), 5):
        assert list(batch) == [
            "dataset_id",
            "tokens",
            "labels",
            "loss_mask",
            "position_ids",
            "document_ids",
        ]
        assert all(list(v.shape).count(S) <= 1 for v in batch.values())
        ids, tokens = batch["document_ids"], batch["tokens"]
        assert ids.shape == (mbs, S) and ids.dtype == torch.int32
        is_eod = tokens == TOKENIZER.eod
        assert is_eod.any()  # short documents: several per sample
        # a new document starts right after each EOD, and only there
        assert torch.equal(ids[:, 0], torch.zeros(mbs, dtype=torch.int32))
        assert torch.equal(ids[:, 1:] - ids[:, :-1], is_eod[:, :-1].int())
        # positions count from each document's start
        restart = torch.cat([torch.ones(mbs, 1, dtype=torch.bool), is_eod[:, :-1]], dim=1)
        assert torch.equal(batch["position_ids"][restart], torch.zeros(int(restart.sum())).long())
        assert torch.equal(
            batch["position_ids"][:, 1:][~restart[:, 1:]],
            batch["position_ids"][:, :-1][~restart[:, 1:]] + 1,
        )
        assert torch.equal(batch["loss_mask"], (~is_eod).float())
