"""GPT2BPETokenizer and HuggingFaceTokenizer: Hugging Face `tokenizers` as the reference engine,
`tiktoken` (pretrain.tokenizer.engine) where it is proven to give the same ids."""

from __future__ import annotations

import json
import logging
import os
import shutil

from pretrain.errors import UserError
from pretrain.tokenizer.base import Tokenizer, megatron_identity, require_file
from pretrain.tokenizer.behaviour import hf_pipeline
from pretrain.tokenizer.engine import GPT2_PATTERN, NotIdentical, TiktokenEngine, mergeable_ranks

log = logging.getLogger(__name__)

GPT2_EOD = "<|endoftext|>"
# Names tried, in order, for the end-of-document token of a tokenizer.json without a config.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


class _HFBackedTokenizer(Tokenizer):
    """Shared code for tokenizers backed by a `tokenizers.Tokenizer`, optionally run by tiktoken."""

    def __init__(
        self, backend, add_special_tokens: bool, eod_token: str | None, pad_token: str | None
    ):
        self._backend = backend
        self._add_special = add_special_tokens
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._eod = backend.token_to_id(eod_token) if eod_token else None
        self.pad = backend.token_to_id(pad_token) if pad_token else None
        self._fast: TiktokenEngine | None = None
        self._pending: tuple | None = None  # (engine, spec) until the engine is chosen

    @property
    def engine(self) -> str:
        """The engine that tokenizes: "tiktoken" or "hf" (chosen now if not yet)."""
        self.prepare()
        return "hf" if self._fast is None else "tiktoken"

    def prepare(self) -> None:
        """Choose the engine now (preprocessing does it once, before its workers fork); training,
        which never tokenizes, never pays for the checks."""
        if self._pending is not None:
            engine, spec = self._pending
            self._pending = None
            self._choose_engine(engine, spec)

    def _defer_engine(self, engine: str, spec) -> None:
        """Choose per `engine` at first use; an explicit tiktoken is checked now, to fail early."""
        self._pending = (engine, spec)
        if engine == "tiktoken":
            self.prepare()

    def _choose_engine(self, engine: str, spec) -> None:
        """Use tiktoken per `engine` (auto, hf, tiktoken); `spec()` -> (ranks, pattern, prefix,
        suffix) or raises NotIdentical."""
        if engine == "hf":
            return
        try:
            ranks, pattern, prefix, suffix = spec()
            added = [t.content for t in self._backend.get_added_tokens_decoder().values()]
            self._fast = TiktokenEngine(
                ranks, pattern, added, self._reference_batch, prefix, suffix
            )
        except NotIdentical as why:
            if engine == "tiktoken":
                raise UserError(
                    f"--tokenizer-engine tiktoken: not proven to give the same ids for "
                    f"{self._describe()} ({why}); use --tokenizer-engine auto or hf"
                ) from None
            log.info("tokenizer engine: Hugging Face tokenizers (%s)", why)

    def _describe(self) -> str:
        return type(self).__name__

    @property
    def eod(self) -> int:
        """The end-of-document id; a UserError if the tokenizer has none."""
        if self._eod is None:
            raise UserError(
                f"{type(self).__name__}: the tokenizer has no end-of-document token "
                f"(add eos_token to tokenizer_config.json next to tokenizer.json)"
            )
        return self._eod

    def _reference_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking; the ids are those of encode()
        encodings = self._backend.encode_batch_fast(texts, add_special_tokens=self._add_special)
        return [e.ids for e in encodings]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (the reference's ids, whichever engine runs)."""
        self.prepare()
        if self._fast is not None:
            return self._fast.encode_batch(texts)
        return self._reference_batch(texts)

    def detokenize(self, ids) -> str:
        """The text of `ids`, special tokens kept."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def behaviour(self) -> dict:
        """The `tokenizers` pipeline as `hf_pipeline` describes it (GPT2BPETokenizer's files and
        the tokenizer.json an export writes for them describe one pipeline)."""
        return hf_pipeline(json.loads(self._backend.to_str()), self._add_special)


class GPT2BPETokenizer(_HFBackedTokenizer):
    """`--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`."""

    def __init__(
        self,
        vocab_file: str,
        merge_file: str,
        include_special_tokens: bool = True,
        engine: str = "auto",
    ):
        from tokenizers import AddedToken, decoders, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        self.vocab_file = require_file(
            vocab_file, "--vocab-file", "GPT2BPETokenizer needs the GPT-2 vocab.json"
        )
        self.merge_file = require_file(
            merge_file, "--merge-file", "GPT2BPETokenizer needs the GPT-2 merges.txt"
        )
        self._include_special = include_special_tokens  # recorded in the identity only
        try:
            vocab, merges = BPE.read_file(self.vocab_file, self.merge_file)
        except Exception as err:  # the Rust reader reports format problems as generic exceptions
            raise UserError(
                f"{self.vocab_file} / {self.merge_file}: not a GPT-2 vocab.json / merges.txt pair "
                f"({err})"
            ) from None
        # Mirrors transformers' GPT2TokenizerFast backend (what Megatron-LM's GPT2BPETokenizer calls).
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
        backend.add_special_tokens([AddedToken(GPT2_EOD, special=True, normalized=False)])
        super().__init__(backend, add_special_tokens=True, eod_token=GPT2_EOD, pad_token=None)
        self._defer_engine(engine, lambda: _gpt2_spec(vocab, merges))

    def _describe(self) -> str:
        return f"{self.vocab_file} / {self.merge_file}"

    @property
    def unique_identifiers(self):
        """Megatron-LM main: library "megatron", path = the type name, its keyword arguments."""
        return megatron_identity(
            "GPT2BPETokenizer",
            [
                ("additional_special_tokens", []),
                ("vocab_file", self.vocab_file),
                ("merges_file", self.merge_file),
                ("use_fast", True),
                ("trust_remote_code", False),
                ("include_special_tokens", self._include_special),
                ("use_gigatoken", False),
            ],
        )

    def save_pretrained(self, out_dir: str) -> None:
        """vocab.json, merges.txt and tokenizer.json in `out_dir`."""
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(self.vocab_file, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(self.merge_file, os.path.join(out_dir, "merges.txt"))
        self._backend.save(os.path.join(out_dir, "tokenizer.json"))


def _gpt2_spec(vocab: dict, merges: list) -> tuple:
    ranks, why = mergeable_ranks(vocab, merges, {GPT2_EOD})
    if ranks is None:
        raise NotIdentical(why)
    _check_reachable(vocab, merges, {GPT2_EOD})
    return ranks, GPT2_PATTERN, (), ()


def _check_reachable(vocab: dict, merges: list, added: set[str]) -> None:
    """tiktoken encodes a piece that is a whole token as that token; the merges must, too."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    bare = HFTokenizer(BPE(dict(vocab), list(merges)))  # no pre-tokenizer: keys are byte-level
    keys = [k for k in vocab if k not in added]
    for key, enc in zip(keys, bare.encode_batch_fast(keys, add_special_tokens=False), strict=True):
        if enc.ids != [vocab[key]]:
            raise NotIdentical(f"token {key!r} is not what the merges make of its bytes")


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """`--tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json|folder`."""

    def __init__(
        self, tokenizer_model: str, include_special_tokens: bool = True, engine: str = "auto"
    ):
        from tokenizers import Tokenizer as HFTokenizer

        if not tokenizer_model:
            raise UserError(
                "--tokenizer-model is required: HuggingFaceTokenizer needs a tokenizer.json or "
                "its folder"
            )
        self.model_arg = tokenizer_model
        is_dir = os.path.isdir(tokenizer_model)
        folder = tokenizer_model if is_dir else os.path.dirname(tokenizer_model)
        path = os.path.join(tokenizer_model, "tokenizer.json") if is_dir else tokenizer_model
        self.path = require_file(
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
        self._defer_engine(engine, lambda: _hf_json_spec(backend, include_special_tokens))

    def _describe(self) -> str:
        return self.path

    @property
    def unique_identifiers(self):
        """Megatron-LM main: library "huggingface", path = --tokenizer-model, its keyword arguments."""
        return megatron_identity(
            self.model_arg,
            [
                ("chat_template", None),
                ("vocab_file", None),
                ("merges_file", None),
                ("additional_special_tokens", []),
                ("use_fast", True),
                ("trust_remote_code", False),
                ("include_special_tokens", self._add_special),
                ("use_gigatoken", False),
            ],
        )

    def save_pretrained(self, out_dir: str) -> None:
        """tokenizer.json (and its config files) in `out_dir`."""
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(self.path, os.path.join(out_dir, "tokenizer.json"))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            src = os.path.join(self._folder, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))


def _hf_json_spec(backend, add_special: bool) -> tuple:
    """tiktoken's spec for a GPT-2 style byte-level BPE tokenizer.json, else NotIdentical."""
    data = json.loads(backend.to_str())
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or data.get("normalizer") is not None:
        raise NotIdentical("not a byte-level BPE model without normalizer")
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix"):
        raise NotIdentical("BPE dropout, byte fallback or subword prefix")
    if model.get("end_of_word_suffix"):
        raise NotIdentical("BPE end-of-word suffix")
    if (
        pre.get("type") != "ByteLevel"
        or not pre.get("use_regex", True)
        or pre.get("add_prefix_space")
    ):
        raise NotIdentical("the pre-tokenizer is not GPT-2's byte-level regex")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    added = {t["content"] for t in data.get("added_tokens", [])}
    ranks, why = mergeable_ranks(model["vocab"], merges, added)
    if ranks is None:
        raise NotIdentical(why)
    if not model.get("ignore_merges"):
        _check_reachable(model["vocab"], merges, added)
    prefix, suffix = _template_ids(data.get("post_processor"), add_special)
    return ranks, GPT2_PATTERN, prefix, suffix


def _template_ids(post, add_special: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a post-processor puts before and after a single text."""
    if post is None or not add_special:
        return (), ()
    kind = post.get("type")
    if kind == "ByteLevel":
        return (), ()
    if kind == "Sequence":
        parts = [_template_ids(p, add_special) for p in post["processors"]]
        if sum(1 for p, s in parts if p or s) > 1:
            raise NotIdentical("several post-processors add tokens")
        return next(((p, s) for p, s in parts if p or s), ((), ()))
    if kind != "TemplateProcessing":
        raise NotIdentical(f"post-processor {kind}")
    before, after, seen = [], [], False
    for piece in post["single"]:
        if "Sequence" in piece:
            seen = True
            continue
        ids = post["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
        (after if seen else before).extend(ids)
    return tuple(before), tuple(after)


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
