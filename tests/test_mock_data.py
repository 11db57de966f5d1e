"""--mock-data: the synthetic sequences and every split's samples equal megatron-core's
MockGPTDataset (test-only oracle) for the same seed, sequence length, tokenizer and flags; the
flag's checks; and a real pretrain_gpt.py run on mock data with no data files."""

import warnings

import numpy as np
import pytest
from test_data_builder import GPT_ARRAYS, assert_same_dataset
from test_data_gpt_dataset import MegatronView, megatron_gpt
from training_fixtures import PYTHON, REPO, logged_losses, model_flags, run, train_flags

from pretrain.cli import parse_args
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import DataConfig
from pretrain.data.datasets.mock import MockGPTDataset, MockSequences
from pretrain.errors import UserError
from pretrain.tokenizer import NullTokenizer


def megatron_mock(seed, seq_length, tokenizer, sizes, **flags):
    mg, _, _ = megatron_gpt()
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    config = mg.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=MegatronView(tokenizer),
        reset_position_ids=flags.get("reset_position_ids", False),
        reset_attention_mask=flags.get("reset_attention_mask", False),
        eod_mask_loss=flags.get("eod_mask_loss", False),
    )
    assert config.mock  # no blend: megatron-core's mock mode, split 1,1,1
    return BlendedMegatronDatasetBuilder(mg.MockGPTDataset, sizes, lambda: True, config).build()


def test_mock_sequences_equal_megatron():
    mg, _, _ = megatron_gpt()
    tok = NullTokenizer(300)
    ours, theirs = MockSequences(tok.vocab_size, tok.eod), mg.MockGPTLowLevelDataset(tok)
    assert len(ours) == len(theirs) == 100_000
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    assert ours.sequence_lengths.dtype == theirs.sequence_lengths.dtype
    for i in [0, 1, 7, 999, 54321, 99_999]:
        length = int(ours.sequence_lengths[i])
        np.testing.assert_array_equal(ours[i], theirs[i])
        for offset, count in [(0, None), (3, 5), (length - 2, 10), (length, 4)]:
            a, b = ours.get(i, offset, count), theirs.get(i, offset, count)
            assert a.dtype == b.dtype and np.array_equal(a, b), (i, offset, count)


@pytest.mark.parametrize(
    "seed,seq_length,flags",
    [(1234, 64, {}), (7, 33, {"eod_mask_loss": True, "reset_position_ids": True})],
)
def test_mock_datasets_equal_megatron(seed, seq_length, flags):
    warnings.filterwarnings("ignore")
    tok = NullTokenizer(1000)
    sizes = [500, 120, 40]
    cfg = DataConfig(seq_length=seq_length, seed=seed, mock=True, **flags)
    ours = build_train_valid_test_datasets(cfg, tok, sizes)
    theirs = megatron_mock(seed, seq_length, tok, sizes, **flags)
    for mine, other in zip(ours, theirs, strict=True):
        assert isinstance(mine, MockGPTDataset)
        # same identity (class, split 1,1,1, seed, ...), arrays and samples
        assert_same_dataset(mine, other)
        for name in GPT_ARRAYS:
            assert np.asarray(getattr(mine, name)).shape == np.asarray(getattr(other, name)).shape


def test_mock_flag_checks(tmp_path):
    base = model_flags("gpt2") + [
        a for a in train_flags("unused") if a not in ("--data-path", "unused")
    ]
    base = [a for a in base if a not in ("--split", "90,10,0")]
    cfg = parse_args(base + ["--mock-data"], env={})
    assert cfg.data.mock and cfg.data.split == "1,1,1" and cfg.data.blend is None
    with pytest.raises(UserError, match="--mock-data cannot be combined with --data-path"):
        parse_args(base + ["--mock-data", "--data-path", str(tmp_path / "x")], env={})
    with pytest.warns(UserWarning, match="ignored with --mock-data"):
        assert parse_args(base + ["--mock-data", "--split", "90,10,0"], env={}).data.split == (
            "1,1,1"
        )
    with pytest.raises(UserError, match="no data given"):
        parse_args(base, env={})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pretrain_on_mock_data_without_files(tmp_path):
    flags = model_flags("gpt2") + train_flags("unused", iters=3)
    flags = [a for a in flags if a not in ("--data-path", "unused", "--split", "90,10,0")]
    result = run(
        [PYTHON, str(REPO / "pretrain_gpt.py"), *flags, "--mock-data"], timeout=280, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-4000:]
    losses = logged_losses(result.stdout)
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values())))
    assert list(tmp_path.iterdir()) == []  # no cache or data file written anywhere
