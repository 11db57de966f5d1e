"""Index-cache names: our tokenizers' `unique_identifiers` equal what Megatron-LM main's tokenizer
records for the same flags, checked against megatron-core's own tokenizer objects (0.16.1, built by
its own `build_tokenizer`) plus the keyword arguments main's `build_tokenizer` adds since; a cache
folder megatron-core filled under main's description is used by us as is."""

import argparse
import json
import os
import shutil
import warnings
from collections import OrderedDict

import numpy as np
import pytest
from tokenizer_fixtures import CL100K, MERGES, VOCAB

from pretrain.tokenizer import TokenizerConfig, build_tokenizer

# Megatron-LM main builds every text tokenizer as this class (0.16.1: a subclass per library type).
MAIN_CLASS = "megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText"
# What Megatron-LM main's megatron/core/tokenizers/utils/build_tokenizer.py passes beyond 0.16.1's
# (with main's flag defaults): key -> (value, the key it goes before: None = at the end, FIRST = the
# first keyword argument, right after class and tokenizer_path).
FIRST = "tokenizer_path+1"
MAIN_ADDS = {
    "GPT2BPETokenizer": {"use_gigatoken": ("False", None)},
    "HuggingFaceTokenizer": {
        "chat_template": ("None", FIRST),
        "use_gigatoken": ("False", None),
    },
    "TikTokenizer": {"chat_template": ("None", FIRST)},
    "SentencePieceTokenizer": {
        "chat_template": ("None", FIRST),
        "ignore_extra_whitespaces": ("True", "legacy"),
    },
    "NullTokenizer": {"pad_id": ("-1", None)},
}


def megatron_args(**kw):
    """The flags megatron-core 0.16.1's build_tokenizer reads, at Megatron-LM's defaults."""
    defaults = dict(
        tokenizer_type=None,
        tokenizer_model=None,
        vocab_file=None,
        merge_file=None,
        vocab_size=None,
        tokenizer_special_tokens=None,
        tokenizer_hf_use_fast=True,
        trust_remote_code=False,
        tokenizer_hf_include_special_tokens=True,
        tokenizer_metadata=None,
        tokenizer_sentencepiece_legacy=False,
        tiktoken_pattern=None,
        tiktoken_num_special_tokens=1000,
    )
    return argparse.Namespace(**{**defaults, **kw})


def megatron_tokenizer(**kw):
    warnings.filterwarnings("ignore")
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as mbuild

    return mbuild(megatron_args(**kw))


def main_identity(theirs, kind: str) -> OrderedDict:
    """megatron-core 0.16.1's identity with Megatron-LM main's added keyword arguments."""
    items = list(theirs.unique_identifiers.items())
    assert items[0][0] == "class"
    items[0] = ("class", MAIN_CLASS)
    for key, (value, before) in MAIN_ADDS.get(kind, {}).items():
        keys = [k for k, _ in items]
        at = len(items) if before is None else 2 if before == FIRST else keys.index(before)
        items.insert(at, (key, value))
    return OrderedDict(items)


@pytest.fixture
def gpt2_home(tmp_path, monkeypatch):
    """Megatron's GPT2BPETokenizer loads AutoTokenizer "gpt2" with --vocab-file/--merge-file; a
    local folder named gpt2 stands in for the Hub (no network)."""
    home = tmp_path / "gpt2"
    home.mkdir()
    shutil.copyfile(VOCAB, home / "vocab.json")
    shutil.copyfile(MERGES, home / "merges.txt")
    (home / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_gpt2_identity_equals_megatron(gpt2_home):
    for vocab, merges in [(VOCAB, MERGES), ("gpt2/vocab.json", "gpt2/merges.txt")]:
        theirs = megatron_tokenizer(
            tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges
        )
        ours = build_tokenizer(
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
        )
        assert ours.unique_identifiers == main_identity(theirs, "GPT2BPETokenizer")
        assert ours.tokenize("Hello world") == theirs.tokenize("Hello world")
        assert (ours.eod, ours.vocab_size) == (theirs.eod, theirs.vocab_size)


@pytest.mark.parametrize("include_special", [True, False])
def test_huggingface_identity_equals_megatron(tmp_path, include_special):
    gpt2 = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    )
    gpt2.save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2TokenizerFast", "eos_token": "<|endoftext|>"})
    )
    model = str(tmp_path / "hf")
    theirs = megatron_tokenizer(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=model,
        tokenizer_hf_include_special_tokens=include_special,
    )
    ours = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=model,
            hf_include_special_tokens=include_special,
        )
    )
    assert ours.unique_identifiers == main_identity(theirs, "HuggingFaceTokenizer")


