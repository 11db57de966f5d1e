"""tools/merge_datasets.py and tools/inspect_data.py."""

import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from tokenizer_fixtures import MERGES, VOCAB

from pretrain.data.files.indexed_dataset import IndexedDatasetBuilder
from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


merge_tool, inspect_tool = _tool("merge_datasets"), _tool("inspect_data")

SHARDS = {  # name -> documents (lists of sequences)
    "b": [[[1, 2], [3]], []],
    "a": [[[4, 5, 6]]],
    "c": [[[7]], [[8, 9], [10], [11]]],
}


def _write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        b.add_document([t for s in doc for t in s], [len(s) for s in doc])
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def _bytes(prefix):
    return [open(prefix + e, "rb").read() for e in (".bin", ".idx")]


def test_merge_dir_lexicographic_equals_megatron_core(tmp_path):
    (tmp_path / "shards").mkdir()
    for name, docs in SHARDS.items():
        _write(tmp_path / "shards" / name, docs)
    ds = merge_tool.main(
        ["--input", str(tmp_path / "shards"), "--output-prefix", str(tmp_path / "out" / "m")]
    )
    expected = _write(tmp_path / "whole", SHARDS["a"] + SHARDS["b"] + SHARDS["c"])
    assert _bytes(str(tmp_path / "out" / "m")) == _bytes(expected)
    assert len(ds) == 7 and ds.num_documents == 5

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder
    mb = MegatronBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for name in sorted(SHARDS):
        mb.add_index(str(tmp_path / "shards" / name))
    mb.finalize(str(tmp_path / "mc.idx"))
    assert _bytes(str(tmp_path / "mc")) == _bytes(expected)


def test_merge_explicit_prefixes_keep_the_given_order(tmp_path):
    prefixes = [_write(tmp_path / n, SHARDS[n]) for n in ("c", "a", "b")]
    merge_tool.main(["--prefixes", *prefixes, "--output-prefix", str(tmp_path / "m")])
    assert _bytes(str(tmp_path / "m")) == _bytes(
        _write(tmp_path / "w", SHARDS["c"] + SHARDS["a"] + SHARDS["b"])
    )


def test_merge_errors(tmp_path):
    a = _write(tmp_path / "a", SHARDS["a"])
    wide = _write(tmp_path / "wide", SHARDS["b"], np.int32)
    with pytest.raises(UserError, match="wide.idx: dtype int32 differs from the output's uint16"):
        merge_tool.main(["--prefixes", a, wide, "--output-prefix", str(tmp_path / "m")])
    assert not os.path.exists(tmp_path / "m.bin") and not os.path.exists(tmp_path / "m.bin.tmp")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="notes.txt: not a .bin/.idx file"):
        merge_tool.prefixes_in_dir(str(tmp_path))
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "merge_datasets.py"),
            "--prefixes",
            a,
            "--output-prefix",
            a,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "is --prefixes" in r.stderr


def test_inspect_summary_and_decode(tmp_path, capsys):
    tok = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    )
    docs = [["Hello world.", " Second sentence 😀"], [], ["漢字 é"]]
    prefix = _write(tmp_path / "d", [[tok.tokenize(s) for s in d] for d in docs])
    info = inspect_tool.main(
        [
            "--input",
            prefix,
            "--document",
            "0",
            "--document",
            "2",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            VOCAB,
            "--merge-file",
            MERGES,
        ]
    )
    lengths = [len(tok.tokenize(s)) for d in docs for s in d]
    assert info["sequences"] == 3 and info["documents"] == 3 and info["empty_documents"] == 1
    assert info["tokens"] == sum(lengths) and info["dtype"] == "uint16"
    assert info["sequence_length_percentiles"]["p0"] == min(lengths)
    assert info["sequence_length_percentiles"]["p100"] == max(lengths)
    out = capsys.readouterr().out
    assert "Hello world.\n Second sentence 😀\n" in out and "漢字 é\n" in out
    with pytest.raises(UserError, match="--document 3: out of range"):
        inspect_tool.main(["--input", prefix, "--document", "3"])


def test_inspect_decodes_with_the_tokenizer_its_sidecar_names(tmp_path, capsys, monkeypatch):
    """preprocess_data.py records its tokenizer flags (absolute paths) in PREFIX.json: --document
    decodes without tokenizer flags, from any folder; changed tokenizer files print ids instead."""
    import shutil

    from test_preprocess import preprocess, write_jsonl

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    shutil.copyfile(VOCAB, vocab)
    shutil.copyfile(MERGES, merges)
    texts = ["Hello world, the first document.", "A second one 😀 with 漢字."]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    monkeypatch.chdir(tmp_path)  # relative tokenizer paths, as users give them
    tok = TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt"
    )
    preprocess([src], tmp_path / "d", workers=1, tokenizer=tok)
    prefix = str(tmp_path / "d_text_document")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    inspect_tool.main(["--input", prefix, "--document", "1", "--document", "0"])
    captured = capsys.readouterr()
    assert f"{texts[1]}\n" in captured.out and f"{texts[0]}\n" in captured.out, captured
    assert "note:" not in captured.err
    with open(merges, "a") as f:
        f.write("x y\n")  # another tokenizer now: its text would be wrong
    inspect_tool.main(["--input", prefix, "--document", "0"])
    captured = capsys.readouterr()
    assert texts[0] not in captured.out and "changed since preprocessing" in captured.err
    ids = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    ).tokenize(texts[0])
    assert " ".join(map(str, ids)) in captured.out


def test_inspect_piped_into_a_reader_that_stops_early_exits_quietly(tmp_path):
    """`inspect_data.py --document 0 | head -1`: far more output than the pipe holds; the reader
    closes after one line. Exit status 0, nothing but the tool's note on stderr."""
    prefix = _write(tmp_path / "big", [[list(range(i, i + 2000)) for i in range(200)]])
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tools", "inspect_data.py"), "--input", prefix,
         "--document", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    assert proc.stdout.readline().startswith(prefix.encode())
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
