"""Data flags (Megatron spellings) -> `DataConfig`, blend parsing, split matrix, sample counts.

`add_data_args` owns the data-side flags; `add_sample_count_args` owns the flags the sample counts
come from (`--train-iters`, `--global-batch-size`, `--seq-length`, `--seed`, ...), which are also
training flags: `pretrain/cli/flags.py` reuses this function so there is one definition of each.
"""

from __future__ import annotations

import argparse
import enum
import functools
import json
import math
import re
import warnings
from dataclasses import dataclass

import numpy as np

from pretrain.data.files.blend_paths import expand
from pretrain.data.schedule import SchedulePhase, check_schedule_prefixes, read_schedule
from pretrain.errors import UserError
from pretrain.flag_help import argument_group

# (prefixes, weights or None)
Blend = tuple[list[str], list[float] | None]


class Split(enum.IntEnum):
    """The three splits, in Megatron's order (the index into every per-split list)."""

    train = 0
    valid = 1
    test = 2


SPLIT_NAMES = tuple(split.name for split in Split)
LEGACY_DEFAULT_SPLIT = "969, 30, 1"
MOCK_SPLIT = "1,1,1"  # megatron-core's split for mock data, whatever --split says


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron's data flags (paths, blends, split, cache, masks, loader) to `parser`'s
    "data and dataloader" group."""
    g = argument_group(parser, "data and dataloader")
    _add_path_args(g)
    _add_build_args(g)
    _add_sample_args(g)
    _add_loader_args(g)
    return parser


def _add_path_args(g) -> None:
    """Which prefixes each split reads: paths, blends, per-split paths, --split, mock data."""
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        metavar="PREFIX",
        help="one prefix (PREFIX for PREFIX.bin/PREFIX.idx), several prefixes (blended by size), "
        "or 'W1 PREFIX1 W2 PREFIX2 ...' (blended by weight); a PREFIX may be a glob (dir/part_*) "
        "or a folder (dir/), standing for the prefixes it holds, which share its weight by tokens",
    )
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="Megatron's synthetic data: no files, no --data-path (for trials and benchmarks)",
    )
    g.add_argument(
        "--data-args-path",
        default=None,
        help="a file holding the --data-path arguments, whitespace separated (for long blends)",
    )
    for split in SPLIT_NAMES:
        g.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            metavar="PREFIX",
            help=f"the {split} split's own blend (same forms as --data-path); "
            "replaces --data-path and --split",
        )
    g.add_argument(
        "--per-split-data-args-path",
        default=None,
        help='JSON file {"train": ..., "valid": ..., "test": ...}, each a string or list in '
        "the --data-path forms",
    )
    g.add_argument(
        "--split",
        default=None,
        metavar="TRAIN,VALID,TEST",
        help="proportions of each --data-path prefix per split, e.g. 949,50,1 "
        f"[default: {LEGACY_DEFAULT_SPLIT.replace(' ', '')} (Megatron's legacy default); "
        f"{MOCK_SPLIT} with --mock-data]",
    )


def _add_build_args(g) -> None:
    """How the datasets are built from them: caches, weights and their schedule, checks."""
    g.add_argument(
        "--data-cache-path",
        default=None,
        help="directory for the index caches; node-local directories are fine, each node builds "
        "its own [default: PREFIX/cache/GPTDataset_indices for each prefix, as Megatron]",
    )
    g.add_argument(
        "--data-schedule",
        default=None,
        metavar="PATH",
        help='JSON list of phases [{"iteration": N, "weights": {PREFIX: W, ...}}, ...]: '
        "the train blend's weights from iteration N on; each prefix continues its own sample "
        "order across phases (docs/DATA.md)",
    )
    g.add_argument(
        "--blend-weights-unit",
        choices=["samples", "tokens"],
        default="samples",
        help="what the weights of 'W1 PREFIX1 W2 PREFIX2' are shares of: samples (Megatron's) "
        "or tokens; every sample is seq-length tokens, so both give the same blend",
    )
    g.add_argument(
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="use data whose fingerprint (PREFIX.json) names another tokenizer than the one given",
    )
    g.add_argument(
        "--mid-level-dataset-surplus",
        type=float,
        default=0.005,
        help="extra fraction of samples built per blended prefix",
    )
    g.add_argument(
        "--num-dataset-builder-threads",
        type=int,
        default=1,
        help="threads building the prefixes of a blend in parallel",
    )


def _add_sample_args(g) -> None:
    """What a sample holds besides its tokens: loss mask, positions, attention across EODs."""
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD input tokens")
    g.add_argument(
        "--reset-position-ids", action="store_true", help="position ids restart after each EOD"
    )
    g.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="tokens cannot attend across an EOD (the loader passes O(S) document ids to "
        "attention, never an [S,S] mask)",
    )
    g.add_argument(
        "--no-create-attention-mask-in-dataloader",
        dest="create_attention_mask",
        action="store_false",
        help="the loader builds no attention input: attention is causal over the whole sample "
        "(refused with --reset-attention-mask, which needs the document ids)",
    )
    g.add_argument(
        "--allow-ambiguous-pad-tokens",
        action="store_true",
        help="keep a tokenizer pad id equal to another special token (not recommended)",
    )


def _add_loader_args(g) -> None:
    """The DataLoader: workers, sampler, and Megatron's start-up flags that change nothing here."""
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    g.add_argument(
        "--dataloader-type",
        choices=["single", "cyclic"],
        default="single",
        help="single: Megatron's sequential sampler; cyclic: random order per epoch",
    )
    g.add_argument(
        "--no-data-sharding",
        dest="data_sharding",
        action="store_false",
        help="cyclic sampler: one global permutation instead of one bucket per DP rank",
    )
    # Megatron's start-up flags for large blends: what they buy is how this loader always works
    # (docs/DATA.md, "Blends of thousands of prefixes")
    g.add_argument(
        "--dataloader-fast-cache-load",
        action="store_true",
        help="accepted: a blend's index caches are always loaded from one file per split, with "
        "no per-prefix cache file looked up",
    )
    g.add_argument(
        "--dataloader-defer-npy-index-mmap",
        action="store_true",
        help="accepted: a blend's index arrays are one mapping per split, and each prefix's "
        ".bin is mapped when a sample first reads it",
    )
    g.add_argument(
        "--per-dataset-sequences-path",
        metavar="PATH",
        help="accepted, not read: each .idx is opened once per process anyway (its header with "
        "the counts is part of that read)",
    )


