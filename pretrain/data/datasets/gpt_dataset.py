"""GPTDataset: fixed-length samples over an IndexedDataset split, in Megatron's exact order.

Index arithmetic (docs/DATA_FORMAT.md §3): the split's sequences are repeated for E epochs and
shuffled jointly (document index, int32), cut into samples of S + x tokens that overlap by x
(sample index, numba kernel), and the samples are shuffled (shuffle index). All randomness comes
from one `numpy.random.RandomState(seed)` consumed in Megatron's order, so the three arrays equal
megatron-core's for the same inputs, values and dtypes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pretrain.data.caches.cache import CacheRequest, Source, load_or_build
from pretrain.data.caches.describe import describe
from pretrain.data.config import DataConfig
from pretrain.data.datasets import helpers
from pretrain.errors import UserError

log = logging.getLogger(__name__)

PAD_TOKEN_ID = -1  # Megatron's pad id when the tokenizer has none (never a real token)
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def split_ranges(num_sequences: int, matrix) -> list[np.ndarray | None]:
    """Sequence ids of each split: arange(round(lo*n), round(hi*n)) as int32 (round half to even)."""
    out = []
    for bounds in matrix:
        if bounds is None:
            out.append(None)
        else:
            lo, hi = bounds
            out.append(
                np.arange(
                    int(round(lo * num_sequences)), int(round(hi * num_sequences)), dtype=np.int32
                )
            )
    return out


@dataclass(frozen=True)
class EpochPlan:
    tokens_per_epoch: int
    num_epochs: int
    separate_final_epoch: bool
    num_samples_sans_final_epoch: int  # meaningful only when separate_final_epoch


def plan_epochs(
    tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra_token: int
) -> EpochPlan:
    """Fewest epochs that hold num_samples; whether the last epoch is shuffled on its own (the 0.80 rule)."""
    if num_samples is None:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    needed = num_samples * seq_length + extra_token
    num_epochs = max(1, -(-needed // tokens_per_epoch))
    if num_epochs == 1:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    sans_final = ((num_epochs - 1) * tokens_per_epoch - extra_token) // seq_length
    from_final = num_samples - sans_final
    per_epoch = (tokens_per_epoch - extra_token) // seq_length
    assert 0 <= from_final <= per_epoch + 1, (from_final, per_epoch)
    separate = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    return EpochPlan(tokens_per_epoch, num_epochs, separate, sans_final)


def _document_index(indices: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    doc_idx = np.empty(num_epochs * len(indices), np.int32)
    doc_idx.reshape(num_epochs, len(indices))[:] = indices  # np.tile's values, without its overhead
    rng.shuffle(doc_idx)
    return doc_idx


def shuffle_index_dtype(total: int) -> type:
    """uint32 unless the sample count needs int64 (Megatron's rule)."""
    return np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32


def _shuffle_index(first_block: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = shuffle_index_dtype(total)
    first = np.arange(first_block, dtype=dtype)
    rng.shuffle(first)
    if first_block == total:
        return first
    last = np.arange(first_block, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


_RNG = threading.local()


def _seeded_rng(seed: int) -> np.random.RandomState:
    """A RandomState in the state `RandomState(seed)` starts in, re-seeded rather than made:
    making one costs ~0.3 ms, a blend of thousands of prefixes makes one per prefix and split."""
    rng = getattr(_RNG, "state", None)
    if rng is None:
        rng = _RNG.state = np.random.RandomState(seed)
    else:
        rng.seed(seed)
    return rng


def build_indices(
    sequence_lengths: np.ndarray,
    indices: np.ndarray,
    plan: EpochPlan,
    seq_length: int,
    seed: int,
    extra_token: int = 1,
    drop_last: bool = True,
) -> dict[str, np.ndarray]:
    """document_index, sample_index and shuffle_index; RNG calls in Megatron's order."""
    rng = _seeded_rng(seed)
    if plan.separate_final_epoch:
        doc_idx = np.concatenate(
            (_document_index(indices, plan.num_epochs - 1, rng), _document_index(indices, 1, rng))
        )
    else:
        doc_idx = _document_index(indices, plan.num_epochs, rng)
    sample_idx = helpers.build_sample_index(
        sequence_lengths,
        doc_idx,
        seq_length,
        plan.num_epochs,
        plan.tokens_per_epoch,
        drop_last,
        extra_token,
    )
    total = sample_idx.shape[0] - 1
    first_block = plan.num_samples_sans_final_epoch if plan.separate_final_epoch else total
    shuffle_idx = _shuffle_index(first_block, total, rng)
    return {"document_index": doc_idx, "sample_index": sample_idx, "shuffle_index": shuffle_idx}


def expected_index_layout(
    sequence_lengths,
    num_indices: int,
    plan: EpochPlan,
    seq_length: int,
    extra_token: int,
    drop_last: bool,
):
    """(dtype, shape) of each index array, known before building: how a cache is validated."""
    doc_len = plan.num_epochs * num_indices
    num_samples = helpers.num_samples_in_sample_index(
        plan.num_epochs, plan.tokens_per_epoch, seq_length, drop_last, extra_token
    )
    largest = max(doc_len, int(sequence_lengths.max()) if len(sequence_lengths) else 0)
    sample_dtype = np.int32 if largest <= helpers.INT32_MAX else np.int64
    return {
        "document_index": (np.dtype(np.int32), (doc_len,)),
        "sample_index": (np.dtype(sample_dtype), (num_samples + 1, 2)),
        "shuffle_index": (np.dtype(shuffle_index_dtype(num_samples)), (num_samples,)),
    }


def index_problem(
    arrays: dict[str, np.ndarray], sequence_lengths: np.ndarray, indices: np.ndarray
) -> str | None:
    """What is out of bounds in loaded index arrays (a damaged cache), or None; O(samples)."""
    doc, sample, shuffle = arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
    if len(doc) and (doc.min() < indices[0] or doc.max() > indices[-1]):
        return f"document_index holds sequences outside {indices[0]}..{indices[-1]}"
    pos, offset = sample[:, 0], sample[:, 1]
    if len(pos) and (pos.min() < 0 or pos.max() >= len(doc) or np.any(pos[1:] < pos[:-1])):
        return "sample_index positions are out of range or decrease"
    if len(pos) and (offset.min() < 0 or np.any(offset > sequence_lengths[doc[pos]])):
        return "sample_index offsets fall outside their sequences"
    if len(shuffle) and shuffle.max() >= len(shuffle):  # unsigned or checked int64 below
        return f"shuffle_index holds values past {len(shuffle) - 1}"
    if len(shuffle) and shuffle.min() < 0:
        return "shuffle_index holds negative values"
    return None


def resolve_pad_id(tokenizer, allow_ambiguous: bool) -> int:
    """tokenizer.pad, unless missing or equal to EOD (then -1, never a real token), as Megatron."""
    pad = getattr(tokenizer, "pad", None)
    if pad is None:
        return PAD_TOKEN_ID
    if pad == getattr(tokenizer, "eod", None) and not allow_ambiguous:
        _warn_ambiguous_pad(pad)
        return PAD_TOKEN_ID
    return pad


@functools.cache
def _warn_ambiguous_pad(pad: int) -> None:
    """Said once per process, not once per dataset of a blend."""
    log.warning(
        "the tokenizer's pad id %d equals its EOD id; padding with %d instead "
        "(--allow-ambiguous-pad-tokens keeps it)",
        pad,
        PAD_TOKEN_ID,
    )


@functools.lru_cache(maxsize=4)
def _positions(seq_length: int) -> torch.Tensor:
    """0..S-1, shared process-wide so that batches without --reset-position-ids expand, not copy."""
    return torch.arange(seq_length, dtype=torch.long)


def emits_document_ids(cfg: DataConfig) -> bool:
    """Whether batches carry `document_ids` (what attention needs for --reset-attention-mask)."""
    return cfg.reset_attention_mask and cfg.create_attention_mask


def document_tensors(tokens: np.ndarray, eod: int, cfg: DataConfig):
    """[b, S] input ids -> tensors (loss_mask float32, position_ids int64, document_ids int32 or
    None), each [b, S].

    Megatron's semantics for the flags, O(S) per sample: an EOD input token gets no loss
    (--eod-mask-loss); positions restart after each EOD (--reset-position-ids); and instead of
    Megatron's [S, S] mask, --reset-attention-mask yields document ids: the number of EODs before
    each position, so a token sees exactly the earlier tokens with its id (the EOD ends its
    document).
    """
    is_eod = tokens == eod
    loss_mask = (~is_eod if cfg.eod_mask_loss else np.ones(tokens.shape, bool)).astype(np.float32)
    b, n = tokens.shape
    positions = _positions(n)
    if cfg.reset_position_ids:
        # each position minus its document's start (one past the last EOD before it); torch's
        # cummax is ~4x faster than numpy's maximum.accumulate here
        starts = np.zeros((b, n), dtype=np.int64)
        np.multiply(is_eod[:, :-1], positions.numpy()[1:], out=starts[:, 1:])
        position_ids = torch.cummax(torch.from_numpy(starts), dim=1).values
        torch.sub(positions, position_ids, out=position_ids)
    else:
        position_ids = positions.expand(b, n)
    document_ids = None
    if emits_document_ids(cfg):
        ids = np.cumsum(is_eod, axis=1, dtype=np.int32)
        ids -= is_eod  # an EOD belongs to the document it ends
        document_ids = torch.from_numpy(ids)
    return torch.from_numpy(loss_mask), position_ids, document_ids


@dataclass(frozen=True, eq=False)
class IndexSpec:
    """Everything a GPTDataset is made of except its index arrays, known before they exist: a
    blend asks for thousands of them, then loads or builds the arrays together."""

    indexed: object
    """The IndexedDataset."""
    dataset_path: str | None
    """The prefix (None for mock data)."""
    indices: np.ndarray
    """Sequence ids of the split."""
    num_samples: int | None
    """Samples requested (None: one epoch)."""
    index_split: str
    """train, valid or test."""
    cfg: DataConfig
    tokenizer: object
    extra_token: int
    drop_last: bool
    identifiers: OrderedDict
    """Megatron's unique_identifiers (its cache description, as JSON, names the cache)."""
    plan: EpochPlan
    expect: dict
    """(dtype, shape) of each index array."""

    @functools.cached_property
    def description(self) -> str:
        return describe(self.identifiers)

    @functools.cached_property
    def description_hash(self) -> str:
        return hashlib.md5(self.description.encode("utf-8")).hexdigest()

    def __len__(self) -> int:
        """Samples of the dataset (rows of the sample index - 1)."""
        return self.expect["sample_index"][1][0] - 1

    def cache_request(self, cache_dir: str | None) -> CacheRequest:
        """The index cache in `cache_dir` (Megatron's names), built by `build_indices`."""
        lengths, cfg = self.indexed.sequence_lengths, self.cfg
        return CacheRequest(
            directory=cache_dir,
            base_name=f"{self.description_hash}-{self.identifiers['class']}-{self.index_split}",
            description=self.description,
            expect=self.expect,
            build=lambda: build_indices(
                lengths,
                self.indices,
                self.plan,
                cfg.seq_length,
                cfg.seed,
                self.extra_token,
                self.drop_last,
            ),
            source=Source(fingerprint=self.indexed.fingerprint, modified=self.indexed.idx_modified),
            check=lambda a: index_problem(a, lengths, self.indices),
        )

    def with_num_samples(self, num_samples: int | None) -> IndexSpec:
        """The same dataset built for `num_samples` samples."""
        return index_spec(
            self.indexed, self.dataset_path, self.indices, num_samples, self.index_split, self.cfg,
            self.tokenizer, self.extra_token, self.drop_last, self.identifiers["class"],
        )  # fmt: skip

    def default_cache_dir(self) -> str | None:
        """--data-cache-path, else Megatron's folder beside the prefix; data without a prefix
        (mock data) is cached only under --data-cache-path, else built in memory, as Megatron."""
        if self.cfg.data_cache_path is None and self.dataset_path is not None:
            return os.path.join(self.dataset_path, "cache", "GPTDataset_indices")
        return self.cfg.data_cache_path


def index_spec(
    indexed,
    dataset_path: str | None,
    indices: np.ndarray,
    num_samples: int | None,
    index_split: str,
    cfg: DataConfig,
    tokenizer,
    extra_token: int = 1,
    drop_last: bool = True,
    dataset_class: str = "GPTDataset",
) -> IndexSpec:
    """The IndexSpec of a GPTDataset (a split without a full sample is a UserError);
    `dataset_class` is part of the cache identity, as in Megatron."""
    identifiers = OrderedDict(
        [
            ("class", dataset_class),
            ("dataset_path", dataset_path),
            ("num_samples", num_samples),
            ("index_split", index_split),
            ("random_seed", cfg.seed),
            ("sequence_length", cfg.seq_length),
            ("split", cfg.split),
            ("split_matrix", cfg.split_matrix),
            ("tokenizer", getattr(tokenizer, "unique_identifiers", None)),
        ]
    )
    lengths = indexed.sequence_lengths
    # the split's sequences are a range (split_ranges): sum a view, not a gathered copy
    contiguous = len(indices) == 0 or indices[-1] - indices[0] + 1 == len(indices)
    picked = (
        lengths[indices[0] : indices[-1] + 1] if contiguous and len(indices) else lengths[indices]
    )
    tokens_per_epoch = int(picked.sum(dtype=np.int64))
    if tokens_per_epoch <= extra_token:
        raise UserError(
            f"{dataset_path}: the {index_split} split has {tokens_per_epoch} tokens, too few for "
            f"one sample (change --split or use more data)"
        )
    plan = plan_epochs(tokens_per_epoch, num_samples, cfg.seq_length, extra_token)
    expect = expected_index_layout(
        lengths, len(indices), plan, cfg.seq_length, extra_token, drop_last
    )
    return IndexSpec(
        indexed=indexed,
        dataset_path=dataset_path,
        indices=indices,
        num_samples=num_samples,
        index_split=index_split,
        cfg=cfg,
        tokenizer=tokenizer,
        extra_token=extra_token,
        drop_last=drop_last,
        identifiers=identifiers,
        plan=plan,
        expect=expect,
    )


class GPTDataset(torch.utils.data.Dataset):
    """Samples of seq_length tokens from the sequences `indices` of an IndexedDataset."""

    def __init__(
        self,
        indexed,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        cfg: DataConfig,
        tokenizer,
        extra_token: int = 1,
        drop_last: bool = True,
    ):
        spec = index_spec(
            indexed, dataset_path, indices, num_samples, index_split, cfg, tokenizer, extra_token,
            drop_last, type(self).__name__,
        )  # fmt: skip
        self._attach(spec, load_or_build(spec.cache_request(spec.default_cache_dir())))

    @classmethod
    def from_spec(cls, spec: IndexSpec, arrays: dict[str, np.ndarray]) -> GPTDataset:
        """The dataset of `spec` with its index arrays already loaded or built (validated)."""
        dataset = cls.__new__(cls)
        dataset._attach(spec, arrays)
        return dataset

    def _attach(self, spec: IndexSpec, arrays: dict[str, np.ndarray]) -> None:
        self.spec = spec
        self.indexed = spec.indexed
        self.dataset_path = spec.dataset_path
        self.indices = spec.indices
        self.num_samples = spec.num_samples
        self.index_split = spec.index_split
        self.cfg = cfg = spec.cfg
        self.extra_token = spec.extra_token
        self.eod = spec.tokenizer.eod
        self.pad = resolve_pad_id(spec.tokenizer, cfg.allow_ambiguous_pad_tokens)
        self.unique_identifiers = spec.identifiers
        # plain ndarray views of the (possibly memory-mapped) arrays: indexing an np.memmap costs a
        # subclass construction per access, which shows in __getitem__
        self.document_index = np.asarray(arrays["document_index"])
        self.sample_index = np.asarray(arrays["sample_index"])
        self.shuffle_index = np.asarray(arrays["shuffle_index"])
        # without these flags loss mask and positions do not depend on the sample
        self._cacheable = not (
            cfg.reset_position_ids or emits_document_ids(cfg) or cfg.eod_mask_loss
        )

    @property
    def unique_description(self) -> str:
        return self.spec.description

    @property
    def unique_description_hash(self) -> str:
        return self.spec.description_hash

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_tokens(self, idx: int, out: np.ndarray | None = None) -> np.ndarray:
        """The S + x token ids of sample idx (int64), padded with the pad id at the data's end."""
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j : j + 2].tolist()
        x = self.extra_token
        if d0 == d1:
            parts = [self.indexed.get(int(self.document_index[d0]), offset=o0, length=o1 - o0 + x)]
        else:
            parts = [self.indexed.get(int(self.document_index[d0]), offset=o0)]
            parts += [self.indexed.get(int(self.document_index[d])) for d in range(d0 + 1, d1)]
            parts.append(self.indexed.get(int(self.document_index[d1]), offset=0, length=o1 + x))
        want = self.cfg.seq_length + x
        have = sum(len(p) for p in parts)
        if have < want:
            parts.append(np.full(want - have, self.pad, dtype=np.int64))
        if out is None:
            return np.concatenate(parts, dtype=np.int64)
        return np.concatenate(parts, out=out)

    def tensors(self, text: np.ndarray) -> dict[str, torch.Tensor]:
        """[b, S + x] token ids -> the batch: tokens, labels, loss_mask, position_ids
        [, document_ids]; every tensor is O(S) per sample (docs/ARCHITECTURE.md, loader contract)."""
        b = text.shape[0]
        S = self.cfg.seq_length
        document_ids = None
        if self._cacheable:
            # one shared positions tensor expanded over the batch, not b copies
            position_ids = _positions(S).expand(b, S)
            # cheaper than torch.ones
            loss_mask = torch.from_numpy(np.ones((b, S), dtype=np.float32))
        else:
            # before the pad ids are replaced below: a pad id equal to EOD counts as EOD (Megatron)
            loss_mask, position_ids, document_ids = document_tensors(
                text[:, :S], self.eod, self.cfg
            )
        if self.extra_token:
            # numpy copies: torch's copy goes multi-threaded from 32k elements (S >= 4096 at
            # micro-batch 8) and its thread pool costs more CPU than the copy in a busy process
            tokens = torch.from_numpy(np.ascontiguousarray(text[:, :-1]))
            labels = torch.from_numpy(np.ascontiguousarray(text[:, 1:]))
        else:
            tokens = torch.from_numpy(text)
            labels = torch.roll(tokens, shifts=-1, dims=1)
            labels[:, -1] = self.pad
        # Padding sits at the end; a pad of -1 is no real token, so unpadded samples need no scan.
        if (
            self.pad != PAD_TOKEN_ID
            or not self.extra_token
            or bool((text[:, -1] == self.pad).any())
        ):
            loss_mask[labels == self.pad] = 0.0
            tokens[tokens == self.pad] = 0
            labels[labels == self.pad] = 0
        batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        batch["position_ids"] = position_ids
        if document_ids is not None:
            batch["document_ids"] = document_ids
        return batch

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """A whole micro-batch at once (torch's DataLoader calls this with the sampler's indices)."""
        text = np.empty((len(indices), self.cfg.seq_length + self.extra_token), dtype=np.int64)
        for row, idx in enumerate(indices):
            self.sample_tokens(idx, out=text[row])
        return self.tensors(text)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([idx]).items()}
