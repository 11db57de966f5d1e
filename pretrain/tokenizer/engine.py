"""`tiktoken` as a faster engine for byte-level BPE, used only where it gives the reference's ids.

The reference is Hugging Face `tokenizers` (what Megatron-LM's GPT2BPETokenizer and
HuggingFaceTokenizer call). tiktoken takes over a tokenizer only when all of this holds:

- the files are GPT-2 style byte-level BPE: no normalizer, the GPT-2 pre-tokenizer regex (which
  tiktoken's r50k pattern expresses: same alternatives, possessive forms, `\\s++$|\\s+(?!\\S)|\\s`
  splitting whitespace exactly like `\\s+(?!\\S)|\\s+`), no dropout, byte fallback or word affixes;
- tiktoken's BPE (merge the adjacent pair whose concatenation has the lowest id) is the merges'
  BPE: every multi-byte token is made by exactly one merge and ids grow in merge order;
- a self-check on built-in awkward texts gives the reference's ids.

Per text, what the engines could disagree on goes to the reference: added/special-token strings
(`<|endoftext|>` is one id in Megatron's ids, tiktoken's ordinary encoding would spell it out),
lone surrogates (not UTF-8), and whitespace runs of LONG_WHITESPACE or more characters (tiktoken's
regex backtracks on them and overflows its stack beyond ~10^5-10^6 characters). A tiktoken panic
on any other text also sends that text to the reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable

GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
LONG_WHITESPACE = 4096
# Coarse byte filter for long whitespace runs: ASCII whitespace (as Python's str.isspace, a superset
# of Unicode White_Space on ASCII) and every non-ASCII byte map to 0; only texts with a run of 0s
# that long get the exact (slower) regex check.
_WS_TABLE = bytes(
    0 if (b in b"\t\n\x0b\x0c\r \x1c\x1d\x1e\x1f" or b >= 0x80) else 1 for b in range(256)
)
_WS_RUN = b"\0" * LONG_WHITESPACE
_LONG_WS_RE = re.compile(r"(?<!\s)\s{" + str(LONG_WHITESPACE) + "}")
# Texts the self-check compares engine and reference on (besides the caller's special strings).
_SELF_CHECK = [
    "Hello world",
    " Hello  world \n\n",
    "I'm they're we've he'll I'd it's 'S 'LL 'ſ",
    "1234567890 3.14159 1e-10 0x1F ١٢٣ ⅷ ²",
    "漢字かなカナ한국어 中文，标点。",
    "👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇯🇵 ❤️",
    "e\u0301 a\u0308\u0323 ñ vs n\u0303",
    "مرحبا بالعالم שלום עולם \u200f\u200e",
    " \t \n\n\n   \r\n\u00a0\u3000\u2003\x85\u2028\x1c\x1f " * 8 + "x",
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f",
    "\U0001d538\U0001d539 \U00020000 \U000e0041 \U0010fffd \ufeff\ufffd \uffff",
    " " * (LONG_WHITESPACE + 3) + "a",
    "word" * 2000,
]


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte -> the byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def mergeable_ranks(
    vocab: dict[str, int], merges: list[tuple[str, str]], added: set[str]
) -> tuple[dict[bytes, int] | None, str]:
    """(tiktoken ranks, "") when tiktoken's BPE is the merges' BPE for this vocab, else (None, why)."""
    alphabet = byte_level_alphabet()
    ranks = {}
    for token, i in vocab.items():
        if token in added:
            continue
        try:
            ranks[bytes(alphabet[c] for c in token)] = i
        except KeyError:
            return None, f"token {token!r} is not in the byte-level alphabet"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "the vocabulary lacks some single-byte tokens"
    previous = -1
    for a, b in merges:
        product = vocab.get(a + b)
        if product is None or product <= previous:
            return None, f"merge {a!r} {b!r}: token ids do not grow in merge order"
        previous = product
    if len(merges) != len(ranks) - 256:
        return None, "some tokens are not made by exactly one merge"
    return ranks, ""


class NotIdentical(Exception):
    """tiktoken would not give the reference's ids for these files (the message says why)."""


class TiktokenEngine:
    """Encode with tiktoken, sending texts the engines could disagree on to `reference`."""

    def __init__(
        self,
        ranks: dict[bytes, int],
        pattern: str,
        special_strings: list[str],
        reference: Callable[[list[str]], list[list[int]]],
        prefix: tuple[int, ...] = (),
        suffix: tuple[int, ...] = (),
    ):
        import tiktoken

        try:
            self._encode = tiktoken.Encoding(
                name="pretrain-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
            ).encode_ordinary
        except ValueError as err:  # a pattern tiktoken's regex engine cannot compile
            raise NotIdentical(f"tiktoken cannot compile the pre-tokenizer regex ({err})") from None
        self._reference = reference
        self._prefix, self._suffix = list(prefix), list(suffix)
        self._specials: dict[str, list[str]] = {}  # by their first two characters, for fast `in`
        for s in special_strings:
            self._specials.setdefault(s[:2], []).append(s)
        self.routed = 0  # texts sent to the reference so far
        texts = _SELF_CHECK + special_strings
        if self.encode_batch(texts) != reference(texts):
            raise NotIdentical("tiktoken's ids differ from the reference on the self-check texts")

    def needs_reference(self, text: str) -> bool:
        """Whether `text` holds something the engines could treat differently."""
        for head, strings in self._specials.items():
            if head in text and any(s in text for s in strings):
                return True
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            return True  # lone surrogate: whatever the reference does with it
        if _WS_RUN not in data.translate(_WS_TABLE):
            return False
        return _LONG_WS_RE.search(text) is not None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The reference's ids for each text."""
        out: list[list[int] | None] = [None] * len(texts)
        routed = []
        for i, text in enumerate(texts):
            if self.needs_reference(text):
                routed.append(i)
                continue
            try:
                ids = self._encode(text)
            except BaseException as err:  # pyo3's PanicException derives from BaseException
                if type(err).__name__ != "PanicException":
                    raise
                routed.append(i)
                continue
            out[i] = self._prefix + ids + self._suffix if self._prefix or self._suffix else ids
        if routed:
            self.routed += len(routed)
            for i, ids in zip(routed, self._reference([texts[i] for i in routed]), strict=True):
                out[i] = ids
        return out
