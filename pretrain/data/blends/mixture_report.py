"""A changing mixture's plan as text: per phase and source, the samples, tokens and epochs of
its own order (`tools/plan_blend.py`, and training's start-up log), and the sources read past
--max-epochs."""

from __future__ import annotations

import numpy as np

from pretrain.data.blends.mixture import MixturePlan, samples_per_epoch


def _epochs(plan: MixturePlan, counts: np.ndarray) -> np.ndarray:
    """[phase, source] epochs of each source's own order read by the end of each phase."""
    per_epoch = np.array(
        [max(1, samples_per_epoch(s.tokens, plan.seq_length)) for s in plan.sources]
    )
    return np.cumsum(counts, axis=0) / per_epoch


def format_phases(plan: MixturePlan, counts: np.ndarray) -> str:
    """The phases as a table: per phase and source drawn, its weight, samples, tokens, epochs
    of its own order in the phase and by the phase's end (`counts`: `phase_counts(plan)`)."""
    width = max(len("prefix"), *(len(s.prefix) for s in plan.sources))
    S = plan.seq_length
    lines = [
        f"data mixture of the train split: {len(plan.phases)} phase(s), seq length {S} (the train "
        f"split is drawn by these phases, not by the blend's one set of weights)",
        f"{'phase':>5s}  {'iteration':>9s}  {'sample':>10s}  {'prefix':{width}s}  {'weight':>7s}  "
        f"{'samples':>10s}  {'tokens':>13s}  {'epochs':>7s}  {'by end':>7s}",
    ]
    so_far = _epochs(plan, counts)
    per_epoch = [max(1, samples_per_epoch(s.tokens, S)) for s in plan.sources]
    for p, phase in enumerate(plan.phases):
        for prefix, w in phase.weights:
            i = plan.index(prefix)
            n = int(counts[p, i])
            lines.append(
                f"{p:5d}  {phase.iteration:9d}  {phase.sample:10d}  {prefix:{width}s}  {w:7.4f}  "
                f"{n:10,d}  {n * S:13,d}  {n / per_epoch[i]:7.2f}  {so_far[p, i]:7.2f}"
            )
    return "\n".join(lines)


def phase_warnings(plan: MixturePlan, counts: np.ndarray, max_epochs: float) -> list[str]:
    """One line per source whose own order is read more than `max_epochs` times, naming the
    first phase by whose end it is."""
    out = []
    so_far = _epochs(plan, counts)
    for i, s in enumerate(plan.sources):
        over = np.nonzero(so_far[:, i] > max_epochs)[0]
        if len(over):
            p = int(over[0])
            out.append(
                f"warning: train {s.prefix}: read {so_far[p, i]:.2f} times by the end of phase "
                f"{p} (iteration {plan.phases[p].iteration} on; > --max-epochs {max_epochs:g}): "
                f"the model will see these documents repeatedly"
            )
    return out
