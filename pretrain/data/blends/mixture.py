"""Mixtures that change: the train blend in phases, each source read on in its own order.

A *source* is one prefix's train split. Its *own order* is the sample order of its GPTDataset
(Megatron's shuffled document, sample and shuffle indices), built with the sample count its first
run gave it; when a later phase needs more of the source than that dataset holds, the order goes
on with a further *segment*: a GPTDataset of the same split with seed --seed + k (k = 1, 2, ...),
so every segment is a whole number of new epochs. A *phase* is a range of the global train order,
[its start sample, the next phase's start), with weights; Megatron's greedy blending kernel
interleaves the phase's sources by those weights, and each source continues its own order where
the earlier phases left it. Nothing of a source is read twice before its order is used up, and
nothing is skipped.

One phase from sample 0 is Megatron's blend: then the builder builds exactly megatron-core's
BlendedDataset (or GPTDataset), as without this module, with the phase's weights (a one-phase
--data-schedule means exactly its weights), unless the run continues the sources' own orders of
a changing mixture (a record whose sources a mixture sized). The phases of a run are those its
checkpoint recorded before the position it resumes at (the *history*), then the configured ones
from there on: the --data-path weights, or --data-schedule's phases.

The record (`TrainState.data_mixture`, saved in every checkpoint; `record` below):
`{"order": {"seq_length", "seed", "train_range"}, "phases": [{"iteration", "sample", "weights":
[[prefix, weight], ...]}], "sources": [{"prefix", "tokens", "segments": [num_samples, ...],
"consumed"}], "mixture": bool}`; `mixture`: the sources' orders were sized by a changing
mixture's phases, not by Megatron's blend (absent in older records: more than one phase). Phase
weights are the kernel's (normalized); `consumed` counts the samples of the source's own order
read before the record's position. A source leaves `sources` never: a dropped
one keeps its position for a later run. A checkpoint whose order identity (sequence length,
seed, train split range) or a source's token count differs from this run's is not continued
(one line says so): its order would be another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from pretrain.data.blends.blended_dataset import MAX_DATASETS, normalize
from pretrain.data.config import Blend, DataConfig
from pretrain.data.datasets import helpers
from pretrain.data.datasets.gpt_dataset import split_ranges
from pretrain.data.files.fingerprint import PrefixFiles
from pretrain.errors import UserError

EXTRA_TOKEN = 1  # each sample reads S + 1 tokens, as the datasets do


@dataclass(frozen=True, kw_only=True)
class Phase:
    """A range of the global train order drawn with one set of weights."""

    iteration: int
    """Iterations completed when the phase starts."""
    sample: int
    """The phase's first sample in the global train order (consumed samples at its start)."""
    weights: tuple[tuple[str, float], ...]
    """(prefix, weight) of each source drawn, as the greedy kernel takes them (normalized)."""

    def as_record(self) -> dict:
        """The phase as JSON-ready data."""
        return {
            "iteration": self.iteration,
            "sample": self.sample,
            "weights": [[p, w] for p, w in self.weights],
        }


@dataclass(frozen=True, kw_only=True)
class Source:
    """One prefix's train split and what its own order is made of."""

    prefix: str
    """The data prefix, as the flags spell it."""
    tokens: int
    """Tokens of the prefix's train split (what its order was built over)."""
    segments: tuple[int | None, ...]
    """num_samples of each GPTDataset of its order, fixed by an earlier run; () for a source
    this run starts."""
    size: int
    """num_samples of the first GPTDataset when this run starts the source (its share of the
    requested samples, plus --mid-level-dataset-surplus)."""
    consumed: int
    """Samples of its own order read before this run's start."""


