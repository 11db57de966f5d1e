"""Tokenizer fingerprints identify what a tokenizer does, not the bytes of its files: the same
tokenizer saved twice, or exported by tools/convert_to_hf.py and loaded again, has one
fingerprint; one changed merge, vocabulary entry or special token gives another. The flow of
docs/CONVERSION.md (preprocess, train, export, continue from the export's tokenizer against the
same data) is accepted; checkpoints record absolute tokenizer paths, and convert_to_hf.py takes
tokenizer flags that replace the recorded ones, checked against the checkpoint's fingerprint."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from tokenizer_fixtures import MERGES, VOCAB
from training_fixtures import PYTHON, REPO, model_flags, run, train_flags
from training_fixtures import test_env as clean_env

from pretrain.data.checks import check_data
from pretrain.data.config import DataConfig
from pretrain.data.files.fingerprint import read_sidecar
from pretrain.data.files.preprocess import PreprocessConfig
from pretrain.data.files.preprocess import run as preprocess
from pretrain.errors import UserError
from pretrain.launch import free_port
from pretrain.tokenizer import TokenizerConfig, build_tokenizer
from pretrain.tokenizer.fingerprint import tokenizer_fingerprint
from pretrain.training.checkpoints.resume_changes import check_tokenizer

LINES = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
]


def hf(path) -> TokenizerConfig:
    return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path))


def fp(cfg: TokenizerConfig) -> dict:
    return tokenizer_fingerprint(cfg, build_tokenizer(cfg))


def tool(name, *args, cwd=REPO, env=None):
    return subprocess.run(
        [PYTHON, str(REPO / "tools" / name), *args],
        capture_output=True, text=True, env=env or clean_env(), cwd=cwd, timeout=300,
    )  # fmt: skip


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's HF tokenizer (tools/train_demo_tokenizer.py, 300 ids) and a corpus."""
    d = tmp_path_factory.mktemp("demo")
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES * 40))
    r = tool("train_demo_tokenizer.py", "--input", str(corpus), "--output-dir", str(d / "tok"),
             "--vocab-size", "300")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return d


def edited(src, dst, change):
    """A copy of the tokenizer folder `src` whose tokenizer.json `change(data)` edited."""
    shutil.copytree(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text())
    change(data)
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


def test_the_same_tokenizer_saved_twice_has_one_fingerprint(demo, tmp_path):
    from transformers import AutoTokenizer

    original = fp(hf(demo / "tok"))
    theirs = AutoTokenizer.from_pretrained(str(demo / "tok"), local_files_only=True)
    theirs.save_pretrained(tmp_path / "a")
    theirs.save_pretrained(tmp_path / "b")
    # the same JSON re-written: other key order, indentation and merges spelt as "a b"
    respelt = edited(demo / "tok", tmp_path / "c", lambda d: None)
    data = json.loads((respelt / "tokenizer.json").read_text())
    data["model"]["merges"] = [" ".join(m) for m in data["model"]["merges"]]
    (respelt / "tokenizer.json").write_text(json.dumps(dict(reversed(data.items())), indent=1))
    for folder in ("a", "b", "c"):
        again = fp(hf(tmp_path / folder))
        assert again["sha256"] == original["sha256"], folder
    a_bytes = (tmp_path / "a" / "tokenizer_config.json").read_bytes()
    assert a_bytes != (demo / "tok" / "tokenizer_config.json").read_bytes()
    assert fp(hf(tmp_path / "a"))["file_sha256"] != original["file_sha256"]  # what was compared


def test_an_export_reimported_has_the_fingerprint_of_its_source(demo, tmp_path):
    """convert_to_hf's tokenizer files (rewritten tokenizer.json and tokenizer_config.json) are
    the same tokenizer, for a HF tokenizer and for GPT-2's vocab.json + merges.txt."""
    from pretrain.convert.hf_folder import save_hf_tokenizer

    gpt2 = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    for name, cfg in (("hf", hf(demo / "tok")), ("gpt2", gpt2)):
        tokenizer = build_tokenizer(cfg)
        assert save_hf_tokenizer(cfg, tokenizer, str(tmp_path / name))
        assert fp(hf(tmp_path / name))["sha256"] == tokenizer_fingerprint(cfg, tokenizer)["sha256"]
    exported = (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert exported != (demo / "tok" / "tokenizer.json").read_bytes()


def _swap_two_merges(data):
    merges = data["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]


def _a_token_gets_another_id(data):  # (and the token that had it takes its id)
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]


def _special_token_strips_left(data):
    data["added_tokens"][0]["lstrip"] = True


@pytest.mark.parametrize(
    "change", [_swap_two_merges, _a_token_gets_another_id, _special_token_strips_left]
)
def test_one_change_gives_another_fingerprint(demo, tmp_path, change):
    original = fp(hf(demo / "tok"))
    other = fp(hf(edited(demo / "tok", tmp_path / "other", change)))
    assert other["sha256"] != original["sha256"]
    assert other["vocab_size"] == original["vocab_size"] and other["eod"] == original["eod"]


def test_one_changed_gpt2_merge_gives_another_fingerprint(tmp_path):
    lines = open(MERGES, encoding="utf-8").read().splitlines(keepends=True)
    lines[1], lines[2] = lines[2], lines[1]  # after the "#version" line
    (tmp_path / "merges.txt").write_text("".join(lines), encoding="utf-8")
    gpt2 = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    changed = TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=str(tmp_path / "merges.txt")
    )
    assert fp(changed)["sha256"] != fp(gpt2)["sha256"]