_SAMPLE_COUNT_FLAGS = (  # (group, flag, default, help) of integer flags
    ("data and dataloader", "--seq-length", None, "tokens per sample (required)"),
    ("initialization", "--seed", 1234, "random seed of the data order and the weights"),
    ("training", "--train-iters", None, "training iterations"),
    ("training", "--train-samples", None, "training samples (instead of --train-iters)"),
    (
        "training",
        "--global-batch-size",
        None,
        "samples per iteration [default: the --deepspeed_config JSON's, else micro batch x DP]",
    ),
    (
        "training",
        "--micro-batch-size",
        1,
        "samples per forward pass per data-parallel rank [default: 1, or pretrain_gpt.py's --deepspeed_config JSON's]",
    ),
    ("validation", "--eval-interval", 1000, "training iterations between evaluations"),
    ("validation", "--eval-iters", 100, "global batches per evaluation (0 = no evaluation)"),
)


def add_sample_count_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags that fix how many samples each split needs, and the sample shape and seed, each in
    its Megatron-LM group (training, initialization, validation, data and dataloader)."""
    for group, flag, default, text in _SAMPLE_COUNT_FLAGS:
        argument_group(parser, group).add_argument(flag, type=int, default=default, help=text)
    return parser


def train_valid_test_num_samples(
    train_iters: int | None,
    train_samples: int | None,
    eval_interval: int,
    eval_iters: int,
    global_batch_size: int | None,
) -> tuple[int, int, int]:
    """Samples per split as Megatron's training loop consumes them."""
    if global_batch_size is None or global_batch_size <= 0:
        raise UserError("--global-batch-size must be a positive integer (samples per iteration)")
    if train_samples is not None:
        n_train = train_samples
        train_iters = train_samples // global_batch_size if train_iters is None else train_iters
    elif train_iters is not None:
        n_train = train_iters * global_batch_size
    else:
        raise UserError("pass --train-iters or --train-samples to size the training split")
    if eval_interval is None or eval_interval <= 0:
        raise UserError(f"--eval-interval must be a positive integer, got {eval_interval}")
    n_valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    n_test = eval_iters * global_batch_size
    return n_train, n_valid, n_test


