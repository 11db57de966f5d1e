"""The tiktoken BPE engine: chosen only where proven, ids equal transformers' GPT2TokenizerFast
(Megatron's GPT2BPETokenizer) on awkward text, risky texts routed to the reference, files where
tiktoken's BPE would differ fall back (auto) or are refused (tiktoken)."""

import json
import shutil

import pytest
from tokenizer_fixtures import MERGES, VOCAB, awkward_texts

from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig, build_tokenizer
from pretrain.tokenizer.engine import LONG_WHITESPACE


def gpt2(engine="auto", vocab=VOCAB, merges=MERGES):
    return build_tokenizer(
        TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(vocab),
            merge_file=str(merges),
            tokenizer_engine=engine,
        )
    )


@pytest.fixture(scope="module")
def fast():
    tok = gpt2("tiktoken")
    assert tok.engine == "tiktoken"
    return tok


def risky_texts():
    """What the engines could treat differently, and what they must not."""
    return [
        "a<|endoftext|>b <|endoftext|>",
        "<|endoftext|>",
        "<|endoftext",
        " " * (LONG_WHITESPACE + 5) + "a",
        " \n" * 400_000 + "x",  # tiktoken's regex overflows its stack on this: must be routed
        "\t" * (LONG_WHITESPACE - 1) + "b",
        "y" * 200_000,
        "antidisestablishmentarianism" * 3000,
        "I'M YOU'RE it'S 'll 've 're 'd 'ſ",
        "".join(chr(c) for c in range(0x20, 0x3000, 7)),
        "".join(chr(c) for c in range(0x1F000, 0x1FB00, 3)),
        "\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000 end",
    ]


def test_ids_equal_megatron_reference(fast, hf_reference):
    texts = awkward_texts(seed=11, n=80) + risky_texts()
    for text, ids in zip(texts, fast.tokenize_batch(texts), strict=True):
        assert ids == hf_reference(text).input_ids, repr(text[:60])


def test_risky_texts_are_routed_and_plain_ones_are_not(fast):
    engine = fast._fast
    before = engine.routed
    fast.tokenize_batch(["Hello world", "æ and ñ", " " * (LONG_WHITESPACE - 1) + "x"])
    assert engine.routed == before
    fast.tokenize_batch(risky_texts()[:5])  # all but "<|endoftext" (not the special token)
    assert engine.routed == before + 4


def test_lone_surrogate_is_treated_as_the_reference_treats_it(fast):
    reference = gpt2("hf")
    for text in ["a\ud800b", "\udfff"]:
        with pytest.raises(Exception) as theirs:
            reference.tokenize(text)
        with pytest.raises(type(theirs.value)):
            fast.tokenize(text)


def test_auto_picks_tiktoken_for_gpt2_and_hf_when_forced():
    assert gpt2().engine == "tiktoken"
    assert gpt2("hf").engine == "hf"


def test_unproven_files_fall_back_or_are_refused(tmp_path, hf_reference):
    """Swap two merged tokens' ids: the merges still define the reference's ids, but tiktoken's
    rank order would no longer be the merge order."""
    from transformers import GPT2TokenizerFast

    vocab = json.load(open(VOCAB, encoding="utf-8"))
    inverse = {i: t for t, i in vocab.items()}
    vocab[inverse[300]], vocab[inverse[40000]] = 40000, 300
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    shutil.copyfile(MERGES, tmp_path / "merges.txt")
    tok = gpt2("auto", tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert tok.engine == "hf"
    reference = GPT2TokenizerFast.from_pretrained(str(tmp_path))
    texts = awkward_texts(seed=12, n=10) + [inverse[300].replace("Ġ", " ") * 3]
    assert tok.tokenize_batch(texts) == [reference(t).input_ids for t in texts]
    with pytest.raises(UserError, match="--tokenizer-engine tiktoken: not proven"):
        gpt2("tiktoken", tmp_path / "vocab.json", tmp_path / "merges.txt")


@pytest.mark.parametrize("include_special", [True, False])
def test_tokenizer_json_with_a_bos_template(tmp_path, include_special):
    """A byte-level tokenizer.json whose post-processor adds BOS: tiktoken runs it, the template's
    ids are added exactly as `tokenizers` adds them (and not with the special tokens flag off)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    gpt2().save_pretrained(str(tmp_path))
    backend = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 50256)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    cfg = TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(tmp_path),
        hf_include_special_tokens=include_special,
    )
    ours, reference = build_tokenizer(cfg), HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ours.engine == "tiktoken"
    texts = awkward_texts(seed=13, n=20) + risky_texts()[:4]
    expected = [e.ids for e in reference.encode_batch(texts, add_special_tokens=include_special)]
    assert ours.tokenize_batch(texts) == expected
    assert (ours.tokenize("hi")[0] == 50256) == include_special
