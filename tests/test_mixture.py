"""Mixture plans without training: one phase is megatron-core's blend; a resume with the same
blend stays Megatron's; a source whose own order runs out goes on with a new segment after
reading every sample of the old one once; records that cannot be continued say so; bad
--data-schedule files and flag combinations are one line each."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from test_data_builder import megatron_world  # noqa: F401 (a fixture, used by name)
from test_data_gpt_dataset import TOKENIZER, megatron_core_datasets, random_lengths, write_corpus
from test_mixture_training import _identity_corpus
from training_fixtures import make_corpus

from pretrain.data.blends.blended_dataset import BlendedDataset
from pretrain.data.blends.explain import locate
from pretrain.data.blends.mixture import blend_arrays, resolve_mixture
from pretrain.data.blends.mixture_dataset import MixtureCounter, MixtureDataset, SourceOrder
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import DataConfig
from pretrain.data.files.fingerprint import PrefixFiles
from pretrain.data.schedule import read_schedule
from pretrain.errors import UserError
from pretrain.tokenizer import NullTokenizer
from pretrain.training.report.logging import MAX_SOURCES_SHOWN, shown_sources

S, SEED, GBS = 16, 5, 4


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixture_corpora")
    return {
        name: write_corpus(str(d / name), random_lengths(n, seed=i, hi=50), seed=i)
        for i, (name, n) in enumerate([("a", 150), ("b", 90), ("c", 60)])
    }


def _cfg(tmp_path, blend, **kw) -> DataConfig:
    return DataConfig(
        seq_length=S, seed=SEED, blend=blend, split="100,0,0",
        data_cache_path=str(tmp_path / "cache"), **kw,
    )  # fmt: skip


def _plan(cfg, n, **resume):
    return resolve_mixture(
        cfg, n, PrefixFiles(cfg.data_cache_path), global_batch_size=GBS, **resume
    )


@pytest.mark.usefixtures("megatron_world")
def test_one_phase_is_megatron_cores_blend(tmp_path, corpora):
    """The phase code's arrays for one phase equal megatron-core's BlendedDataset's, and the
    builder then builds Megatron's own BlendedDataset."""
    blend = ([corpora["a"], corpora["b"], corpora["c"]], [0.3, 0.5, 0.2])
    cfg = _cfg(tmp_path, blend)
    plan = _plan(cfg, 300)
    assert plan.megatron and plan.lines == ()
    theirs = megatron_core_datasets(
        [300, 0, 0], TOKENIZER, str(tmp_path / "theirs"), random_seed=SEED,
        sequence_length=S, blend=blend, split="100,0,0",
    )[0]  # fmt: skip
    di, dsi = blend_arrays(plan)
    np.testing.assert_array_equal(di, theirs.dataset_index)
    np.testing.assert_array_equal(dsi, theirs.dataset_sample_index)
    ours = build_train_valid_test_datasets(cfg, TOKENIZER, [300, 0, 0], mixture=plan)[0]
    assert isinstance(ours, BlendedDataset)
    assert ours.unique_description_hash == theirs.unique_description_hash


def test_a_resume_with_the_same_blend_stays_megatrons(tmp_path, corpora):
    """The record of a run resumed with the same weights (and more iterations) is one phase:
    the builder builds Megatron's blend again, with nothing said."""
    cfg = _cfg(tmp_path, ([corpora["a"], corpora["b"]], [1, 3]))
    plan = _plan(cfg, 200)
    built = build_train_valid_test_datasets(cfg, TOKENIZER, [200, 0, 0], mixture=plan)[0]
    record = MixtureCounter(built, plan, cfg).record(40)
    assert [s["consumed"] for s in record["sources"]] == np.bincount(
        built.dataset_index[:40]
    ).tolist()
    for n in (200, 400):
        again = _plan(cfg, n, record=json.loads(json.dumps(record)), iteration=10, consumed=40)
        assert again.megatron and again.lines == ()


