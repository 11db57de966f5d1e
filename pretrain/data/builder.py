"""Flags -> train/valid/test datasets, with Megatron's blend sizing (docs/DATA_FORMAT.md §4).

Every process that needs data calls `build_train_valid_test_datasets`; the index caches make sure
each array is built once per node (or once per shared filesystem) and loaded everywhere else, so no
rank waits at a barrier for rank 0 and nodes without a shared cache directory work.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence

from pretrain.data.blends.blend_build import BlendRequest, build_blend_split
from pretrain.data.blends.blended_dataset import normalize
from pretrain.data.blends.mixture import MixturePlan
from pretrain.data.caches.cache import load_or_build
from pretrain.data.config import Blend, DataConfig, Split
from pretrain.data.datasets.gpt_dataset import GPTDataset, IndexSpec, index_spec, split_ranges
from pretrain.data.datasets.mock import build_mock_datasets
from pretrain.data.files.fingerprint import PrefixFiles
from pretrain.data.files.indexed_dataset import IndexedDataset
from pretrain.data.files.notices import Notices
from pretrain.data.gc_pause import gc_paused
from pretrain.errors import UserError

log = logging.getLogger(__name__)

FULL_RANGE = (0.0, 1.0)


def sizes_per_dataset(
    weights: Sequence[float], split_sizes: Sequence[int | None], surplus: float = 0.0
):
    """[dataset][split] sample counts: ceil(ceil(N * w) * (1 + surplus)) (surplus 0: the targets)."""
    return [
        [
            None if n is None else int(math.ceil(math.ceil(n * w) * (1 + surplus)))
            for n in split_sizes
        ]
        for w in weights
    ]


def _open(files: PrefixFiles, prefix: str) -> IndexedDataset:
    """`prefix`'s dataset from `files`, or one line saying that the pair does not exist."""
    if not files.exists(prefix):
        raise UserError(
            f"{prefix}: no {prefix}.bin/{prefix}.idx pair (check the --data-path prefix; "
            "tools/preprocess_data.py writes PREFIX_text_document.bin/.idx)"
        )
    return files.indexed(prefix)


