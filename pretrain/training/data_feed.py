"""What a run feeds its engine: the train, validation and test datasets built from the run's
configs, and each data-parallel rank's loader dicts of them after the consumed samples (the
backend turns them into what its engine takes). `pretrain` builds them once; a spike rewind rebuilds the train batches."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from pretrain.data.blends.mixture import MixturePlan, phase_counts, resolve_mixture
from pretrain.data.blends.mixture_dataset import MixtureCounter
from pretrain.data.blends.plan import log_plan
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import train_valid_test_num_samples
from pretrain.data.datasets.samplers import build_pretraining_data_loader
from pretrain.parallel import state
from pretrain.training.logging import logger
from pretrain.training.state import TrainState

if TYPE_CHECKING:
    from pretrain.training.run import Prepared, RunConfig


def train_mixture(
    cfg: RunConfig, prepared: Prepared, train_state: TrainState, num_train: int
) -> MixturePlan | None:
    """The train split's phases from the flags and the checkpoint's record; None where the
    train order is not the blend's own (mock data, the cyclic sampler's random order)."""
    return resolve_mixture(
        cfg.data,
        num_train,
        prepared.files,
        global_batch_size=cfg.training.global_batch_size,
        record=train_state.data_mixture or None,
        iteration=train_state.iteration,
        consumed=train_state.consumed_train_samples,
    )


def data_iterators(
    cfg: RunConfig,
    prepared: Prepared,
    train_state: TrainState,
):
    """(train batches, validation sets, test batches or None), the train dataset and its
    per-source counter (None without one) of a run; no validation sets without a valid split
    or with --eval-iters 0; train and validation positioned after `train_state`'s consumed
    samples, whose `data_mixture` record is set to the counter's; no train batches for a run
    whose checkpoint is at or past --train-iters."""
    from pretrain.training.per_source import source_names
    from pretrain.training.validation_sets import ValidationSet, set_suffixes

    t, ev = cfg.training, cfg.evaluation
    consumed_train, consumed_valid = (
        train_state.consumed_train_samples,
        train_state.consumed_valid_samples,
    )
    num_samples = train_valid_test_num_samples(
        t.train_iters, t.train_samples, ev.eval_interval, ev.eval_iters, t.global_batch_size
    )
    mixture = train_mixture(cfg, prepared, train_state, num_samples[0])
    for line in mixture.lines if mixture is not None else ():
        logger.info(line)  # rank 0: what a changed mixture does to each source
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        cfg.data,
        prepared.tokenizer,
        num_samples,
        multiple_validation_sets=ev.multiple_validation_sets,
        files=prepared.files,
        mixture=mixture,
    )
    changing = mixture is not None and not mixture.megatron
    counts = phase_counts(mixture, dataset_index=train_ds.dataset_index) if changing else None
    # the blend plan table (a changing mixture's: per phase), once (rank 0 logs INFO)
    log_plan(cfg.data, num_samples, logger, files=prepared.files, mixture=mixture, counts=counts)
    counter = None
    if mixture is not None:
        counter = MixtureCounter(train_ds, mixture, cfg.data)
        train_state.data_mixture = counter.record(consumed_train)
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
    # a finished run launched again (a requeue) trains nothing: its consumed samples may be
    # all a blend holds (Megatron sizes it exactly), which no sampler can start after
    done = train_state.iteration >= t.train_iters
    train = iter(()) if done else batches(train_ds, consumed_train)
    return train, valid_sets, test, train_ds, counter


def rank_batches(cfg: RunConfig, dataset, consumed: int):
    """This rank's loader dicts of `dataset` after `consumed` samples."""
    dp_rank, dp = state.get_data_parallel_rank(), state.get_data_parallel_world_size()
    loader = build_pretraining_data_loader(
        dataset, consumed, cfg.training.micro_batch_size, dp_rank, dp, cfg.data
    )
    return iter(loader)
