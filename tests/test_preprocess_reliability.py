"""tools/preprocess_data.py as a hostile but realistic user runs it: two runs on one prefix, a
file-size limit, an empty corpus, JSON no parser accepts, a 20 MB line, a killed run's
temporaries. Real processes, real files, real signals."""

import contextlib
import glob
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public
from test_preprocess import GPT2, make_records, megatron_reference, same_files, write_jsonl
from tokenizer_fixtures import CL100K, MERGES, VOCAB, awkward_texts

from pretrain.data.files.corpus import RecordBatch
from pretrain.data.files.encoder import LONG_TEXT, EncodeOptions, Encoder
from pretrain.data.files.indexed_dataset import IndexedDataset
from pretrain.tokenizer import TokenizerConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py")]
GPT2_FLAGS = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def preprocess_cmd(src, prefix, *extra):
    return [*TOOL, "--input", str(src), "--output-prefix", str(prefix), "--workers", "1",
            *GPT2_FLAGS, *extra]  # fmt: skip


def run(cmd, limit_bytes=None, timeout=180):
    """Run with a file-size limit where given (SIGXFSZ ignored: writes fail with EFBIG)."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout,
                          preexec_fn=limit if limit_bytes else None)  # fmt: skip


def one_error_line(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def temporaries(directory):
    return [f for f in os.listdir(directory) if f.endswith(".tmp") or f.startswith(".")]


@contextlib.contextmanager
def paused_run(cmd, temporary_glob):
    """Run A: `cmd` in its own session, stopped (SIGSTOP) as soon as a temporary matching
    `temporary_glob` exists; yields the process; killed on exit if it still runs."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not glob.glob(temporary_glob) and time.time() < deadline:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGSTOP)
        assert proc.poll() is None, "run A finished before run B could start"
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def finish_paused(proc) -> subprocess.Popen:
    """Let a `paused_run` go on (SIGCONT) and wait for it; the process, with `stderr_text`."""
    os.killpg(proc.pid, signal.SIGCONT)
    _, proc.stderr_text = proc.communicate(timeout=240)
    return proc


def big_corpus(path, n=3000, seed=0):
    rng = random.Random(seed)
    texts = awkward_texts(seed=seed, n=200)
    return write_jsonl(
        path, [{"text": " ".join(rng.choices(texts, k=4)), "id": i} for i in range(n)]
    )


@pytest.mark.timeout(300)
def test_second_run_on_a_busy_prefix_refuses(tmp_path, hf_reference):
    """Run A is stopped (SIGSTOP) while its temporaries exist; run B on the same prefix must refuse
    and leave A's files alone; A then finishes with Megatron's bytes, and no temporary is left."""
    src = big_corpus(tmp_path / "c.jsonl")
    prefix = tmp_path / "out"
    with paused_run(preprocess_cmd(src, prefix), f"{prefix}_text_document.bin.*.tmp") as first:
        second = run(preprocess_cmd(src, prefix))
        line = one_error_line(second)
        assert (
            f"--output-prefix {prefix}: another run is writing {prefix}_text_document.bin/.idx"
            in line
        )
        assert glob.glob(f"{prefix}_text_document.bin.*.tmp")  # A's temporary is untouched
        finish_paused(first)
    assert first.returncode == 0, first.stderr_text
    ref = megatron_reference(src, ["text"], str(tmp_path / "ref"), hf_reference, False)
    assert same_files(f"{prefix}_text_document", ref["text"])
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("ignore_in_parent", [True, False])
def test_file_size_limit_keeps_the_previous_output(tmp_path, ignore_in_parent):
    """`ulimit -f`: one line naming the .bin and the bytes needed; the previous output is intact.
    Without SIGXFSZ ignored by the caller the tool ignores it itself (else the kernel kills it)."""
    prefix = tmp_path / "out"
    small = write_jsonl(tmp_path / "small.jsonl", make_records(seed=1, n=20))
    assert run(preprocess_cmd(small, prefix)).returncode == 0
    before = {e: open(f"{prefix}_text_document.{e}", "rb").read() for e in ("bin", "idx")}
    src = big_corpus(tmp_path / "big.jsonl")
    limit = 64 * 1024
    if ignore_in_parent:
        proc = run(preprocess_cmd(src, prefix), limit_bytes=limit)
    else:
        proc = subprocess.run(preprocess_cmd(src, prefix), capture_output=True, text=True,
                              env=ENV, timeout=180,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE,
                                                                    (limit, limit)))  # fmt: skip
    line = one_error_line(proc)
    assert line.startswith(f"error: {prefix}_text_document.bin: cannot write, file too large (")
    needed = int(line.split("(")[1].split(" bytes needed")[0].replace(",", ""))
    assert needed > limit
    after = {e: open(f"{prefix}_text_document.{e}", "rb").read() for e in ("bin", "idx")}
    assert after == before
    assert temporaries(tmp_path) == []


def test_empty_corpus_warns_and_fails_unless_allowed(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    proc = run(preprocess_cmd(empty, tmp_path / "out"))
    assert "warning: 0 documents" in proc.stderr
    assert "0 documents, nothing written" in one_error_line(proc)
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]  # no lock file left either
    only_empty = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}] * 5)
    proc = run(preprocess_cmd(only_empty, tmp_path / "out"))
    assert "warning: 5 documents, 0 tokens" in proc.stderr and proc.returncode == 2
    allowed = run(preprocess_cmd(only_empty, tmp_path / "out", "--allow-empty"))
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: 5 documents, 0 tokens" in allowed.stderr
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.num_documents == 5 and len(ds) == 0