@dataclass(frozen=True, kw_only=True)
class MixturePlan:
    """The phases and sources of one run's train split."""

    phases: tuple[Phase, ...]
    """History, then the configured phases, consecutive equal ones merged."""
    sources: tuple[Source, ...]
    """Recorded sources (in their recorded order), then those this run starts (for Megatron's
    one phase only their names: its built datasets make the record)."""
    num_samples: int
    """Train samples the run asks for (--train-iters x global batch, or --train-samples)."""
    start: int
    """Consumed train samples where the run starts."""
    seq_length: int
    """Tokens per sample."""
    lines: tuple[str, ...] = ()
    """What changed against the checkpoint: one line per source (logged at start)."""
    megatron: bool = False
    """Megatron's own blend: one phase from sample 0 that continues no changing mixture's
    orders; the builder builds it as megatron-core builds it (from `blend`)."""
    blend: Blend | None = None
    """Megatron's one phase as a blend when it is not the flags' train blend: a --data-schedule
    phase's prefixes and weights, as the file gives them; None: the flags' train blend."""

    def lengths(self) -> list[int]:
        """Samples of each phase in the global order; the last is sized as Megatron sizes a
        blend: the sum of ceil(remaining requested samples x weight) over its sources."""
        out = [b.sample - a.sample for a, b in zip(self.phases, self.phases[1:], strict=False)]
        rest = max(0, self.num_samples - self.phases[-1].sample)
        out.append(sum(math.ceil(rest * w) for _, w in self.phases[-1].weights))
        return out

    def index(self, prefix: str) -> int:
        """Position of `prefix` in `sources`."""
        return next(i for i, s in enumerate(self.sources) if s.prefix == prefix)


def kernel_weights(prefixes: list[str], weights: list[float]) -> tuple[tuple[str, float], ...]:
    """(prefix, weight) as Megatron's greedy kernel receives them: the builder normalizes the
    weights and BlendedDataset normalizes them again (kept, so one phase is megatron-core's
    blend bit for bit)."""
    return tuple(zip(prefixes, normalize(normalize(weights)), strict=True))


def phase_draws(weights: tuple[tuple[str, float], ...], length: int):
    """(positions in `weights`, sample within the phase) of the phase's samples, greedy."""
    w = np.array([x for _, x in weights], dtype=np.float64)
    return helpers.build_blending_indices(w, length)


def phase_counts(
    plan: MixturePlan, end: int | None = None, dataset_index: np.ndarray | None = None
) -> np.ndarray:
    """[phase, source] samples each phase draws from each source in the first `end` samples of
    the train order (default: the samples the run trains on), from the greedy kernel, or
    counted in `dataset_index` (a built MixtureDataset's) when given."""
    end = plan.num_samples if end is None else end
    out = np.zeros((len(plan.phases), len(plan.sources)), dtype=np.int64)
    for p, (phase, length) in enumerate(zip(plan.phases, plan.lengths(), strict=True)):
        n = min(length, end - phase.sample)
        if n <= 0:
            break
        if dataset_index is not None:
            part = dataset_index[phase.sample : phase.sample + n]
            out[p] = np.bincount(part, minlength=len(plan.sources))
            continue
        which, _ = phase_draws(phase.weights, n)
        drawn = np.bincount(which, minlength=len(phase.weights))
        for (prefix, _), k in zip(phase.weights, drawn, strict=True):
            out[p, plan.index(prefix)] += k
    return out


def blend_arrays(plan: MixturePlan) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of the whole train order: each phase's
    greedy interleave, each source's samples numbered on from where the earlier phases stopped."""
    lengths = plan.lengths()
    di = np.empty(sum(lengths), dtype=np.int16)
    dsi = np.empty(sum(lengths), dtype=np.int64)
    offsets = np.zeros(len(plan.sources), dtype=np.int64)
    pos = 0
    for phase, length in zip(plan.phases, lengths, strict=True):
        which, local = phase_draws(phase.weights, length)
        ids = np.array([plan.index(p) for p, _ in phase.weights], dtype=np.int16)[which]
        di[pos : pos + length] = ids
        dsi[pos : pos + length] = offsets[ids] + local
        offsets += np.bincount(ids, minlength=len(plan.sources))
        pos += length
    return di, dsi


