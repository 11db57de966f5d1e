"""Notices about many prefixes said as one line: how many, the worst few named, each one at DEBUG.

A blend of thousands of prefixes would otherwise print a line per prefix for every per-prefix
notice (an empty split, a scanned `.bin`, a rebuilt cache, a little-used prefix). `Notices`
collects them; `line()` is the summary (the count, the `few` worst by their rank, "and N more"),
`details()` every notice in full, which callers log at DEBUG (`--logging-level 10`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

SHOWN = 3  # prefixes a summary names
DEBUG_HINT = "each one is logged with --logging-level 10"


@dataclass
class Notices:
    """Notices of one kind; `rank`: larger is worse (named first)."""

    items: list[tuple[float, str, str]] = field(default_factory=list)

    def add(self, prefix: str, detail: str, rank: float = 0.0) -> None:
        self.items.append((rank, prefix, detail))

    def __len__(self) -> int:
        return len(self.items)

    def named(self, few: int = SHOWN) -> str:
        """'p1 (detail), p2 (detail) and 1,234 more': the `few` worst, first come first on ties."""
        order = sorted(range(len(self.items)), key=lambda i: -self.items[i][0])
        shown = [f"{self.items[i][1]} ({self.items[i][2]})" for i in order[:few]]
        rest = len(self.items) - len(shown)
        return ", ".join(shown) + (f" and {rest:,} more" if rest > 0 else "")

    def line(self, headline: str, few: int = SHOWN, rest: str | None = DEBUG_HINT) -> str:
        """`headline` with the worst few named, and `rest` (where the others are) when there
        are more."""
        hint = f"; {rest}" if rest and len(self.items) > few else ""
        return f"{headline}: {self.named(few)}{hint}"

    def details(self, headline: str) -> list[str]:
        """One line per notice, in the order they came."""
        return [f"{headline}: {prefix} ({detail})" for _, prefix, detail in self.items]

    def log(self, log: logging.Logger, level: int, headline: str) -> None:
        """The summary at `level`, then every notice at DEBUG (only when DEBUG is shown)."""
        if not self.items:
            return
        log.log(level, "%s", self.line(headline))
        if log.isEnabledFor(logging.DEBUG):
            for text in self.details(headline):
                log.debug("%s", text)
