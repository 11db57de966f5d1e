"""TikTokenizer (.tiktoken files), NullTokenizer (ids as text) and the SentencePiece tokenizers."""

from __future__ import annotations

import os

from pretrain.errors import UserError
from pretrain.tokenizer.base import Tokenizer, megatron_identity, require_file
from pretrain.tokenizer.behaviour import sentencepiece_model, tiktoken_encoding

_GPT2_EOD = "<|endoftext|>"
# Megatron's TikTokenizer patterns (`--tiktoken-pattern v1|v2`) and the cl100k_base pattern.
_TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",  # noqa: E501
    "cl100k_base": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",  # noqa: E501
}
_CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}


class TikTokenizer(Tokenizer):
    """An OpenAI `.tiktoken` file (base64 token + rank per line) encoded by `tiktoken`.

    Special-token text in the data is encoded as ordinary text, so documents cannot inject EOD.
    """

    def __init__(
        self, tokenizer_model: str, pattern: str | None = None, vocab_size: int | None = None
    ):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path = require_file(
            tokenizer_model, "--tokenizer-model", "TikTokenizer needs a .tiktoken file"
        )
        stem = os.path.basename(self.path).split(".")[0]
        self._pattern_arg, self._vocab_size_arg = pattern, vocab_size
        if pattern is None:
            if stem not in _TIKTOKEN_PATTERNS:
                raise UserError(
                    f"--tiktoken-pattern is required for {self.path}: pass v1, v2, cl100k_base or "
                    "a regex"
                )
            pattern = stem
        regex = _TIKTOKEN_PATTERNS.get(pattern, pattern)
        try:
            ranks = load_tiktoken_bpe(self.path)
        except Exception as err:
            raise UserError(f"{self.path}: not a .tiktoken file ({err})") from None
        specials = dict(_CL100K_SPECIALS) if stem == "cl100k_base" else {_GPT2_EOD: len(ranks)}
        self._enc = tiktoken.Encoding(
            name=stem, pat_str=regex, mergeable_ranks=ranks, special_tokens=specials
        )
        self.vocab_size = self._enc.n_vocab
        self._eod = specials[_GPT2_EOD]
        self._spec = (ranks, regex, specials)  # for `behaviour`

    @property
    def eod(self) -> int:
        """`<|endoftext|>`'s id."""
        return self._eod

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Ordinary encoding: special-token text stays text."""
        return [self._enc.encode_ordinary(t) for t in texts]

    def detokenize(self, ids) -> str:
        """The text of `ids`."""
        return self._enc.decode([int(i) for i in ids])

    def behaviour(self) -> dict:
        """Ranks, split regex and special tokens (`tiktoken_encoding`)."""
        return tiktoken_encoding(*self._spec)

    @property
    def unique_identifiers(self):
        """Megatron-LM main: library "tiktoken", path = --tokenizer-model, its keyword arguments
        (`pattern` and `vocab_size` only when given)."""
        kwargs: list[tuple[str, object]] = [("chat_template", None)]
        if self._pattern_arg:
            kwargs.append(("pattern", self._pattern_arg))
        if self._vocab_size_arg:
            kwargs.append(("vocab_size", self._vocab_size_arg))
        kwargs += [("num_special_tokens", 1000), ("special_tokens", None)]
        return megatron_identity(self.path, kwargs)


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids in [0, vocab_size); eod = vocab_size (the rule of
    megatron-core <= 0.16 and Megatron-DeepSpeed; Megatron-LM main uses vocab_size - 1)."""

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or vocab_size <= 0:
            raise UserError("--vocab-size is required and must be positive for NullTokenizer")
        self._inner_size = int(vocab_size)
        self.vocab_size = self._inner_size + 1

    @property
    def eod(self) -> int:
        """The id after the last text id."""
        return self._inner_size

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """The integers of each text; a ValueError for anything else or an id out of range."""
        return [self._parse(t) for t in texts]

    def _parse(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as err:
            raise ValueError(
                f"NullTokenizer text must be whitespace-separated integers ({err})"
            ) from None
        bad = next((i for i in ids if not 0 <= i < self._inner_size), None)
        if bad is not None:
            raise ValueError(f"NullTokenizer id {bad} is outside [0, {self._inner_size})")
        return ids

    def detokenize(self, ids) -> str:
        """The ids as space-separated integers."""
        return " ".join(str(int(i)) for i in ids)

    def behaviour(self) -> dict:
        """The number of text ids (the eod is the next one)."""
        return {"scheme": "null", "text_ids": self._inner_size}

    @property
    def unique_identifiers(self):
        """Megatron-LM main: no path, `vocab_size` as given, and its default `pad_id` -1."""
        return megatron_identity(None, [("vocab_size", self._inner_size), ("pad_id", -1)])


class SentencePieceTokenizer(Tokenizer):
    """`--tokenizer-type SentencePieceTokenizer|GPTSentencePieceTokenizer|Llama2Tokenizer
    --tokenizer-model x.model`, as Megatron-LM main builds all three (one class, library
    "sentencepiece", default flags): ids = the model's `encode` of the text, no BOS or EOS added;
    eod = the model's EOS id; pad = its pad id (none when the model has none); vocab size = its
    number of pieces."""

    def __init__(self, tokenizer_model: str, tokenizer_type: str = "SentencePieceTokenizer"):
        try:
            import sentencepiece
        except ImportError:
            raise UserError(
                f"--tokenizer-type {tokenizer_type} needs the sentencepiece package "
                "(pip install sentencepiece)"
            ) from None
        self.path = require_file(
            tokenizer_model, "--tokenizer-model", f"{tokenizer_type} needs a SentencePiece .model"
        )
        self.tokenizer_type = tokenizer_type
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as err:
            raise UserError(f"{self.path}: not a SentencePiece model ({err})") from None
        self.vocab_size = self._sp.get_piece_size()
        pad = self._sp.pad_id()
        self.pad = pad if pad >= 0 else None
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def eod(self) -> int:
        """The model's EOS id; a UserError if it has none."""
        eos = self._sp.eos_id()
        if eos < 0:
            raise UserError(
                f"{self.path}: the SentencePiece model has no EOS piece, which Megatron uses as "
                "end of document (train it with eos_id >= 0)"
            )
        return eos

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """The model's ids for each text, no BOS/EOS (one thread: workers give the parallelism)."""
        return self._sp.encode(texts, out_type=int, num_threads=1)

    def detokenize(self, ids) -> str:
        """The text of `ids`."""
        return self._sp.decode([int(i) for i in ids])

    def behaviour(self) -> dict:
        """The model proto as `sentencepiece_model` describes it."""
        return sentencepiece_model(self._sp.serialized_model_proto())

    @property
    def unique_identifiers(self):
        """Megatron-LM main: library "sentencepiece", path = --tokenizer-model, its defaults."""
        return megatron_identity(
            self.path,
            [
                ("chat_template", None),
                ("ignore_extra_whitespaces", True),
                ("legacy", False),
                ("special_tokens", None),
            ],
        )
