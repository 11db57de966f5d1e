"""`--data-schedule FILE`: the train blend's weights per phase of a run (docs/DATA.md).

The file is a JSON list of phases, each `{"iteration": N, "weights": {"PREFIX": W, ...}}`: from
iteration N on (0-indexed: the phase at N governs the samples of iterations N + 1, N + 2, ...,
as the log counts them) the train split draws from each PREFIX in proportion to W. The first
phase starts at iteration 0, iterations increase strictly, weights are numbers >= 0 (0, or
leaving a prefix out, means "not drawn in this phase") and every phase weighs some prefix.
Which prefixes exist is the train blend's business (`--data-path`, `--train-data-path`):
`DataConfig` checks that the two name the same prefixes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pretrain.errors import UserError

FLAG = "--data-schedule"
FORMAT = '[{"iteration": 0, "weights": {"PREFIX_A": 0.5, "PREFIX_B": 0.5}}, ...]'


@dataclass(frozen=True, kw_only=True)
class SchedulePhase:
    """One entry of a --data-schedule file."""

    iteration: int
    """Iterations completed when the phase starts (0: from the first iteration)."""
    weights: tuple[tuple[str, float], ...]
    """(prefix, weight > 0) in file order; prefixes left out or weighted 0 are not drawn."""


def _refuse(path: str, what: str) -> UserError:
    return UserError(f"{FLAG} {path}: {what} (expected {FORMAT})")


def _shown(value) -> str:
    """`value` as the message shows it: its repr, cut short (a weight may have 400 digits)."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"


def _weight(w) -> float | None:
    """A JSON weight as a float; None unless it is a finite number >= 0."""
    if isinstance(w, bool) or not isinstance(w, int | float):
        return None
    try:
        value = float(w)
    except OverflowError:  # an integer past the largest float
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _phase(entry, k: int, path: str) -> SchedulePhase:
    """Entry `k` of the file as a phase, or one line naming what is wrong with it."""
    if not isinstance(entry, dict) or set(entry) != {"iteration", "weights"}:
        raise _refuse(path, f"phase {k} must be an object with exactly iteration and weights")
    iteration, weights = entry["iteration"], entry["weights"]
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise _refuse(path, f"phase {k}: iteration {iteration!r} is not an integer >= 0")
    if not isinstance(weights, dict) or not weights:
        raise _refuse(path, f"phase {k}: weights must be an object PREFIX -> weight")
    pairs = []
    for prefix, w in weights.items():
        value = _weight(w)
        if value is None:
            raise _refuse(
                path, f"phase {k}: weight {_shown(w)} of {prefix} is not a finite number >= 0"
            )
        if value > 0:
            pairs.append((prefix, value))
    if not pairs:
        raise _refuse(path, f"phase {k}: every weight is 0 (give some prefix a weight > 0)")
    if not math.isfinite(sum(w for _, w in pairs)):
        raise _refuse(path, f"phase {k}: the weights sum past the largest float (scale them down)")
    return SchedulePhase(iteration=iteration, weights=tuple(pairs))


def _object(path: str):
    """A JSON object hook refusing a key given twice (json keeps the last, silently)."""

    def pairs_to_dict(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise _refuse(path, f"{key!r} is given twice in one object (give it once)")
            out[key] = value
        return out

    return pairs_to_dict


def read_schedule(path: str) -> tuple[SchedulePhase, ...]:
    """The phases of a --data-schedule file, checked; one UserError line naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f, object_pairs_hook=_object(path))
    except OSError as err:
        raise UserError(f"{FLAG} {path}: cannot read ({err.strerror}); check the path") from None
    except RecursionError:
        raise _refuse(path, "nested too deeply to be a list of phases") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        line = getattr(err, "lineno", None)
        where = f"{path}:{line}" if line else path
        raise UserError(f"{FLAG} {where}: not valid JSON ({err}); expected {FORMAT}") from None
    if not isinstance(spec, list) or not spec:
        raise _refuse(path, "not a non-empty JSON list of phases")
    phases = tuple(_phase(entry, k, path) for k, entry in enumerate(spec))
    if phases[0].iteration != 0:
        raise _refuse(path, f"the first phase starts at iteration {phases[0].iteration}, not 0")
    for k in range(1, len(phases)):
        if phases[k].iteration <= phases[k - 1].iteration:
            raise _refuse(
                path,
                f"phase {k} starts at iteration {phases[k].iteration}, not after phase {k - 1}'s "
                f"{phases[k - 1].iteration} (list phases in increasing iterations)",
            )
    return phases


def check_schedule_prefixes(
    phases: tuple[SchedulePhase, ...], prefixes: list[str], flag: str
) -> None:
    """Refuse a schedule naming a prefix the train blend (`flag`) does not list, a train prefix
    no phase weighs, or a train blend that lists a prefix twice."""
    listed = set(prefixes)
    if len(listed) < len(prefixes):
        twice = next(p for p in prefixes if prefixes.count(p) > 1)
        raise UserError(
            f"{FLAG}: {flag} lists {twice} twice; with a schedule every prefix is one source "
            f"(list it once)"
        )
    named = {prefix for phase in phases for prefix, _ in phase.weights}
    unknown = sorted(named - listed)
    if unknown:
        raise UserError(
            f"{FLAG}: {unknown[0]} is not a prefix of {flag} (list every scheduled prefix there, "
            f"spelled as in the schedule)"
        )
    unweighed = [p for p in prefixes if p not in named]
    if unweighed:
        raise UserError(
            f"{FLAG}: no phase weighs {unweighed[0]} of {flag} (give it a weight in some phase, "
            f"or drop it from {flag})"
        )
