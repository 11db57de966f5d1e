"""`TokenizerConfig` and the Megatron-LM tokenizer flags that fill it."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields

from pretrain.flag_help import argument_group

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
SUPPORTED_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
    *SENTENCEPIECE_TYPES,
)
ENGINES = ("auto", "hf", "tiktoken")


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """Which tokenizer to build, with the paths exactly as given on the command line."""

    tokenizer_type: str | None = None
    """`--tokenizer-type`: one of SUPPORTED_TYPES."""
    vocab_file: str | None = None
    """`--vocab-file`: GPT-2 vocab.json (GPT2BPETokenizer)."""
    merge_file: str | None = None
    """`--merge-file`: GPT-2 merges.txt (GPT2BPETokenizer)."""
    tokenizer_model: str | None = None
    """`--tokenizer-model`: tokenizer.json (or its folder), .tiktoken file or SentencePiece model."""
    vocab_size: int | None = None
    """`--vocab-size`: NullTokenizer's number of ids (recorded by Megatron for TikTokenizer too)."""
    hf_include_special_tokens: bool = True
    """False with `--tokenizer-hf-no-include-special-tokens`: no BOS/EOS added to each text."""
    tiktoken_pattern: str | None = None
    """`--tiktoken-pattern`: v1, v2, cl100k_base or a regex (TikTokenizer)."""
    tokenizer_engine: str = "auto"
    """`--tokenizer-engine`: BPE engine for GPT-2 style BPE; never changes the ids."""

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> TokenizerConfig:
        """The config from parsed `add_tokenizer_args` flags (missing flags take the defaults)."""
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
            tokenizer_engine=getattr(ns, "tokenizer_engine", None) or "auto",
        )

    def record(self) -> dict:
        """The flags as a JSON object with absolute paths (a data sidecar's `tokenizer_flags`, a
        checkpoint's `tokenizer`), so that a tool run from another folder can rebuild the
        tokenizer (`from_record`)."""
        out = dataclasses.asdict(self)
        for key in ("vocab_file", "merge_file", "tokenizer_model"):
            if out[key]:
                out[key] = os.path.abspath(out[key])
        return out

    @classmethod
    def from_record(cls, record: dict) -> TokenizerConfig:
        """The config `record()` wrote (unknown entries ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron-LM's tokenizer flags (plus `--tokenizer-engine`) to `parser`'s "tokenizer"
    group."""
    g = argument_group(parser, "tokenizer")
    g.add_argument("--tokenizer-type", metavar="NAME", help=f"one of {', '.join(SUPPORTED_TYPES)}")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument(
        "--tokenizer-model",
        help="HuggingFaceTokenizer: tokenizer.json or a folder holding one; TikTokenizer: a "
        ".tiktoken file; SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: "
        "a SentencePiece .model file",
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
        metavar="PATTERN",
        help="TikTokenizer: v1, v2, cl100k_base or a regex [default: from the file name, e.g. "
        "cl100k_base]",
    )
    g.add_argument(
        "--tokenizer-engine",
        choices=ENGINES,
        default="auto",
        help="BPE engine for GPT2BPETokenizer and byte-level HuggingFaceTokenizer files: auto "
        "(tiktoken where it is proven to give the same ids as Hugging Face tokenizers, else "
        "tokenizers), hf, or tiktoken (refused where not proven). The ids never depend on it.",
    )
    return parser
