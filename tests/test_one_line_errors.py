"""Bad input that used to end in a traceback (a ZeroDivisionError, a DeepSpeed assertion, a
TypeError, an IndexError at the first forward) is one `error:` line, exit status 2, through the
real entry points: integer flags below their bound, float flags that are not finite or below
their bound, a spike policy without the spike check, entries of the wrong JSON type in a
checkpoint's pretrain_meta.json or in a data sidecar PREFIX.json, and a sidecar that no longer
describes its .bin/.idx (they were replaced after preprocessing).

The refused training runs run one after another in one process (tests/training_multirun.py: each
must stop with a UserError, its line printed as pretrain_gpt.py prints it); a flag and a
checkpoint case also run through pretrain_gpt.py itself, for its exit status."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from training_fixtures import (
    PYTHON,
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_outputs,
    one_rank_multirun,
    run,
    train_flags,
)
from training_fixtures import test_env as clean_env

pytestmark = [pytest.mark.timeout(600)]


def _one_error_line(cmd: list[str]) -> str:
    """Run `cmd`; it must exit 2 with exactly one `error:` line and no traceback. The line."""
    proc = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1, (
        proc.returncode,
        proc.stdout[-2000:],
        proc.stderr[-3000:],
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    return lines[0]


def _the_error_line(output: str) -> str:
    """The one `error:` line of a refused run's output, which holds no traceback."""
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in output, output[-3000:]
    return lines[0]


def _train(*flags: str) -> list[str]:
    return [PYTHON, str(REPO / "pretrain_gpt.py"), *flags]