def test_json_no_parser_accepts_is_a_bad_line(tmp_path, hf_reference):
    """Nesting deeper than the recursion limit and an integer of 5000 digits: `FILE:LINE:` like any
    bad line, and --skip-bad-lines skips them (the rest equals Megatron's output without them)."""
    good = [{"text": t} for t in awkward_texts(seed=3, n=6)]
    lines = [json.dumps(r) for r in good]
    lines.insert(2, "[" * 100_000 + "]" * 100_000)
    lines.insert(4, '{"text": "x", "n": ' + "7" * 5000 + "}")
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    line = one_error_line(run(preprocess_cmd(src, tmp_path / "out")))
    assert line.startswith(f"error: {src}:3: JSON nested too deeply")
    skipped = run(preprocess_cmd(src, tmp_path / "out", "--skip-bad-lines"))
    assert skipped.returncode == 0, skipped.stderr
    assert f"{src}:5: invalid JSON value: Exceeds the limit (4300 digits)" in skipped.stderr
    assert "2 skipped lines" in skipped.stdout
    clean = write_jsonl(tmp_path / "clean.jsonl", good)
    ref = megatron_reference(clean, ["text"], str(tmp_path / "ref"), hf_reference, False)
    assert same_files(str(tmp_path / "out_text_document"), ref["text"])


def _long_text(n_bytes, seed):
    """Mostly English-like words, one in ten pieces awkward unicode: about `n_bytes` of UTF-8."""
    rng = random.Random(seed)
    awkward = [t for t in awkward_texts(seed=seed, n=300) if t]
    words = "the quick brown fox jumps over a lazy dog, Hello world.".split()
    parts, size = [], 0
    while size < n_bytes:
        piece = rng.choice(awkward) if rng.random() < 0.1 else " ".join(rng.choices(words, k=12))
        parts.append(piece)
        size += len(piece.encode("utf-8")) + 1
    return " ".join(parts)


@pytest.mark.parametrize("kind", ["gpt2", "cl100k"])
def test_long_text_in_pieces_equals_the_whole(kind, hf_reference, monkeypatch):
    """Texts past LONG_TEXT are tokenized in pieces; the ids equal the reference tokenizer's on the
    whole text (transformers' GPT-2 / tiktoken's cl100k)."""
    text = _long_text(3 * LONG_TEXT, seed=11)
    if kind == "gpt2":
        cfg, expected = GPT2, hf_reference(text).input_ids
    else:
        cfg = TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=CL100K)
        # tiktoken's own cl100k_base definition, with the ranks read from the offline file
        local = tiktoken.load.load_tiktoken_bpe(CL100K)
        monkeypatch.setattr(tiktoken_ext.openai_public, "load_tiktoken_bpe", lambda *a, **k: local)
        enc = tiktoken.Encoding(**tiktoken_ext.openai_public.cl100k_base())
        expected = enc.encode_ordinary(text)
    encoder = Encoder(EncodeOptions(cfg, ["text"]))
    assert encoder.pieces_are_exact
    batch = RecordBatch("t.jsonl", [1], raw=[json.dumps({"text": text}).encode()])
    out = encoder.encode(batch).keys[0]
    np.testing.assert_array_equal(out.tokens, np.asarray(expected))


_MEASURE = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
sys.stderr.write(r.stderr)
"""


def _peak_mb(cmd):
    """Peak RSS (MB) of the largest process of the run (the tool or a worker)."""
    r = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True,
                       env=ENV, timeout=600)  # fmt: skip
    code, mb = r.stdout.split()
    assert code == "0", r.stderr
    return int(mb)


@pytest.mark.timeout(600)
def test_a_20mb_line_is_read_with_a_few_copies(tmp_path):
    text = _long_text(20_000_000, seed=12)
    src = tmp_path / "big.jsonl"
    src.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    line_mb = os.path.getsize(src) / 1e6
    str_mb = sys.getsizeof(text) / 1e6  # in memory: 4 bytes per character once one is past U+FFFF
    baseline = write_jsonl(tmp_path / "one.jsonl", [{"text": "hello"}])
    base_mb = _peak_mb(preprocess_cmd(baseline, tmp_path / "small"))
    peak_mb = _peak_mb(preprocess_cmd(src, tmp_path / "big"))
    print(f"peak {peak_mb} MB, baseline {base_mb} MB, line {line_mb:.1f} MB, str {str_mb:.1f} MB")
    assert peak_mb - base_mb < 4 * max(line_mb, str_mb)  # before: 2.4 GB over the baseline
    assert IndexedDataset(str(tmp_path / "big_text_document")).num_documents == 1


@pytest.mark.timeout(300)
def test_temporaries_of_a_killed_run_are_removed_by_the_next(tmp_path):
    src = big_corpus(tmp_path / "c.jsonl")
    prefix = tmp_path / "out"
    cmd = preprocess_cmd(src, prefix)
    killed = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                              start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not glob.glob(f"{prefix}_text_document.bin.*.tmp") and time.time() < deadline:
            time.sleep(0.01)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(30)
    (stray,) = glob.glob(f"{prefix}_text_document.bin.*.tmp")
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr
    assert f"removed {stray} (left by an interrupted run)" in proc.stderr
    assert temporaries(tmp_path) == []
