"""The data tools' command lines (build_data_cache, plan_blend, explain_batch): training's own
data, sample-count and tokenizer flags, so a tool takes a run's command line as it is."""

from __future__ import annotations

import argparse

from pretrain.cli.flags import build_parser
from pretrain.convert.checkpoint_reader import find_checkpoint
from pretrain.data.blends.mixture import MixturePlan, resolve_mixture
from pretrain.data.config import DataConfig, add_data_args, add_sample_count_args
from pretrain.data.files.fingerprint import PrefixFiles
from pretrain.errors import UserError
from pretrain.flag_help import RawDescriptionHelpFormatter, add_megatron_groups
from pretrain.tokenizer import add_tokenizer_args


def data_tool_parser(description: str, *, tokenizer: bool = True) -> argparse.ArgumentParser:
    """A data tool's parser (build_data_cache, plan_blend, explain_batch): training's own data and
    sample-count flags (and tokenizer flags), so a tool takes a run's command line as it is."""
    # allow_abbrev=False: a training flag must never be taken for an abbreviation of a tool's own
    parser = argparse.ArgumentParser(
        description=description, formatter_class=RawDescriptionHelpFormatter, allow_abbrev=False
    )
    add_megatron_groups(parser)  # Megatron's group order, as pretrain_gpt.py --help
    add_data_args(parser)
    add_sample_count_args(parser)
    if tokenizer:
        add_tokenizer_args(parser)
    return parser


def parse_data_tool_args(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The tool's flags; the rest of the command line must be pretrain_gpt.py flags: a typo of a
    data flag (say --splt) would otherwise plan, explain or cache other data, silently. Of those,
    `logging_level` (--logging-level) is kept: the tools log at training's level."""
    ns, rest = parser.parse_known_args(argv)
    training, unknown = build_parser().parse_known_args(rest)
    if unknown:
        raise UserError(
            f"unrecognized argument(s): {' '.join(unknown)} (neither a data flag nor a "
            "pretrain_gpt.py flag; see --help)"
        )
    ns.logging_level = training.logging__logging_level
    return ns


def load_meta(load: str | None) -> dict:
    """The metadata of the checkpoint `--load` names (its latest step); {} without --load."""
    return {} if load is None else find_checkpoint(load)[1]


def run_mixture(
    cfg: DataConfig, num_train: int, global_batch_size: int, meta: dict
) -> MixturePlan | None:
    """The train split's phases of the run the flags describe, resumed from the checkpoint
    metadata `meta` ({}: a fresh run) as training resumes: its recorded phases up to its
    position, the flags' from there on."""
    return resolve_mixture(
        cfg,
        num_train,
        PrefixFiles(cfg.data_cache_path),
        global_batch_size=global_batch_size,
        record=meta.get("data_mixture"),
        iteration=int(meta.get("iteration", 0)),
        consumed=int(meta.get("consumed_train_samples", 0)),
    )
