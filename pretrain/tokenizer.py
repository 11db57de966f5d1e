"""Tokenizers behind Megatron's `--tokenizer-type` flags, all on Rust/C libraries (no Python BPE loop).

- `GPT2BPETokenizer` (`--vocab-file`, `--merge-file`): the same `tokenizers` pipeline that
  transformers' GPT2TokenizerFast builds from vocab.json + merges.txt (what current Megatron-LM uses),
  so the ids are identical: byte-level BPE, GPT-2 regex, `<|endoftext|>` (50256) as a special token.
- `HuggingFaceTokenizer` (`--tokenizer-model`: a tokenizer.json or a folder holding one).
- `TikTokenizer` (`--tokenizer-model`: an OpenAI `.tiktoken` file such as cl100k_base).
- `NullTokenizer` (`--vocab-size`): text is whitespace-separated integer ids; eod = vocab size.

Every tokenizer has a batch API (`tokenize_batch`) that the preprocessing workers use.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass

from pretrain.errors import UserError

SUPPORTED_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")
# Megatron types we do not build; each gets a hint instead of a bare "unknown".
_UNSUPPORTED_HINTS = {
    "SentencePieceTokenizer": "convert the model to a tokenizer.json and use HuggingFaceTokenizer",
    "GPTSentencePieceTokenizer": "convert the model to a tokenizer.json and use HuggingFaceTokenizer",
    "Llama2Tokenizer": "use HuggingFaceTokenizer with the model's tokenizer.json",
    "BertWordPieceLowerCase": "BERT tokenizers are not used for GPT pretraining; use HuggingFaceTokenizer",
    "BertWordPieceCase": "BERT tokenizers are not used for GPT pretraining; use HuggingFaceTokenizer",
}
_GPT2_EOD = "<|endoftext|>"
# Names tried, in order, for the end-of-document token of a tokenizer.json without a config.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
# Megatron's TikTokenizer patterns (`--tiktoken-pattern v1|v2`) and the cl100k_base pattern.
_TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "cl100k_base": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
}
_CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}


@dataclass
class TokenizerConfig:
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    hf_include_special_tokens: bool = True
    tiktoken_pattern: str | None = None

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> TokenizerConfig:
        return cls(
            tokenizer_type=getattr(ns, "tokenizer_type", None),
            vocab_file=getattr(ns, "vocab_file", None),
            merge_file=getattr(ns, "merge_file", None),
            tokenizer_model=getattr(ns, "tokenizer_model", None),
            vocab_size=getattr(ns, "vocab_size", None),
            hf_include_special_tokens=not getattr(
                ns, "tokenizer_hf_no_include_special_tokens", False
            ),
            tiktoken_pattern=getattr(ns, "tiktoken_pattern", None),
        )


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron's tokenizer flags to `parser`."""
    g = parser.add_argument_group("tokenizer (Megatron-LM flag names)")
    g.add_argument("--tokenizer-type", help=f"one of {', '.join(SUPPORTED_TYPES)}")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument(
        "--tokenizer-model",
        help="HuggingFaceTokenizer: tokenizer.json or a folder holding one; TikTokenizer: a .tiktoken file",
    )
    g.add_argument(
        "--vocab-size", type=int, help="NullTokenizer: number of ids (eod is this value)"
    )
    g.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="HuggingFaceTokenizer: do not add BOS/EOS etc. to every tokenized text",
    )
    g.add_argument(
        "--tiktoken-pattern",
        help="TikTokenizer: v1, v2, cl100k_base or a regex (default: from the file name, e.g. cl100k_base)",
    )
    return parser


class Tokenizer:
    """Interface: `vocab_size` (unpadded), `eod`, `pad`, `tokenize`, `tokenize_batch`, `detokenize`."""

    vocab_size: int
    pad: int | None = None

    @property
    def eod(self) -> int:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": f"{type(self).__module__}.{type(self).__qualname__}"})

    def save_pretrained(self, out_dir: str) -> None:
        raise UserError(f"{type(self).__name__} cannot be exported to Hugging Face files")


def _require_file(path: str | None, flag: str, what: str) -> str:
    if not path:
        raise UserError(f"{flag} is required: {what}")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: file not found ({what})")
    return path