def test_sentencepiece_and_tiktoken_fingerprints_follow_the_model(tmp_path):
    """The same SentencePiece model trained under another name (its trainer_spec records the
    name) has one fingerprint, another model type another; a .tiktoken file copied keeps its
    fingerprint, one changed rank changes it."""
    from test_tokenizer_sentencepiece import _train
    from tokenizer_fixtures import CL100K

    def sp(path):
        return fp(TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=path))

    first, second = (
        _train(tmp_path, "one", model_type="bpe"),
        _train(tmp_path, "two", model_type="bpe"),
    )
    assert open(first, "rb").read() != open(second, "rb").read()
    assert sp(first)["sha256"] == sp(second)["sha256"]
    assert sp(_train(tmp_path, "three", model_type="unigram"))["sha256"] != sp(first)["sha256"]

    def tik(path):
        return fp(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(path)))

    lines = open(CL100K).read().splitlines(keepends=True)
    copy, swapped = (
        tmp_path / "copy" / "cl100k_base.tiktoken",
        tmp_path / "swapped" / "cl100k_base.tiktoken",
    )
    for path in (copy, swapped):  # the name chooses the special tokens
        path.parent.mkdir()
    copy.write_text("".join(lines))
    a, b = lines[10].split(), lines[11].split()
    lines[10], lines[11] = f"{a[0]} {b[1]}\n", f"{b[0]} {a[1]}\n"  # two tokens swap ranks
    swapped.write_text("".join(lines))
    assert tik(copy)["sha256"] == tik(CL100K)["sha256"]
    assert tik(swapped)["sha256"] != tik(CL100K)["sha256"]


def _old_record(fingerprint: dict) -> dict:
    """The fingerprint as versions before content fingerprints wrote it (sha256 of file bytes)."""
    keep = ("type", "files", "vocab_size", "eod")
    return {**{k: fingerprint[k] for k in keep}, "sha256": fingerprint["file_sha256"]}


