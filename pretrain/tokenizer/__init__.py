"""Tokenizers behind Megatron's `--tokenizer-type` flags, all on Rust/C libraries (no Python BPE loop).

- `GPT2BPETokenizer` (`--vocab-file`, `--merge-file`): the ids of transformers' GPT2TokenizerFast
  from vocab.json + merges.txt (what Megatron-LM uses): byte-level BPE, GPT-2 regex,
  `<|endoftext|>` (50256) as a special token. Run by `tiktoken` where proven identical
  (`--tokenizer-engine`, see `engine.py`), else by Hugging Face `tokenizers`.
- `HuggingFaceTokenizer` (`--tokenizer-model`: a tokenizer.json or a folder holding one).
- `TikTokenizer` (`--tokenizer-model`: an OpenAI `.tiktoken` file such as cl100k_base).
- `SentencePieceTokenizer`, `GPTSentencePieceTokenizer`, `Llama2Tokenizer` (`--tokenizer-model`:
  a SentencePiece .model), as Megatron-LM main defines them.
- `NullTokenizer` (`--vocab-size`): text is whitespace-separated integer ids; eod = vocab size.

Every tokenizer has a batch API (`tokenize_batch`) that the preprocessing workers use, and the
`unique_identifiers` Megatron-LM main records for the same flags (so index caches are shared).
"""

from __future__ import annotations

from pretrain.errors import UserError
from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.bpe import GPT2BPETokenizer, HuggingFaceTokenizer
from pretrain.tokenizer.config import (
    ENGINES,
    SENTENCEPIECE_TYPES,
    SUPPORTED_TYPES,
    TokenizerConfig,
    add_tokenizer_args,
)
from pretrain.tokenizer.others import NullTokenizer, SentencePieceTokenizer, TikTokenizer

__all__ = [
    "ENGINES",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SUPPORTED_TYPES",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "add_tokenizer_args",
    "build_tokenizer",
]

# Megatron types we do not build; each gets a hint instead of a bare "unknown".
_UNSUPPORTED_HINTS = {
    "BertWordPieceLowerCase": "BERT tokenizers are not used for GPT pretraining",
    "BertWordPieceCase": "BERT tokenizers are not used for GPT pretraining",
}


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer `cfg` names; a one-line UserError for a bad or missing flag or file."""
    kind = cfg.tokenizer_type
    if cfg.tokenizer_engine not in ENGINES:
        raise UserError(
            f"--tokenizer-engine {cfg.tokenizer_engine}: use one of {', '.join(ENGINES)}"
        )
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            cfg.vocab_file, cfg.merge_file, cfg.hf_include_special_tokens, cfg.tokenizer_engine
        )
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(
            cfg.tokenizer_model, cfg.hf_include_special_tokens, cfg.tokenizer_engine
        )
    if kind == "TikTokenizer":
        return TikTokenizer(cfg.tokenizer_model, cfg.tiktoken_pattern, cfg.vocab_size)
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(cfg.tokenizer_model, kind)
    if kind == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    if kind is None:
        raise UserError(f"--tokenizer-type is required: one of {', '.join(SUPPORTED_TYPES)}")
    hint = _UNSUPPORTED_HINTS.get(kind, f"use one of {', '.join(SUPPORTED_TYPES)}")
    raise UserError(f"--tokenizer-type {kind} is not supported ({hint})")