def train_tokens(files: PrefixFiles, prefix: str, train_range) -> int:
    """Tokens of `prefix`'s train split."""
    lengths = files.indexed(prefix).sequence_lengths
    ids = split_ranges(len(lengths), [train_range, None, None])[0]
    return int(lengths[ids].sum(dtype=np.int64)) if len(ids) else 0


def samples_per_epoch(tokens: int, seq_length: int) -> int:
    """Samples one epoch of `tokens` tokens holds (Megatron's count, drop_last)."""
    if tokens <= EXTRA_TOKEN:
        return 0
    return helpers.num_samples_in_sample_index(1, tokens, seq_length, True, EXTRA_TOKEN)


def schedule_blends(cfg: DataConfig) -> list[tuple[int, Blend]]:
    """[(iteration, (prefixes drawn, their weights as given))] of --data-schedule's phases,
    the prefixes in the train blend's order."""
    out = []
    for phase in cfg.data_schedule:
        given = dict(phase.weights)
        drawn = [p for p in cfg.train_blend[0] if p in given]
        out.append((phase.iteration, (drawn, [given[p] for p in drawn])))
    return out


def configured_phases(cfg: DataConfig, tokens: dict[str, int]) -> list[tuple[int, tuple]]:
    """[(iteration, kernel weights)] of the flags: --data-schedule's phases, else one phase of
    the train blend as Megatron weighs it (by size when it has no weights; one prefix: 1.0)."""
    prefixes, weights = cfg.train_blend
    if cfg.data_schedule is not None:
        return [(it, kernel_weights(*blend)) for it, blend in schedule_blends(cfg)]
    if len(prefixes) == 1:
        return [(0, ((prefixes[0], 1.0),))]
    if weights is None:  # Megatron: weights = samples per epoch, prefixes without any dropped
        per_epoch = {p: samples_per_epoch(tokens[p], cfg.seq_length) for p in prefixes}
        drawn = [p for p in prefixes if per_epoch[p] > 0] or prefixes
        w = normalize([per_epoch[p] for p in drawn])
        return [(0, tuple(zip(drawn, w, strict=True)))]
    return [(0, kernel_weights(prefixes, weights))]


def order_identity(cfg: DataConfig) -> dict:
    """What every source's own order depends on besides its data: the record's `order`."""
    return {"seq_length": cfg.seq_length, "seed": cfg.seed, "train_range": list(cfg.train_range)}


@dataclass(frozen=True)
class _History:
    phases: list[Phase]
    sources: dict[str, dict]  # prefix -> its record entry, usable
    lines: list[str]
    mixture: bool = False  # the recorded orders were sized by a changing mixture


def _mixture_record(record: dict) -> bool:
    """Whether a record's sources were ordered by a changing mixture (older records: more
    than one phase)."""
    return bool(record.get("mixture", len(record.get("phases", [])) > 1))


def _history(record: dict | None, cfg: DataConfig, consumed: int, tokens: dict) -> _History:
    """The recorded phases before `consumed` and the recorded sources this run can continue."""
    if not record or consumed == 0:
        return _History([], {}, [])
    if record.get("order") != order_identity(cfg):
        return _History(
            [],
            {},
            [
                f"data mixture: the checkpoint's sources were ordered with {record.get('order')}, "
                f"this run with {order_identity(cfg)}: their recorded positions do not apply; "
                f"the train order is this run's (Megatron's), from its sample {consumed}"
            ],
        )
    phases = [
        Phase(
            iteration=int(p["iteration"]),
            sample=int(p["sample"]),
            weights=tuple((str(a), float(b)) for a, b in p["weights"]),
        )
        for p in record.get("phases", [])
        if int(p["sample"]) < consumed
    ]
    sources, lines = {}, []
    for entry in record.get("sources", []):
        prefix = entry["prefix"]
        if prefix in tokens and tokens[prefix] != int(entry["tokens"]):
            lines.append(
                f"data mixture: {prefix}: its train split now holds {tokens[prefix]} tokens "
                f"(was {entry['tokens']}): its recorded position does not apply; it starts "
                f"over as a new source"
            )
            continue
        sources[prefix] = entry
    if any(p not in sources for phase in phases for p, _ in phase.weights):
        lines.append(
            f"data mixture: a source of the recorded phases changed: the train order is this "
            f"run's (Megatron's), from its sample {consumed}"
        )
        return _History([], {}, lines)
    return _History(phases, sources, lines, _mixture_record(record))