@pytest.mark.usefixtures("megatron_world")
def test_a_source_read_up_goes_on_with_a_new_segment(tmp_path):
    """Source b (one short epoch) weighted 0.1, then 0.9 from sample 40: the greedy phase needs
    more of b than its first GPTDataset holds, so its order goes on with a second one (seed + 1),
    after every sample of the first was read exactly once; both are megatron-core's GPTDatasets
    (with the recorded size, then the missing one)."""
    a = _identity_corpus(tmp_path / "a", 0, num_docs=40)
    b = _identity_corpus(tmp_path / "b", 1, num_docs=20)
    tok = NullTokenizer(3000)
    first = _cfg(tmp_path, ([a, b], [0.9, 0.1]))
    plan = _plan(first, 120)
    built = build_train_valid_test_datasets(first, tok, [120, 0, 0], mixture=plan)[0]
    record = MixtureCounter(built, plan, first).record(40)
    second = _cfg(tmp_path, ([a, b], [0.1, 0.9]))
    plan2 = _plan(second, 120, record=record, iteration=10, consumed=40)
    assert not plan2.megatron
    ours = build_train_valid_test_datasets(second, tok, [120, 0, 0], mixture=plan2)[0]
    assert isinstance(ours, MixtureDataset) and isinstance(ours.datasets[1], SourceOrder)
    seg0, seg1 = ours.datasets[1].segments
    recorded = record["sources"][1]["segments"][0]
    needed = int((ours.dataset_index == 1).sum())
    oracle = [
        megatron_core_datasets(
            [n, 0, 0], tok, str(tmp_path / f"theirs{k}"), random_seed=SEED + k,
            sequence_length=S, blend=([b], None), split="100,0,0",
        )[0]
        for k, n in ((0, recorded), (1, needed - len(seg0)))
    ]  # fmt: skip
    assert (seg0.num_samples, len(seg0)) == (recorded, len(oracle[0]))
    assert len(seg0.document_index) == len(seg0.indices)  # one epoch: every document once
    assert len(seg1) == len(oracle[1]) and len(seg0) < needed <= len(seg0) + len(seg1)
    order = [ours[k]["tokens"].numpy() for k in range(len(ours)) if ours.dataset_index[k] == 1]
    expected = [oracle[0][j]["tokens"].numpy() for j in range(len(oracle[0]))]
    expected += [oracle[1][j]["tokens"].numpy() for j in range(len(oracle[1]))]
    for k, tokens in enumerate(order):
        np.testing.assert_array_equal(tokens, expected[k], err_msg=str(k))
    ids = np.concatenate(order[: len(seg0)])
    ids = ids[ids != 3000]
    assert len(ids) == len(set(ids.tolist()))  # the first epoch: no token twice
    k = int(np.nonzero(ours.dataset_index == 1)[0][len(seg0)])
    prefix, in_order, gpt, local = locate(ours, k)
    assert (prefix, in_order, gpt, local) == (b, len(seg0), seg1, 0)


def test_records_that_cannot_be_continued_say_so(tmp_path, corpora):
    cfg = _cfg(tmp_path, ([corpora["a"], corpora["b"]], [0.5, 0.5]))
    plan = _plan(cfg, 100)
    built = build_train_valid_test_datasets(cfg, TOKENIZER, [100, 0, 0], mixture=plan)[0]
    record = MixtureCounter(built, plan, cfg).record(20)
    other = _cfg(tmp_path, ([corpora["a"], corpora["b"]], [0.9, 0.1]))
    # another --seed orders every source otherwise: Megatron's order, said in one line
    reseeded = DataConfig(**{**other.__dict__, "seed": SEED + 1})
    plan = _plan(reseeded, 100, record=record, iteration=5, consumed=20)
    assert plan.megatron and "their recorded positions do not apply" in plan.lines[0]
    # a source whose train split changed restarts as a new one
    changed = json.loads(json.dumps(record))
    changed["sources"][1]["tokens"] += 1
    with_b_new = _plan(other, 100, record=changed, iteration=5, consumed=20)
    assert any("starts over as a new source" in line for line in with_b_new.lines)
    # a counter that its phases do not give: refused, naming the record
    damaged = json.loads(json.dumps(record))
    damaged["sources"][0]["consumed"] += 1
    with pytest.raises(UserError, match="data_mixture record says .* consumed 11 samples"):
        _plan(other, 100, record=damaged, iteration=5, consumed=20)


