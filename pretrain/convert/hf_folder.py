"""Hugging Face model folders: write one from our weights, read one into our weights.

A folder holds `config.json`, `model.safetensors` (or shards + `model.safetensors.index.json`),
`generation_config.json` and the tokenizer files, so that `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load it without a network.

Tokenizers: a GPT-2 BPE tokenizer (vocab.json + merges.txt) becomes `GPT2Tokenizer` files with
`<|endoftext|>` as bos/eos/unk; a Hugging Face tokenizer.json keeps its file and gets its end-of-
document token as eos. NullTokenizer (test ids) and TikTokenizer have no HF tokenizer files to
write: the model is exported without them and the CLI says so.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from dataclasses import dataclass

import torch
import transformers

from pretrain.checkpoint import safe_load
from pretrain.convert.hf_adapter import (
    from_hf_config,
    from_hf_state_dict,
    to_hf_config,
    to_hf_state_dict,
)
from pretrain.convert.model_card import is_model_card
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.tokenizer import Tokenizer, TokenizerConfig, build_tokenizer

EXPORTABLE_TOKENIZERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer")
# the names an export holds: the model (save_pretrained), the tokenizer files, the model card
EXPORT_FILE = re.compile(
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens"
    r"|vocab)\.json|merges\.txt|chat_template\.jinja|README\.md"
    r"|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
)


def foreign_entries(folder: str) -> list[str]:
    """The entries of `folder` that no export (tools/convert_to_hf.py) writes: none for one of
    its exports, every entry when the folder's README.md is not the model card an export holds."""
    names = sorted(os.listdir(folder))
    if not is_model_card(os.path.join(folder, "README.md")):
        return names
    return [
        n
        for n in names
        if not (EXPORT_FILE.fullmatch(n) and os.path.isfile(os.path.join(folder, n)))
    ]


@dataclass
class SpecialTokens:
    bos: int | None
    eos: int | None
    pad: int | None


def special_tokens(cfg: TokenizerConfig, tokenizer: Tokenizer | None) -> SpecialTokens:
    """The eos/bos/pad ids the HF export declares, from the tokenizer (None without one)."""
    if tokenizer is None:
        return SpecialTokens(None, None, None)
    eos = tokenizer.eod
    # GPT-2 uses <|endoftext|> for both
    bos = eos if cfg.tokenizer_type == "GPT2BPETokenizer" else None
    return SpecialTokens(bos=bos, eos=eos, pad=getattr(tokenizer, "pad", None))


def build_tokenizer_from_checkpoint(cfg: TokenizerConfig) -> Tokenizer | None:
    """The checkpoint's tokenizer; None when it records none (e.g. imported from a folder without one)."""
    if cfg.tokenizer_type is None:
        return None
    try:
        return build_tokenizer(cfg)
    except UserError as err:
        raise UserError(
            f"the checkpoint's tokenizer cannot be loaded: {err} (the paths in pretrain_meta.json are "
            f"the ones given to pretrain_gpt.py; run from the same directory, or restore the files)"
        ) from None


def save_hf_tokenizer(cfg: TokenizerConfig, tokenizer: Tokenizer | None, out_dir: str) -> bool:
    """Write HF tokenizer files to out_dir; False (nothing written) for tokenizers HF cannot load."""
    if tokenizer is None or cfg.tokenizer_type not in EXPORTABLE_TOKENIZERS:
        return False
    # vocab.json + merges.txt + tokenizer.json, or tokenizer.json (+ config)
    tokenizer.save_pretrained(out_dir)
    eos_text = tokenizer.detokenize([tokenizer.eod])
    if cfg.tokenizer_type == "GPT2BPETokenizer":
        hf_tokenizer = transformers.GPT2Tokenizer(
            os.path.join(out_dir, "vocab.json"),  # vocab, merges
            os.path.join(out_dir, "merges.txt"),
            bos_token=eos_text,
            eos_token=eos_text,
            unk_token=eos_text,
        )
    else:
        hf_tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(out_dir, "tokenizer.json"), eos_token=eos_text
        )
    hf_tokenizer.save_pretrained(out_dir)
    return True


def build_hf_model(
    ours: dict[str, torch.Tensor], config: ModelConfig, specials: SpecialTokens, dtype: torch.dtype
) -> transformers.PreTrainedModel:
    """The transformers model holding `ours` (full, unpadded), in `dtype`."""
    hf_config = to_hf_config(config, bos=specials.bos, eos=specials.eos, pad=specials.pad)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    weights = {k: v.to(dtype) for k, v in to_hf_state_dict(ours, config).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied_head = [] if config.untie_embeddings_and_output_weights else ["lm_head.weight"]
    if unexpected or set(missing) - set(tied_head):
        raise RuntimeError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=specials.bos, eos_token_id=specials.eos, pad_token_id=specials.pad
    )
    return model.eval()


def _indexed_shards(index: str) -> list[str]:
    """The shard file names `model.safetensors.index.json` maps weights to: each a
    `.safetensors` file of its folder; UserError (one line) for any other index."""
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(
            f"{index}: not a readable JSON index ({type(err).__name__}: {err})"
        ) from None
    names = list(weight_map.values()) if isinstance(weight_map, dict) else [None]
    for name in names:
        if (
            not isinstance(name, str)
            or os.path.basename(name) != name
            or not name.endswith(".safetensors")
        ):
            raise UserError(
                f"{index}: its weight_map must map each weight to a .safetensors file of this "
                f"folder, not {name!r} (a damaged or doctored index)"
            )
    return sorted(set(names))


def _read_weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        paths = [os.path.join(folder, name) for name in _indexed_shards(index)]
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        paths = [os.path.join(folder, "model.safetensors")]
    else:
        paths = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
        if not paths:
            raise UserError(
                f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model*.bin "
                f"(not a Hugging Face model folder)"
            )
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise UserError(
            f"{folder}: missing weight shard(s) {', '.join(map(os.path.basename, missing))} "
            f"named by model.safetensors.index.json (copy the whole folder)"
        )
    weights = {}
    for path in paths:
        try:
            weights.update(
                load_file(path) if path.endswith(".safetensors") else safe_load.load(path)
            )
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - a damaged file
            raise UserError(f"{path}: cannot be read ({type(err).__name__}: {err})") from None
    return weights


def _with_gpt2_prefix(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base-model GPT-2 files (e.g. OpenAI's) name tensors `h.0...` instead of `transformer.h.0...`."""
    if "transformer.wte.weight" in weights or "wte.weight" not in weights:
        return weights
    return {(k if k.startswith("lm_head.") else "transformer." + k): v for k, v in weights.items()}


def hf_folder_tokenizer(folder: str) -> TokenizerConfig | None:
    """The folder's tokenizer as our HuggingFaceTokenizer config, if it has a tokenizer.json."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    return TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(folder)
    )


def read_hf_folder(
    folder: str, seq_length: int | None = None, make_vocab_size_divisible_by: int = 128
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(our ModelConfig, our full unpadded state dict) of a local HF GPT-2 / Llama folder."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UserError(
            f"{folder}: no config.json (point --load at a local Hugging Face model folder)"
        )
    try:
        hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"{folder}/config.json: cannot be read by transformers ({err})") from None
    config = dataclasses.replace(
        from_hf_config(hf_config, seq_length),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    weights = _read_weights(folder)
    if hf_config.model_type == "gpt2":
        weights = _with_gpt2_prefix(weights)
    return config, from_hf_state_dict(weights, config)
