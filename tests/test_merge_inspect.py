"""tools/merge_datasets.py and tools/inspect_data.py."""

import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from tokenizer_fixtures import MERGES, VOCAB

from pretrain.data.indexed_dataset import IndexedDatasetBuilder
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
    assert (
        r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "is also an input" in r.stderr
    )


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