def test_phases_after_the_last_iteration_are_left_out(tmp_path, corpora):
    a, b = corpora["a"], corpora["b"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps([
        {"iteration": 0, "weights": {a: 1}},
        {"iteration": 4, "weights": {a: 1, b: 3}},
        {"iteration": 50, "weights": {b: 1}},
    ]))  # fmt: skip
    cfg = _cfg(tmp_path, ([a, b], None), data_schedule=read_schedule(str(path)))
    plan = _plan(cfg, 10 * GBS)
    assert [(p.iteration, p.sample) for p in plan.phases] == [(0, 0), (4, 16)]
    assert [round(w, 6) for _, w in plan.phases[1].weights] == [0.25, 0.75]
    assert plan.lengths() == [16, math.ceil(24 * 0.25) + math.ceil(24 * 0.75)]


@pytest.mark.parametrize(
    "text, says",
    [
        ("{", "not valid JSON"),
        ("[]", "not a non-empty JSON list"),
        ('[{"iteration": 3, "weights": {"P": 1}}]', "starts at iteration 3, not 0"),
        ('[{"iteration": 0, "weights": {"P": -1}}]', "weight -1 of P is not a finite number >= 0"),
        ('[{"iteration": 0, "weights": {"P": 1' + "0" * 400 + '}}]',
         r"weight 10000000000000000000\.\.\. \(401 characters\) of P is not a finite number"),
        ('[{"iteration": 0, "weights": {"P": 1}}, {"iteration": 4, "weights": {"P": 1e308, '
         '"Q": 1e308}}]', "phase 1: the weights sum past the largest float"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('[{"iteration": 0, "weights": {"P": 1, "Q": 2, "P": 3}}]', "'P' is given twice"),
        ('[{"iteration": 0, "weights": {"P": 0}}]', "every weight is 0"),
        ('[{"iteration": 0, "weights": {"P": 1}, "x": 1}]', "exactly iteration and weights"),
        ('[{"iteration": 0, "weights": {"P": 1}}, {"iteration": 0, "weights": {"P": 2}}]',
         "not after phase 0's 0"),
    ],
)  # fmt: skip
def test_a_bad_schedule_file_is_one_line(tmp_path, text, says):
    path = tmp_path / "schedule.json"
    path.write_text(text)
    with pytest.raises(UserError, match=says) as err:
        read_schedule(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_schedule_and_flags_that_do_not_fit_are_one_line(tmp_path, corpora):
    a, b = corpora["a"], corpora["b"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"iteration": 0, "weights": {a: 1, "elsewhere": 1}}]))
    elsewhere = read_schedule(str(path))
    path.write_text(json.dumps([{"iteration": 0, "weights": {a: 1}}]))
    only_a = read_schedule(str(path))
    cases = [
        (dict(blend=([a], None), data_schedule=elsewhere), "elsewhere is not a prefix of --data-path"),
        (dict(blend=([a, b], None), data_schedule=only_a), f"no phase weighs {b}"),
        (dict(blend=([a, a], None), data_schedule=only_a), f"lists {a} twice"),
        (dict(blend=([a], None), data_schedule=only_a, dataloader_type="cyclic"), "needs --dataloader-type single"),
    ]  # fmt: skip
    for kw, says in cases:
        with pytest.raises(UserError, match=says):
            _cfg(tmp_path, **kw)


def test_a_schedule_with_a_varying_batch_size_is_refused(tmp_path):
    from pretrain.cli import parse_args

    corpus = make_corpus(tmp_path / "corpus")
    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"iteration": 0, "weights": {corpus: 1}}]))
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--train-samples", "32", "--data-path", corpus, "--split", "90,10,0",
        "--data-schedule", str(path), "--rampup-batch-size", "4", "4", "16",
    ]  # fmt: skip
    with pytest.raises(UserError, match="--data-schedule starts its phases at iterations"):
        parse_args(argv, env={})


def test_the_log_shows_per_source_tokens_for_blends_of_up_to_32_sources():
    few = {f"p{i}": i for i in range(MAX_SOURCES_SHOWN)}
    assert shown_sources(few) == few
    assert shown_sources({**few, "one more": 1}) == {} and shown_sources(None) == {}


def test_a_prefix_listed_twice_stays_megatrons_but_cannot_change(tmp_path, corpora):
    a = corpora["a"]
    cfg = _cfg(tmp_path, ([a, a], [1, 1]))
    plan = _plan(cfg, 40)
    built = build_train_valid_test_datasets(cfg, TOKENIZER, [40, 0, 0], mixture=plan)[0]
    record = MixtureCounter(built, plan, cfg).record(8)
    assert [s["prefix"] for s in record["sources"]] == [a, a]
    assert _plan(cfg, 40, record=record, iteration=2, consumed=8).megatron
    with pytest.raises(UserError, match=f"lists {a} twice"):
        _plan(_cfg(tmp_path, ([a, a], [1, 3])), 40, record=record, iteration=2, consumed=8)


