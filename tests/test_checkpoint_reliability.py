"""A checkpoint that `--load` would pick is never damaged, and a damaged one is one line.

Real runs of pretrain_gpt.py (one rank, ZeRO-1, dropout on), real files damaged the ways copies
and disks damage them, a real file-size limit (`ulimit -f`, SIGXFSZ ignored) for a full disk.
Which step `--load` picks is checked both through the code's own chooser (fast, many cases) and
through real runs (what a user sees: the warning, the loaded iteration, the losses).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from training_fixtures import (
    PYTHON,
    REPO,
    deepspeed_cmd,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_outputs,
    read_metrics,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

from pretrain.checkpoint import fingerprints
from pretrain.checkpoint.commit import prune_steps
from pretrain.checkpoint.format import FINGERPRINTS_KEY, META_FILE
from pretrain.checkpoint.integrity import choose_checkpoint, manifest
from pretrain.errors import UserError
from pretrain.launch import free_port
from pretrain.training.checkpoints.save_lock import LOCK_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERS = 4
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
RNG = "rng_state_0.pt"
FILE_LIMIT = 64 * 1024  # bytes: above the RNG file and metadata, below the model file


def _flags(corpus: str, iters: int, metrics: Path, *extra: str) -> list[str]:
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    return (
        model_flags("gpt2")
        + dropout
        + train_flags(corpus, iters=iters)
        + layout_flags(1, 1, 1)
        + ["--metrics-file", str(metrics), *extra]
    )


def _one_rank_env() -> dict:
    return clean_env(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """4 iterations, a save after each, --save-total-limit 2: global_step3 and global_step4."""
    tmp = tmp_path_factory.mktemp("reliability")
    corpus = make_corpus(tmp / "corpus")
    ckpt = tmp / "base"
    flags = _flags(corpus, ITERS, tmp / "base.jsonl", "--save", str(ckpt), "--save-interval", "1")
    result = run(
        [PYTHON, str(REPO / "pretrain_gpt.py"), *flags, "--save-total-limit", "2"], timeout=300
    )
    assert result.returncode == 0, result.stdout[-6000:]
    return tmp, corpus, ckpt, result.stdout


def _copy(base, name: str) -> Path:
    tmp, _, ckpt, _ = base
    dst = tmp / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ckpt, dst)
    return dst


def _snapshot(folder: Path) -> dict:
    """name -> (size, mtime_ns, inode) of every file under `folder`: any rewrite changes it.
    DeepSpeed's helper scripts (zero_to_fp32.py ...), which it copies beside the steps at every
    ZeRO save, and the --save lock, which every run holds, belong to no checkpoint and are left
    out."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith("zero_to_") and p.name != LOCK_FILE
    }


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_save_total_limit_keeps_the_newest_complete_steps(base):
    _, _, ckpt, output = base
    steps = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert steps == ["global_step3", "global_step4"]  # no hidden temporaries either
    assert (ckpt / "latest").read_text() == "global_step4"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    for removed in ("global_step1", "global_step2"):
        assert f"removed {ckpt / removed} (--save-total-limit)" in output
    # the metadata lists every file of its step with its size
    meta = json.loads((ckpt / "global_step4" / META_FILE).read_text())
    on_disk = {p.name: p.stat().st_size for p in (ckpt / "global_step4").iterdir()}
    assert meta["files"] == {k: v for k, v in on_disk.items() if k != META_FILE}
    assert {MODEL, OPTIM, RNG} <= set(meta["files"])


def test_prune_never_removes_the_step_latest_names(base):
    ckpt = _copy(base, "prune")
    (ckpt / "latest").write_text("global_step3")  # e.g. after a fallback
    (ckpt / "global_step1").mkdir()  # an incomplete step (no metadata)
    assert prune_steps(str(ckpt), keep=1) == []
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [
        "global_step1",
        "global_step3",
        "global_step4",
    ]
    (ckpt / "latest").write_text("global_step4")
    assert prune_steps(str(ckpt), keep=1) == ["global_step3"]