def test_null_identity_equals_megatron():
    theirs = megatron_tokenizer(tokenizer_type="NullTokenizer", vocab_size=1000)
    ours = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=1000))
    assert ours.unique_identifiers == main_identity(theirs, "NullTokenizer")
    assert json.loads(json.dumps(ours.unique_identifiers))["tokenizer_path"] is None


@pytest.mark.parametrize("pattern,vocab_size", [(None, None), ("v2", 1300)])
def test_tiktoken_identity_equals_megatron(tmp_path, pattern, vocab_size):
    """Megatron's TikTokenizer reads a JSON vocabulary, ours a .tiktoken file: the identity is the
    same for the same flags (only the path string enters it)."""
    import base64

    from tiktoken.load import load_tiktoken_bpe

    merged = [b for b in load_tiktoken_bpe(CL100K) if len(b) > 1][:44]
    tokens = [bytes([i]) for i in range(256)] + merged  # Megatron's format: bytes first, in order
    json_vocab = tmp_path / "vocab.json"
    json_vocab.write_text(
        json.dumps(
            [
                {"rank": r, "token_bytes": base64.b64encode(b).decode(), "token_str": ""}
                for r, b in enumerate(tokens)
            ]
        )
    )
    theirs = megatron_tokenizer(
        tokenizer_type="TikTokenizer",
        tokenizer_model=str(json_vocab),
        tiktoken_pattern=pattern or "v2",
        vocab_size=vocab_size or 1300,
    )
    expected = main_identity(theirs, "TikTokenizer")
    if pattern is None:  # main records pattern / vocab_size only when the flags are given
        del expected["pattern"]
    if vocab_size is None:
        del expected["vocab_size"]
    expected["tokenizer_path"] = CL100K
    ours = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="TikTokenizer",
            tokenizer_model=CL100K,
            tiktoken_pattern=pattern,
            vocab_size=vocab_size,
        )
    )
    assert ours.unique_identifiers == expected


class _MegatronMainTokenizer:
    """Megatron's own 0.16.1 tokenizer object reporting main's identity (MAIN_ADDS)."""

    def __init__(self, theirs, kind):
        self.eod, self.pad, self.vocab_size = theirs.eod, -1, theirs.vocab_size
        self.unique_identifiers = main_identity(theirs, kind)


def test_cache_filled_by_megatron_is_used_as_is(tmp_path, gpt2_home):
    """megatron-core's GPTDataset, with Megatron's GPT-2 tokenizer, fills a cache folder; ours finds
    every file under the same name and rebuilds nothing."""
    from test_data_gpt_dataset import megatron_gpt, random_lengths, write_corpus

    from pretrain.data.config import DataConfig
    from pretrain.data.datasets.gpt_dataset import GPTDataset
    from pretrain.data.files.indexed_dataset import IndexedDataset

    mg, MIndexed, Split = megatron_gpt()
    prefix = write_corpus(str(tmp_path / "corpus"), random_lengths(200, seed=1), eod=50256)
    theirs_tok = megatron_tokenizer(
        tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES
    )
    cache = tmp_path / "cache"
    mcfg = mg.GPTDatasetConfig(
        random_seed=7,
        sequence_length=16,
        blend=([prefix], None),
        split="98,1,1",
        path_to_cache=str(cache),
        tokenizer=_MegatronMainTokenizer(theirs_tok, "GPT2BPETokenizer"),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    indices = np.arange(200, dtype=np.int32)
    theirs = mg.GPTDataset(MIndexed(prefix), prefix, indices, 300, Split.train, mcfg)
    before = {p: os.stat(cache / p).st_mtime_ns for p in os.listdir(cache)}
    ours_tok = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    )
    cfg = DataConfig(
        seq_length=16, seed=7, blend=([prefix], None), split="98,1,1", data_cache_path=str(cache)
    )
    ours = GPTDataset(IndexedDataset(prefix), prefix, indices, 300, "train", cfg, ours_tok)
    assert ours.unique_description_hash == theirs.unique_description_hash
    after = {p: os.stat(cache / p).st_mtime_ns for p in os.listdir(cache)}
    # Megatron's files were used as they are: none rewritten, nothing rebuilt; the only file
    # added is our record of the .idx fingerprint they belong to (pretrain/data/caches/cache.py)
    added = sorted(set(after) - set(before))
    assert [p for p in added if not p.endswith("-idx_fingerprint.txt")] == [], added
    assert {p: after[p] for p in before} == before