def test_per_split_paths_change_the_train_blend_only(tmp_path, corpora):
    """--train-data-path re-weighted on resume: the train split is the phases', the validation
    split stays the one --valid-data-path builds (Megatron's GPTDataset, its own samples)."""
    a, b, c = corpora["a"], corpora["b"], corpora["c"]

    def cfg(weights):
        return DataConfig(
            seq_length=S, seed=SEED, blend_per_split=[([a, b], weights), ([c], None), None],
            data_cache_path=str(tmp_path / "cache"),
        )  # fmt: skip

    first = cfg([0.5, 0.5])
    plan = _plan(first, 100)
    train, valid, _ = build_train_valid_test_datasets(first, TOKENIZER, [100, 20, 0], mixture=plan)
    record = MixtureCounter(train, plan, first).record(40)
    assert record["order"]["train_range"] == [0.0, 1.0]
    second = cfg([0.2, 0.8])
    plan2 = _plan(second, 100, record=record, iteration=10, consumed=40)
    train2, valid2, _ = build_train_valid_test_datasets(
        second, TOKENIZER, [100, 20, 0], mixture=plan2
    )
    assert isinstance(train2, MixtureDataset) and type(valid2) is type(valid)
    np.testing.assert_array_equal(train2.dataset_index[:40], train.dataset_index[:40])
    np.testing.assert_array_equal(valid2.shuffle_index, valid.shuffle_index)
    b_next = int(np.nonzero(train2.dataset_index[40:] == 1)[0][0]) + 40
    assert train2.dataset_sample_index[b_next] == record["sources"][1]["consumed"]


def _schedule(tmp_path, name, phases) -> tuple:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps([{"iteration": i, "weights": w} for i, w in phases]))
    return read_schedule(str(path))


def _identity(tokens: np.ndarray) -> set[int]:
    return set(tokens[tokens != 3000].tolist())


def test_a_one_phase_schedule_is_the_blend_of_its_weights(tmp_path):
    """--data-schedule 0.9 a / 0.1 b, its next phase after the run's end, over --data-path a b
    (no weights): the train split is the direct blend --data-path 0.9 a 0.1 b, sample for
    sample, and plan_blend plans those weights and counts (not a's and b's sizes)."""
    from pretrain.data.blends.plan import plan_blend

    a = _identity_corpus(tmp_path / "a", 0, num_docs=40)
    b = _identity_corpus(tmp_path / "b", 1, num_docs=40)
    tok = NullTokenizer(3000)
    schedule = _schedule(tmp_path, "s", [(0, {a: 0.9, b: 0.1}), (50, {b: 1})])
    cfg = _cfg(tmp_path, ([a, b], None), data_schedule=schedule)
    plan = _plan(cfg, 24)
    ours = build_train_valid_test_datasets(cfg, tok, [24, 0, 0], mixture=plan)[0]
    direct = _cfg(tmp_path, ([a, b], [0.9, 0.1]))
    theirs = build_train_valid_test_datasets(direct, tok, [24, 0, 0])[0]
    assert isinstance(ours, BlendedDataset)
    assert ours.unique_description_hash == theirs.unique_description_hash
    drawn = np.bincount(theirs.dataset_index[:24]).tolist()
    assert abs(drawn[0] - 0.9 * 24) < 1 and sum(drawn) == 24  # not by size (about 12 each)
    for k in range(24):
        np.testing.assert_array_equal(ours[k]["tokens"], theirs[k]["tokens"], err_msg=str(k))
    rows = plan_blend(cfg, [24, 0, 0], mixture=plan)
    whole = np.bincount(theirs.dataset_index).tolist()  # the blend's every sample
    assert [(r.prefix, round(r.weight, 4), r.samples) for r in rows] == [
        (a, 0.9, whole[0]),
        (b, 0.1, whole[1]),
    ]


