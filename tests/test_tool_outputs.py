"""Every tool that writes refuses an output that is one of its inputs or an existing dataset or
checkpoint file (`pretrain/outputs.py`, `pretrain/checkpoint/outputs.py`), in one line, with the
input byte for byte as it was; a destination it cannot write (immutable folder, /proc, a
file-size limit) is one line naming it, and nothing half-written is left."""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from convert_fixtures import load_tool
from test_plot_run import write_log

from pretrain.convert.checkpoint_writer import write_checkpoint
from pretrain.data.files.indexed_dataset import IndexedDatasetBuilder
from pretrain.errors import exit_on_user_error
from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel

REPO = Path(__file__).resolve().parents[1]
PLAN_FLAGS = ["--split", "100,0,0", "--seq-length", "8", "--train-iters", "2"]
PLAN_FLAGS += ["--global-batch-size", "2", "--eval-iters", "0"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def _dataset(prefix: Path) -> str:
    """A small real .bin/.idx pair (uint16 tokens < 1000)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        builder.add_document(rng.integers(0, 999, 30, dtype=np.uint16), [30])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _checkpoint(path: Path) -> str:
    """A small real --finetune checkpoint (`latest`, a step folder, its metadata)."""
    config = ModelConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8
    )
    weights = GPTModel(config).state_dict()
    tokenizer = {"tokenizer_type": "NullTokenizer", "vocab_size": config.vocab_size - 1}
    return write_checkpoint(str(path), weights, config, tokenizer=tokenizer)


@pytest.fixture
def world(tmp_path):
    """A log, a JSONL corpus, a dataset and a checkpoint: the inputs the cases name."""
    write_log(tmp_path / "run.log", range(1, 6))
    (tmp_path / "corpus.jsonl").write_text('{"text": "to be or not to be"}\n' * 50)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    return {
        "log": str(tmp_path / "run.log"),
        "corpus": str(tmp_path / "corpus.jsonl"),
        "data": _dataset(tmp_path / "data_text_document"),
        "ckpt": _checkpoint(tmp_path / "ckpt"),
        "hf": str(tmp_path / "hf"),
        "root": str(tmp_path),
    }


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _refusal(tool: str, argv: list[str], capsys) -> str:
    """Run tools/<tool>.py's main in this process; return its one `error:` line (exit 2)."""
    main = exit_on_user_error(load_tool(tool).main)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# (tool, argv from the world's paths, the flag and the words the line names)
CASES = {
    "plot_run --out LOG": (
        "plot_run",
        lambda w: ["--log", w["log"], "--out", w["log"]],
        "--out",
        "is --log",
    ),
    "plot_run --out DATA.bin": (
        "plot_run",
        lambda w: ["--log", w["log"], "--out", w["data"] + ".bin"],
        "--out",
        "a file of the dataset",
    ),
    "plot_run --out CKPT/latest": (
        "plot_run",
        lambda w: ["--log", w["log"], "--out", os.path.join(w["ckpt"], "latest")],
        "--out",
        "part of the checkpoint",
    ),
    "plan_blend --plot DATA.idx": (
        "plan_blend",
        lambda w: ["--data-path", w["data"], *PLAN_FLAGS, "--plot", w["data"] + ".idx"],
        "--plot",
        "is --data-path",
    ),
    "build_data_cache --data-cache-path CKPT": (
        "build_data_cache",
        lambda w: (
            ["--data-path", w["data"], *PLAN_FLAGS, *NULL_TOKENIZER]
            + ["--data-cache-path", w["ckpt"]]
        ),
        "--data-cache-path",
        "part of the checkpoint",
    ),
    "explain_batch --data-cache-path CKPT": (
        "explain_batch",
        lambda w: (
            ["--data-path", w["data"], *PLAN_FLAGS, *NULL_TOKENIZER, "--iteration", "1"]
            + ["--data-cache-path", w["ckpt"]]
        ),
        "--data-cache-path",
        "part of the checkpoint",
    ),
    "train_demo_tokenizer --output-dir CORPUS": (
        "train_demo_tokenizer",
        lambda w: ["--input", w["corpus"], "--output-dir", w["corpus"]],
        "--output-dir",
        "is --input",
    ),
    "convert_from_hf --save DATA.bin": (
        "convert_from_hf",
        lambda w: ["--load", w["hf"], "--save", w["data"] + ".bin"],
        "--save",
        "a file of the dataset",
    ),
    "convert_from_megatron --output-dir LOAD": (
        "convert_from_megatron",
        lambda w: ["--load", w["ckpt"], "--output-dir", w["ckpt"]],
        "--output-dir",
        "is --load",
    ),
    "convert_to_hf --overwrite --output-dir CKPT/..": (
        "convert_to_hf",
        lambda w: ["--load", w["ckpt"], "--output-dir", w["root"], "--overwrite"],
        "--output-dir",
        "holds --load",
    ),
    "make_default_data --output-dir DATA.idx": (
        "make_default_data",
        lambda w: ["--output-dir", w["data"] + ".idx"],
        "--output-dir",
        "a file of the dataset",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_output_that_is_an_input_or_kept_data_is_refused(
    tmp_path, world, capsys, monkeypatch, case
):
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # build_data_cache imports plan_blend
    tool, argv, flag, words = CASES[case]
    before = _digests(tmp_path)
    line = _refusal(tool, argv(world), capsys)
    assert line.startswith(f"error: {flag} ") and words in line, line
    assert "nothing was written" in line, line
    assert _digests(tmp_path) == before  # every input byte for byte, nothing added


def test_merge_refuses_an_output_that_is_an_input_under_another_name(tmp_path, capsys):
    """A symlinked prefix is the same files: refused, not merged into itself."""
    a = _dataset(tmp_path / "a")
    for ext in (".bin", ".idx"):
        os.symlink(f"{a}{ext}", tmp_path / f"alias{ext}")
    before = _digests(tmp_path)
    argv = ["--prefixes", a, "--output-prefix", str(tmp_path / "alias")]
    line = _refusal("merge_datasets", argv, capsys)
    assert line.startswith("error: --output-prefix ") and "--prefixes" in line, line
    assert _digests(tmp_path) == before
    assert all(os.path.islink(tmp_path / f"alias{ext}") for ext in (".bin", ".idx"))


@pytest.fixture
def immutable(tmp_path):
    """A folder nothing can be created in, even by root (`chattr +i`)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i unsupported here: {made.stderr.decode().strip()}")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def _unwritable_cases(w: dict, dest: str):
    """(tool, argv, flag) writing `dest` (a path in an unwritable place)."""
    plan = ["--data-path", w["data"], *PLAN_FLAGS, "--plot", f"{dest}/plan.png"]
    tokenizer = ["--input", w["corpus"], "--output-dir", f"{dest}/tok", "--vocab-size", "300"]
    return [
        ("plot_run", ["--log", w["log"], "--out", f"{dest}/curves.png"], "--out"),
        ("plan_blend", plan, "--plot"),
        ("train_demo_tokenizer", tokenizer, "--output-dir"),
        ("convert_to_hf", ["--load", w["ckpt"], "--output-dir", f"{dest}/hf"], "--output-dir"),
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["chattr", "proc"])
def test_an_unwritable_destination_is_one_line_naming_it(tmp_path, world, capsys, where, request):
    dest = str(request.getfixturevalue("immutable")) if where == "chattr" else "/proc"
    for tool, argv, flag in _unwritable_cases(world, dest):
        line = _refusal(tool, argv, capsys)
        assert line.startswith(f"error: {flag} {dest}/") and "cannot write" in line, line
        assert "nothing was written" in line, line
    if where == "chattr":
        assert os.listdir(dest) == []


def test_train_demo_tokenizer_leaves_no_half_written_folder(tmp_path, world, monkeypatch, capsys):
    """A failure after the first file: no OUT folder, no temporary beside it."""
    tool = load_tool("train_demo_tokenizer")
    real = tool.atomic_write_bytes
    calls = []

    def fail_second(path, data, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        real(path, data, **kw)

    monkeypatch.setattr(tool, "atomic_write_bytes", fail_second)
    out = tmp_path / "tok"
    argv = ["--input", world["corpus"], "--output-dir", str(out), "--vocab-size", "300"]
    with pytest.raises(SystemExit):
        exit_on_user_error(tool.main)(argv)
    assert "error: --output-dir" in capsys.readouterr().err
    assert len(calls) == 2 and not out.exists()
    assert not [p for p in os.listdir(tmp_path) if "tok" in p]


@pytest.mark.timeout(300)
def test_convert_from_hf_under_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    import transformers

    hf = tmp_path / "hf"
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(hf)
    limit = 64 * 512  # `ulimit -f 64`: 64 blocks of 512 bytes
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_from_hf.py"), "--load", str(hf)]
        + ["--save", str(tmp_path / "ckpt")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: --save {tmp_path / 'ckpt'}: "), errors
    assert "file too large" in errors[0] and "ulimit -f" in errors[0], errors
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--target-tensor-parallel-size", "0"),
        ("--target-pipeline-parallel-size", "0"),
        ("--make-vocab-size-divisible-by", "0"),
        ("--seq-length", "0"),
        ("--target-expert-tensor-parallel-size", "-1"),
    ],
)
def test_convert_from_hf_refuses_nonsense_sizes(tmp_path, capsys, flag, value):
    argv = ["--load", str(tmp_path), "--save", str(tmp_path / "ckpt"), flag, value]
    line = _refusal("convert_from_hf", argv, capsys)
    assert line == f"error: {flag} {value}: must be at least 1", line
    assert not (tmp_path / "ckpt").exists()


def test_a_folder_with_a_file_named_latest_is_not_taken_for_a_checkpoint(tmp_path, world):
    """Only a real checkpoint is protected: `notes/latest` beside an old plot does not stop
    plot_run from replacing the plot."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "latest").write_text("my notes\n")
    (notes / "curves.png").write_bytes(b"old plot")
    assert (
        load_tool("plot_run").main(["--log", world["log"], "--out", str(notes / "curves.png")]) == 0
    )
    assert (notes / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert (notes / "latest").read_text() == "my notes\n"
