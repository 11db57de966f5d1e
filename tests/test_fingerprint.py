"""Data fingerprints: preprocess_data.py writes PREFIX.json (tokenizer, inputs, counts, largest id),
merge_datasets.py merges them and refuses mixed tokenizers, and the launch check refuses data made
by another tokenizer or holding ids beyond the vocabulary, in one line; Megatron-made data (no
sidecar) is scanned once. Counts and ids are checked against megatron-core's IndexedDataset."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tokenizer_fixtures import CL100K, MERGES, VOCAB
from training_fixtures import make_corpus, model_flags, train_flags

from pretrain.data.checks import check_data, data_fingerprints
from pretrain.data.config import DataConfig
from pretrain.data.files import fingerprint, token_stats
from pretrain.data.files.fingerprint import read_sidecar
from pretrain.data.files.preprocess import PreprocessConfig, run
from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig, build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
TIKTOKEN = TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=CL100K)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def write_jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


def preprocess(tmp_path, name, texts, tok=GPT2):
    src = write_jsonl(tmp_path / f"{name}.jsonl", texts)
    cfg = PreprocessConfig(
        inputs=[src], output_prefix=str(tmp_path / name), tokenizer=tok, append_eod=True, workers=1
    )
    run(cfg)
    return str(tmp_path / f"{name}_text_document"), src


TEXTS = ["First Citizen: Before we proceed any further, hear me speak.", "All: Speak, speak.", ""]


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory):
    return preprocess(tmp_path_factory.mktemp("fp"), "shake", TEXTS * 5)


def megatron_indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


def test_preprocess_writes_the_sidecar(gpt2_data):
    prefix, src = gpt2_data
    side = read_sidecar(prefix)
    tok = side["tokenizer"]
    assert tok["type"] == "GPT2BPETokenizer"
    assert tok["files"] == {"vocab_file": sha256(VOCAB), "merge_file": sha256(MERGES)}
    assert (tok["vocab_size"], tok["eod"], tok["append_eod"]) == (50257, 50256, True)
    assert side["json_keys"] == ["text"] and side["level"] == "document"
    assert side["inputs"] == [{"path": os.path.abspath(src), "bytes": os.path.getsize(src)}]
    theirs = megatron_indexed(prefix)  # the independent reader of the .idx/.bin
    assert side["sequences"] == len(theirs)
    assert side["documents"] == len(theirs.document_indices) - 1
    assert side["tokens"] == int(theirs.sequence_lengths.sum())
    assert side["max_token_id"] == max(int(theirs[i].max()) for i in range(len(theirs)))
    assert side["max_token_id"] == 50256  # the appended EOD


def test_merge_merges_sidecars_and_refuses_mixed_tokenizers(tmp_path, gpt2_data):
    other, src2 = preprocess(tmp_path, "more", ["Second Citizen: One word, good citizens."])
    merged = str(tmp_path / "merged")
    tool = [sys.executable, os.path.join(ROOT, "tools", "merge_datasets.py")]
    r = subprocess.run(
        [*tool, "--prefixes", gpt2_data[0], other, "--output-prefix", merged],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    side = read_sidecar(merged)
    assert side["tokenizer"] == read_sidecar(other)["tokenizer"]
    assert [i["path"] for i in side["inputs"]] == [
        os.path.abspath(gpt2_data[1]),
        os.path.abspath(src2),
    ]
    assert side["tokens"] == int(megatron_indexed(merged).sequence_lengths.sum())
    assert side["max_token_id"] == 50256
    # another tokenizer: refused before anything is written
    tik, _ = preprocess(
        tmp_path, "tik", ["Third Citizen: We are accounted poor citizens."], TIKTOKEN
    )
    out = str(tmp_path / "mixed")
    r = subprocess.run(
        [*tool, "--prefixes", gpt2_data[0], tik, "--output-prefix", out],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "GPT2BPETokenizer" in r.stderr and "TikTokenizer" in r.stderr
    assert not any(os.path.exists(out + e) for e in (".bin", ".idx", ".json"))


def test_check_refuses_another_tokenizer_unless_allowed(gpt2_data):
    prefix = gpt2_data[0]
    cfg = DataConfig(seq_length=8, blend=([prefix], None), split="1")
    tik = build_tokenizer(TIKTOKEN)
    with pytest.raises(UserError) as err:
        check_data(cfg, TIKTOKEN, tik, tik.vocab_size)
    message = str(err.value)
    assert "\n" not in message and "GPT2BPETokenizer" in message and "TikTokenizer" in message
    allowed = DataConfig(
        seq_length=8, blend=([prefix], None), split="1", allow_tokenizer_mismatch=True
    )
    check_data(allowed, TIKTOKEN, tik, tik.vocab_size)  # cl100k's vocabulary holds every id
    gpt2 = build_tokenizer(GPT2)
    check_data(cfg, GPT2, gpt2, gpt2.vocab_size)  # the same tokenizer, other paths would do too
    with pytest.raises(UserError, match=r"holds token id 50256 .* has 50000 ids"):
        check_data(cfg, GPT2, gpt2, 50000)


def test_a_same_size_other_bin_beside_its_sidecar_is_refused_before_training(tmp_path, gpt2_data):
    """The .idx and the sidecar kept, the .bin replaced by random bytes of its size: the counts
    agree and the sidecar's largest id fits, so training used to start and fail at the first
    forward (IndexError: ids up to 65535 in a 50257-row embedding). Now the check before launch
    refuses it in one line naming the .bin, reading 64 KiB of it."""
    prefix = str(tmp_path / "copy")
    for ext in (".idx", ".json"):
        shutil.copyfile(gpt2_data[0] + ext, prefix + ext)
    size = os.path.getsize(gpt2_data[0] + ".bin")
    with open(prefix + ".bin", "wb") as f:
        f.write(np.random.default_rng(0).bytes(size))
    cfg = DataConfig(seq_length=8, blend=([prefix], None), split="1")
    gpt2 = build_tokenizer(GPT2)
    with pytest.raises(UserError) as err:
        check_data(cfg, GPT2, gpt2, gpt2.vocab_size)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{prefix}.bin: is not the file "), message
    shutil.copyfile(gpt2_data[0] + ".bin", prefix + ".bin")  # the right bytes again: accepted
    check_data(cfg, GPT2, gpt2, gpt2.vocab_size)


def test_megatron_data_without_sidecar_is_scanned_once(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "megatron_made")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 900, int(n)) for n in rng.integers(1, 50, 40)]
    for d in docs:
        builder.add_document(d, [len(d)])
    builder.finalize(prefix + ".idx")
    largest = max(int(d.max()) for d in docs)
    cache = tmp_path / "cache"
    cfg = DataConfig(seq_length=8, blend=([prefix], None), split="1", data_cache_path=str(cache))
    null = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=1000)
    check_data(cfg, null, build_tokenizer(null), 1000)
    stats = [f for f in os.listdir(cache) if f.endswith("TokenStats.json")]
    kept = json.load(open(cache / stats[0]))["prefixes"]
    assert len(stats) == 1 and kept[os.path.abspath(prefix)]["max_token_id"] == largest
    with pytest.raises(UserError, match=f"holds token id {largest}"):
        check_data(cfg, null, build_tokenizer(null), largest)
    summary = data_fingerprints(cfg)[prefix]
    assert summary["sidecar"] is False and summary["max_token_id"] == largest
    assert summary["documents"] == 40 and summary["tokens"] == sum(len(d) for d in docs)


def test_second_check_reads_the_cached_scan(tmp_path, monkeypatch):
    prefix = make_corpus(tmp_path / "corpus", num_docs=10)
    cfg = DataConfig(seq_length=8, blend=([prefix], None), split="1", data_cache_path=str(tmp_path))
    assert fingerprint.largest_token_id(prefix, str(tmp_path)) == 100
    monkeypatch.setattr(token_stats, "scan_max_token", lambda p: pytest.fail("scanned twice"))
    assert fingerprint.largest_token_id(prefix, str(tmp_path)) == 100
    assert data_fingerprints(cfg)[prefix]["max_token_id"] == 100


def test_training_and_build_data_cache_check_before_launch(tmp_path, gpt2_data):
    from pretrain.cli import parse_args

    corpus = make_corpus(tmp_path / "corpus", num_docs=20)  # NullTokenizer ids 0..100
    argv = model_flags("gpt2") + train_flags(corpus)
    argv[argv.index("--vocab-size") + 1] = "50"
    with pytest.raises(UserError, match="holds token id 100"):
        parse_args(argv, env={})
    tool = os.path.join(ROOT, "tools", "build_data_cache.py")
    flags = ["--data-path", gpt2_data[0], "--split", "1", "--seq-length", "8", "--train-iters", "2"]
    flags += [
        "--global-batch-size",
        "2",
        "--tokenizer-type",
        "TikTokenizer",
        "--tokenizer-model",
        CL100K,
    ]
    r = subprocess.run(
        [sys.executable, tool, *flags], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "TikTokenizer" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(
        [sys.executable, tool, *flags, "--allow-tokenizer-mismatch", "--data-cache-path", str(tmp_path / "c")],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_convert_checks_the_data_the_checkpoint_records(tmp_path, gpt2_data):
    from pretrain.data.checks import check_recorded_data

    meta = {"blend": [[gpt2_data[0], str(tmp_path / "gone")], None], "blend_per_split": None}
    gpt2, tik = build_tokenizer(GPT2), build_tokenizer(TIKTOKEN)
    assert check_recorded_data(meta, GPT2, gpt2, gpt2.vocab_size) == 1  # the missing one is skipped
    with pytest.raises(UserError, match="TikTokenizer"):
        check_recorded_data(meta, TIKTOKEN, tik, tik.vocab_size)
    assert check_recorded_data(meta, TIKTOKEN, tik, tik.vocab_size, allow_mismatch=True) == 1
    assert check_recorded_data(None, GPT2, gpt2, gpt2.vocab_size) == 0