def _placed(configured, iteration: int, consumed: int, gbs: int, num_samples: int):
    """The configured phases from (`iteration`, `consumed`) on, at their first samples; phases
    at or after the run's end are left out."""
    active = max(i for i, (it, _) in enumerate(configured) if it <= iteration)
    out = [Phase(iteration=iteration, sample=consumed, weights=configured[active][1])]
    for it, weights in configured[active + 1 :]:
        sample = consumed + (it - iteration) * gbs
        if sample < num_samples:
            out.append(Phase(iteration=it, sample=sample, weights=weights))
    return out


def _merged(phases: list[Phase]) -> tuple[Phase, ...]:
    """Consecutive phases with the same weights as one (the earlier)."""
    out = []
    for phase in phases:
        if not out or out[-1].weights != phase.weights:
            out.append(phase)
    return tuple(out)


def resolve_mixture(
    cfg: DataConfig,
    num_samples: int,
    files: PrefixFiles,
    *,
    global_batch_size: int,
    record: dict | None = None,
    iteration: int = 0,
    consumed: int = 0,
) -> MixturePlan | None:
    """The train split's phases and sources for a run at (`iteration`, `consumed`), resumed from
    `record` (a checkpoint's `data_mixture`; None: a fresh run or an older checkpoint, whose
    train order is then this run's from sample 0, as Megatron's). None where the train order
    is not the blend's own: mock data, and the cyclic sampler's random order."""
    if cfg.train_blend is None or cfg.dataloader_type != "single":
        return None
    prefixes = cfg.train_blend[0]
    tokens = {p: train_tokens(files, p, cfg.train_range) for p in prefixes}
    history = _history(record, cfg, consumed, tokens)
    at = (iteration, consumed) if history.phases else (0, 0)
    placed = _placed(configured_phases(cfg, tokens), *at, global_batch_size, num_samples)
    phases = _merged(history.phases + placed)
    _refuse_listed_twice(phases)
    names = list(dict.fromkeys([*history.sources, *(p for ph in phases for p, _ in ph.weights)]))
    _refuse_too_many(names)
    plan = MixturePlan(
        phases=phases,
        sources=tuple(
            Source(prefix=p, tokens=tokens.get(p, 0), segments=(), size=0, consumed=0)
            for p in names
        ),
        num_samples=num_samples,
        start=consumed,
        seq_length=cfg.seq_length,
    )
    if len(phases) == 1 and not (history.phases and history.mixture):
        # Megatron's blend, of the phase's weights; the builder builds it, its datasets make
        # the record
        blend = _given_blend(cfg, phases[0].weights)
        return replace(plan, lines=tuple(history.lines), megatron=True, blend=blend)
    targets, read = _targets(plan), phase_counts(plan, consumed).sum(axis=0)
    surplus = 1 + cfg.mid_level_dataset_surplus
    sources = []
    for s, n, target in zip(plan.sources, read, targets, strict=True):
        entry = history.sources.get(s.prefix)
        if entry is not None:
            _check_counter(entry, int(n))
            s = replace(s, tokens=int(entry["tokens"]), segments=tuple(entry["segments"]))
        sources.append(replace(s, size=math.ceil(target * surplus), consumed=int(n)))
    plan = replace(plan, sources=tuple(sources))
    lines = history.lines + _change_lines(plan, len(history.phases))
    return replace(plan, lines=tuple(lines))


