"""`--load` loads what you meant: a step folder is that step; a file, a Hugging Face export, a
path that does not exist or a folder without a checkpoint (either not --save) is one line;
another tokenizer is refused; other data is said; a file copied in from another step is refused
by name: by its fingerprint (any file, DeepSpeed's ZeRO optimizer shard and DCP's files included,
at resume and in the tools), or, in a checkpoint from before fingerprints, by the position it
records; such a checkpoint still resumes.

Real runs of pretrain_gpt.py at one rank (ZeRO-1, dropout 0; and the torch backend), real
checkpoint files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizer_fixtures import MERGES, VOCAB
from training_fixtures import (
    PYTHON,
    REPO,
    checkpointed_model,
    layout_flags,
    make_corpus,
    megatron_loss,
    model_flags,
    multirun_outputs,
    one_rank_multirun,
    read_metrics,
    run,
    token_losses,
    train_flags,
    training_batch,
)

from pretrain.checkpoint.format import FINGERPRINTS_KEY, META_FILE, read_meta
from pretrain.checkpoint.relayout import TargetLayout, reshard
from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.errors import UserError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ITERS = 4
MODEL = "mp_rank_00_model_states.pt"
RNG = "rng_state_0.pt"
FULL = "full_state_tp00_pp00.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
DCP = (".metadata", "__0_0.distcp")


def _flags(corpus: str, iters: int, metrics: Path, *extra: str) -> list[str]:
    return (
        model_flags("gpt2")
        + train_flags(corpus, iters=iters)
        + layout_flags(1, 1, 1)
        + ["--metrics-file", str(metrics), *extra]
    )


def _torch_flags(corpus: str, metrics: Path, *extra: str) -> list[str]:
    """A one-rank torch-backend (--use-torch-fsdp2: DCP checkpoints) run of ITERS iterations."""
    flags = model_flags("gpt2") + train_flags(corpus, iters=ITERS)
    return flags + ["--use-torch-fsdp2", "--metrics-file", str(metrics), *extra]


def _train(flags: list[str], timeout: float = 400):
    return run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=timeout)


def _one_error(result) -> str:
    """The single `error:` line of a refused run (exit 2, no traceback)."""
    assert result.returncode == 2, result.stdout[-4000:]
    return _one_error_line(result.stdout)


def _one_error_line(output: str) -> str:
    """The single `error:` line of a refused run's output, which holds no traceback."""
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    return errors[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One process: 4 iterations saved at 2 and 4 (tmp/base: global_step2, global_step4), the
    same on the torch backend (tmp/torch), and a checkpoint trained with the GPT-2 tokenizer
    (50257 ids) for 2 iterations (tmp/gpt2)."""
    tmp = tmp_path_factory.mktemp("load_intent")
    corpus = make_corpus(tmp / "corpus")
    ckpt = tmp / "base"
    runs = [
        _flags(corpus, ITERS, tmp / "base.jsonl", "--save", str(ckpt), "--save-interval", "2"),
        _gpt2_flags(corpus, 2, tmp / "gpt2.jsonl")
        + ["--save", str(tmp / "gpt2"), "--save-interval", "2"],
        _torch_flags(
            corpus, tmp / "torch.jsonl", "--save", str(tmp / "torch"), "--save-interval", "2"
        ),
    ]
    result = one_rank_multirun(runs, tmp / "base.json", timeout=600)
    assert result.returncode == 0, result.stdout[-6000:]
    return tmp, corpus, ckpt


def _copy(base, name: str, source: str = "base") -> Path:
    """A copy of the base checkpoint tmp/`source` (or of the torch backend's: "torch")."""
    tmp = base[0]
    dst = tmp / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(tmp / source, dst)
    return dst


def _without_fingerprints(step: Path) -> None:
    """`step` as a checkpoint written before file fingerprints: none in its metadata."""
    meta = json.loads((step / META_FILE).read_text())
    del meta[FINGERPRINTS_KEY]
    (step / META_FILE).write_text(json.dumps(meta))


def _step_folder(base) -> tuple[list[str], Path, Path]:
    """(the flags of a run loading a copy's global_step2 folder, as written before file
    fingerprints; the copy; its step folder)."""
    tmp, corpus, _ = base
    ckpt = _copy(base, "step_folder")
    step = ckpt / "global_step2"
    _without_fingerprints(step)
    load = ["--load", str(step), "--save", str(tmp / "sf"), "--save-interval", "2"]
    return _flags(corpus, ITERS, tmp / "step_folder.jsonl", *load), ckpt, step


def test_a_step_folder_resumes_that_step(base, runs):
    """...even one written before file fingerprints (older checkpoints keep loading)."""
    tmp = base[0]
    output, ckpt, step = runs["step_folder"]
    assert FINGERPRINTS_KEY in read_meta(str(base[2] / "global_step2"))  # what was taken out
    assert FINGERPRINTS_KEY not in read_meta(str(step))
    assert (
        f"--load {step}: a step folder: resuming exactly global_step2 "
        f"({ckpt / 'latest'} names global_step4)" in output
    )
    assert "data differs" not in output and "trained with" not in output
    resumed, reference = read_metrics(tmp / "step_folder.jsonl"), read_metrics(tmp / "base.jsonl")
    assert sorted(resumed) == [3, 4]  # not a fresh start at 1
    assert resumed[3]["lm-loss"] == reference[3]["lm-loss"]


def _hf_export(folder: Path) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)


NOT_A_CHECKPOINT = {
    "file": ["is a file; --load takes a checkpoint folder"],
    "hf_export": ["is a Hugging Face model folder", "tools/convert_from_hf.py --load"],
    "empty": ["holds no checkpoint", "is not the --save folder", "drop --load"],
    "missing": [
        "does not exist: check the path",
        "drop --load",
        "same folder to --load and --save",
    ],
    "incomplete_step": ["this step folder is not a complete checkpoint", MODEL],
}


def _not_a_checkpoint(base, case: str) -> tuple[list[str], Path, Path]:
    """(the flags of a run loading the `case` of NOT_A_CHECKPOINT; that target; its --save)."""
    tmp, corpus, _ = base
    target = tmp / f"not_{case}"
    shutil.rmtree(target, ignore_errors=True)
    if target.exists():
        target.unlink()
    if case == "file":
        target.write_bytes((base[2] / "global_step2" / MODEL).read_bytes())
    elif case == "hf_export":
        _hf_export(target)
    elif case == "empty":
        target.mkdir()
    elif case == "missing":
        pass  # a typo: the path is not there at all
    else:
        shutil.copytree(base[2] / "global_step2", target)
        (target / MODEL).unlink()
    save = tmp / f"save_{case}"
    load = ["--load", str(target), "--save", str(save), "--save-interval", "1"]
    return _flags(corpus, 2, tmp / "x.jsonl", *load), target, save


@pytest.mark.parametrize("case", sorted(NOT_A_CHECKPOINT))
def test_what_is_not_a_checkpoint_is_one_line(runs, case):
    """Each of these started from scratch before (exit 0, a warning)."""
    output, target, save = runs[f"not_{case}"]
    line = _one_error_line(output)
    assert f"--load {target}" in line and all(w in line for w in NOT_A_CHECKPOINT[case]), line
    assert not list(save.glob("global_step*"))


def _requeue(base) -> tuple[list[str], list[str]]:
    """The requeue idiom: the same command (--load = --save) launched twice, the first time with
    the folder spelled `X/` for --load (it does not exist yet); the second run (a longer
    --train-iters lengthens the default decay span: the flags' schedule, explicitly)."""
    tmp, corpus, _ = base
    folder = tmp / "requeue"
    shutil.rmtree(folder, ignore_errors=True)
    same = ["--load", str(folder), "--save", str(folder), "--save-interval", "1"]
    first = _flags(corpus, 2, tmp / "requeue.jsonl", *same)
    first[first.index("--load") + 1] = f"{folder}/"
    return first, _flags(corpus, 3, tmp / "requeue.jsonl", *same, "--override-opt_param-scheduler")


def test_a_new_or_empty_load_that_is_save_starts_fresh_and_then_resumes(base, runs):
    """The requeue idiom: the same command (--load = --save) launched again and again."""
    tmp = base[0]
    folder = tmp / "requeue"
    (first,), (second,) = runs["requeue_first"], runs["requeue_second"]
    assert (
        f"--load {folder}/: no checkpoint there (yet); starting from scratch: the first launch of a job that "
        f"resumes itself" in first
    )
    assert sorted(read_metrics(tmp / "requeue.jsonl")) == [1, 2, 3]
    assert "loaded checkpoint" in second and "starting from scratch" not in second


def _gpt2_flags(corpus: str, iters: int, metrics: Path) -> list[str]:
    flags = _flags(corpus, iters, metrics)
    at = flags.index("--tokenizer-type")
    flags[at : at + 4] = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        VOCAB,
        "--merge-file",
        MERGES,
    ]
    return flags


