"""Mixtures that change, checked on the tokens a real training run feeds its model.

Every token of the three sources' train data names its source and position (source s holds ids
s * 1000 + 1, + 2, ... in file order; the EOD is 3000), and the model's embedding records the
token ids of every micro-batch it receives (on the first pipeline stage, TP rank 0), at every
layout. The expected train order is built from the oracles only: megatron-core's GPTDataset of
each source (its own order) and megatron-core's greedy blending kernel per phase (weights
normalized here), each source continuing its own order across phases. Nine runs, all of 8
iterations of 4 samples:

- R1 (DP 1): --data-path 0.5 A 0.5 B, stopped and saved after iteration 3 (sample 12); its
  samples are megatron-core's BlendedDataset's, sample for sample;
- R2 (DP 1): R1's checkpoint re-weighted to 0.9 A 0.1 B;
- R4 (DP 2): R1's checkpoint with C added (0.4 A 0.4 B 0.2 C);
- R5 (TP 2): R1's checkpoint with B removed (A alone);
- R3 (DP 1): a two-phase --data-schedule (0.5 A 0.5 B, then 0.2 A 0.3 B 0.5 C from iteration
  5), stopped in the middle of its first phase (after iteration 3) ...
- R6 (PP 2): ... and resumed at another layout, across the phase boundary;
- R7 (the torch backend, FSDP2 at DP 2): R3's DeepSpeed checkpoint resumed there, across the
  phase boundary (another backend: through the layout-independent full state);
- R8 (DP 1): a --data-schedule of one phase within the run (0.9 A 0.1 B; its next phase starts
  at --train-iters) over --data-path A B C: megatron-core's BlendedDataset of 0.9 A 0.1 B;
- R9 (DP 1): R3's checkpoint resumed with a schedule whose second phase starts at
  --train-iters: one phase is left, and each source goes on in its own order.

For each run's whole train order (its first part fed by R1 or R3): every sample fed equals the
expected one (no source sample read twice before its order is used up, none skipped, the
weights' greedy interleave per phase), each source's non-EOD tokens are all distinct (an
independent check of "no duplicate"), the counts per source stay within one sample of weight x
samples at every iteration of a phase, and the checkpoint's per-source counters, the log's
'consumed tokens' fields and the --metrics-file scalars equal the counts of what was fed. The
log says what changed, one line per source. explain_batch.py and plan_blend.py, given the
runs' flags and checkpoints, name the samples and counts that were fed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from distributed import run_on_ranks
from test_data_builder import megatron_world  # noqa: F401 (a fixture, used by name)
from training_fixtures import model_flags, read_metrics

from pretrain.data.files.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from pretrain.tokenizer import NullTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VOCAB = 3000  # NullTokenizer: eod = 3000
SOURCES = {"a": 0, "b": 1, "c": 2}
ITERS, GBS, STOP = 8, 4, 3
S = 16
SEED = 7
SCHEDULE = [
    {"iteration": 0, "weights": {"a": 0.5, "b": 0.5}},
    {"iteration": 5, "weights": {"a": 0.2, "b": 0.3, "c": 0.5}},
]
# one phase within the run: its next phase starts at --train-iters
ONE_PHASE = [
    {"iteration": 0, "weights": {"a": 0.9, "b": 0.1}},
    {"iteration": ITERS, "weights": {"c": 1}},
]
FIRST_PHASE_ONLY = [SCHEDULE[0], {"iteration": ITERS, "weights": {"c": 1}}]


def _identity_corpus(prefix: Path, source: int, num_docs: int = 40) -> str:
    """Documents of 5-30 tokens, each token id source * 1000 + (its position in the source's
    data, from 1), each document ended by the EOD."""
    rng = np.random.default_rng(source)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    next_id = source * 1000 + 1
    for _ in range(num_docs):
        n = int(rng.integers(5, 30))
        doc = np.arange(next_id, next_id + n)
        next_id += n
        builder.add_item(np.append(doc, VOCAB))
        builder.end_document()
    assert next_id < (source + 1) * 1000
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


def _source_of(tokens: np.ndarray) -> int:
    return int(tokens[tokens != VOCAB].min()) // 1000


def _data_flags(corpora: dict, data: list[str], *extra: str) -> list[str]:
    """A run's data, batch and tokenizer flags (what the data tools take too)."""
    return [
        "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--train-iters", str(ITERS),
        "--seq-length", str(S), "--seed", str(SEED), "--split", "100,0,0",
        "--data-path", *[corpora.get(w, w) for w in data], "--eval-iters", "0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *extra,
    ]  # fmt: skip


