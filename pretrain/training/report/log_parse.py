"""Read Megatron-format training logs back: the iteration lines, validation lines and batch size.

The formats are the ones `logging.py` writes (and Megatron-LM prints), so this also reads
Megatron-LM's own logs: `iteration N/ M | name: value | ...` and `validation[-<set>] loss at
iteration N | lm loss value: X | ...`. One parser for every tool that reads logs (demo summary, plots).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.training.report.logging import SOURCE_FIELD

ITERATION_LINE = re.compile(r"^\s*iteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
FIELD = re.compile(r"\s*([^|:]+?):\s*([^|]+?)\s*\|")
# periodic evaluations, and the one after the last iteration (" on validation set"); not the test set
# (with --multiple-validation-sets: "validation-<name> loss at ...", one block per set)
VALIDATION_LINE = re.compile(
    r"validation(-\S+)? loss at iteration (\d+)(?: on validation set)?\s*\|\s*"
    r"lm loss value:\s*(\S+)"
)
# our start-up banner: "batch | global 8 = micro 4 x ...; 2,048 tokens/iteration"
BANNER_BATCH = re.compile(r"batch\s*\|\s*global (\d+) = .*?([\d,]+) tokens/iteration")


def parse_iteration_lines(text: str) -> list[dict[str, str]]:
    """One dict per iteration line: field name -> value text, plus `iteration` and `train_iters`."""
    rows = []
    for line in text.splitlines():
        match = ITERATION_LINE.match(line)
        if not match:
            continue
        row = dict(FIELD.findall(match.group(3) + "|"))
        row["iteration"], row["train_iters"] = match.group(1), match.group(2)
        rows.append(row)
    return rows


@dataclass
class RunLog:
    """The numbers of one training log, for plots and summaries."""

    path: Path
    """The log file."""
    rows: list[dict[str, str]] = field(default_factory=list)
    """The iteration lines, as parse_iteration_lines gives them."""
    validation: list[tuple[int, float]] = field(default_factory=list)
    """(iteration, validation lm loss) per evaluation."""
    validation_sets: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """--multiple-validation-sets: set name -> (iteration, lm loss) per evaluation."""
    seq_length: int | None = None
    """Tokens per sample, from the start-up banner (None: no banner in the log)."""

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(iterations, values) of the iteration-line field `name`, where present."""
        points = [(int(r["iteration"]), float(r[name])) for r in self.rows if name in r]
        return [p[0] for p in points], [p[1] for p in points]

    def sources(self) -> dict[str, tuple[list[int], list[float]]]:
        """{data source: (iterations, training tokens read from it)} from the iteration lines'
        `consumed tokens <prefix>` fields (blends of up to 32 sources log them)."""
        names = dict.fromkeys(k for r in self.rows for k in r if k.startswith(SOURCE_FIELD))
        return {name[len(SOURCE_FIELD) :]: self.series(name) for name in names}

    def tokens_at(self, iterations: list[int]) -> list[float] | None:
        """Tokens consumed after each iteration (None without a sequence length)."""
        if self.seq_length is None or not self.rows:
            return None
        consumed = {int(r["iteration"]): int(r["consumed samples"]) for r in self.rows}
        per_iteration = int(self.rows[-1]["consumed samples"]) / int(self.rows[-1]["iteration"])
        return [consumed.get(i, i * per_iteration) * self.seq_length for i in iterations]


def read_run_log(path: Path, seq_length: int | None = None) -> RunLog:
    """Parse one log file; `seq_length` overrides the one read from the banner."""
    text = Path(path).read_text(errors="replace")
    run = RunLog(path=Path(path), rows=parse_iteration_lines(text))
    # one point per iteration: the final evaluation may repeat the last periodic one
    by_set: dict[str, dict[int, float]] = {}
    for suffix, iteration, value in VALIDATION_LINE.findall(text):
        by_set.setdefault(suffix[1:], {})[int(iteration)] = float(value)
    run.validation = sorted(by_set.pop("", {}).items())
    run.validation_sets = {name: sorted(points.items()) for name, points in by_set.items()}
    banner = BANNER_BATCH.search(text)
    if seq_length is not None:
        run.seq_length = seq_length
    elif banner:
        run.seq_length = int(banner.group(2).replace(",", "")) // int(banner.group(1))
    return run