class _HFBackedTokenizer(Tokenizer):
    """Shared code for tokenizers backed by a `tokenizers.Tokenizer`."""

    def __init__(
        self, backend, add_special_tokens: bool, eod_token: str | None, pad_token: str | None
    ):
        self._backend = backend
        self._add_special = add_special_tokens
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._eod = backend.token_to_id(eod_token) if eod_token else None
        self.pad = backend.token_to_id(pad_token) if pad_token else None

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise UserError(
                f"{type(self).__name__}: the tokenizer has no end-of-document token "
                f"(add eos_token to tokenizer_config.json next to tokenizer.json)"
            )
        return self._eod

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking; the ids are those of encode()
        return [
            e.ids
            for e in self._backend.encode_batch_fast(texts, add_special_tokens=self._add_special)
        ]

    def detokenize(self, ids) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_HFBackedTokenizer):
    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import AddedToken, decoders, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        self.vocab_file = _require_file(
            vocab_file, "--vocab-file", "GPT2BPETokenizer needs the GPT-2 vocab.json"
        )
        self.merge_file = _require_file(
            merge_file, "--merge-file", "GPT2BPETokenizer needs the GPT-2 merges.txt"
        )
        try:
            vocab, merges = BPE.read_file(self.vocab_file, self.merge_file)
        except Exception as err:  # the Rust reader reports format problems as generic exceptions
            raise UserError(
                f"{self.vocab_file} / {self.merge_file}: not a GPT-2 vocab.json / merges.txt pair ({err})"
            ) from None
        # Mirrors transformers' GPT2Tokenizer backend (what Megatron-LM's GPT2BPETokenizer calls).
        backend = HFTokenizer(
            BPE(
                vocab,
                merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(_GPT2_EOD, special=True, normalized=False)])
        super().__init__(backend, add_special_tokens=True, eod_token=_GPT2_EOD, pad_token=None)

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["tokenizer_path"] = [self.vocab_file, self.merge_file]
        return ids

    def save_pretrained(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(self.vocab_file, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(self.merge_file, os.path.join(out_dir, "merges.txt"))
        self._backend.save(os.path.join(out_dir, "tokenizer.json"))


class HuggingFaceTokenizer(_HFBackedTokenizer):
    def __init__(self, tokenizer_model: str, include_special_tokens: bool = True):
        from tokenizers import Tokenizer as HFTokenizer

        if not tokenizer_model:
            raise UserError(
                "--tokenizer-model is required: HuggingFaceTokenizer needs a tokenizer.json or its folder"
            )
        folder = (
            tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(tokenizer_model)
        )
        path = (
            os.path.join(tokenizer_model, "tokenizer.json")
            if os.path.isdir(tokenizer_model)
            else tokenizer_model
        )
        self.path = _require_file(
            path, "--tokenizer-model", "HuggingFaceTokenizer needs a tokenizer.json"
        )
        try:
            backend = HFTokenizer.from_file(self.path)
        except Exception as err:
            raise UserError(f"{self.path}: not a Hugging Face tokenizer.json ({err})") from None
        config = _read_tokenizer_config(folder)
        eos, pad = _token_name(config.get("eos_token")), _token_name(config.get("pad_token"))
        if eos is None:
            eos = next((t for t in _EOS_CANDIDATES if backend.token_to_id(t) is not None), None)
        self._folder = folder
        super().__init__(
            backend, add_special_tokens=include_special_tokens, eod_token=eos, pad_token=pad
        )

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["tokenizer_path"] = [self.path]
        ids["include_special_tokens"] = str(self._add_special)
        return ids

    def save_pretrained(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(self.path, os.path.join(out_dir, "tokenizer.json"))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            src = os.path.join(self._folder, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))


def _read_tokenizer_config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(
            f"{path}: unreadable tokenizer config ({err}; fix or remove the file)"
        ) from None


def _token_name(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TikTokenizer(Tokenizer):
    """An OpenAI `.tiktoken` file (base64 token + rank per line) encoded by `tiktoken`.

    Special-token text in the data is encoded as ordinary text, so documents cannot inject EOD.
    """

    def __init__(self, tokenizer_model: str, pattern: str | None = None):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path = _require_file(
            tokenizer_model, "--tokenizer-model", "TikTokenizer needs a .tiktoken file"
        )
        stem = os.path.basename(self.path).split(".")[0]
        if pattern is None:
            if stem not in _TIKTOKEN_PATTERNS:
                raise UserError(
                    f"--tiktoken-pattern is required for {self.path}: pass v1, v2, cl100k_base or a regex"
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
        self._pattern = pattern

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["tokenizer_path"] = [self.path]
        ids["pattern"] = self._pattern
        return ids


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids in [0, vocab_size); eod = vocab_size (Megatron's rule)."""

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or vocab_size <= 0:
            raise UserError("--vocab-size is required and must be positive for NullTokenizer")
        self._inner_size = int(vocab_size)
        self.vocab_size = self._inner_size + 1

    @property
    def eod(self) -> int:
        return self._inner_size

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
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
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer `cfg` describes; UserError naming the flag or file on bad input."""
    kind = cfg.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(cfg.tokenizer_model, cfg.hf_include_special_tokens)
    if kind == "TikTokenizer":
        return TikTokenizer(cfg.tokenizer_model, cfg.tiktoken_pattern)
    if kind == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    if kind is None:
        raise UserError(f"--tokenizer-type is required: one of {', '.join(SUPPORTED_TYPES)}")
    hint = _UNSUPPORTED_HINTS.get(kind, f"use one of {', '.join(SUPPORTED_TYPES)}")
    raise UserError(f"--tokenizer-type {kind} is not supported ({hint})")