def _with(flags: list[str], flag: str, value: str) -> list[str]:
    out = list(flags)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A corpus, the flags of a two-iteration run on it, and that run's checkpoint (one step)."""
    tmp = tmp_path_factory.mktemp("errors")
    corpus = make_corpus(tmp / "corpus")
    flags = model_flags("gpt2") + train_flags(corpus, iters=2) + layout_flags(1, 1, 0)
    ckpt = tmp / "ckpt"
    result = run(_train(*flags, "--save", str(ckpt), "--save-interval", "2"), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return tmp, flags, ckpt


# flag, value, words of the line (today: ZeroDivisionError, DeepSpeed's assertion, a
# RuntimeError in the evaluation, or a run that silently logs every iteration)
FLAGS = [
    ("--micro-batch-size", "0", "--micro-batch-size 0: must be >= 1"),
    ("--micro-batch-size", "-2", "--micro-batch-size -2: must be >= 1"),
    ("--log-interval", "0", "--log-interval 0: must be >= 1"),
    ("--log-interval", "-1", "--log-interval -1: must be >= 1"),
    ("--tensorboard-log-interval", "0", "--tensorboard-log-interval 0: must be >= 1"),
    ("--exit-interval", "-1", "--exit-interval -1: must be >= 0"),
    ("--make-vocab-size-divisible-by", "0", "--make-vocab-size-divisible-by 0: must be >= 1"),
    ("--eval-iters", "-1", "--eval-iters -1: must be >= 0"),
    # a traceback (numpy's seed, the expert weights' shape, the optimizer's nan check)
    ("--seed", "-1", "--seed -1: must be >= 0"),
    ("--seed", "4294967296", "--seed 4294967296: must be <= 2147483647"),
    ("--moe-ffn-hidden-size", "0", "--moe-ffn-hidden-size 0: must be >= 1"),
    ("--moe-ffn-hidden-size", "-5", "--moe-ffn-hidden-size -5: must be >= 1"),
    ("--lr", "nan", "--lr nan: must be a finite number >= 0"),
    ("--weight-decay", "nan", "--weight-decay nan: must be a finite number >= 0"),
    # reported as a --min-lr error, or accepted and meaning nothing: a negative clip was
    # clipping off, an infinite factor no spike ever, a policy without the check no check
    ("--lr", "-1", "--lr -1.0: must be a finite number >= 0 (the peak learning rate)"),
    ("--clip-grad", "-1", "--clip-grad -1.0: must be a finite number >= 0"),
    ("--spiky-loss-factor", "inf", "--spiky-loss-factor inf: must be a finite number > 0"),
    ("--spiky-loss-policy", "skip", "--spiky-loss-policy skip needs --check-for-spiky-loss"),
]
# flags a case needs besides its own
FLAG_CONTEXT = {"--spiky-loss-factor": ["--check-for-spiky-loss"]}


FLAG_IDS = [f"{f}={v}" for f, v, _ in FLAGS]


@pytest.mark.parametrize(("flag", "value", "words"), FLAGS, ids=FLAG_IDS)
def test_flags_outside_their_range(refused, flag, value, words):
    output, _ = refused[f"{flag}={value}"]
    assert words in _the_error_line(output)


def test_exit_interval_zero_means_no_exit_interval_as_in_megatron(tiny):
    """Megatron-LM reads `--exit-interval 0` as unset (before: ZeroDivisionError at iteration 1)."""
    _, flags, _ = tiny
    result = run(_train(*flags, "--exit-interval", "0"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " iteration        2/       2 |" in result.stdout, result.stdout[-3000:]
    assert "exiting after iteration" not in result.stdout


# an entry of pretrain_meta.json -> a value of the wrong type, the words of the line (today: a
# TypeError inside the layout or model check, or a refusal that misreads the value)
META = [
    ("model", [], "entry model is [], not an object"),
    ("parallel", 5, "entry parallel is 5, not an object"),
    ("parallel.zero_stage", "0", 'entry parallel.zero_stage is "0", not an integer'),
    ("model.num_layers", "2", 'entry model.num_layers is "2", not an integer'),
    ("padded_vocab_size", "128", 'entry padded_vocab_size is "128", not an integer'),
]


def _set(tree: dict, dotted: str, value) -> None:
    *outer, last = dotted.split(".")
    for key in outer:
        tree = tree[key]
    tree[last] = value


META_IDS = [m[0] for m in META]


def _bad_meta(tiny, tmp: Path, entry: str, value) -> tuple[list[str], Path]:
    """(the flags of a resume from a copy of the checkpoint whose pretrain_meta.json has `value`
    at `entry`; that file)."""
    _, flags, ckpt = tiny
    load = tmp / "ckpt"
    shutil.copytree(ckpt, load)
    path = load / "global_step2" / "pretrain_meta.json"
    meta = json.loads(path.read_text())
    _set(meta, entry, value)
    path.write_text(json.dumps(meta))
    return [*_with(flags, "--train-iters", "3"), "--load", str(load)], path


@pytest.mark.parametrize(("entry", "value", "words"), META, ids=META_IDS)
def test_wrong_json_types_in_the_checkpoint_metadata(refused, entry, value, words):
    output, path = refused[entry]
    line = _the_error_line(output)
    assert f"{path}: {words}" in line and "--load" in line, line


def _jsonl(path: Path, docs: int, top: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = [
        " ".join(str(rng.randrange(top)) for _ in range(rng.randrange(5, 40))) for _ in range(docs)
    ]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return str(path)


def _preprocess(src: str, prefix: Path, vocab: int) -> str:
    cmd = [
        PYTHON,
        str(REPO / "tools" / "preprocess_data.py"),
        "--input",
        src,
        "--output-prefix",
        str(prefix),
    ]
    cmd += [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab),
        "--append-eod",
        "--workers",
        "1",
    ]
    result = run(cmd, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    return f"{prefix}_text_document"


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
    """Two preprocessed datasets with sidecars: ids < 100 (the run's vocabulary) and ids < 900."""
    tmp = tmp_path_factory.mktemp("sidecar")
    small = _preprocess(_jsonl(tmp / "a.jsonl", 60, 100, 0), tmp / "a", 100)
    large = _preprocess(_jsonl(tmp / "b.jsonl", 50, 900, 1), tmp / "b", 1000)
    return tmp, small, large


def _copy(prefix: str, to: Path) -> str:
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(prefix + ext, str(to) + ext)
    return str(to)


def _on_data(tiny, prefix: str) -> list[str]:
    _, flags, _ = tiny
    return [*_with(flags, "--data-path", prefix), "--split", "100,0,0"]


SIDECAR = [
    ("tokenizer", "NullTokenizer", 'entry tokenizer is "NullTokenizer", not an object'),
    ("max_token_id", [100], "entry max_token_id is [100], not an integer"),
    ("max_token_id", None, "entry max_token_id is null, not an integer"),
    ("tokenizer.sha256", 7, "entry tokenizer.sha256 is 7, not a string"),
]
SIDECAR_IDS = [f"{s[0]}={s[1]}" for s in SIDECAR]


def _bad_sidecar(tiny, preprocessed, tmp: Path, entry: str, value) -> tuple[list[str], str]:
    """(the flags of a run on a copy of the small dataset whose sidecar has `value` at `entry`;
    the copy's prefix)."""
    _, small, _ = preprocessed
    prefix = _copy(small, tmp / "data")
    sidecar = json.loads(Path(prefix + ".json").read_text())
    _set(sidecar, entry, value)
    Path(prefix + ".json").write_text(json.dumps(sidecar))
    return _on_data(tiny, prefix), prefix


@pytest.mark.parametrize(("entry", "value", "words"), SIDECAR, ids=SIDECAR_IDS)
def test_wrong_json_types_in_a_data_sidecar(refused, entry, value, words):
    output, prefix = refused[f"{entry}={value}"]
    assert f"{prefix}.json: {words}" in _the_error_line(output)


def test_merge_refuses_a_sidecar_of_the_wrong_type(preprocessed, tmp_path):
    _, small, _ = preprocessed
    prefix = _copy(small, tmp_path / "data")
    Path(prefix + ".json").write_text(
        json.dumps({"format": "pretrain-data-fingerprint/1", "tokenizer": []})
    )
    cmd = [PYTHON, str(REPO / "tools" / "merge_datasets.py"), "--prefixes", prefix, small]
    line = _one_error_line(cmd + ["--output-prefix", str(tmp_path / "merged")])
    assert f"{prefix}.json: entry tokenizer is [], not an object" in line


def _replaced_data(tiny, preprocessed, tmp: Path) -> tuple[list[str], str]:
    """(the flags of a run on a copy of the small dataset whose .bin/.idx are the large one's,
    its sidecar kept; the copy's prefix)."""
    _, small, large = preprocessed
    prefix = _copy(small, tmp / "data")
    for ext in (".bin", ".idx"):
        shutil.copy(large + ext, prefix + ext)
    return _on_data(tiny, prefix), prefix


def test_a_sidecar_of_replaced_data_is_refused_at_start_up(refused):
    """The .bin/.idx of the first dataset replaced by the second's (ids up to 899), its sidecar
    kept (largest id 100, which fits the vocabulary): today the check trusts the sidecar and
    the first forward fails with an IndexError in the embedding."""
    output, prefix = refused["replaced"]
    line = _the_error_line(output)
    assert f"{prefix}.json: records documents 60, but {prefix}.idx has 50" in line, line
    assert f"delete {prefix}.json" in line and "preprocess_data.py" in line, line


@pytest.fixture(scope="module")
def refused(tiny, preprocessed, tmp_path_factory) -> dict[str, tuple[str, object]]:
    """Every refused training run above in one one-rank process: case id -> (the run's output,
    the file or prefix its line names). The multirun checks that each stopped with a UserError."""
    tmp = tmp_path_factory.mktemp("refused")
    cases = {
        case: (_with(tiny[1] + FLAG_CONTEXT.get(flag, []), flag, value), None)
        for case, (flag, value, _) in zip(FLAG_IDS, FLAGS, strict=True)
    }
    for case, (entry, value, _) in zip(META_IDS, META, strict=True):
        cases[case] = _bad_meta(tiny, _folder(tmp, case), entry, value)
    for case, (entry, value, _) in zip(SIDECAR_IDS, SIDECAR, strict=True):
        cases[case] = _bad_sidecar(tiny, preprocessed, _folder(tmp, case), entry, value)
    cases["replaced"] = _replaced_data(tiny, preprocessed, _folder(tmp, "replaced"))
    runs = [{"argv": argv, "refused": True} for argv, _ in cases.values()]
    result = one_rank_multirun(runs, tmp / "runs.json", timeout=600)
    assert result.returncode == 0, result.stdout[-6000:]
    outputs = multirun_outputs(result.stdout)
    assert len(outputs) == len(cases), result.stdout[-6000:]
    return {
        case: (output, named)
        for (case, (_, named)), output in zip(cases.items(), outputs, strict=True)
    }


def _folder(tmp: Path, case: str) -> Path:
    """A new folder of its own for `case` under `tmp`."""
    return Path(tempfile.mkdtemp(prefix="case-", dir=tmp))


@pytest.mark.parametrize("case", ["flag", "meta"])
def test_pretrain_gpt_ends_a_refused_run_with_exit_status_2(tiny, tmp_path, case):
    """Through pretrain_gpt.py itself: a bad flag (refused while parsing) and a bad checkpoint
    (refused after start-up) end with exit status 2 and the one line."""
    if case == "flag":
        line = _one_error_line(_train(*_with(tiny[1], "--micro-batch-size", "0")))
        assert "--micro-batch-size 0: must be >= 1" in line
    else:
        argv, path = _bad_meta(tiny, tmp_path, "model", [])
        line = _one_error_line(_train(*argv))
        assert f"{path}: entry model is [], not an object" in line and "--load" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_bad_command_line_is_said_once_by_a_two_rank_launch(tmp_path, launcher):
    """Both ranks parse the same flags and fail alike; the job prints the line once (both ranks
    printed it before), and still fails."""
    from training_fixtures import deepspeed_cmd, torchrun_cmd

    corpus = make_corpus(tmp_path / "corpus")
    flags = model_flags("gpt2") + train_flags(corpus, iters=2) + layout_flags(1, 1, 0)
    launch = torchrun_cmd if launcher == "torchrun" else deepspeed_cmd
    result = run(launch(2, flags + ["--data-path", str(tmp_path / "missing")]), timeout=300)
    lines = [line for line in result.stdout.splitlines() if "error: " in line]
    assert result.returncode != 0 and "missing.bin does not exist" in result.stdout, result.stdout
    assert len([line for line in lines if "missing.bin" in line]) == 1, result.stdout[-4000:]


@pytest.mark.slow
def test_the_line_is_said_when_a_silent_rank_fails_first(tmp_path):
    """The same under torchrun with the first rank (the one that prints) started 5 s late: the
    silent rank fails first, and torchrun ends every rank once one has failed; the silent rank
    waits (SILENT_EXIT_DELAY_SECONDS) until the first rank has said it. Before, the line was lost
    (seen under load with `accelerate launch`: `exitcode: -15` for rank 0, no error line)."""
    from training_fixtures import BIN

    from pretrain.launch import free_port

    corpus = make_corpus(tmp_path / "corpus")
    flags = model_flags("gpt2") + train_flags(corpus, iters=2) + layout_flags(1, 1, 0)
    late_first_rank = '[ "$LOCAL_RANK" = 0 ] && sleep 5; exec "$0" "$@"'
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += ["--no-python", "bash", "-c", late_first_rank, PYTHON, str(REPO / "pretrain_gpt.py")]
    result = run([*cmd, *flags, "--data-path", str(tmp_path / "missing")], timeout=300)
    lines = [line for line in result.stdout.splitlines() if "missing.bin does not exist" in line]
    assert result.returncode != 0 and len(lines) == 1, result.stdout[-4000:]


@pytest.mark.parametrize(
    "env, prints",
    [
        ({}, True),  # one process, no launcher
        ({"LOCAL_RANK": "0", "RANK": "2"}, True),  # the first rank of the second node
        ({"LOCAL_RANK": "1", "RANK": "1"}, False),
        ({"SLURM_LOCALID": "3"}, False),
        ({"LOCAL_RANK": "x"}, True),  # unreadable: print rather than hide the error
    ],
)
def test_which_ranks_print_a_start_up_error(env, prints):
    from pretrain.launch import reports_start_up_errors

    assert reports_start_up_errors(env) is prints
