"""Pretraining batch samplers (Megatron's `single` and `cyclic`) and the training DataLoader.

Both samplers yield micro-batches of sample ids for one data-parallel rank and resume from
`consumed_samples`, the global count of samples all ranks have taken so far (saved in checkpoints).

- `single`: global order 0, 1, 2, ... in blocks of micro_batch_size * dp_size; rank r takes the
  r-th slice of each block. The union of the ranks' micro-batches at a step is therefore the DP = 1
  order, whatever the DP size. A trailing partial block is dropped.
- `cyclic`: a new random order each epoch, seeded with the epoch number (Megatron's choice; not
  --seed). With data sharding (default) each rank permutes its own contiguous bucket, so the order
  depends on the DP size, as in Megatron; with --no-data-sharding it is one global permutation dealt
  round-robin.

DataLoader worker processes ignore the exit signals (`ignore_exit_signals`): a scheduler or launcher
that signals every process of a job must not kill them under a rank that is finishing its iteration
and saving. They still end with their rank: torch's workers check every 5 s that their parent is
alive (tests/test_preemption.py::test_workers_ignore_exit_signals_but_end_with_their_rank).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # noqa: F401  (its exit hook is registered before ours)
import signal
from collections.abc import Iterator

import torch

from pretrain.data.config import DataConfig
from pretrain.errors import UserError


def _check(total: int, consumed: int, mbs: int, dp_rank: int, dp_size: int) -> None:
    if total <= 0:
        raise UserError("the dataset has no samples (check --split and the data prefixes)")
    if mbs <= 0 or dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"bad sampler layout: micro_batch_size={mbs} dp_rank={dp_rank} dp_size={dp_size}"
        )


class PretrainingSampler:
    """`single`: sequential order, resumable at any multiple of micro_batch_size * dp_size."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ):
        _check(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
        if consumed_samples >= total_samples:
            raise UserError(
                f"consumed samples {consumed_samples} >= dataset size {total_samples}: nothing left "
                "to train on (raise --train-iters/--train-samples only with a rebuilt dataset)"
            )
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.rank = dp_rank
        self.block = micro_batch_size * dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // self.block

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.rank * self.mbs
        for start in range(self.consumed, self.total - self.block + 1, self.block):
            yield list(range(start + lo, start + lo + self.mbs))


class PretrainingRandomSampler:
    """`cyclic`: a random order per epoch (generator seeded with the epoch), cycling forever.

    Every rank yields (active - within) / (mbs * dp) micro-batches per epoch, so the ranks stay in
    step and `consumed` lands exactly on the next epoch's start.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        data_sharding: bool = True,
    ):
        _check(total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.rank = dp_rank
        self.dp = dp_size
        self.block = micro_batch_size * dp_size
        self.sharding = data_sharding
        self.active = total_samples - total_samples % self.block
        if self.active == 0:
            raise UserError(
                f"the dataset has {total_samples} samples, fewer than one step's "
                f"micro_batch_size * data_parallel_size = {self.block}"
            )

    def __len__(self) -> int:
        return self.active // self.block

    def _order(self, epoch: int, within: int) -> list[int]:
        g = torch.Generator()
        g.manual_seed(epoch)
        if self.sharding:
            bucket = (self.total // self.block) * self.mbs
            perm = torch.randperm(bucket, generator=g)[within // self.dp :]
            return (perm + self.rank * bucket).tolist()
        full = (self.total // self.mbs) * self.mbs
        return torch.randperm(full, generator=g)[within:][self.rank :: self.dp].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            epoch, within = divmod(self.consumed, self.active)
            if within % self.block:
                raise UserError(
                    f"consumed samples {self.consumed} is not a multiple of micro_batch_size * "
                    f"data_parallel_size = {self.block}; resume with the same batch layout"
                )
            order = self._order(epoch, within)
            for k in range(0, len(order) - self.mbs + 1, self.mbs):
                self.consumed += self.block
                yield order[k : k + self.mbs]


EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")  # Megatron's --exit-signal choices


def ignore_exit_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the worker ignores every signal of `EXIT_SIGNALS`; its rank
    decides what a signal means (`--exit-signal-handler`: finish the iteration and save)."""
    for name in EXIT_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def kill_daemonic_children() -> None:
    """atexit hook: SIGKILL this process's daemonic children (the DataLoader workers). At exit
    multiprocessing terminates them with SIGTERM and joins them; workers ignore SIGTERM
    (`ignore_exit_signals`), so a loader still referenced at exit (a DeepSpeed engine holding its
    iterator) would keep the rank waiting forever. Registered after multiprocessing's hook, this
    one runs first."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()


def collate_samples(data):
    """Our datasets build whole micro-batches (`__getitems__`); anything else is stacked by torch."""
    return data if isinstance(data, dict) else torch.utils.data.default_collate(data)


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    cfg: DataConfig,
) -> torch.utils.data.DataLoader:
    """A DataLoader yielding one micro-batch (dict of stacked tensors) per step for this DP rank."""
    if cfg.dataloader_type == "single":
        sampler = PretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size
        )
    elif cfg.dataloader_type == "cyclic":
        sampler = PretrainingRandomSampler(
            len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size, cfg.data_sharding
        )
    else:
        raise UserError(f"--dataloader-type {cfg.dataloader_type}: choose single or cyclic")
    if cfg.num_workers > 0:
        atexit.unregister(kill_daemonic_children)  # once per process
        atexit.register(kill_daemonic_children)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.num_workers,
        collate_fn=collate_samples,
        worker_init_fn=ignore_exit_signals,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=cfg.num_workers > 0,
    )