def _null_on_gpt2(base) -> list[str]:
    """The flags of a run loading the GPT-2-tokenizer checkpoint with NullTokenizer --vocab-size
    50256: GPT-2's 50257 ids, the same shapes, other tokens."""
    tmp, corpus, _ = base
    null = _flags(corpus, 3, tmp / "null.jsonl", "--load", str(tmp / "gpt2"))
    at = null.index("--vocab-size")
    null[at + 1] = "50256"
    return null


def test_another_tokenizer_is_refused(base, runs):
    """NullTokenizer --vocab-size 50256 has GPT-2's 50257 ids: the same shapes, other tokens.
    The refusal runs through pretrain_gpt.py itself (exit status 2)."""
    tmp = base[0]
    gpt2_checkpoint = tmp / "gpt2"
    line = _one_error(_train(_null_on_gpt2(base)))
    assert f"--load {gpt2_checkpoint}: the checkpoint was trained with GPT2BPETokenizer" in line
    assert "this run uses NullTokenizer" in line and "--allow-tokenizer-mismatch" in line
    assert f"--tokenizer-type GPT2BPETokenizer --vocab-file {VOCAB}" in line
    # one iteration more than saved (a longer decay span): name the schedule, as Megatron asks
    (allowed,) = runs["null_allowed"]
    assert "continuing (--allow-tokenizer-mismatch)" in allowed
    assert sorted(read_metrics(tmp / "null.jsonl")) == [3]


