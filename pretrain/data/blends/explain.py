"""Which documents are in a training batch: iteration -> samples -> prefixes -> token ranges.

Training with `--dataloader-type single` takes, at iteration N (1-indexed, as in the log), the
samples (N-1)*G ... N*G-1 of the train dataset (G = global batch size), handed to data-parallel
ranks by the same samplers training uses (`samplers.py`). A sample of a BlendedDataset is sample
`dataset_sample_index[k]` of prefix `dataset_index[k]`; a GPTDataset sample is a window over its
document and sample indices. Nothing here trains or builds a model: only the index arrays are read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pretrain.data.blends.blended_dataset import BlendedDataset
from pretrain.data.blends.mixture_dataset import MixtureDataset, SourceOrder
from pretrain.data.config import DataConfig
from pretrain.data.datasets.gpt_dataset import GPTDataset
from pretrain.data.datasets.samplers import PretrainingRandomSampler, PretrainingSampler
from pretrain.errors import UserError


@dataclass(frozen=True, kw_only=True)
class SampleOrigin:
    """Where one sample of one iteration's batch comes from."""

    iteration: int
    """Training iteration (1-indexed, as the log counts)."""
    dp_rank: int
    """Data-parallel rank that reads the sample."""
    micro_batch: int
    """Micro-batch of that rank within the iteration (0-indexed)."""
    sample: int
    """Index in the train dataset's order (the consumed samples before it, with `single`)."""
    dataset: str
    """The data prefix, as given on the command line."""
    dataset_sample: int
    """Index of the sample in that prefix's own order (its GPTDataset, then the further
    segments a changing mixture adds: pretrain/data/blends/mixture.py)."""
    documents: list[list[int]]
    """[document_id, first_token, end_token] for each document the sample's window covers."""

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict, in declaration order."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def window_documents(gpt: GPTDataset, dataset_sample: int) -> list[list[int]]:
    """[sequence id, first token, end token) of each document sample `dataset_sample` reads
    (S + 1 tokens: the inputs and the last label; fewer where the data ends and padding follows)."""
    j = int(gpt.shuffle_index[dataset_sample])
    (d0, o0), (d1, o1) = gpt.sample_index[j : j + 2].tolist()
    lengths = gpt.indexed.sequence_lengths
    out = []
    for d in range(d0, d1 + 1):
        doc = int(gpt.document_index[d])
        first = o0 if d == d0 else 0
        end = min(o1 + gpt.extra_token, int(lengths[doc])) if d == d1 else int(lengths[doc])
        if end > first:
            out.append([doc, first, end])
    return out


def locate(dataset, sample: int) -> tuple[str, int, GPTDataset, int]:
    """(prefix, index in the prefix's own order, the GPTDataset holding it, index there) of
    sample `sample` of `dataset` (a GPTDataset, BlendedDataset or MixtureDataset, whose sources'
    orders may continue over several GPTDatasets)."""
    if isinstance(dataset, BlendedDataset | MixtureDataset):
        order = dataset.datasets[int(dataset.dataset_index[sample])]
        k = int(dataset.dataset_sample_index[sample])
        gpt, local = order.locate(k) if isinstance(order, SourceOrder) else (order, k)
        return order.dataset_path, k, gpt, local
    return dataset.dataset_path, sample, dataset, sample


def iteration_samples(
    cfg: DataConfig,
    total: int,
    iteration: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
) -> Iterator[tuple[int, list[int]]]:
    """(micro-batch, sample ids) of `dp_rank` at `iteration`, from the samplers training uses."""
    block = micro_batch_size * dp_size
    if global_batch_size % block:
        raise UserError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
            f"{micro_batch_size} x --data-parallel-size {dp_size} (use the run's batch flags)"
        )
    consumed = (iteration - 1) * global_batch_size
    if consumed + global_batch_size > total:
        raise UserError(
            f"--iteration {iteration}: the train dataset has {total} samples, "
            f"{total // global_batch_size} iterations of {global_batch_size}"
        )
    if cfg.dataloader_type == "cyclic":
        args = (total, consumed, micro_batch_size, dp_rank, dp_size, cfg.data_sharding)
        sampler = PretrainingRandomSampler(*args)
    else:
        sampler = PretrainingSampler(total, consumed, micro_batch_size, dp_rank, dp_size)
    batches = iter(sampler)
    for micro_batch in range(global_batch_size // block):
        yield micro_batch, next(batches)


def explain_iteration(
    dataset,
    cfg: DataConfig,
    iteration: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_size: int,
    dp_ranks: list[int],
) -> list[SampleOrigin]:
    """Every sample of `iteration`'s global batch read by `dp_ranks`, in micro-batch order."""
    out = []
    for rank in dp_ranks:
        batches = iteration_samples(
            cfg, len(dataset), iteration, global_batch_size, micro_batch_size, dp_size, rank
        )
        for micro_batch, samples in batches:
            for k in samples:
                prefix, dataset_sample, gpt, local = locate(dataset, k)
                out.append(
                    SampleOrigin(
                        iteration=iteration,
                        dp_rank=rank,
                        micro_batch=micro_batch,
                        sample=k,
                        dataset=prefix,
                        dataset_sample=dataset_sample,
                        documents=window_documents(gpt, local),
                    )
                )
    return out