def _damage_cases():
    step4 = ("global_step4",)
    return {
        "truncated model file": (lambda c: _truncate(c / "global_step4" / MODEL), step4 + (MODEL,)),
        "truncated optimizer file": (lambda c: _truncate(c / "global_step4" / OPTIM), step4 + (OPTIM,)),
        "missing model file": (lambda c: (c / "global_step4" / MODEL).unlink(), step4 + (MODEL,)),
        "missing RNG file": (lambda c: (c / "global_step4" / RNG).unlink(), step4 + (RNG,)),
        "empty metadata": (lambda c: (c / "global_step4" / META_FILE).write_text(""), step4 + (META_FILE,)),
        "broken metadata": (lambda c: (c / "global_step4" / META_FILE).write_text('{"iter'), step4 + (META_FILE,)),
        "metadata without entries": (lambda c: (c / "global_step4" / META_FILE).write_text("[]"), step4 + (META_FILE,)),
        "missing metadata": (lambda c: (c / "global_step4" / META_FILE).unlink(), step4 + (META_FILE,)),
    }  # fmt: skip


@pytest.mark.parametrize("case", sorted(_damage_cases()))
def test_damaged_step_falls_back_to_the_newest_complete_one(base, case):
    ckpt = _copy(base, "damaged")
    damage, named = _damage_cases()[case]
    damage(ckpt)
    choice = choose_checkpoint(str(ckpt))
    assert choice.tag == "global_step3" and choice.meta["iteration"] == 3
    assert "resuming from global_step3, the newest complete step" in choice.note
    for part in named:
        assert part in choice.note, (part, choice.note)


@pytest.mark.parametrize(
    "latest",
    [b"\xff\xfe\x00garbage", b"", b"  \n", b"global_step9", None],
    ids=["non-utf8", "empty", "blank", "names-a-missing-step", "missing"],
)
def test_damaged_or_missing_latest_resumes_from_the_newest_complete_step(base, latest):
    ckpt = _copy(base, "latest")
    if latest is None:
        (ckpt / "latest").unlink()
    else:
        (ckpt / "latest").write_bytes(latest)
    choice = choose_checkpoint(str(ckpt))
    assert choice.tag == "global_step4"
    assert str(ckpt / "latest") in choice.note and "resuming from global_step4" in choice.note


@pytest.mark.parametrize("target", ["../../x", "/etc", "global_step4/../../base", "..", "."])
def test_latest_outside_the_load_folder_is_refused(base, target):
    ckpt = _copy(base, "outside")
    (ckpt / "latest").write_text(target)
    with pytest.raises(UserError, match="refusing to load from outside --load") as err:
        choose_checkpoint(str(ckpt))
    assert str(ckpt / "latest") in str(err.value)


def test_no_complete_step_is_refused_never_a_fresh_start(base):
    ckpt = _copy(base, "nothing")
    (ckpt / "latest").unlink()
    _truncate(ckpt / "global_step4" / MODEL)
    (ckpt / "global_step3" / RNG).unlink()
    with pytest.raises(UserError) as err:
        choose_checkpoint(str(ckpt))
    message = str(err.value)
    assert "\n" not in message and "no complete checkpoint" in message
    assert "global_step3, global_step4" in message and MODEL in message
    assert choose_checkpoint(str(base[0] / "does-not-exist")) is None  # a new folder: fresh