def _latest_step2(ckpt: Path) -> Path:
    """`ckpt` with `latest` naming global_step2 (what --load resumes), global_step4 kept."""
    (ckpt / "latest").write_text("global_step2")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    return ckpt


def _other_data(base) -> tuple[list[str], list[str], str]:
    """(the flags of a run loading global_step2 of a copy with other data and --seq-length 8;
    those flags without --load; the other data's prefix)."""
    tmp = base[0]
    load = _latest_step2(_copy(base, "other_data"))
    other = make_corpus(tmp / "other_corpus", num_docs=150, seed=5)
    change = ["--seq-length", "8", "--max-position-embeddings", "16"]
    flags = _flags(other, ITERS, tmp / "other.jsonl", *change)
    return flags + ["--load", str(load)], flags, other


def test_other_data_and_sequence_length_are_said_and_continue_at_the_consumed_samples(base, runs):
    """Continued pretraining on other data: allowed, one line; the run reads the new data's
    order from the consumed-samples position (checked against the checkpoint's own model)."""
    tmp, _, ckpt = base
    output, flags, other = runs["other_data"]
    lines = [line for line in output.splitlines() if "this run's data differs" in line]
    assert len(lines) == 1, output[-6000:]
    assert (
        str(tmp / "corpus") in lines[0]
        and other in lines[0]
        and "--seq-length: 16 -> 8" in lines[0]
    )
    assert "continues at its sample 16 (the consumed-samples count)" in lines[0]
    resumed = read_metrics(tmp / "other.jsonl")
    assert sorted(resumed) == [3, 4]
    per_token, mask = token_losses(checkpointed_model(str(ckpt), 2), training_batch(flags, 3))
    assert resumed[3]["lm-loss"] == pytest.approx(megatron_loss(per_token, mask, 2), rel=1e-5)


def _copy_in(ckpt: Path, names) -> None:
    """global_step4's `names` copied over global_step2's (the file list updated to their sizes,
    as a copy of both would be)."""
    meta_path = ckpt / "global_step2" / META_FILE
    meta = json.loads(meta_path.read_text())
    for name in names:
        shutil.copyfile(ckpt / "global_step4" / name, ckpt / "global_step2" / name)
        meta["files"][name] = (ckpt / "global_step2" / name).stat().st_size
    meta_path.write_text(json.dumps(meta))


FROM_ANOTHER_STEP = {
    FULL: ["--zero-stage", "0"],  # another layout: resumes through the full state
    MODEL: [],
    RNG: [],
}


def _mixed_step(base, name: str) -> tuple[list[str], Path]:
    """(the flags of a run loading global_step2, written before file fingerprints, with
    global_step4's `name` copied in; the step)."""
    tmp, corpus, _ = base
    ckpt = _latest_step2(_copy(base, f"mixed_{name}"))
    _copy_in(ckpt, [name])
    _without_fingerprints(ckpt / "global_step2")
    flags = _flags(corpus, ITERS, tmp / "mixed.jsonl", "--load", str(ckpt))
    return flags + FROM_ANOTHER_STEP[name], ckpt / "global_step2"


@pytest.mark.parametrize("name", sorted(FROM_ANOTHER_STEP))
def test_a_file_from_another_step_is_refused_by_name(runs, name):
    """In a checkpoint from before file fingerprints, by the position the file records."""
    output, step = runs[f"mixed_{name}"]
    line = _one_error_line(output)
    assert f"{step / name}: holds iteration 4 (32 consumed samples)" in line, line
    assert f"{step / META_FILE} says iteration 2 (16 consumed samples)" in line


