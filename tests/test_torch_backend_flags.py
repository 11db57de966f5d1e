"""The torch backend's flags (pretrain/training/backends/torch/flags.py): what --use-torch-fsdp2
turns on, and the one-line refusals of what it cannot honour, before anything starts."""

import re

import pytest
from training_fixtures import make_corpus, model_flags, train_flags

from pretrain.checkpoint.format import build_metadata
from pretrain.cli import parse_args
from pretrain.errors import UserError
from pretrain.training.checkpoints.compatible import check_compatible

ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TWO_RANKS = {**ONE_RANK, "WORLD_SIZE": "2"}


@pytest.fixture(scope="module")
def argv(tmp_path_factory):
    corpus = make_corpus(tmp_path_factory.mktemp("flags") / "corpus")
    return model_flags("gpt2") + train_flags(corpus)


def test_the_flag_selects_the_torch_backend(argv):
    assert parse_args(argv, env=TWO_RANKS).parallel.backend == "deepspeed"
    cfg = parse_args(argv + ["--use-torch-fsdp2", "--async-save"], env=TWO_RANKS)
    assert cfg.parallel.backend == "torch" and cfg.checkpoint.async_save
    assert (cfg.parallel.offload_optimizer, cfg.parallel.offload_param) == (None, None)
    formats = ["--ckpt-format", "torch_dist"]
    assert parse_args(argv + ["--use-torch-fsdp2", *formats], env=ONE_RANK).parallel.use_torch_fsdp2


@pytest.mark.parametrize(
    "flags", [["--cpu-offload"], ["--offload-optimizer", "cpu"], ["--offload-param", "cpu"]]
)
def test_any_cpu_offload_flag_is_fsdp2s_one_policy(argv, flags):
    cfg = parse_args(argv + ["--use-torch-fsdp2", *flags], env=TWO_RANKS)
    assert (cfg.parallel.offload_optimizer, cfg.parallel.offload_param) == ("cpu", "cpu")


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--zero-stage", "3"], "--zero-stage 3 with --use-torch-fsdp2: FSDP2 always shards"),
        (["--use-distributed-optimizer"], "--use-distributed-optimizer with --use-torch-fsdp2"),
        (["--ckpt-format", "torch"], "--ckpt-format torch with --use-torch-fsdp2: the torch"),
        (["--offload-param", "nvme"], "--offload-param nvme with --use-torch-fsdp2: FSDP2"),
    ],
)
def test_what_the_torch_backend_cannot_honour_is_one_line(argv, flags, line):
    with pytest.raises(UserError, match=re.escape(line)) as err:
        parse_args(argv + ["--use-torch-fsdp2", *flags], env=TWO_RANKS)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--async-save"], "--async-save: background checkpoint writes are the torch backend's"),
        (["--ckpt-format", "torch_dist"], "--ckpt-format torch_dist: DCP checkpoints are written"),
    ],
)
def test_torch_backend_flags_without_it_are_one_line(argv, flags, line):
    with pytest.raises(UserError, match=re.escape(line) + ".*add --use-torch-fsdp2"):
        parse_args(argv + flags, env=ONE_RANK)


def test_a_checkpoint_of_the_other_backend_without_full_state_is_one_line(argv):
    torch_cfg = parse_args(argv + ["--use-torch-fsdp2"], env=TWO_RANKS)
    ds_cfg = parse_args(argv, env=TWO_RANKS)
    meta = build_metadata(
        iteration=2,
        consumed_train_samples=16,
        consumed_valid_samples=0,
        model=torch_cfg.model,
        parallel=torch_cfg.parallel,
        pipeline_engine=False,
        tokenizer=torch_cfg.tokenizer.record(),
        full_state=False,
    )
    assert meta["parallel"]["backend"] == "torch"
    check_compatible(torch_cfg.checkpoint, torch_cfg.model, torch_cfg.parallel, meta, "ck")
    with pytest.raises(UserError, match=re.escape(
        "--load ck: the checkpoint was written by the torch backend, and it was saved with "
        "--no-save-full-state")  + ".*resume it with --use-torch-fsdp2$"):  # fmt: skip
        check_compatible(ds_cfg.checkpoint, ds_cfg.model, ds_cfg.parallel, meta, "ck")