def test_damaged_checkpoint_is_one_line_on_every_rank(base):
    """A real two-rank launch: refused before any process group, one line per rank."""
    tmp, corpus, _, _ = base
    ckpt = _copy(base, "two_ranks")
    shutil.rmtree(ckpt / "global_step3")
    _truncate(ckpt / "global_step4" / OPTIM)
    flags = _flags(corpus, ITERS + 1, tmp / "two.jsonl", "--load", str(ckpt))
    result = run(deepspeed_cmd(2, flags), timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, result.stdout[-4000:]
    assert all(str(ckpt / "global_step4" / OPTIM) in line for line in errors), errors
    assert "Traceback" not in result.stdout


def _multirun(runs: list[list[str]], runs_file: Path, **popen) -> subprocess.CompletedProcess:
    """Several pretrain() runs in one one-rank process (tests/training_multirun.py)."""
    runs_file.write_text(json.dumps(runs))
    cmd = [PYTHON, str(REPO / "tests" / "training_multirun.py"), str(runs_file)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_one_rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(out[-6000:]) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _two_prefixes(flags: list[str], second: str) -> list[str]:
    """`flags` with a second prefix in --data-path (Megatron sizes such a blend exactly)."""
    i = flags.index("--data-path")
    return [*flags[: i + 2], second, *flags[i + 2 :]]


@pytest.fixture(scope="module")
def reruns(base):
    """One process, four runs on copies of the base checkpoint (see the tests below), then a
    two-prefix blend trained to its end and launched again into its own folder (a requeue)."""
    tmp, corpus, _, _ = base
    second, blend_ck = make_corpus(tmp / "corpus2", seed=1), tmp / "blend"
    same = ["--save", str(blend_ck), "--save-interval", "100"]
    blend = _two_prefixes(_flags(corpus, 2, tmp / "b.jsonl", *same), second)
    relaunch, finetune, fallback, no_latest = (
        _copy(base, n) for n in ("relaunch", "finetune", "fallback", "no_latest")
    )
    _truncate(fallback / "global_step4" / MODEL)
    (no_latest / "latest").unlink()
    before = {"relaunch": _snapshot(relaunch), "finetune": _snapshot(finetune)}
    every = ["--save-interval", "1"]
    longer = ["--override-opt_param-scheduler"]  # --train-iters ITERS + 1: the flags' schedule
    runs = [
        _flags(corpus, ITERS, tmp / "r.jsonl", "--load", str(relaunch), "--save", str(relaunch), *every),
        _flags(corpus, ITERS, tmp / "f.jsonl", "--load", str(finetune), "--save", str(finetune), "--save-interval", "100", "--finetune"),
        _flags(corpus, ITERS + 1, tmp / "fallback.jsonl", "--load", str(fallback), "--save", str(fallback), *every, *longer),
        _flags(corpus, ITERS + 1, tmp / "no_latest.jsonl", "--load", str(no_latest), "--save", str(no_latest), *every, *longer),
        blend,
        [*blend, "--load", str(blend_ck)],
    ]  # fmt: skip
    result = _multirun(runs, tmp / "reruns.json")
    assert result.returncode == 0, result.stdout[-8000:]
    return base, result.stdout, before, (relaunch, finetune, fallback, no_latest)


def test_finished_run_launched_again_saves_nothing(reruns):
    _, output, before, (relaunch, *_) = reruns
    assert "nothing to do (and nothing saved)" in multirun_outputs(output)[0]
    assert _snapshot(relaunch) == before["relaunch"]


def test_a_finished_blend_requeued_has_nothing_to_do(reruns):
    """A two-prefix blend's consumed samples are all its train split holds; launched again with
    --load X --save X it says so and succeeds (the launch's exit status 0: the fixture), where
    the sampler refused to start after the last sample before."""
    _, output, _, _ = reruns
    again = multirun_outputs(output)[-1]
    assert "checkpoint is at iteration 2 >= --train-iters 2: nothing to do" in again, again[-3000:]
    assert "error:" not in again


def test_finetune_into_its_own_folder_keeps_the_step_latest_names(reruns):
    _, output, before, (_, finetune, *_) = reruns
    assert (
        f"not saving iteration {ITERS}: {finetune / 'global_step4'} is the complete checkpoint `latest` names"
        in output
    )
    assert _snapshot(finetune) == before["finetune"]


def test_load_falls_back_and_resumes_exactly(reruns):
    (tmp, _, _, _), output, _, (_, _, fallback, no_latest) = reruns
    reference = read_metrics(tmp / "base.jsonl")
    assert (
        f"WARNING: --load {fallback}: {fallback / 'latest'} names global_step4, but "
        f"{fallback / 'global_step4' / MODEL} has" in output
    )
    assert (
        f"WARNING: --load {no_latest}: no {no_latest / 'latest'} file: resuming from global_step4"
        in output
    )
    resumed = read_metrics(tmp / "fallback.jsonl")
    assert sorted(resumed) == [4, 5]
    assert resumed[4]["lm-loss"] == reference[4]["lm-loss"]  # bit for bit, from global_step3
    assert (fallback / "latest").read_text() == "global_step5"
    # the damaged step 4 (not what --load would pick) was replaced by a complete one
    assert choose_checkpoint(str(fallback)).note is None
    assert choose_checkpoint(str(no_latest)).tag == "global_step5"


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def test_full_disk(base):
    """Under `ulimit -f`: a finished run launched again succeeds without writing; a save that
    does not fit is one line naming the file and the bytes, the previous checkpoint intact."""
    tmp, corpus, _, _ = base
    ckpt = _copy(base, "full")
    before = _snapshot(ckpt)
    same = ["--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1"]
    runs = [
        _flags(corpus, ITERS, tmp / "full_a.jsonl", *same),
        _flags(corpus, ITERS + 1, tmp / "full_b.jsonl", *same, "--override-opt_param-scheduler"),
    ]
    result = _multirun(runs, tmp / "full.json", preexec_fn=_limit_file_size)
    assert result.returncode == 2, result.stdout[-6000:]
    assert "nothing to do" in result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stdout, result.stdout[-6000:]
    assert MODEL in errors[0] and "File too large" in errors[0]
    assert "needs about" in errors[0] and "bytes" in errors[0]
    assert _snapshot(ckpt) == before  # nothing left behind, nothing touched
    choice = choose_checkpoint(str(ckpt))
    assert choice.tag == "global_step4" and choice.note is None


def _with_nan(path: Path, edit) -> None:
    """Put a NaN into a saved file and update the metadata's sizes and fingerprints, as a
    diverged run's own save would look."""
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)
    meta_path = path.parent / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["files"] = {k: v for k, v in manifest(str(path.parent)).items() if k != META_FILE}
    meta[FINGERPRINTS_KEY] = fingerprints.record(str(path.parent), meta["files"])
    meta_path.write_text(json.dumps(meta))


def _nan_weight(state):
    state["module"]["layers.1.mlp.fc2.weight"][0, 0] = float("nan")


def _nan_moment(state):
    state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"][7] = float("nan")


@pytest.mark.parametrize(
    "edit,file,named",
    [
        (_nan_weight, MODEL, "weights layers.1.mlp.fc2.weight"),
        (_nan_moment, OPTIM, "partition0.exp_avg"),
    ],
    ids=["weights", "optimizer"],
)
def test_non_finite_checkpoint_is_refused(base, edit, file, named):
    tmp, corpus, _, _ = base
    ckpt = _copy(base, "nan")
    _with_nan(ckpt / "global_step4" / file, edit)
    flags = _flags(corpus, ITERS + 1, tmp / "nan.jsonl", "--load", str(ckpt))
    result = run([PYTHON, str(REPO / "pretrain_gpt.py"), *flags], timeout=300, env=_one_rank_env())
    assert result.returncode == 2, result.stdout[-6000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stdout
    assert "non-finite values (NaN/Inf)" in errors[0] and named in errors[0], errors[0]


@pytest.fixture(scope="module")
def convert_to_hf():
    from convert_fixtures import load_tool

    return load_tool("convert_to_hf")


@pytest.mark.parametrize("where", ["equal", "inside", "containing"])
def test_convert_overwrite_never_deletes_the_checkpoint(base, convert_to_hf, where):
    ckpt = _copy(base, "export_into")
    before = _snapshot(ckpt)
    out = {"equal": ckpt, "inside": ckpt / "global_step4", "containing": ckpt.parent}[where]
    with pytest.raises(UserError, match=r"(is|holds) --load|part of the checkpoint") as err:
        convert_to_hf.main(["--load", str(ckpt), "--output-dir", str(out), "--overwrite"])
    assert "\n" not in str(err.value)
    assert _snapshot(ckpt) == before


def test_convert_refuses_non_finite_weights_without_verify(base, convert_to_hf):
    tmp = base[0]
    ckpt = _copy(base, "export_nan")
    _with_nan(ckpt / "global_step4" / MODEL, _nan_weight)
    with pytest.raises(UserError, match="non-finite") as err:
        convert_to_hf.main(["--load", str(ckpt), "--output-dir", str(tmp / "hf_nan")])
    assert "layers.1.mlp.fc2.weight" in str(err.value)
    assert not (tmp / "hf_nan").exists()