def _flags(data_flags: list[str], metrics: Path, *extra: str) -> list[str]:
    return [
        *model_flags("gpt2"), *data_flags, "--lr", "1e-3", "--lr-warmup-iters", "1",
        "--log-interval", "1", "--eval-interval", "1000", "--num-workers", "0",
        "--distributed-backend", "gloo", "--metrics-file", str(metrics), *extra,
    ]  # fmt: skip


def _train_and_record(rank: int, world: int, runs: list[list[str]]) -> list[tuple]:
    """Rank body: `pretrain` each argv in turn; per run (log text, [(dp rank, tokens)] of every
    micro-batch this rank's embedding received, or None on ranks that do not record)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from pretrain.cli import parse_args
    from pretrain.model.gpt import Embedding
    from pretrain.parallel import state
    from pretrain.training.run import pretrain

    fed = []
    forward = Embedding.forward

    def recording(self, tokens, *args, **kwargs):
        if state.get_tensor_model_parallel_rank() == 0:
            fed.append((state.get_data_parallel_rank(), tokens.detach().clone().numpy()))
        return forward(self, tokens, *args, **kwargs)

    Embedding.forward = recording
    out = []
    for argv in runs:
        fed.clear()
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            pretrain(parse_args(argv))
        out.append((log.getvalue(), list(fed) if fed else None))
    return out


def _global_order(per_rank: list, first_sample: int) -> dict[int, np.ndarray]:
    """{train order position: the sample's tokens} from every recording rank's micro-batches
    (Megatron's sequential sampler: DP rank d's n-th micro-batch of an iteration holds
    position start + n x mbs x DP + d, mbs = 1)."""
    recorded = [r for r in per_rank if r is not None]
    dp = len(recorded)
    out = {}
    for batches in recorded:
        for n, (d, tokens) in enumerate(batches):
            assert tokens.shape == (1, S)
            iteration, micro = divmod(n, GBS // dp)
            out[first_sample + iteration * GBS + micro * dp + d] = tokens[0]
    return out


def _megatron_order(prefix: str, cache: Path) -> list[np.ndarray]:
    """The oracle: megatron-core's GPTDataset of `prefix`'s train split (one epoch here: every
    run needs less), its samples' input tokens in its own order."""
    from test_data_gpt_dataset import megatron_core_datasets

    ds = megatron_core_datasets(
        [None, None, None],
        NullTokenizer(VOCAB),
        str(cache),
        random_seed=SEED,
        sequence_length=S,
        blend=([prefix], None),
        split="100,0,0",
    )[0]
    return [ds[k]["tokens"].numpy() for k in range(len(ds))]


def _expected(phases: list[tuple[int, dict]], orders: dict, total: int) -> list[tuple[str, int]]:
    """[(source, index in its own order)] of the train order: per phase (first sample, {source:
    weight}), megatron-core's greedy kernel over the normalized weights (the last phase over
    sum ceil(remaining x weight) samples), each source numbered on across phases."""
    from megatron.core.datasets import helpers_cpp

    out, taken = [], dict.fromkeys(orders, 0)
    ends = [p[0] for p in phases[1:]] + [None]
    for (start, weights), end in zip(phases, ends, strict=True):
        names = list(weights)
        w = np.array([weights[n] for n in names], dtype=np.float64)
        w /= w.sum()
        size = end - start if end is not None else sum(math.ceil((total - start) * x) for x in w)
        index = np.zeros(size, dtype=np.int16)
        sample = np.zeros(size, dtype=np.int64)
        helpers_cpp.build_blending_indices(index, sample, w, len(names), size, False)
        for k in index:
            name = names[k]
            out.append((name, taken[name]))
            taken[name] += 1
    return out[:total]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixture")
    corpora = {n: _identity_corpus(tmp / n, s) for n, s in SOURCES.items()}
    for name, phases in (("schedule", SCHEDULE), ("one", ONE_PHASE), ("first", FIRST_PHASE_ONLY)):
        (tmp / f"{name}.json").write_text(
            json.dumps(
                [{**p, "weights": {corpora[k]: w for k, w in p["weights"].items()}} for p in phases]
            )
        )
    ck1, ck2 = str(tmp / "ck1"), str(tmp / "ck2")
    stop = ["--save-interval", "100", "--exit-interval", str(STOP)]
    sched = ["--data-schedule", str(tmp / "schedule.json")]
    data = {
        "r1": _data_flags(corpora, ["0.5", "a", "0.5", "b"]),
        "r2": _data_flags(corpora, ["0.9", "a", "0.1", "b"]),
        "r3": _data_flags(corpora, ["a", "b", "c"], *sched),
        "r4": _data_flags(corpora, ["0.4", "a", "0.4", "b", "0.2", "c"]),
        "r5": _data_flags(corpora, ["a"]),
        "r6": _data_flags(corpora, ["a", "b", "c"], *sched),
        "r7": _data_flags(corpora, ["a", "b", "c"], *sched),
        "r8": _data_flags(corpora, ["a", "b", "c"], "--data-schedule", str(tmp / "one.json")),
        "r9": _data_flags(corpora, ["a", "b", "c"], "--data-schedule", str(tmp / "first.json")),
    }
    extra = {
        "r1": ["--save", ck1, *stop],
        "r2": ["--load", ck1],
        "r3": ["--save", ck2, *stop],
        "r4": ["--load", ck1],
        "r5": ["--load", ck1, "--tensor-model-parallel-size", "2"],
        "r6": ["--load", ck2, "--pipeline-model-parallel-size", "2"],
        "r7": ["--load", ck2, "--use-torch-fsdp2"],
        "r8": [],
        "r9": ["--load", ck2],
    }
    argv = {r: _flags(data[r], tmp / f"{r}.jsonl", *extra[r]) for r in data}
    ones = ("r1", "r2", "r3", "r8", "r9")
    one = run_on_ranks(_train_and_record, 1, ([argv[r] for r in ones],), 600)
    second = ("r4", "r5", "r6", "r7")
    two = run_on_ranks(_train_and_record, 2, ([argv[r] for r in second],), 900)
    results = {}
    for names, per_rank in ((ones, one), (second, two)):
        for i, name in enumerate(names):
            log = per_rank[0][i][0]
            first = 0 if name in ("r1", "r3", "r8") else STOP * GBS
            results[name] = (log, _global_order([r[i][1] for r in per_rank], first))
    orders = {n: _megatron_order(p, tmp / "oracle") for n, p in corpora.items()}
    return tmp, corpora, data, results, orders


WHOLE_RUNS = {  # run -> (its first part, [(first sample, {source: weight})])
    "r2": ("r1", [(0, {"a": 0.5, "b": 0.5}), (12, {"a": 0.9, "b": 0.1})]),
    "r4": ("r1", [(0, {"a": 0.5, "b": 0.5}), (12, {"a": 0.4, "b": 0.4, "c": 0.2})]),
    "r5": ("r1", [(0, {"a": 0.5, "b": 0.5}), (12, {"a": 1.0})]),
    "r6": ("r3", [(0, {"a": 0.5, "b": 0.5}), (20, {"a": 0.2, "b": 0.3, "c": 0.5})]),
    "r7": ("r3", [(0, {"a": 0.5, "b": 0.5}), (20, {"a": 0.2, "b": 0.3, "c": 0.5})]),
    "r9": ("r3", [(0, {"a": 0.5, "b": 0.5})]),
}


def _whole(results, name):
    first, _ = WHOLE_RUNS[name]
    fed = {**results[first][1], **results[name][1]}
    assert sorted(fed) == list(range(ITERS * GBS)), (name, sorted(fed))
    return [fed[k] for k in range(ITERS * GBS)]


@pytest.mark.usefixtures("megatron_world")
def test_an_unchanged_blend_feeds_megatron_cores_blend(runs, tmp_path):
    """R1's 12 samples are megatron-core's BlendedDataset's for the same flags, in order."""
    from test_data_gpt_dataset import megatron_core_datasets

    _, corpora, _, results, _ = runs
    blend = megatron_core_datasets(
        [ITERS * GBS, 0, 0],
        NullTokenizer(VOCAB),
        str(tmp_path),
        random_seed=SEED,
        sequence_length=S,
        blend=([corpora["a"], corpora["b"]], [0.5, 0.5]),
        split="100,0,0",
    )[0]
    fed = results["r1"][1]
    assert sorted(fed) == list(range(STOP * GBS))
    for k, tokens in fed.items():
        np.testing.assert_array_equal(tokens, blend[k]["tokens"].numpy(), err_msg=str(k))


@pytest.mark.usefixtures("megatron_world")
def test_a_one_phase_schedule_feeds_the_blend_of_its_weights(runs, tmp_path):
    """R8 (--data-schedule 0.9 A 0.1 B, its next phase at --train-iters) feeds megatron-core's
    BlendedDataset of --data-path 0.9 A 0.1 B, sample for sample; plan_blend.py plans that
    blend's weights and samples and explain_batch.py names the fed samples."""
    from test_data_gpt_dataset import megatron_core_datasets

    _, corpora, data, results, orders = runs
    a, b = corpora["a"], corpora["b"]
    blend = megatron_core_datasets(
        [ITERS * GBS, 0, 0],
        NullTokenizer(VOCAB),
        str(tmp_path),
        random_seed=SEED,
        sequence_length=S,
        blend=([a, b], [0.9, 0.1]),
        split="100,0,0",
    )[0]
    fed = results["r8"][1]
    assert sorted(fed) == list(range(ITERS * GBS))
    for k, tokens in fed.items():
        np.testing.assert_array_equal(tokens, blend[k]["tokens"].numpy(), err_msg=str(k))
    out = _tool("plan_blend", data["r8"])
    for prefix, weight, n in zip(
        [a, b], ("0.9000", "0.1000"), np.bincount(blend.dataset_index), strict=True
    ):
        row = re.search(
            rf"^train\s+{re.escape(prefix)}\s+[\d,]+\s+[\d,]+\s+(\S+)\s+(\d+)", out, re.M
        )
        assert row and row.groups() == (weight, str(n)), out
    assert corpora["c"] not in out.split("warning")[0]  # the blend of the phase: no C
    explained = _tool("explain_batch", [*data["r8"], "--iteration", f"1-{ITERS}", "--json"])
    rows = [json.loads(line) for line in explained.splitlines() if line.startswith("{")]
    assert [r["sample"] for r in rows] == list(range(ITERS * GBS))
    name = {p: n for n, p in corpora.items()}
    for r in rows:
        tokens = orders[name[r["dataset"]]][r["dataset_sample"]]
        np.testing.assert_array_equal(tokens, fed[r["sample"]])


@pytest.mark.parametrize("name", sorted(WHOLE_RUNS))
def test_each_source_continues_its_own_order_with_the_new_weights(runs, name):
    tmp, corpora, _, results, orders = runs
    _, phases = WHOLE_RUNS[name]
    fed = _whole(results, name)
    expected = _expected(phases, orders, ITERS * GBS)
    for k, (tokens, (source, j)) in enumerate(zip(fed, expected, strict=True)):
        np.testing.assert_array_equal(tokens, orders[source][j], err_msg=f"{name} sample {k}")
    # independently of the oracle: no token of a source fed twice (one epoch here), and the
    # weights hold at every iteration of each phase within one sample
    by_source: dict[int, list] = {}
    for tokens in fed:
        by_source.setdefault(_source_of(tokens), []).extend(tokens[tokens != VOCAB].tolist())
    for ids in by_source.values():
        assert len(ids) == len(set(ids))
    ends = [p[0] for p in phases[1:]] + [ITERS * GBS]
    for (start, weights), end in zip(phases, ends, strict=True):
        total = sum(weights.values())
        for stop in range(start + GBS - start % GBS, end + 1, GBS):
            drawn = [_source_of(t) for t in fed[start:stop]]
            for source, w in weights.items():
                got = drawn.count(SOURCES[source])
                assert abs(got - w / total * (stop - start)) <= 1, (name, stop, source, got)


@pytest.mark.parametrize("name", sorted(WHOLE_RUNS))
def test_counters_log_and_scalars_count_what_was_fed(runs, name):
    tmp, corpora, _, results, _ = runs
    first, _ = WHOLE_RUNS[name]
    fed = _whole(results, name)
    metrics = {**read_metrics(tmp / f"{first}.jsonl"), **read_metrics(tmp / f"{name}.jsonl")}
    log = results[first][0] + results[name][0]
    for it in range(1, ITERS + 1):
        drawn = [_source_of(t) for t in fed[: it * GBS]]
        for source, s in SOURCES.items():
            tokens = drawn.count(s) * S
            key = f"consumed-tokens/{corpora[source]}"
            if tokens or key in metrics[it]:
                assert metrics[it][key] == tokens, (name, it, source)
                field = rf"consumed tokens {re.escape(corpora[source])}: (\d+) \|"
                line = re.search(rf" iteration\s+{it}/.*\| {field}", log)
                assert line and int(line.group(1)) == tokens, (name, it, source)
    # the first part's checkpoint (after iteration 3) counts its first 12 samples per source
    ck = {"r1": "ck1", "r3": "ck2"}[first]
    meta = json.loads((tmp / ck / f"global_step{STOP}" / "pretrain_meta.json").read_text())
    drawn = [_source_of(t) for t in fed[: STOP * GBS]]
    got = {s["prefix"]: s["consumed"] for s in meta["data_mixture"]["sources"]}
    assert got == {corpora[n]: drawn.count(s) for n, s in SOURCES.items() if corpora[n] in got}
    assert len(got) == (3 if first == "r3" else 2)


def test_the_log_says_what_changed_per_source(runs):
    _, corpora, _, results, _ = runs
    a, b, c = corpora["a"], corpora["b"], corpora["c"]
    where = "data mixture from iteration 3 (sample 12)"
    expect = {
        "r2": [f"{where}: {a}: weight 0.5000 -> 0.9000: continues at sample 6 of its own order",
               f"{where}: {b}: weight 0.5000 -> 0.1000: continues at sample 6 of its own order"],
        "r4": [f"{where}: {c}: new source, weight 0.2000: starts its own order at sample 0"],
        "r5": [f"{where}: {b}: dropped (weight 0.5000 -> 0) at sample 6 of its own order"],
        "r6": [f"data mixture: phase from iteration 5 (sample 20): {a} 0.2000, {b} 0.3000, {c} 0.5000"],
        "r7": [f"data mixture: phase from iteration 5 (sample 20): {a} 0.2000, {b} 0.3000, {c} 0.5000"],
    }  # fmt: skip
    for name, lines in expect.items():
        for line in lines:
            assert line in results[name][0], (name, line, results[name][0][-3000:])
    # R3's start-up plan is its schedule's: no train row of --data-path's own blend (by size)
    assert not re.search(rf"^train\s+{re.escape(a)}\s", results["r3"][0], re.M)


def _tool(script: str, argv: list[str]) -> str:
    """Run a tool's main in this process; its stdout."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(script, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(argv) == 0
    return out.getvalue()


def test_explain_batch_names_the_fed_samples_of_a_reweighted_run(runs):
    """explain_batch.py with R2's flags and R1's checkpoint explains all 8 iterations: each
    sample's source and index in its own order are those fed."""
    tmp, corpora, data, results, orders = runs
    fed = _whole(results, "r2")
    load = ["--load", str(tmp / "ck1"), "--iteration", f"1-{ITERS}", "--json"]
    out = _tool("explain_batch", [*data["r2"], *load])
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["sample"] for r in rows] == list(range(ITERS * GBS))
    name = {p: n for n, p in corpora.items()}
    for r in rows:
        tokens = orders[name[r["dataset"]]][r["dataset_sample"]]
        np.testing.assert_array_equal(tokens, fed[r["sample"]])


def test_plan_blend_plans_the_schedule_that_was_fed(runs):
    """plan_blend.py with R6's flags and R3's checkpoint prints, per phase and source, the
    samples R3 + R6 fed."""
    tmp, corpora, data, results, _ = runs
    fed = _whole(results, "r6")
    out = _tool("plan_blend", [*data["r6"], "--load", str(tmp / "ck2")])
    _, phases = WHOLE_RUNS["r6"]
    for p, (start, weights) in enumerate(phases):
        end = phases[p + 1][0] if p + 1 < len(phases) else ITERS * GBS
        drawn = [_source_of(t) for t in fed[start:end]]
        for source in weights:
            n = drawn.count(SOURCES[source])
            head = rf"^\s*{p}\s+\d+\s+{start}\s+{re.escape(corpora[source])}\s+\S+\s+(\d+)"
            row = re.search(head, out, re.M)
            assert row and int(row.group(1)) == n, (p, source, out)