def parse_blend(values: list[str], source: str) -> Blend:
    """`[P]`, `[P1 P2 ...]` or `[W1 P1 W2 P2 ...]` -> (prefixes, weights or None); an entry
    that is a glob or a folder stands for the prefixes it names, its weight shared among them by
    tokens (`pretrain/data/files/blend_paths.py`)."""
    return expand(*_blend_words(values, source), source)


def _blend_words(values: list[str], source: str) -> Blend:
    """`parse_blend` before globs and folders are expanded."""
    values = [v.strip() for v in values if v.strip()]
    if not values:
        raise UserError(
            f"{source}: no dataset prefix given (pass PREFIX or 'W1 PREFIX1 W2 PREFIX2 ...')"
        )
    if len(values) % 2 == 1:
        return values, None
    weights = []
    for v in values[0::2]:
        try:
            weights.append(float(v))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return values, None
    if any(w is None for w in weights):
        raise UserError(
            f"{source}: mixes weights and prefixes ({' '.join(values)}); give either "
            "'PREFIX1 PREFIX2 ...' or a weight before every prefix 'W1 PREFIX1 W2 PREFIX2 ...'"
        )
    for w in weights:
        if not math.isfinite(w) or w <= 0:
            raise UserError(
                f"{source}: weight {w} is not a positive number (every blend weight must be > 0)"
            )
    if not math.isfinite(sum(weights)):
        raise UserError(
            f"{source}: the weights {' '.join(values[0::2])} overflow when added "
            "(only their ratios matter: use smaller numbers)"
        )
    return list(values[1::2]), weights


_SPLIT_PART = re.compile(r"\s*(?:\d+\.?\d*|\.\d+)\s*")  # a plain non-negative decimal


