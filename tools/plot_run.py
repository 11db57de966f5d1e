#!/usr/bin/env python
"""Draw training curves from Megatron-format logs, several runs overlaid.

    python tools/plot_run.py --log runs/demo/train.log [--log other.log ...] --out curves.png

Panels: training loss (solid) with validation loss (dots; with --multiple-validation-sets one
marker shape per set), learning rate, grad norm and tokens/s,
against iterations (top row) and tokens (second row; tokens = consumed samples x sequence length,
read from the start-up banner or --seq-length); for a blend, a third row draws the training
tokens read per data source (the lines' `consumed tokens <prefix>` fields) against iterations. Reads any log with Megatron's iteration lines
(`iteration N/ M | ... | lm loss: ... |`), ours or Megatron-LM's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.training.report.log_parse import RunLog, read_run_log  # noqa: E402

PANELS = [  # (iteration-line field, title, log scale)
    ("lm loss", "loss (dots: validation)", False),
    ("learning rate", "learning rate", False),
    ("grad norm", "grad norm", True),
    ("tokens per second", "tokens/s", False),
]


def build_parser() -> argparse.ArgumentParser:
    """--log (repeatable), --label, --out, --seq-length."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--log", action="append", required=True, type=Path, help="a training log")
    p.add_argument("--label", action="append", default=None, help="legend name per --log")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument(
        "--seq-length", type=int, default=None, help="tokens per sample (default: from the log)"
    )
    return p


MARKERS = ("o", "s", "^", "D", "v", "P")  # one per validation set (--multiple-validation-sets)
RUN_STYLES = ("-", "--", ":", "-.")  # one per run on the per-source panel


def _draw_row(axes, runs: list[RunLog], labels: list[str], by_tokens: bool) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    colours = plt.get_cmap("tab10").colors
    for ax, (name, title, log_scale) in zip(axes, PANELS, strict=True):
        for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
            its, values = run.series(name)
            x = run.tokens_at(its) if by_tokens else its
            if not its or x is None:
                continue
            ax.plot(x, values, color=colours[i % 10], label=label, lw=1.5)
            if name != "lm loss":
                continue
            sets = [("", run.validation)] + sorted(run.validation_sets.items())
            for k, (set_name, points) in enumerate(p for p in sets if p[1]):
                v_its = [v[0] for v in points]
                vx = run.tokens_at(v_its) if by_tokens else v_its
                ax.plot(
                    vx,
                    [v[1] for v in points],
                    MARKERS[k % len(MARKERS)],
                    color=colours[i % 10],
                    ms=5,
                    label=f"{label} validation-{set_name}" if set_name else None,
                )
        ax.set_title(title)
        ax.set_xlabel("tokens" if by_tokens else "iteration")
        if by_tokens:  # 1.5M, not 1500000 run into its neighbours
            ax.xaxis.set_major_formatter(EngFormatter())
        if log_scale and ax.has_data():
            ax.set_yscale("log")
        ax.grid(alpha=0.3)


def _draw_sources(ax, runs: list[RunLog], labels: list[str]) -> None:
    """Training tokens read per data source against iterations: a colour per source, a line
    style per run (a re-weighted run's slopes change where its weights do)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    colours = plt.get_cmap("tab10").colors
    names = list(dict.fromkeys(n for run in runs for n in run.sources()))
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        for name, (its, tokens) in run.sources().items():
            k = names.index(name)
            style = RUN_STYLES[i % len(RUN_STYLES)]
            ax.plot(its, tokens, style, color=colours[k % 10], lw=1.5, label=f"{label}: {name}")
    ax.set_title("tokens read per data source")
    ax.set_xlabel("iteration")
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")


def plot_runs(runs: list[RunLog], labels: list[str], out: str) -> None:
    """Write the 2 x 4 panel figure of `runs` to the PNG `out` (atomically), with a third row
    for the tokens read per data source when a log has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pretrain.atomic import atomic_write
    from pretrain.outputs import reported_writes

    rows = 3 if any(run.sources() for run in runs) else 2
    fig = plt.figure(figsize=(18, 4 * rows))
    grid = fig.add_gridspec(rows, len(PANELS))
    axes = [[fig.add_subplot(grid[r, c]) for c in range(len(PANELS))] for r in range(2)]
    _draw_row(axes[0], runs, labels, by_tokens=False)
    _draw_row(axes[1], runs, labels, by_tokens=True)
    axes[0][0].legend(fontsize="small")
    if rows == 3:
        _draw_sources(fig.add_subplot(grid[2, :]), runs, labels)
    fig.tight_layout()
    with reported_writes("--out", out):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=80))
    plt.close(fig)


@exit_on_user_error
def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    labels = args.label or [str(p) for p in args.log]
    if len(labels) != len(args.log):
        raise UserError(f"--label given {len(labels)} times for {len(args.log)} --log files")
    from pretrain.checkpoint.outputs import kept_data
    from pretrain.outputs import refuse_output

    refuse_output("--out", args.out, [("--log", str(p)) for p in args.log], protect=kept_data)
    runs = []
    for path in args.log:
        if not path.is_file():
            raise UserError(f"--log {path}: no such file")
        run = read_run_log(path, args.seq_length)
        if not run.rows:
            raise UserError(f"{path}: no Megatron-format iteration lines (is it a training log?)")
        runs.append(run)
    plot_runs(runs, labels, args.out)
    print(f"wrote {args.out} ({len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