class _Builder:
    def __init__(
        self,
        cfg: DataConfig,
        tokenizer,
        progress: Callable[[str], None] | None,
        files: PrefixFiles | None,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.progress = progress or (lambda what: None)
        self.files = files or PrefixFiles(cfg.data_cache_path)

    def indexed(self, prefix: str) -> IndexedDataset:
        return _open(self.files, prefix)

    def spec(
        self, prefix: str, matrix, split: int, num_samples: int | None, empty: Notices
    ) -> IndexSpec | None:
        """`prefix`'s dataset in `split`, or None (noted in `empty`) when it gets no sequence."""
        indexed = self.indexed(prefix)
        indices = split_ranges(len(indexed), matrix)[split]
        if len(indices) == 0:
            # Megatron loops forever here (no tokens can never reach the requested samples)
            empty.add(prefix, f"{len(indexed):,} sequences", len(indexed))
            self.progress(f"{Split(split).name} {prefix} (empty)")
            return None
        return index_spec(
            indexed, prefix, indices, num_samples, Split(split).name, self.cfg, self.tokenizer
        )

    def say_empty(self, empty: Notices, split: int, of: int) -> None:
        """One line for the prefixes `split` gets no sequence from (of `of`)."""
        # info, not warning: every rank reaches this, and only rank 0 logs at info
        name, flag = Split(split).name, f"--split {self.cfg.split}"
        if of == 1 and len(empty) == 1:
            _, prefix, count = empty.items[0]
            log.info(
                "%s: the %s split gets 0 of %s with %s; it is not built", prefix, name, count, flag
            )
            return
        empty.log(
            log,
            logging.INFO,
            f"the {name} split gets no sequence from {len(empty):,} of {of:,} prefixes with "
            f"{flag}; it is not built from them",
        )

    def gpt(self, prefix: str, matrix, split: int, num_samples: int | None) -> GPTDataset | None:
        if matrix[split] is None:
            return None
        empty = Notices()
        spec = self.spec(prefix, matrix, split, num_samples, empty)
        self.say_empty(empty, split, 1)
        if spec is None:
            return None
        ds = GPTDataset.from_spec(spec, load_or_build(spec.cache_request(spec.default_cache_dir())))
        self.progress(f"{Split(split).name} {prefix}")
        return ds

    def gpt_splits(self, prefix: str, matrix, sizes) -> list[GPTDataset | None]:
        return [self.gpt(prefix, matrix, split, sizes[split]) for split in Split]

    def train_split(self, blend: Blend, num_samples: int):
        """The train split of `blend` alone, built as the flags' train blend would be built if
        it were `blend` (Megatron's one phase of a --data-schedule)."""
        sizes = [num_samples, None, None]
        if self.cfg.blend is None:
            matrix = [FULL_RANGE, None, None]
            if len(blend[0]) == 1:
                return self.gpt(blend[0][0], matrix, Split.train, num_samples)
        else:
            matrix = [self.cfg.split_matrix[Split.train], None, None]
        return self.blend_splits(blend, matrix, sizes)[Split.train]

    def blend_splits(self, blend: Blend, matrix, sizes) -> list:
        """One blended dataset per split of `matrix` from the prefixes of `blend`."""
        prefixes, weights = blend
        if weights is not None:
            weights = normalize(weights)
            targets = sizes_per_dataset(weights, sizes)
            buffered = sizes_per_dataset(weights, sizes, self.cfg.mid_level_dataset_surplus)
        else:
            targets, buffered = None, [[None] * len(Split) for _ in prefixes]
        out = []
        for split in Split:
            if matrix[split] is None:
                out.append(None)
                continue
            empty = Notices()
            specs = [
                self.spec(prefix, matrix, split, buffered[p][split], empty)
                for p, prefix in enumerate(prefixes)
            ]
            self.say_empty(empty, split, len(prefixes))
            request = BlendRequest(
                split=Split(split).name,
                prefixes=list(prefixes),
                specs=specs,
                weights=weights,
                targets=None if targets is None else [t[split] for t in targets],
                size=sizes[split],
            )
            out.append(build_blend_split(request, self.cfg, self.progress))
        return out


@gc_paused()
def build_train_valid_test_datasets(
    cfg: DataConfig,
    tokenizer,
    num_samples: Sequence[int | None],
    progress: Callable[[str], None] | None = None,
    *,
    multiple_validation_sets: bool = False,
    files: PrefixFiles | None = None,
    mixture: MixturePlan | None = None,
    without_train: bool = False,
) -> list:
    """[train, valid, test] datasets (GPTDataset, BlendedDataset or None) for `num_samples` per split.

    `mixture`: the train split's phases (pretrain/data/blends/mixture.py); unless it is Megatron's one
    phase, the train split is its `MixtureDataset`; Megatron's one phase of a --data-schedule
    is the blend of its weights. `without_train`: build no train split.

    `multiple_validation_sets` (Megatron's --multiple-validation-sets, per-split data paths only):
    valid is a list of one GPTDataset per valid prefix, in order, each of the valid split's
    sample count and built as megatron-core builds it (the whole prefix, unblended).
    `files`: the prefixes as already opened (start-up opens each once)."""
    sizes = list(num_samples)
    if multiple_validation_sets and (cfg.blend is not None or cfg.mock):
        raise UserError(
            "--multiple-validation-sets needs the validation prefixes in --valid-data-path (with "
            "--data-path or --mock-data the validation split is one set)"
        )
    if cfg.mock:
        return build_mock_datasets(cfg, tokenizer, sizes, progress)
    b = _Builder(cfg, tokenizer, progress, files)
    if mixture is not None and (not mixture.megatron or mixture.blend is not None):
        rest = build_train_valid_test_datasets(
            cfg,
            tokenizer,
            sizes,
            progress,
            multiple_validation_sets=multiple_validation_sets,
            files=b.files,
            without_train=True,
        )
        return [_mixture_train(b, mixture, sizes[0]), *rest[1:]]
    if cfg.blend is not None:
        return _cut_blend(b, cfg, sizes, without_train)
    return _per_split_blends(b, cfg.blend_per_split, sizes, multiple_validation_sets, without_train)


def _cut_blend(b: _Builder, cfg: DataConfig, sizes: list, without_train: bool) -> list:
    """--data-path's one blend (or prefix), cut into the three splits by --split."""
    matrix = cfg.split_matrix
    if without_train and matrix is not None:
        matrix[Split.train] = None
    prefixes, weights = cfg.blend
    if len(prefixes) == 1 and weights is None:
        return b.gpt_splits(prefixes[0], matrix, sizes)
    return b.blend_splits(cfg.blend, matrix, sizes)


def _per_split_blends(
    b: _Builder,
    blends: Sequence[Blend | None],
    sizes: list,
    multiple_validation_sets: bool,
    without_train: bool,
) -> list:
    """--train/valid/test-data-path: each split's own blend, the whole of each prefix."""
    out = []
    for i, blend in enumerate(blends):
        if blend is None or (without_train and i == Split.train):
            out.append(None)
            continue
        matrix = [None] * 3
        matrix[i] = FULL_RANGE
        only = [None] * 3
        only[i] = sizes[i]
        prefixes, _ = blend
        if multiple_validation_sets and i == Split.valid:
            out.append([_one_validation_set(b, prefix, matrix, sizes[i]) for prefix in prefixes])
        elif len(prefixes) == 1:
            out.append(b.gpt(prefixes[0], matrix, i, sizes[i]))
        else:
            out.append(b.blend_splits(blend, matrix, only)[i])
    return out


def _mixture_train(b: _Builder, mixture: MixturePlan, num_samples: int):
    """The train split of a mixture that is not the flags' train blend."""
    if mixture.megatron:
        return b.train_split(mixture.blend, num_samples)
    from pretrain.data.blends.mixture_dataset import build_mixture

    return build_mixture(mixture, b.cfg, b.tokenizer, b.files)


def _one_validation_set(b: _Builder, prefix: str, matrix, num_samples: int | None) -> GPTDataset:
    dataset = b.gpt(prefix, matrix, Split.valid, num_samples)
    if dataset is None:
        raise UserError(
            f"--multiple-validation-sets: the validation set {prefix} holds no sequences (drop "
            "it from --valid-data-path)"
        )
    return dataset


def count_builds(cfg: DataConfig) -> int:
    """How many datasets `build_train_valid_test_datasets` builds (for a progress bar)."""
    if cfg.mock:
        return sum(m is not None for m in cfg.split_matrix)
    if cfg.blend is not None:
        prefixes, weights = cfg.blend
        splits = sum(m is not None for m in cfg.split_matrix)
        if len(prefixes) == 1 and weights is None:
            return splits
        return splits * (len(prefixes) + 1)
    return sum(1 if len(b[0]) == 1 else len(b[0]) + 1 for b in cfg.blend_per_split if b is not None)


def _split_blend(cfg: DataConfig, split: int) -> tuple[list[str], list | None, str | None]:
    """(prefixes, split matrix, why the split is empty by configuration) for one split."""
    name = Split(split).name
    if cfg.blend is not None:
        matrix = cfg.split_matrix
        if matrix[split] is None:
            return [], None, f"--split {cfg.split} gives it 0% of the data"
        return cfg.blend[0], matrix, None
    blend = cfg.blend_per_split[split]
    if blend is None:
        return [], None, f"no --{name}-data-path (or {name} entry in --per-split-data-args-path)"
    matrix = [None] * 3
    matrix[split] = FULL_RANGE
    return blend[0], matrix, None


def _blend_flag(cfg: DataConfig, split: int) -> str:
    """The flag that lists the prefixes of `split` (for messages)."""
    return "--data-path" if cfg.blend is not None else f"--{Split(split).name}-data-path"


def _why_empty(prefix: str, indexed: IndexedDataset, in_split: int, tokens: int, cfg) -> str:
    """Why one prefix gives a split no tokens: no documents, only empty ones, or the --split."""
    if indexed.num_documents == 0:
        return f"{prefix} holds 0 documents (its corpus was empty; check the preprocessing input)"
    if len(indexed) == 0 or not indexed.sequence_lengths.any():
        return (
            f"{prefix} holds {indexed.num_documents} documents but 0 tokens (every document "
            "is empty; check --json-keys when preprocessing)"
        )
    if in_split == 0:
        return (
            f"--split {cfg.split} gives it 0 of the {len(indexed)} sequences of {prefix} (use "
            "more data or a larger share)"
        )
    return f"it gets {tokens} token(s) of {prefix}, too few for one sample"


def _same_file_key(prefix: str):
    """What two spellings of one prefix share: its `.idx` file's (device, inode), one lookup
    (realpath takes one per path component); the normalised path where there is no `.idx`."""
    try:
        st = os.stat(f"{prefix}.idx")
    except OSError:
        return os.path.realpath(prefix)
    return st.st_dev, st.st_ino


def duplicate_warnings(cfg: DataConfig) -> list[str]:
    """One line per prefix that a blend lists more than once (the same path however spelled),
    with its weights. Like Megatron-LM, each listing stays a part of its own: this only warns."""
    blends = [(cfg.blend, "--data-path")] if cfg.blend is not None else []
    for split, blend in enumerate(cfg.blend_per_split or []):
        if blend is not None:
            blends.append((blend, _blend_flag(cfg, split)))
    out = []
    for (prefixes, weights), flag in blends:
        where: dict[object, list[int]] = {}
        for i, prefix in enumerate(prefixes):
            where.setdefault(_same_file_key(prefix), []).append(i)
        for places in where.values():
            if len(places) < 2:
                continue
            name, n = prefixes[places[0]], len(places)
            spellings = list(dict.fromkeys(prefixes[i] for i in places))
            spelled = f"as {', '.join(spellings)}; " if len(spellings) > 1 else ""
            if weights is None:
                how = f"{spelled}no weights: each listing adds the prefix's size"
            else:
                share = sum(weights[i] for i in places) / sum(weights)
                given = ", ".join(f"{weights[i]:g}" for i in places)
                how = f"{spelled}weights {given}: together {100 * share:.1f}% of the blend"
            out.append(
                f"{flag} lists {name} {n} times ({how}); as in Megatron-LM each listing is a "
                f"blend part of its own over the same documents: their samples are read up to "
                f"{n} times (list it once, with the summed weight, to silence this)"
            )
    return out


def _split_used(split: int, num_samples: Sequence[int | None], eval_iters: int) -> bool:
    """Whether the run draws from `split`: always train; valid and test only when evaluating."""
    return split == Split.train or bool(eval_iters > 0 and num_samples[split])


def check_splits_before_launch(
    cfg: DataConfig,
    num_samples: Sequence[int | None],
    eval_iters: int = 0,
    warn: Callable[[str], None] | None = None,
    files: PrefixFiles | None = None,
) -> None:
    """Refuse, with one line saying why, a train split that is empty or a blend part that gives
    it no data (Megatron's builder never returns, or asserts, on such a blend); `warn` once per
    prefix a blend lists twice, once if evaluation will find no validation data, and once per
    blend part that gives the valid or test split nothing (that split is drawn from the other
    parts). Reads only the `.idx` files (validated, through `files`), so it runs before launch.
    Mock data (no files) always has every split."""
    if cfg.mock:
        return
    files = files or PrefixFiles(cfg.data_cache_path)
    for line in duplicate_warnings(cfg) if warn is not None else []:
        warn(line)
    for split in Split:
        if _split_used(split, num_samples, eval_iters):
            _check_split(cfg, split, eval_iters, warn, files)


def _short_why(indexed: IndexedDataset, in_split: int, tokens: int) -> str:
    """`_why_empty` in a few words, for a summary naming many prefixes."""
    if indexed.num_documents == 0:
        return "0 documents"
    if len(indexed) == 0 or not indexed.sequence_lengths.any():
        return "0 tokens"
    if in_split == 0:
        return f"0 of {len(indexed):,} sequences"
    return f"{tokens} token(s), too few for one sample"


def _joined(reasons: list[str], few: int = 3) -> str:
    """The first `few` reasons, and how many more there are."""
    more = f"; and {len(reasons) - few:,} more" if len(reasons) > few else ""
    return "; ".join(reasons[:few]) + more


def _check_split(cfg: DataConfig, split: int, eval_iters: int, warn, files: PrefixFiles) -> None:
    """`check_splits_before_launch` for one split that the run draws from."""
    prefixes, matrix, why = _split_blend(cfg, split)
    reasons = [why] if why else []
    empty_parts = []  # (prefix, why) of the parts that give this split no data
    empty = Notices()  # the same, in a few words
    total = 0
    for prefix in prefixes:
        indexed = _open(files, prefix)
        ids = split_ranges(len(indexed), matrix)[split]
        tokens = (
            int(indexed.sequence_lengths[ids[0] : ids[-1] + 1].sum(dtype="int64"))
            if len(ids)
            else 0
        )
        total += tokens
        if tokens <= 1:  # a sample needs seq_length + 1 tokens, cycled over epochs: 2 suffice
            empty_parts.append((prefix, _why_empty(prefix, indexed, len(ids), tokens, cfg)))
            empty.add(prefix, _short_why(indexed, len(ids), tokens), len(indexed))
    reasons += [reason for _, reason in empty_parts]
    name = Split(split).name
    if total <= 1:
        if split == Split.train:
            raise UserError(f"the train split is empty: {_joined(reasons)}")
        if split == Split.valid and warn is not None:
            warn(
                f"no validation data ({_joined(reasons)}): evaluation is skipped although "
                f"--eval-iters is {eval_iters} (pass --eval-iters 0 to say so)"
            )
        return
    flag = _blend_flag(cfg, split)
    if split == Split.train and empty_parts:
        prefix, reason = empty_parts[0]
        raise UserError(
            f"the train split of blend part {prefix} is empty: {reason}; every part of a "
            f"blend must feed training (drop {prefix} from {flag}, or change --split)"
        )
    if warn is None or not empty_parts:
        return
    if len(empty_parts) == 1:
        prefix, reason = empty_parts[0]
        warn(
            f"the {name} split of blend part {prefix} is empty: {reason}; the {name} split "
            f"is drawn from the other parts of {flag} only"
        )
        return
    by_split = f" (--split {cfg.split})" if cfg.blend is not None else ""
    warn(
        empty.line(
            f"the {name} split of {len(empty):,} of {len(prefixes):,} blend parts is "
            f"empty{by_split}; it is drawn from the other parts of {flag} only",
            rest=None,
        )
    )
