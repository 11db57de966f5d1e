"""Megatron-LM's --multiple-validation-sets / --validation-set-names.

The validation sets are the datasets megatron-core's own BlendedMegatronDatasetBuilder builds with
`multiple_validation_sets=True` (test-only oracle: one unblended GPTDataset per --valid-data-path
prefix, each of the valid split's sample count); a real run (one process, and PP = 2) prints one
Megatron block per set, "validation-<name> loss at iteration N | ...", whose loss is the
checkpointed model's loss on the next --eval-iters global batches of megatron-core's dataset for
that prefix; a run stopped and resumed reads the same samples of each set as the uninterrupted
one; bad combinations are refused in one line naming the flag.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_data_builder import S, assert_same_dataset
from test_data_gpt_dataset import (
    TOKENIZER,
    megatron_core_datasets,
    random_lengths,
    write_corpus,
)
from training_fixtures import (
    PYTHON,
    REPO,
    checkpointed_model,
    make_corpus,
    megatron_loss,
    model_flags,
    run,
    token_losses,
    torchrun_cmd,
    train_flags,
)

from pretrain.cli import parse_args
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import DataConfig, train_valid_test_num_samples
from pretrain.errors import UserError
from pretrain.tokenizer import build_tokenizer

GBS, MBS, EVAL_ITERS, ITERS = 8, 2, 2, 4
ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_validation_sets_equal_megatron_cores(tmp_path):
    prefixes = [
        write_corpus(str(tmp_path / name), random_lengths(n, seed=i, hi=50), seed=i)
        for i, (name, n) in enumerate([("a", 80), ("b", 40), ("c", 60)])
    ]
    per_split = [([prefixes[0]], None), (prefixes, None), ([prefixes[2]], None)]
    sizes = [200, 48, 16]
    cfg = DataConfig(
        seq_length=S, seed=5, blend_per_split=per_split, data_cache_path=str(tmp_path / "ours")
    )
    ours = build_train_valid_test_datasets(cfg, TOKENIZER, sizes, multiple_validation_sets=True)
    theirs = megatron_core_datasets(
        sizes,
        TOKENIZER,
        str(tmp_path / "theirs"),
        random_seed=5,
        sequence_length=S,
        blend_per_split=per_split,
        multiple_validation_sets=True,
    )
    assert isinstance(ours[1], list) and len(ours[1]) == len(theirs[1]) == 3
    for o, t in zip(ours[1], theirs[1], strict=True):
        assert len(o) >= 48  # each set holds the valid split's whole sample count
        assert_same_dataset(o, t)
    assert_same_dataset(ours[0], theirs[0])
    assert_same_dataset(ours[2], theirs[2])


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sets")
    names = ("train", "web", "code", "test")
    return tmp, {name: make_corpus(tmp / name, seed=i) for i, name in enumerate(names)}


def _flags(corpora, *extra: str) -> list[str]:
    tmp, c = corpora
    flags = model_flags("gpt2") + train_flags(c["train"], iters=ITERS, gbs=GBS, mbs=MBS)
    i = flags.index("--data-path")
    flags[i : i + 2] = ["--train-data-path", c["train"], "--test-data-path", c["test"]]
    flags[flags.index("--split") : flags.index("--split") + 2] = []
    flags[flags.index("--eval-interval") + 1] = "2"
    flags[flags.index("--eval-iters") + 1] = str(EVAL_ITERS)
    return flags + list(extra)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--validation-set-names", "web"], "--validation-set-names needs --multiple-validation-sets"),
        (["--multiple-validation-sets"], "--multiple-validation-sets needs the validation prefixes in --valid-data-path"),
        (["--valid-data-path", "{web}", "{code}", "--multiple-validation-sets", "--validation-set-names", "web"],
         "--validation-set-names gives 1 name(s) for 2 validation prefix(es)"),
        (["--valid-data-path", "{web}", "{code}", "--multiple-validation-sets", "--validation-set-names", "x", "x"],
         "--validation-set-names x x: the names must differ"),
        (["--valid-data-path", "1", "{web}", "2", "{code}", "--multiple-validation-sets"],
         "--multiple-validation-sets evaluates each --valid-data-path prefix on its own: drop the weights"),
    ],
)  # fmt: skip
def test_bad_combinations_are_refused_in_one_line(corpora, extra, message):
    extra = [x.format(**corpora[1]) for x in extra]
    with pytest.raises(UserError, match=re.escape(message)):
        parse_args(_flags(corpora, *extra), env=ONE_RANK)


def test_data_path_blend_is_refused(corpora):
    """With --data-path the validation split is one blend (Megatron's builder ignores the flag)."""
    _, c = corpora
    argv = _flags(corpora)
    i = argv.index("--train-data-path")
    argv[i : i + 4] = ["--data-path", c["web"], c["code"], "--split", "80,20,0"]
    with pytest.raises(UserError, match="with --data-path the validation split is one blended"):
        parse_args(argv + ["--multiple-validation-sets"], env=ONE_RANK)


def _run_flags(corpora, name: str, *extra: str) -> list[str]:
    tmp, c = corpora
    return _flags(
        corpora,
        "--valid-data-path",
        c["web"],
        c["code"],
        "--multiple-validation-sets",
        "--validation-set-names",
        "web",
        "code",
        "--metrics-file",
        str(tmp / f"{name}.jsonl"),
        "--save",
        str(tmp / f"{name}_ckpt"),
        *extra,
    )


def _train(corpora, name: str, flags: list[str], nproc: int = 1) -> tuple[str, list[dict]]:
    """Run pretrain_gpt.py; (output, metrics records)."""
    tmp, _ = corpora
    if nproc == 1:
        out = run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=400)
    else:
        out = run(torchrun_cmd(nproc, flags), timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    records = [json.loads(x) for x in (tmp / f"{name}.jsonl").read_text().splitlines()]
    return out.stdout, records


_RUNS: dict[str, tuple] = {}


def _sets_run(layout: str, corpora) -> tuple:
    """(flags, output, records, checkpoint folder) of one run per layout and module."""
    if layout not in _RUNS:
        tmp, _ = corpora
        flags = _run_flags(corpora, layout, "--save-interval", str(ITERS))
        pp = ["--pipeline-model-parallel-size", "2"] if layout == "pp2" else []
        output, records = _train(corpora, layout, flags + pp, nproc=2 if pp else 1)
        _RUNS[layout] = flags, output, records, tmp / f"{layout}_ckpt"
    return _RUNS[layout]


@pytest.fixture(scope="module", params=["1rank", "pp2"])
def sets_run(request, corpora):
    return _sets_run(request.param, corpora)


@pytest.mark.slow
def test_each_set_prints_megatrons_block(sets_run):
    _, output, records, _ = sets_run
    blocks = re.findall(
        r"^(-+)\n( validation(\S*) loss at iteration (\d+)( on \w+ set)? \| lm loss value: \S+ \| "
        r"lm loss PPL: \S+ \| )\n(-+)$",
        output,
        re.MULTILINE,
    )
    seen = [(suffix, int(it), where) for _, _, suffix, it, where, _ in blocks]
    assert seen == [
        ("-web", 2, ""),
        ("-code", 2, ""),
        ("-web", 4, ""),
        ("-code", 4, ""),
        ("-web", 4, " on validation set"),
        ("-code", 4, " on validation set"),
        ("", 4, " on test set"),  # the test split stays one set
    ]
    assert all(len(top) == len(line) + 1 == len(bottom) for top, line, *_, bottom in blocks)
    # no blended-validation block and no per-source lines: each set is one source
    assert "| source " not in output and " validation loss at iteration 2 " not in output
    keys = {k for r in records for k in r}
    assert {"validation-web-loss", "validation-code-loss", "validation-web-ppl"} <= keys
    assert "validation-loss" not in keys


@pytest.mark.slow
def test_each_sets_loss_is_the_models_loss_on_megatron_cores_samples(sets_run, tmp_path):
    flags, _, records, ckpt = sets_run
    cfg = parse_args(flags, env=ONE_RANK)
    t, ev = cfg.training, cfg.evaluation
    sizes = train_valid_test_num_samples(
        t.train_iters, None, ev.eval_interval, ev.eval_iters, t.global_batch_size
    )
    theirs = megatron_core_datasets(
        sizes,
        build_tokenizer(cfg.tokenizer),
        str(tmp_path / "theirs"),
        random_seed=t.seed,
        sequence_length=t.seq_length,
        blend_per_split=cfg.data.blend_per_split,
        multiple_validation_sets=True,
    )[1]

    model = checkpointed_model(str(ckpt))  # the model at iteration 4, as evaluated there
    assert model.iteration == ITERS
    per_pass = EVAL_ITERS * GBS
    for name, dataset in zip(("web", "code"), theirs, strict=True):
        key = f"validation-{name}-loss"
        logged = [r[key] for r in records if r["iteration"] == ITERS and key in r]
        assert len(logged) == 2  # the periodic pass at 4, then the final one
        for n, loss in enumerate(logged):
            start = (1 + n) * per_pass  # the pass at 2 read [0, 16) of each set
            samples = [dataset[k] for k in range(start, start + per_pass)]
            batch = {
                k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                for k in ("tokens", "labels", "loss_mask", "position_ids")
            }
            assert loss == pytest.approx(megatron_loss(*token_losses(model, batch), MBS), rel=1e-5)


@pytest.mark.slow
def test_a_resume_goes_on_where_each_set_stopped(corpora):
    """Stopped after iteration 2 and resumed: the passes at 4 read the same samples of each set
    as the uninterrupted run (the checkpoint's consumed-validation count is each set's position)."""
    _, _, records, _ = _sets_run("1rank", corpora)
    tmp, _ = corpora
    _train(corpora, "first", _run_flags(corpora, "first", "--exit-interval", "2"))
    load = ["--load", str(tmp / "first_ckpt"), "--save-interval", str(ITERS)]
    _, resumed = _train(corpora, "second", _run_flags(corpora, "second", *load))
    for name in ("web", "code"):
        key = f"validation-{name}-loss"
        expected = [r[key] for r in records if r["iteration"] == ITERS and key in r]
        got = [r[key] for r in resumed if r["iteration"] == ITERS and key in r]
        assert len(got) == 2 and got == pytest.approx(expected, rel=1e-9)