def parse_split(split: str) -> list[float]:
    """'949,50,1' -> normalized float64 proportions, padded to three.

    Megatron reads the numbers with the regex `[.0-9]+`, which turns "-1,2,0" into 1,2,0, "inf,1,0"
    into 1,0 and "1.2.3,1,0" into a crash; here every comma- (or slash-) separated part must be a
    plain non-negative decimal, so such strings are refused with the flag named.
    """
    parts = re.split(r"[,/]", split)
    bad = [p for p in parts if not _SPLIT_PART.fullmatch(p)]
    if bad or len(parts) > 3:
        what = (
            f"{bad[0].strip()!r} is not a non-negative number" if bad else "more than three parts"
        )
        raise UserError(
            f"--split {split!r}: {what} (give up to three proportions train,valid,test, e.g. 949,50,1)"
        )
    values = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    total = sum(values)
    if total <= 0:
        raise UserError(f"--split {split!r}: the proportions sum to zero (e.g. 949,50,1)")
    if not math.isfinite(total):
        raise UserError(
            f"--split {split!r}: the proportions are too large to add up (use smaller numbers)"
        )
    w = np.array(values, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """Bookends (lo, hi) per split from the int 0 (None where the split is empty), as Megatron."""
    return list(_split_matrix(split))


@functools.cache
def _split_matrix(split: str) -> tuple[tuple[float, float] | None, ...]:
    """`split_matrix`, computed once per split string (every dataset of a blend asks)."""
    bounds = [0]
    for p in parse_split(split):
        bounds.append(bounds[-1] + p)
    return tuple(
        (lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:], strict=False)
    )


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokenized data is and how samples are made from it (Megatron's data flags)."""

    seq_length: int
    """Tokens per sample (--seq-length)."""
    seed: int = 1234
    """Seed of the document and sample shuffles (--seed)."""
    blend: Blend | None = None
    """(prefixes, weights or None) of --data-path / --data-args-path."""
    blend_per_split: list[Blend | None] | None = None
    """One blend per split from --{train,valid,test}-data-path / --per-split-data-args-path."""
    split: str | None = None
    """Train,valid,test proportions of every --data-path prefix (--split)."""
    data_cache_path: str | None = None
    """Folder for the index caches; None = beside each prefix (--data-cache-path)."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per blended prefix (--mid-level-dataset-surplus)."""
    num_dataset_builder_threads: int = 1
    """Threads building a blend's prefixes in parallel (--num-dataset-builder-threads)."""
    eod_mask_loss: bool = False
    """No loss on EOD input tokens (--eod-mask-loss)."""
    reset_position_ids: bool = False
    """Position ids restart after each EOD (--reset-position-ids)."""
    reset_attention_mask: bool = False
    """Tokens cannot attend across an EOD (--reset-attention-mask): batches carry document_ids."""
    create_attention_mask: bool = True
    """The loader builds what attention needs (document_ids with reset_attention_mask; nothing
    for causal attention); off (--no-create-attention-mask-in-dataloader): nothing, ever."""
    allow_ambiguous_pad_tokens: bool = False
    """Keep a pad id equal to another special token (--allow-ambiguous-pad-tokens)."""
    num_workers: int = 2
    """DataLoader worker processes (--num-workers)."""
    dataloader_type: str = "single"
    """"single" (Megatron's sequential sampler) or "cyclic" (--dataloader-type)."""
    data_sharding: bool = True
    """Cyclic sampler: one bucket per DP rank (off: --no-data-sharding)."""
    blend_weights_unit: str = "samples"
    """What blend weights are shares of: "samples" (Megatron's) or "tokens" (--blend-weights-unit)."""
    allow_tokenizer_mismatch: bool = False
    """Accept data whose fingerprint names another tokenizer (--allow-tokenizer-mismatch)."""
    mock: bool = False
    """Megatron's synthetic sequences instead of files, split 1,1,1 (--mock-data)."""
    data_schedule: tuple[SchedulePhase, ...] | None = None
    """The train blend's weights per phase (--data-schedule FILE); None: the blend's own."""

    def __post_init__(self):
        if self.seq_length is None or self.seq_length <= 0:
            raise UserError(f"--seq-length must be a positive integer, got {self.seq_length}")
        if self.blend is not None and self.blend_per_split is not None:
            raise UserError(
                "--data-path/--data-args-path cannot be combined with --train/valid/test-data-path "
                "or --per-split-data-args-path; use one form"
            )
        if self.mock:
            self._use_mock_split()
        elif self.blend is None and not (self.blend_per_split and any(self.blend_per_split)):
            raise UserError(
                "no data given: pass --data-path PREFIX (or --train-data-path ... / "
                "--data-args-path / --per-split-data-args-path)"
            )
        if self.blend_per_split is not None and self.split is not None:
            raise UserError(
                "--split cannot be combined with per-split data paths (each split uses all of "
                "its own prefixes); drop --split"
            )
        if self.blend is not None and self.split is None:
            warnings.warn(
                f"--split not given, using Megatron's legacy default '{LEGACY_DEFAULT_SPLIT}'",
                stacklevel=2,
            )
            object.__setattr__(self, "split", LEGACY_DEFAULT_SPLIT)  # frozen: set once, here
        if self.split is not None:
            split_matrix(self.split)  # validate now, with the flag named
        if self.reset_attention_mask and not self.create_attention_mask:
            raise UserError(
                "--reset-attention-mask needs the document ids the data loader builds; "
                "drop --no-create-attention-mask-in-dataloader (or --reset-attention-mask)"
            )
        if self.mid_level_dataset_surplus < 0:
            raise UserError("--mid-level-dataset-surplus must be >= 0")
        if self.num_workers < 0:
            raise UserError("--num-workers must be >= 0")
        if self.data_schedule is not None:
            self._check_schedule()

    def _check_schedule(self) -> None:
        """A --data-schedule needs a train blend of the same prefixes and the sequential sampler."""
        if self.mock or self.train_blend is None:
            raise UserError(
                "--data-schedule weighs the prefixes of the train blend: give them with "
                "--data-path or --train-data-path"
            )
        if self.dataloader_type != "single":
            raise UserError(
                f"--data-schedule needs --dataloader-type single (with {self.dataloader_type} "
                f"the blend is read in a random order, so no source continues its own order)"
            )
        flag = "--data-path" if self.blend is not None else "--train-data-path"
        check_schedule_prefixes(self.data_schedule, self.train_blend[0], flag)

    @property
    def train_blend(self) -> Blend | None:
        """The blend the train split is drawn from (--data-path or --train-data-path)."""
        if self.blend is not None:
            return self.blend
        return self.blend_per_split[0] if self.blend_per_split else None

    @property
    def train_range(self) -> tuple[float, float]:
        """Bounds of each train prefix's train split (all of it with per-split data paths)."""
        return tuple(self.split_matrix[0]) if self.blend is not None else (0.0, 1.0)

    def _use_mock_split(self) -> None:
        """Mock data has no files and megatron-core always splits it 1,1,1."""
        if self.blend is not None or self.blend_per_split is not None:
            raise UserError(
                "--mock-data cannot be combined with --data-path/--data-args-path or per-split "
                "data paths (Megatron takes one data source; drop one)"
            )
        if self.split is not None and parse_split(self.split) != parse_split(MOCK_SPLIT):
            warnings.warn(
                f"--split {self.split} is ignored with --mock-data (Megatron splits mock data "
                f"{MOCK_SPLIT})",
                stacklevel=3,
            )
        object.__setattr__(self, "split", MOCK_SPLIT)  # frozen: set once, here

    @property
    def split_matrix(self) -> list[tuple[float, float] | None] | None:
        return None if self.split is None else split_matrix(self.split)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> DataConfig:
        blend, blend_per_split = blends_from_args(ns)
        return cls(
            seq_length=ns.seq_length,
            seed=ns.seed,
            blend=blend,
            blend_per_split=blend_per_split,
            split=ns.split,
            data_cache_path=ns.data_cache_path,
            mid_level_dataset_surplus=ns.mid_level_dataset_surplus,
            num_dataset_builder_threads=ns.num_dataset_builder_threads,
            eod_mask_loss=ns.eod_mask_loss,
            reset_position_ids=ns.reset_position_ids,
            reset_attention_mask=ns.reset_attention_mask,
            create_attention_mask=ns.create_attention_mask,
            allow_ambiguous_pad_tokens=ns.allow_ambiguous_pad_tokens,
            num_workers=ns.num_workers,
            dataloader_type=ns.dataloader_type,
            data_sharding=ns.data_sharding,
            blend_weights_unit=getattr(ns, "blend_weights_unit", "samples"),
            allow_tokenizer_mismatch=getattr(ns, "allow_tokenizer_mismatch", False),
            mock=getattr(ns, "mock_data", False),
            data_schedule=(
                None
                if getattr(ns, "data_schedule", None) is None
                else read_schedule(ns.data_schedule)
            ),
        )


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot read ({err.strerror}); check the path") from err


def _global_blend(ns: argparse.Namespace) -> Blend | None:
    """The blend of --data-path or --data-args-path (None if neither is given)."""
    if ns.data_path is not None and ns.data_args_path is not None:
        raise UserError("give either --data-path or --data-args-path, not both")
    if ns.data_args_path is not None:
        words = _read_text(ns.data_args_path, "--data-args-path").split()
        return parse_blend(words, ns.data_args_path)
    return None if ns.data_path is None else parse_blend(ns.data_path, "--data-path")


def _per_split_blends(ns: argparse.Namespace) -> list[Blend | None] | None:
    """The per-split blends of --per-split-data-args-path or --{train,valid,test}-data-path."""
    per_split_flags = [getattr(ns, f"{s}_data_path") for s in SPLIT_NAMES]
    if ns.per_split_data_args_path is not None:
        path = ns.per_split_data_args_path
        try:
            spec = json.loads(_read_text(path, "--per-split-data-args-path"))
        except json.JSONDecodeError as err:
            raise UserError(
                f"{path}:{err.lineno}: not valid JSON ({err.msg}); expected "
                '{"train": ..., "valid": ..., "test": ...}'
            ) from err
        if not isinstance(spec, dict) or not set(spec) <= set(SPLIT_NAMES):
            raise UserError(f'{path}: expected a JSON object with keys "train", "valid", "test"')
        blends = []
        for name in SPLIT_NAMES:
            value = spec.get(name)
            if isinstance(value, str):
                value = value.split()
            blends.append(None if value is None else parse_blend(value, f"{path} [{name}]"))
        return blends
    if all(p is None for p in per_split_flags):
        return None
    return [
        None if p is None else parse_blend(p, f"--{name}-data-path")
        for name, p in zip(SPLIT_NAMES, per_split_flags, strict=True)
    ]


def blends_from_args(
    ns: argparse.Namespace,
) -> tuple[Blend | None, list[Blend | None] | None]:
    """(blend, per-split blends) from the data-path flags; `DataConfig` refuses both at once."""
    return _global_blend(ns), _per_split_blends(ns)