@pytest.mark.usefixtures("megatron_world")
def test_a_two_phase_record_resumed_with_one_phase_left_continues_each_source(tmp_path):
    """A two-phase schedule's checkpoint in its first phase, resumed with a schedule whose next
    phase starts at the run's end: one phase is left, and each source goes on in its own order
    where the record left it (the counters never go back, no sample is read twice)."""
    a, b, c = (_identity_corpus(tmp_path / n, s, num_docs=40) for s, n in enumerate("abc"))
    tok = NullTokenizer(3000)
    blend = ([a, b, c], None)
    first = _schedule(tmp_path, "s1", [(0, {a: 0.5, b: 0.5}), (5, {a: 0.2, b: 0.3, c: 0.5})])
    cfg1 = _cfg(tmp_path, blend, data_schedule=first)
    plan1 = _plan(cfg1, 32)
    run1 = build_train_valid_test_datasets(cfg1, tok, [32, 0, 0], mixture=plan1)[0]
    record = json.loads(json.dumps(MixtureCounter(run1, plan1, cfg1).record(12)))
    later = _schedule(tmp_path, "s2", [(0, {a: 0.5, b: 0.5}), (8, {c: 1})])
    cfg2 = _cfg(tmp_path, blend, data_schedule=later)
    plan2 = _plan(cfg2, 32, record=record, iteration=3, consumed=12)
    run2 = build_train_valid_test_datasets(cfg2, tok, [32, 0, 0], mixture=plan2)[0]
    np.testing.assert_array_equal(run2.dataset_index[:12], run1.dataset_index[:12])
    np.testing.assert_array_equal(run2.dataset_sample_index[:12], run1.dataset_sample_index[:12])
    counter = MixtureCounter(run2, plan2, cfg2)
    at_resume = counter.record(12)
    assert at_resume["sources"] == record["sources"]
    before = {s["prefix"]: s["consumed"] for s in record["sources"]}
    after = {s["prefix"]: s["consumed"] for s in counter.record(32)["sources"]}
    assert all(after[p] >= n for p, n in before.items()) and after[c] == 0
    seen: set[int] = set()
    for k in range(12):
        seen |= _identity(run1[k]["tokens"].numpy())
    for k in range(12, 32):
        ids = _identity(run2[k]["tokens"].numpy())
        assert not ids & seen, k  # nothing the first run read is read again
        seen |= ids


def test_the_start_up_plan_warns_of_the_phases_epochs_not_the_blends(tmp_path, corpora, caplog):
    """A schedule reading c alone from iteration 2 on reads it past --max-epochs: the plan
    training logs says so per phase, and plans no train row of --data-path's own blend (by
    size, a and c are each read under 2 times: it warned of nothing)."""
    import logging

    from pretrain.data.blends.plan import log_plan

    a, c = corpora["a"], corpora["c"]
    schedule = _schedule(tmp_path, "s", [(0, {a: 1}), (2, {c: 1})])
    cfg = _cfg(tmp_path, ([a, c], None), data_schedule=schedule)
    plan = _plan(cfg, 500)
    log = logging.getLogger("test_plan")
    with caplog.at_level(logging.INFO, logger="test_plan"):
        log_plan(cfg, [500, 0, 0], log, files=PrefixFiles(cfg.data_cache_path), mixture=plan)
    text = caplog.text
    over = re.search(
        rf"warning: train {re.escape(c)}: read ([\d.]+) times by the end of phase 1", text
    )
    assert over and float(over.group(1)) > 4, text
    assert not re.search(rf"^train\s+{re.escape(a)}\s", text, re.M)


def test_more_sources_than_int16_ids_hold_are_refused(tmp_path, corpora):
    """A record of 33,000 sources (kept: a source never leaves the record) and two drawn ones:
    one line, before any int16 dataset id wraps."""
    a, b = corpora["a"], corpora["b"]
    cfg = _cfg(tmp_path, ([a, b], [0.5, 0.5]))
    plan = _plan(cfg, 40)
    built = build_train_valid_test_datasets(cfg, TOKENIZER, [40, 0, 0], mixture=plan)[0]
    record = MixtureCounter(built, plan, cfg).record(8)
    old = [{"prefix": f"gone/p{i}", "tokens": 100, "segments": [5], "consumed": 0}
           for i in range(33_000)]  # fmt: skip
    record = {**record, "sources": old + record["sources"]}
    reweighted = _cfg(tmp_path, ([a, b], [0.1, 0.9]))
    with pytest.raises(UserError, match="has 33,002 sources .* at most 32,766 are supported"):
        _plan(reweighted, 40, record=record, iteration=2, consumed=8)
