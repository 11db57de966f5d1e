"""Data flags -> DataConfig: blend forms, per-split files, split strings, sample counts, errors."""

import argparse
import json

import pytest

from pretrain.data.config import (
    DataConfig,
    add_data_args,
    add_sample_count_args,
    parse_blend,
    train_valid_test_num_samples,
)
from pretrain.errors import UserError


def parse(argv):
    p = argparse.ArgumentParser()
    add_data_args(p)
    add_sample_count_args(p)
    return DataConfig.from_args(p.parse_args(argv))


def test_blend_forms():
    assert parse_blend(["a"], "x") == (["a"], None)
    assert parse_blend(["a", "b", "c"], "x") == (["a", "b", "c"], None)
    assert parse_blend(["0.3", "a", "0.7", "b"], "x") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"], "x") == (["a", "b"], None)  # even list of prefixes
    assert parse_blend(["1", "a"], "x") == (["a"], [1.0])
    with pytest.raises(UserError, match="mixes weights and prefixes"):
        parse_blend(["0.3", "a", "b", "c"], "--data-path")
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(UserError, match="positive"):
            parse_blend([bad, "a", "1", "b"], "--data-path")


def test_flags_to_config(tmp_path):
    cfg = parse(
        [
            "--data-path",
            "0.2",
            "p1",
            "0.8",
            "p2",
            "--split",
            "949,50,1",
            "--seq-length",
            "128",
            "--seed",
            "5",
            "--data-cache-path",
            str(tmp_path),
            "--eod-mask-loss",
            "--no-create-attention-mask-in-dataloader",
            "--dataloader-type",
            "cyclic",
        ]
    )
    assert cfg.blend == (["p1", "p2"], [0.2, 0.8]) and cfg.blend_per_split is None
    assert (cfg.seq_length, cfg.seed, cfg.split) == (128, 5, "949,50,1")
    assert cfg.eod_mask_loss and not cfg.create_attention_mask and cfg.dataloader_type == "cyclic"
    assert cfg.split_matrix == [(0, 0.949), (0.949, 0.999), (0.999, 1.0)]


def test_data_args_path_and_per_split_files(tmp_path):
    args_file = tmp_path / "blend.txt"
    args_file.write_text("0.5 a\n0.5   b\n")
    assert parse(
        ["--data-args-path", str(args_file), "--split", "1", "--seq-length", "8"]
    ).blend == (["a", "b"], [0.5, 0.5])
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": "1 a 3 b", "valid": ["c"], "test": None}))
    cfg = parse(["--per-split-data-args-path", str(per_split), "--seq-length", "8"])
    assert cfg.blend is None and cfg.split is None
    assert cfg.blend_per_split == [(["a", "b"], [1.0, 3.0]), (["c"], None), None]
    cfg = parse(["--train-data-path", "a", "--valid-data-path", "b", "--seq-length", "8"])
    assert cfg.blend_per_split == [(["a"], None), (["b"], None), None]


def test_legacy_default_split_with_warning():
    with pytest.warns(UserWarning, match="969, 30, 1"):
        cfg = parse(["--data-path", "p", "--seq-length", "8"])
    assert cfg.split == "969, 30, 1"


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--data-path", "a", "--train-data-path", "b", "--seq-length", "8"], "cannot be combined"),
        (
            ["--train-data-path", "b", "--split", "1,1,1", "--seq-length", "8"],
            "--split cannot be combined",
        ),
        (["--seq-length", "8"], "no data given"),
        (["--data-path", "a", "--split", "1,1,1,1", "--seq-length", "8"], "up to three"),
        (["--data-path", "a", "--split", "0,0", "--seq-length", "8"], "sum to zero"),
        (["--data-path", "a", "--split", "1"], "--seq-length"),
        (["--data-args-path", "/nonexistent/blend.txt", "--seq-length", "8"], "cannot read"),
    ],
)
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(UserError, match=match):
        parse(argv)


def test_bad_per_split_json_names_file_and_line(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"train": "a",\n "valid": }')
    with pytest.raises(UserError, match=f"{f}:2: not valid JSON"):
        parse(["--per-split-data-args-path", str(f), "--seq-length", "8"])


def test_sample_counts_follow_megatron_training_loop():
    # train = iters * gbs; valid = (iters // interval + 1) * eval_iters * gbs; test = eval_iters * gbs
    assert train_valid_test_num_samples(1000, None, 100, 10, 32) == (32000, 11 * 10 * 32, 320)
    # --train-samples: iterations derived as samples // gbs
    assert train_valid_test_num_samples(None, 1000, 10, 2, 8) == (1000, (125 // 10 + 1) * 2 * 8, 16)
    assert train_valid_test_num_samples(50, None, 1000, 0, 4) == (200, 0, 0)
    with pytest.raises(UserError, match="--train-iters or --train-samples"):
        train_valid_test_num_samples(None, None, 10, 2, 8)
    with pytest.raises(UserError, match="--global-batch-size"):
        train_valid_test_num_samples(10, None, 10, 2, None)
