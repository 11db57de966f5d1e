"""What a run feeds its engine: the train, validation and test datasets built from the run's
configs, and each data-parallel rank's loader dicts of them after the consumed samples (the
backend turns them into what its engine takes). `pretrain` builds them once; a spike rewind rebuilds the train batches."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import train_valid_test_num_samples
from pretrain.data.plan import log_plan
from pretrain.data.samplers import build_pretraining_data_loader
from pretrain.parallel import state
from pretrain.training.logging import logger

if TYPE_CHECKING:
    from pretrain.training.run import Prepared, RunConfig


def data_iterators(
    cfg: RunConfig,
    prepared: Prepared,
    consumed_train: int,
    consumed_valid: int,
):
    """(train batches, validation sets, test batches or None) and the train dataset of a run; no
    validation sets without a valid split or with --eval-iters 0; train and validation
    positioned after the consumed samples."""
    from pretrain.training.per_source import source_names
    from pretrain.training.validation_sets import ValidationSet, set_suffixes

    t, ev = cfg.training, cfg.evaluation
    num_samples = train_valid_test_num_samples(
        t.train_iters, t.train_samples, ev.eval_interval, ev.eval_iters, t.global_batch_size
    )
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        cfg.data,
        prepared.tokenizer,
        num_samples,
        multiple_validation_sets=ev.multiple_validation_sets,
        files=prepared.files,
    )
    # the blend plan table, once (rank 0 logs INFO)
    log_plan(cfg.data, num_samples, logger, files=prepared.files)
    batches = functools.partial(rank_batches, cfg)

    if valid_ds is None or ev.eval_iters == 0:
        valid_sets = []
    elif ev.multiple_validation_sets:
        suffixes = set_suffixes(ev.validation_set_names, cfg.data)
        valid_sets = [
            ValidationSet(suffix, batches(d, consumed_valid))
            for suffix, d in zip(suffixes, valid_ds, strict=True)
        ]
    else:
        sources = source_names(valid_ds)
        valid_sets = [ValidationSet("", batches(valid_ds, consumed_valid), sources)]
    test = None if test_ds is None or ev.eval_iters == 0 else batches(test_ds, 0)
    return batches(train_ds, consumed_train), valid_sets, test, train_ds


def rank_batches(cfg: RunConfig, dataset, consumed: int):
    """This rank's loader dicts of `dataset` after `consumed` samples."""
    dp_rank, dp = state.get_data_parallel_rank(), state.get_data_parallel_world_size()
    loader = build_pretraining_data_loader(
        dataset, consumed, cfg.training.micro_batch_size, dp_rank, dp, cfg.data
    )
    return iter(loader)
