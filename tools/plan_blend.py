#!/usr/bin/env python
"""Plan a data blend before paying for it: what each prefix contributes to each split.

Put this script in front of your training arguments; it reads only the data and sample-count flags
(and ignores the rest), reads only the .idx files, and builds nothing:

    python tools/plan_blend.py --data-path 0.3 data/a_text_document 0.7 data/b_text_document \\
        --split 949,50,1 --seq-length 1024 --train-iters 2000 --global-batch-size 16 \\
        [--max-epochs 4] [--plot plan.png] [... any other training flags ...]

For every split and prefix it prints: tokens, documents, the requested weight (normalized), the
samples the blend will draw, the resulting epochs and the prefix's actual share of the split's
tokens; then a warning for every prefix read more than --max-epochs times or less than
--min-epochs of it (train split; one line naming the worst few when several are).
`tools/build_data_cache.py --plan` prints the same table.

With --data-schedule (or --load CKPT of a run whose blend changes on resume) the train split is
planned per phase instead: for every phase and source drawn, its weight, samples, tokens and
epochs of the source's own order in the phase and by the phase's end, and a warning for every
source read more than --max-epochs times (docs/DATA.md).
Like training, it first refuses a train split that is empty or a blend part that gives it no data.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pretrain.cli import data_tool_parser, parse_data_tool_args  # noqa: E402
from pretrain.cli.data_tools import load_meta, run_mixture  # noqa: E402
from pretrain.data.blends.mixture import phase_counts  # noqa: E402
from pretrain.data.blends.mixture_report import format_phases, phase_warnings  # noqa: E402
from pretrain.data.blends.plan import (  # noqa: E402
    DEFAULT_MAX_EPOCHS,
    DEFAULT_MIN_EPOCHS,
    PlanRow,
    format_plan,
    plan_blend,
    warning_summaries,
)
from pretrain.data.builder import check_splits_before_launch  # noqa: E402
from pretrain.data.config import (  # noqa: E402
    DataConfig,
    train_valid_test_num_samples,
)
from pretrain.errors import exit_on_user_error  # noqa: E402


def add_plan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plan's own flags (also used by build_data_cache.py --plan)."""
    g = parser.add_argument_group("plan")
    g.add_argument(
        "--max-epochs",
        type=float,
        default=DEFAULT_MAX_EPOCHS,
        help="warn when a prefix is read more often than this many epochs",
    )
    g.add_argument(
        "--min-epochs",
        type=float,
        default=DEFAULT_MIN_EPOCHS,
        help="warn when training reads less than this fraction of a prefix",
    )
    g.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also draw token shares and epochs into this PNG",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The data, sample-count and plan flags, and --load; other training flags are ignored."""
    parser = add_plan_args(data_tool_parser(__doc__, tokenizer=False))
    parser.add_argument(
        "--load",
        default=None,
        help="plan the resume of this checkpoint directory (its latest step): its recorded "
        "data phases up to its iteration, these flags' from there on",
    )
    return parser


def plot_plan(rows: list[PlanRow], path: str, max_epochs: float) -> None:
    """Two panels per split present: the token share and the epochs of each prefix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pretrain.atomic import atomic_write
    from pretrain.outputs import reported_writes

    splits = [s for s in ("train", "valid", "test") if any(r.split == s for r in rows)]
    fig, axes = plt.subplots(len(splits), 2, figsize=(11, 1.2 + 0.5 * len(rows)), squeeze=False)
    colours = plt.get_cmap("tab10").colors
    for (share_ax, epoch_ax), split in zip(axes, splits, strict=True):
        mine = [r for r in rows if r.split == split]
        names = [os.path.basename(r.prefix) for r in mine]
        y = range(len(mine))
        bar_colours = [colours[i % len(colours)] for i in y]
        share_ax.barh(y, [100 * r.token_share for r in mine], color=bar_colours)
        requested = [None if r.weight is None else 100 * r.weight for r in mine]
        for i, w in enumerate(requested):
            if w is not None:
                share_ax.plot([w, w], [i - 0.4, i + 0.4], color="black", lw=2)
        share_ax.set_yticks(list(y), names)
        share_ax.set_xlabel("share of tokens, % (black: requested weight)")
        share_ax.set_title(f"{split}: token share")
        epoch_ax.barh(y, [r.epochs for r in mine], color=bar_colours)
        epoch_ax.axvline(max_epochs, color="red", ls="--", label=f"--max-epochs {max_epochs:g}")
        epoch_ax.set_yticks(list(y), names)
        epoch_ax.set_xlabel("epochs (times each prefix is read)")
        epoch_ax.set_title(f"{split}: epochs")
        epoch_ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    with reported_writes("--plot", path):
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def refuse_plot_path(ns: argparse.Namespace, cfg: DataConfig) -> None:
    """--plot may not be one of the files the plan reads (a prefix's .bin/.idx/.json, the
    --data-args-path files, --load), nor another dataset's or a checkpoint's file."""
    from pretrain.checkpoint.outputs import kept_data
    from pretrain.data.checks import data_prefixes
    from pretrain.outputs import refuse_output

    inputs = [
        ("--data-path", p + ext) for p in data_prefixes(cfg) for ext in (".bin", ".idx", ".json")
    ]
    for flag in ("data_args_path", "per_split_data_args_path", "load"):
        if getattr(ns, flag, None):
            inputs.append((f"--{flag.replace('_', '-')}", getattr(ns, flag)))
    refuse_output("--plot", ns.plot, inputs, protect=kept_data)


def run_plan(ns: argparse.Namespace, cfg: DataConfig) -> list[PlanRow]:
    """Refuse a blend that cannot feed training (as training would, before launch), then print
    the plan (and warnings), draw it if --plot; return its rows."""
    if ns.plot:
        refuse_plot_path(ns, cfg)
    counts = train_valid_test_num_samples(
        ns.train_iters, ns.train_samples, ns.eval_interval, ns.eval_iters, ns.global_batch_size
    )
    check_splits_before_launch(
        cfg, counts, ns.eval_iters, lambda msg: print(f"warning: {msg}", file=sys.stderr)
    )
    meta = load_meta(getattr(ns, "load", None))
    mixture = run_mixture(cfg, counts[0], ns.global_batch_size, meta)
    rows = plan_blend(cfg, counts, mixture=mixture)  # a changing mixture's train split: below
    if rows:
        print(format_plan(rows, cfg.seq_length))
    for line in warning_summaries(rows, ns.max_epochs, ns.min_epochs, "the table lists each"):
        print(line)
    if mixture is not None and not mixture.megatron:
        drawn = phase_counts(mixture)
        print(format_phases(mixture, drawn))
        for line in [*mixture.lines, *phase_warnings(mixture, drawn, ns.max_epochs)]:
            print(line)
    if ns.plot:
        plot_plan(rows, ns.plot, ns.max_epochs)
        print(f"wrote {ns.plot}")
    return rows


@exit_on_user_error
def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    ns = parse_data_tool_args(build_parser(), argv)
    run_plan(ns, DataConfig.from_args(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
