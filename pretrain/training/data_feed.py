"""What a run feeds its engine: the train, validation and test datasets built from the run's
configs, and each data-parallel rank's loader dicts of them after the consumed samples (the
backend turns them into what its engine takes). `pretrain` builds them once; a spike rewind
rebuilds the train batches. It takes the run's configs and what the checks before launch built
(the tokenizer, the opened prefixes) as arguments: `run.py` imports it, not the reverse."""

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
from pretrain.training.report.logging import logger
from pretrain.training.report.per_source import source_names
from pretrain.training.report.validation_sets import ValidationSet, set_suffixes
from pretrain.training.state import TrainState

if TYPE_CHECKING:
    from pretrain.data.config import DataConfig
    from pretrain.data.files.fingerprint import PrefixFiles
    from pretrain.tokenizer import Tokenizer
    from pretrain.training.loop.loop import TrainingConfig
    from pretrain.training.report.evaluator import EvalConfig


def train_mixture(
    data: DataConfig,
    global_batch_size: int,
    files: PrefixFiles,
    train_state: TrainState,
    num_train: int,
) -> MixturePlan | None:
    """The train split's phases from the flags and the checkpoint's record; None where the
    train order is not the blend's own (mock data, the cyclic sampler's random order)."""
    return resolve_mixture(
        data,
        num_train,
        files,
        global_batch_size=global_batch_size,
        record=train_state.data_mixture or None,
        iteration=train_state.iteration,
        consumed=train_state.consumed_train_samples,
    )


def data_iterators(
    *,
    data: DataConfig,
    training: TrainingConfig,
    evaluation: EvalConfig,
    tokenizer: Tokenizer,
    files: PrefixFiles,
    train_state: TrainState,
):
    """(train batches, validation sets, test batches or None), the train dataset and its
    per-source counter (None without one) of a run; no validation sets without a valid split
    or with --eval-iters 0; train and validation positioned after `train_state`'s consumed
    samples, whose `data_mixture` record is set to the counter's; no train batches for a run
    whose checkpoint is at or past --train-iters."""
    t, ev = training, evaluation
    consumed_train, consumed_valid = (
        train_state.consumed_train_samples,
        train_state.consumed_valid_samples,
    )
    num_samples = train_valid_test_num_samples(
        t.train_iters, t.train_samples, ev.eval_interval, ev.eval_iters, t.global_batch_size
    )
    mixture = train_mixture(data, t.global_batch_size, files, train_state, num_samples[0])
    for line in mixture.lines if mixture is not None else ():
        logger.info(line)  # rank 0: what a changed mixture does to each source
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        data,
        tokenizer,
        num_samples,
        multiple_validation_sets=ev.multiple_validation_sets,
        files=files,
        mixture=mixture,
    )
    changing = mixture is not None and not mixture.megatron
    counts = phase_counts(mixture, dataset_index=train_ds.dataset_index) if changing else None
    # the blend plan table (a changing mixture's: per phase), once (rank 0 logs INFO)
    log_plan(data, num_samples, logger, files=files, mixture=mixture, counts=counts)
    counter = None
    if mixture is not None:
        counter = MixtureCounter(train_ds, mixture, data)
        train_state.data_mixture = counter.record(consumed_train)
    batches = functools.partial(rank_batches, data, t.micro_batch_size)

    valid_sets = _validation_sets(
        valid_ds, ev, data, functools.partial(batches, consumed=consumed_valid)
    )
    test = None if test_ds is None or ev.eval_iters == 0 else batches(test_ds, 0)
    # a finished run launched again (a requeue) trains nothing: its consumed samples may be
    # all a blend holds (Megatron sizes it exactly), which no sampler can start after
    done = train_state.iteration >= t.train_iters
    train = iter(()) if done else batches(train_ds, consumed_train)
    return train, valid_sets, test, train_ds, counter


def _validation_sets(valid_ds, evaluation: EvalConfig, data: DataConfig, batches) -> list:
    """The `ValidationSet`s the evaluator runs (`batches(dataset)`: a set's loader dicts): one
    per --valid-data prefix with --multiple-validation-sets, else one (per-source sums of a
    blend); none without a valid split or with --eval-iters 0."""
    if valid_ds is None or evaluation.eval_iters == 0:
        return []
    if evaluation.multiple_validation_sets:
        suffixes = set_suffixes(evaluation.validation_set_names, data)
        return [ValidationSet(s, batches(d)) for s, d in zip(suffixes, valid_ds, strict=True)]
    return [ValidationSet("", batches(valid_ds), source_names(valid_ds))]


def rank_batches(data: DataConfig, micro_batch_size: int, dataset, consumed: int):
    """This rank's loader dicts of `dataset` after `consumed` samples."""
    dp_rank, dp = state.get_data_parallel_rank(), state.get_data_parallel_world_size()
    loader = build_pretraining_data_loader(dataset, consumed, micro_batch_size, dp_rank, dp, data)
    return iter(loader)
