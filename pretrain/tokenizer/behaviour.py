"""What a tokenizer does to text, as plain JSON data: the input of its content fingerprint.

Each `Tokenizer.behaviour()` describes how text becomes ids, and nothing else, so that the same
tokenizer saved twice (other bytes, other key order, another `tokenizers` version's spelling of
the merges) or exported by tools/convert_to_hf.py and loaded again is described identically:

- `tokenizers` pipelines (GPT2BPETokenizer, HuggingFaceTokenizer): the backend's own JSON
  (`Tokenizer.to_str()`) without what never changes ids (`version`, `padding`, `truncation`,
  the `decoder`, ByteLevel's `trim_offsets`), merges as [left, right] pairs, added tokens in id
  order, and the post-processor reduced to the ids it puts around one text (none: no post-
  processor; an export's template `[A]` adds none, so it is none too).
- TikTokenizer: the ranks, the split regex and the special tokens.
- SentencePiece: the model proto's pieces and (de)normaliser, and the trainer options that
  change encoding (model type, byte fallback, whitespace), not its training inputs.
- NullTokenizer: the number of ids.
"""

from __future__ import annotations

import base64

# trainer_spec fields of a SentencePiece model that change how a text is encoded
_SP_ENCODING_OPTIONS = (
    "model_type",
    "byte_fallback",
    "treat_whitespace_as_suffix",
    "split_digits",
    "unk_id",
    "bos_id",
    "eos_id",
    "pad_id",
)


def hf_pipeline(backend_json: dict, add_special_tokens: bool) -> dict:
    """The parts of a `tokenizers` JSON that make the ids of one text (see the module doc)."""
    model = dict(backend_json.get("model") or {})
    if "merges" in model:
        model["merges"] = [
            m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]
        ]
    added = sorted(backend_json.get("added_tokens") or [], key=lambda t: t.get("id", -1))
    post = _post_processor(backend_json.get("post_processor")) if add_special_tokens else None
    return {
        "scheme": "tokenizers",
        "normalizer": backend_json.get("normalizer"),
        "pre_tokenizer": _without_offsets(backend_json.get("pre_tokenizer")),
        "model": model,
        "added_tokens": added,
        "post_processor": post,
    }


def _without_offsets(component):
    """`component` without ByteLevel's `trim_offsets` (it moves offsets, never ids)."""
    if isinstance(component, dict):
        return {
            k: _without_offsets(v)
            for k, v in component.items()
            if not (k == "trim_offsets" and component.get("type") == "ByteLevel")
        }
    if isinstance(component, list):
        return [_without_offsets(c) for c in component]
    return component


def _post_processor(post: dict | None):
    """What a post-processor adds to one text: None when nothing (none, ByteLevel, a template
    of the text alone, a Sequence of those); a template's ids before/after the text; any other
    kind as it is."""
    if post is None or post.get("type") == "ByteLevel":
        return None
    if post.get("type") == "Sequence":
        parts = [p for p in (_post_processor(q) for q in post.get("processors", [])) if p]
        return None if not parts else parts[0] if len(parts) == 1 else parts
    if post.get("type") == "TemplateProcessing":
        pieces = []
        for piece in post.get("single", []):
            if "Sequence" in piece:
                pieces.append("TEXT")
            else:
                name = piece["SpecialToken"]["id"]
                pieces.extend(post["special_tokens"][name]["ids"])
        return None if pieces == ["TEXT"] else {"template": pieces}
    return _without_offsets(post)


def tiktoken_encoding(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> dict:
    """A tiktoken encoding: its ranks (base64 tokens in rank order), split regex, special tokens."""
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    return {
        "scheme": "tiktoken",
        "ranks": [[base64.b64encode(token).decode("ascii"), rank] for token, rank in ordered],
        "pattern": pattern,
        "special_tokens": dict(sorted(specials.items())),
    }


def sentencepiece_model(serialized: bytes) -> dict:
    """A SentencePiece model proto: pieces, normaliser, denormaliser, encoding options."""
    from google.protobuf.json_format import MessageToDict
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(serialized)
    trainer = MessageToDict(proto.trainer_spec, preserving_proto_field_name=True)
    options = {name: trainer.get(name) for name in _SP_ENCODING_OPTIONS}
    return {
        "scheme": "sentencepiece",
        "pieces": [[p.piece, p.score, p.type] for p in proto.pieces],
        "normalizer": MessageToDict(proto.normalizer_spec, preserving_proto_field_name=True),
        "denormalizer": MessageToDict(proto.denormalizer_spec, preserving_proto_field_name=True),
        "options": options,
    }