def _given_blend(cfg: DataConfig, weights: tuple) -> Blend | None:
    """The --data-schedule phase whose kernel weights are `weights`, as a blend; None without
    a schedule (the phase is the flags' train blend)."""
    if cfg.data_schedule is None:
        return None
    return next(b for _, b in schedule_blends(cfg) if kernel_weights(*b) == weights)


def _targets(plan: MixturePlan) -> list[int]:
    """[source] samples the phases ask of it: the sum over phases of ceil(requested x weight)."""
    out = [0] * len(plan.sources)
    ends = [p.sample for p in plan.phases[1:]] + [max(plan.num_samples, plan.phases[-1].sample)]
    for phase, end in zip(plan.phases, ends, strict=True):
        for prefix, w in phase.weights:
            out[plan.index(prefix)] += math.ceil((end - phase.sample) * w)
    return out


def _refuse_too_many(names: list[str]) -> None:
    """The train order numbers its sources in int16, as Megatron's blend numbers its datasets."""
    if len(names) >= MAX_DATASETS:
        raise UserError(
            f"the data mixture has {len(names):,} sources (the checkpoint's recorded ones and "
            f"the train blend's); at most {MAX_DATASETS - 1:,} are supported (merge small "
            f"prefixes with tools/merge_datasets.py)"
        )


def _refuse_listed_twice(phases: tuple[Phase, ...]) -> None:
    """A changing mixture tells sources apart by prefix: each must be listed once (Megatron's
    one phase may list a prefix twice: each listing is a blend part of its own)."""
    for phase in phases if len(phases) > 1 else ():
        names = [p for p, _ in phase.weights]
        twice = [p for p in names if names.count(p) > 1]
        if twice:
            raise UserError(
                f"the train blend lists {twice[0]} twice; changing the mixture (--data-schedule, "
                f"or other weights on resume) needs each prefix once (list it once, with the "
                f"summed weight)"
            )


def _check_counter(entry: dict, drawn: int) -> None:
    """A recorded per-source counter must be what the recorded phases draw."""
    if int(entry["consumed"]) != drawn:
        raise UserError(
            f"the checkpoint's data_mixture record says {entry['prefix']} consumed "
            f"{entry['consumed']} samples, its phases draw {drawn}: the record is damaged "
            f"(resume from another checkpoint)"
        )


def _change_lines(plan: MixturePlan, history: int) -> list[str]:
    """One line per source when the weights change where the run starts: the weight before and
    after, and where in its own order the source goes on; none when nothing changes there."""
    if not history or len(plan.phases) == history or plan.phases[history].sample != plan.start:
        return []
    before, now = dict(plan.phases[history - 1].weights), plan.phases[history]
    where = f"data mixture from iteration {now.iteration} (sample {plan.start})"
    after = dict(now.weights)
    out = []
    for s in plan.sources:
        old, new = before.get(s.prefix, 0.0), after.get(s.prefix, 0.0)
        epochs = s.consumed / max(1, samples_per_epoch(s.tokens, plan.seq_length))
        at = f"sample {s.consumed} of its own order ({epochs:.2f} epochs read)"
        if not s.segments:
            what = f"new source, weight {new:.4f}: starts its own order at sample 0"
        elif old > 0 and new == 0:
            what = f"dropped (weight {old:.4f} -> 0) at {at}; checkpoints keep that position"
        elif new == 0:
            what = f"not drawn (weight 0), stays at {at}"
        elif old == new:
            what = f"weight {new:.4f} (unchanged): continues at {at}"
        else:
            what = f"weight {old:.4f} -> {new:.4f}: continues at {at}"
        out.append(f"{where}: {s.prefix}: {what}")
    return out
