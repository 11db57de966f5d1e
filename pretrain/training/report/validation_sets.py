"""The validation sets one evaluation pass runs, and Megatron-LM's --multiple-validation-sets.

Without the flag there is one validation set: the valid split (a blend when it has several
prefixes; its per-source losses are logged after Megatron's block, `per_source`).

With `--multiple-validation-sets` (Megatron-LM main's flag) each prefix of `--valid-data-path`
is a validation set of its own, unblended: a GPTDataset over the whole prefix with the valid
split's sample count, exactly as megatron-core's BlendedMegatronDatasetBuilder builds it. Each
pass evaluates `--eval-iters` global batches of every set, in the order given, and prints one
Megatron block per set, " validation-<name> loss at iteration N | ...", where <name> is the
set's `--validation-set-names` entry or its position (0, 1, ...). Every set draws the same
number of samples per pass, so the one consumed-validation-samples counter of the checkpoint is
the position in each set.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pretrain.data.config import DataConfig, Split
from pretrain.errors import UserError


@dataclass(frozen=True)
class ValidationSet:
    """One set a validation pass evaluates."""

    suffix: str
    """"" for the one validation set, "-<name>" with --multiple-validation-sets (Megatron's
    "validation<suffix> loss" wording)."""
    batches: Iterator
    """This set's batches, positioned after the consumed validation samples."""
    sources: list[str] | None = None
    """The blend's prefixes in `dataset_id` order, for per-source losses; None: not a blend."""


def _valid_prefixes(data: DataConfig) -> list[str] | None:
    blend = data.blend_per_split[Split.valid] if data.blend_per_split else None
    return None if blend is None else blend[0]


def check_validation_sets(multiple: bool, names: list[str] | None, data: DataConfig) -> None:
    """Refuse, in one line naming the flag and the fix, what Megatron refuses (names without the
    flag, a name count differing from the set count) and what it would silently get wrong (the
    flag with a --data-path blend, whose validation split is one set; weights, which the sets
    cannot use)."""
    if names is not None and not multiple:
        raise UserError(
            "--validation-set-names needs --multiple-validation-sets (the names label its "
            "validation sets); add it or drop the names"
        )
    if not multiple:
        return
    prefixes = _valid_prefixes(data)
    if prefixes is None:
        raise UserError(
            "--multiple-validation-sets needs the validation prefixes in --valid-data-path "
            'PREFIX1 PREFIX2 ... (or a "valid" entry in --per-split-data-args-path); with '
            "--data-path the validation split is one blended set"
        )
    if data.blend_per_split[Split.valid][1] is not None:
        raise UserError(
            "--multiple-validation-sets evaluates each --valid-data-path prefix on its own: drop "
            "the weights (give PREFIX1 PREFIX2 ...)"
        )
    if names is not None and len(names) != len(prefixes):
        raise UserError(
            f"--validation-set-names gives {len(names)} name(s) for {len(prefixes)} validation "
            "prefix(es) in --valid-data-path; give one name per prefix"
        )
    if names is not None and len(set(names)) != len(names):
        raise UserError(
            f"--validation-set-names {' '.join(names)}: the names must differ (each labels one "
            "set's log lines and scalars)"
        )


def set_suffixes(names: list[str] | None, data: DataConfig) -> list[str]:
    """ "-<name>" per validation prefix: the --validation-set-names entry, else its position."""
    prefixes = _valid_prefixes(data) or []
    return [f"-{name}" for name in (names or range(len(prefixes)))]
