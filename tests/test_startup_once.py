"""Start-up does each piece of work once per process: `parse_args` builds the tokenizer and opens
(validates) the data prefixes for its checks, and `pretrain` trains with those instead of
building and validating them again (`pretrain.training.run_config.Prepared`)."""

import dataclasses
import json

import pytest
from training_fixtures import PYTHON, REPO, make_corpus, model_flags, run, train_flags
from training_fixtures import test_env as clean_env  # (pytest would collect test_env)

from pretrain.cli import parse_args
from pretrain.launch import free_port
from pretrain.tokenizer import NullTokenizer
from pretrain.training.run import _prepared

# One pretrain_gpt.py process whose real constructors and readers are wrapped to count calls.
COUNTING_RUN = """
import collections, json, sys
from pretrain.data.files import fingerprint, token_stats
from pretrain.data.files.indexed_dataset import IndexedDataset
from pretrain.tokenizer import NullTokenizer
from pretrain.tokenizer import fingerprint as tokenizer_fp

counts = collections.Counter()

def counting(name, real, key):
    def wrapper(*args, **kwargs):
        counts[f"{name} {key(*args)}"] += 1
        return real(*args, **kwargs)
    return wrapper

NullTokenizer.__init__ = counting("tokenizer", NullTokenizer.__init__, lambda self, *a: "built")
IndexedDataset._validate = counting("validate", IndexedDataset._validate, lambda s, idx, b: idx)
fingerprint.read_sidecar = counting("sidecar", fingerprint.read_sidecar, lambda prefix: prefix)
token_stats.scan_max_token = counting("scan", token_stats.scan_max_token, lambda ds: ds.prefix)
tokenizer_fp.file_sha256 = counting("sha256", tokenizer_fp.file_sha256, lambda path: path)
tokenizer_fp.content_sha256 = counting(
    "content", tokenizer_fp.content_sha256, lambda tok: type(tok).__name__
)

from pretrain.cli import parse_args
from pretrain.training.run import pretrain

pretrain(parse_args(sys.argv[1:]))
print("COUNTS " + json.dumps(counts))
"""


def test_a_run_builds_its_tokenizer_and_validates_its_data_once(tmp_path):
    prefix = make_corpus(tmp_path / "corpus")  # no sidecar: Megatron-made data
    argv = model_flags("gpt2") + train_flags(prefix, iters=3)
    argv += ["--eval-interval", "3", "--eval-iters", "1", "--data-cache-path", str(tmp_path)]
    env = clean_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = run([PYTHON, "-c", COUNTING_RUN, *argv], timeout=600, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "done: 3 iterations" in out.stdout
    counts = json.loads(out.stdout.split("COUNTS ", 1)[1].splitlines()[0])
    assert counts == {
        "tokenizer built": 1,  # was 2: parse_args (vocabulary size), then the dataset builder
        f"validate {prefix}.idx": 1,  # was 5: split check, token scan, plan, builder, record
        f"sidecar {prefix}": 1,  # was 4: data check (twice), checkpoint fingerprints (twice)
        f"scan {prefix}": 1,  # its largest token id (no sidecar), kept by the .idx fingerprint
        "content NullTokenizer": 1,  # the tokenizer's content fingerprint
    }


def test_pretrain_rebuilds_what_a_replaced_config_changed(tmp_path):
    """A RunConfig whose tokenizer or data was replaced after parsing never trains with the
    tokenizer or files parse_args built for the old one."""
    prefix = make_corpus(tmp_path / "corpus")
    cfg = parse_args(model_flags("gpt2") + train_flags(prefix), env={})
    assert _prepared(cfg) is cfg.prepared
    assert isinstance(cfg.prepared.tokenizer, NullTokenizer)
    assert cfg.prepared.tokenizer.vocab_size == 101  # --vocab-size 100 + eod

    wider = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, vocab_size=300))
    assert _prepared(wider).tokenizer.vocab_size == 301
    other = make_corpus(tmp_path / "other", seed=1)
    moved = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, blend=([other], None)))
    rebuilt = _prepared(moved)
    assert rebuilt.files is not cfg.prepared.files and rebuilt.data_config == moved.data
    assert cfg == dataclasses.replace(cfg, prepared=None)  # not part of the configuration


@pytest.mark.slow  # an end-to-end run over 5 s: not in `make test-fast`
def test_a_resume_hashes_its_tokenizer_files_once(tmp_path):
    """A resumed run hashes each tokenizer file, and what the tokenizer does, once
    (`Prepared.tokenizer_fingerprint`), for the data check, the comparison with the checkpoint's
    tokenizer and the record its checkpoints keep (was three times, once for each)."""
    from tokenizer_fixtures import MERGES, VOCAB

    prefix = make_corpus(tmp_path / "corpus")
    argv = model_flags("gpt2") + train_flags(prefix, iters=3)
    i = argv.index("--tokenizer-type")
    argv[i : i + 4] = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB]
    argv += ["--merge-file", MERGES, "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    env = clean_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    first = run([PYTHON, "-c", COUNTING_RUN, *argv, "--exit-interval", "2"], 600, env, REPO)
    assert first.returncode == 0, first.stdout[-4000:]
    env["MASTER_PORT"] = str(free_port())
    resumed = run([PYTHON, "-c", COUNTING_RUN, *argv, "--load", str(tmp_path / "ck")], 600, env)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "loaded checkpoint" in resumed.stdout.lower(), resumed.stdout[-3000:]
    counts = json.loads(resumed.stdout.split("COUNTS ", 1)[1].splitlines()[0])
    assert counts[f"sha256 {VOCAB}"] == 1 and counts[f"sha256 {MERGES}"] == 1, counts
    assert counts["content GPT2BPETokenizer"] == 1, counts