def test_an_old_byte_hash_sidecar_is_compared_by_bytes(demo, tmp_path):
    """A sidecar written before content fingerprints: the same files are accepted; the same
    tokenizer saved again is refused as before, saying the record is a hash of file bytes."""
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES))
    out = str(tmp_path / "d")
    preprocess(PreprocessConfig(inputs=[str(src)], output_prefix=out, tokenizer=hf(demo / "tok"),
                                append_eod=True, workers=1))  # fmt: skip
    prefix = out + "_text_document"
    side = read_sidecar(prefix)
    side["tokenizer"] = _old_record(side["tokenizer"])
    (tmp_path / "d_text_document.json").write_text(json.dumps(side))
    data = DataConfig(seq_length=8, blend=([prefix], None), split="1")
    same = build_tokenizer(hf(demo / "tok"))
    check_data(data, hf(demo / "tok"), same, same.vocab_size)
    shutil.copytree(demo / "tok", tmp_path / "resaved")
    (tmp_path / "resaved" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    resaved = build_tokenizer(hf(tmp_path / "resaved"))
    with pytest.raises(UserError, match="file sha256") as err:
        check_data(data, hf(tmp_path / "resaved"), resaved, resaved.vocab_size)
    assert "\n" not in str(err.value)


def pretrain_cmd(prefix, tokenizer_model, *extra, iters=2):
    argv = model_flags("gpt2", vocab_divisible_by=None) + train_flags(prefix, iters=iters)
    i = argv.index("--tokenizer-type")
    argv[i : i + 4] = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    argv.insert(i + 3, str(tokenizer_model))
    return [PYTHON, str(REPO / "pretrain_gpt.py"), *argv, *extra]


def train_env():
    return clean_env(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )


@pytest.fixture(scope="module")
def trained(demo):
    """Data preprocessed with the demo tokenizer and a checkpoint trained on it, run from the
    demo folder with the tokenizer given by a relative path."""
    preprocess(PreprocessConfig(inputs=[str(demo / "corpus.jsonl")], output_prefix=str(demo / "d"),
                                tokenizer=hf(demo / "tok"), append_eod=True, workers=1))  # fmt: skip
    prefix = str(demo / "d_text_document")
    cmd = pretrain_cmd(prefix, "tok", "--save", str(demo / "ck"), "--save-interval", "2")
    out = run(cmd, 600, train_env(), cwd=demo)
    assert out.returncode == 0, out.stdout[-4000:]
    return prefix, demo / "ck"


def step_meta(checkpoint):
    (path,) = checkpoint.glob("global_step*/pretrain_meta.json")
    return path


@pytest.mark.slow  # over 10 s of end-to-end tool runs: not in `make test-fast`
@pytest.mark.timeout(900)
def test_continued_training_from_the_export_is_accepted(trained, demo, tmp_path):
    """docs/CONVERSION.md: export, import, and train on with `--tokenizer-model HF_DIR` (the
    export's rewritten tokenizer files) against the data the checkpoint was trained on
    (before: refused, "tokenized with HuggingFaceTokenizer (sha256 d4cf...), but this run uses
    HuggingFaceTokenizer (sha256 e158...)")."""
    prefix, checkpoint = trained
    meta = json.loads(step_meta(checkpoint).read_text())
    assert meta["tokenizer"]["tokenizer_model"] == str(demo / "tok")  # recorded absolute
    # exported from another folder than the training ran in: the recorded path is found
    export = tool("convert_to_hf.py", "--load", str(checkpoint), "--output-dir", "hf", cwd=tmp_path)
    assert export.returncode == 0, export.stdout + export.stderr
    hf_dir = tmp_path / "hf"
    assert check_tokenizer(meta, fp(hf(hf_dir)), False, str(checkpoint)) is None  # a resume
    imported = tool("convert_from_hf.py", "--load", str(hf_dir), "--save", str(tmp_path / "from_hf"),
                    "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1")  # fmt: skip
    assert imported.returncode == 0, imported.stdout + imported.stderr
    cmd = pretrain_cmd(prefix, hf_dir, "--load", str(tmp_path / "from_hf"), "--finetune")
    out = run(cmd, 600, train_env())
    assert out.returncode == 0, out.stdout[-4000:]
    assert "done: 2 iterations" in out.stdout, out.stdout[-3000:]


@pytest.mark.slow  # over 10 s of end-to-end tool runs: not in `make test-fast`
@pytest.mark.timeout(900)
def test_convert_finds_a_moved_tokenizer_by_flag_checked_against_the_fingerprint(
    trained, demo, tmp_path
):
    """A checkpoint recording a relative tokenizer path (as before absolute paths), exported from
    another folder: one line naming the flag; the flag with the same tokenizer (its own files or
    the export's) works; another tokenizer is refused in one line naming both."""
    _, checkpoint = trained
    moved = tmp_path / "ck"
    shutil.copytree(checkpoint, moved)
    meta_path = step_meta(moved)
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"]["tokenizer_model"] = "tok"
    meta_path.write_text(json.dumps(meta))
    line = one_error_line(
        tool("convert_to_hf.py", "--load", str(moved), "--output-dir", "a", cwd=tmp_path)
    )
    assert "tok (recorded --tokenizer-model) is not here; pass --tokenizer-model PATH" in line
    ok = tool("convert_to_hf.py", "--load", str(moved), "--output-dir", "b",
              "--tokenizer-model", str(demo / "tok"), cwd=tmp_path)  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    again = tool("convert_to_hf.py", "--load", str(moved), "--output-dir", "c",
                 "--tokenizer-model", str(tmp_path / "b"), cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    other = edited(demo / "tok", tmp_path / "other", _swap_two_merges)
    line = one_error_line(tool("convert_to_hf.py", "--load", str(moved), "--output-dir", "d",
                               "--tokenizer-model", str(other), cwd=tmp_path))  # fmt: skip
    ours, theirs = meta["tokenizer_fingerprint"]["sha256"][:12], fp(hf(other))["sha256"][:12]
    assert f"trained with HuggingFaceTokenizer (sha256 {ours}" in line
    assert f"--tokenizer-model {other} give HuggingFaceTokenizer (sha256 {theirs}" in line
    assert not (tmp_path / "d").exists()


def test_an_old_checkpoint_record_is_compared_by_bytes(demo, tmp_path):
    """A checkpoint's byte-hash fingerprint (before content fingerprints): the same files resume;
    other files of the same tokenizer are refused as before, in one line saying "file sha256"."""
    meta = {"tokenizer_fingerprint": _old_record(fp(hf(demo / "tok")))}
    assert check_tokenizer(meta, fp(hf(demo / "tok")), False, "ck") is None
    shutil.copytree(demo / "tok", tmp_path / "resaved")
    (tmp_path / "resaved" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    with pytest.raises(UserError, match="trained with HuggingFaceTokenizer \\(file sha256") as err:
        check_tokenizer(meta, fp(hf(tmp_path / "resaved")), False, "ck")
    assert "\n" not in str(err.value)
    assert check_tokenizer({"tokenizer_fingerprint": fp(hf(demo / "tok"))},
                           fp(hf(tmp_path / "resaved")), False, "ck") is None  # fmt: skip