# files that record no position: copied from global_step4 into global_step2 -> (the base
# checkpoint, the files)
COPIED_IN = {"zero_optimizer": ("base", (OPTIM,)), "dcp": ("torch", DCP)}


def _copied_in(base, case: str) -> tuple[list[str], Path, tuple[str, ...]]:
    """(the flags of a run loading global_step2 with COPIED_IN[case]'s files of global_step4
    copied in; the step; those files)."""
    tmp, corpus, _ = base
    source, names = COPIED_IN[case]
    ckpt = _latest_step2(_copy(base, f"copied_{case}", source))
    sizes = {
        s: [(ckpt / s / n).stat().st_size for n in names] for s in ("global_step2", "global_step4")
    }
    assert sizes["global_step2"] == sizes["global_step4"]  # the completeness check cannot see it
    _copy_in(ckpt, names)
    load = ["--load", str(ckpt)]
    metrics = tmp / "copied.jsonl"
    flags = (
        _torch_flags(corpus, metrics, *load)
        if source == "torch"
        else _flags(corpus, ITERS, metrics, *load)
    )
    return flags, ckpt / "global_step2", names


def _fingerprint_refusal(line: str, step: Path, names, source: Path) -> None:
    """`line` names one of `names` in `step` as not this step's file, and that file's bytes are
    indeed not the ones `source` (the uncopied step) holds."""
    named = [n for n in names if f"{step / n}: not the file this step saved" in line]
    assert len(named) == 1, line
    assert f"differs from the one {step / META_FILE} recorded" in line, line
    assert "copied in from another step" in line and "put back this step's own file" in line
    assert (step / named[0]).read_bytes() != (source / named[0]).read_bytes()


@pytest.mark.parametrize("case", sorted(COPIED_IN))
def test_a_copied_in_file_is_refused_by_its_fingerprint(base, runs, case):
    """DeepSpeed's ZeRO optimizer shard, DCP's `.metadata` + `__0_0.distcp`: same names, same
    sizes, no position of their own; refused before anything is loaded."""
    output, step, names = runs[f"copied_{case}"]
    source = base[0] / COPIED_IN[case][0] / "global_step2"
    _fingerprint_refusal(_one_error_line(output), step, names, source)


def _reshard(step: Path, out: Path) -> None:
    reshard(str(step), read_meta(str(step)), str(out), TargetLayout(tensor_parallel_size=1))


# tools/convert_to_hf.py's reader and tools/reshard_checkpoint.py's reshard
TOOLS = {"zero_optimizer": lambda step, _out: read_checkpoint(str(step)), "dcp": _reshard}


@pytest.mark.parametrize("case", sorted(TOOLS))
def test_the_tools_refuse_a_copied_in_file(base, runs, tmp_path, case):
    """On the steps above, before reading a tensor or writing anything."""
    _, step, names = runs[f"copied_{case}"]
    with pytest.raises(UserError) as refused:
        TOOLS[case](step, tmp_path / "out")
    source = base[0] / COPIED_IN[case][0] / "global_step2"
    _fingerprint_refusal(str(refused.value), step, names, source)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def runs(base):
    """Every run above but the base runs and the real refusal, one after another in one one-rank
    process (a refused run must stop with a UserError; the exit status of a refusal is
    test_another_tokenizer_is_refused's): case -> (that run's output, what its test checks it
    against)."""
    tmp = base[0]
    first, second = _requeue(base)
    allowed = _null_on_gpt2(base) + ["--allow-tokenizer-mismatch", "--override-opt_param-scheduler"]
    cases = {
        "step_folder": _step_folder(base),
        "requeue_first": (first,),
        "requeue_second": (second,),
        "null_allowed": (allowed,),
        "other_data": _other_data(base),
    }
    refused = {f"not_{case}": _not_a_checkpoint(base, case) for case in NOT_A_CHECKPOINT}
    refused |= {f"mixed_{name}": _mixed_step(base, name) for name in FROM_ANOTHER_STEP}
    refused |= {f"copied_{case}": _copied_in(base, case) for case in COPIED_IN}
    entries = [argv for argv, *_ in cases.values()]
    entries += [{"argv": argv, "refused": True} for argv, *_ in refused.values()]
    result = one_rank_multirun(entries, tmp / "runs.json", timeout=900)
    assert result.returncode == 0, result.stdout[-6000:]
    outputs = multirun_outputs(result.stdout)
    cases |= refused
    assert len(outputs) == len(cases), result.stdout[-6000:]
    return {
        case: (out, *rest) for (case, (_, *rest)), out in zip(cases.items(), outputs, strict=True)
    }
