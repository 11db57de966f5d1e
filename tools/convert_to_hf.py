#!/usr/bin/env python
"""Export a pretrain_gpt.py checkpoint (any TP, PP, ZeRO 0-3) to a Hugging Face model folder.

    python tools/convert_to_hf.py --load checkpoints/demo --output-dir hf_export/demo --verify

The folder gets config.json, model.safetensors (sharded above --max-shard-size),
generation_config.json and the tokenizer files, so `AutoModelForCausalLM.from_pretrained(OUT)`
and `AutoTokenizer.from_pretrained(OUT)` work offline. GPT-2-style models become GPT2LMHeadModel,
Llama-style ones LlamaForCausalLM, mixture-of-experts ones MixtralForCausalLM, Qwen3MoeForCausalLM
or Glm4MoeForCausalLM. Everything is written to a temporary folder next to OUT and
renamed to OUT only when complete (and, with --verify, verified). docs/CONVERSION.md has details.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # reading checkpoints needs no accelerator

import torch  # noqa: E402

from pretrain.atomic import give_plain_modes, make_temp_folder  # noqa: E402
from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import (  # noqa: E402
    ignore_file_size_signal,
    refuse_output,
    reported_writes,
    write_error,
)

DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    """This tool's flags."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--load",
        "--checkpoint",
        dest="load",
        required=True,
        help="checkpoint directory (pretrain_gpt.py --save DIR), or one of its global_step<N> folders",
    )
    p.add_argument(
        "--iteration",
        type=int,
        help="which global_step<N> to export (default: the one `latest` names)",
    )
    p.add_argument(
        "--output-dir",
        required=True,
        help="the Hugging Face folder to create (must not exist or be empty, unless --overwrite)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output-dir, once the new export is complete (and verified)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weight dtype in the export (auto: as stored in the checkpoint)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split model.safetensors into shards of at most this size",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="compare our model's and transformers' logits and loss on one token batch (fail above "
        "1e-4 absolute for logits, 1e-6 relative for the loss, fp32), then print a short greedy sample",
    )
    p.add_argument(
        "--allow-tokenizer-mismatch",
        action="store_true",
        help="export even if the tokenizer given (or found at the recorded paths), or the training "
        "data's fingerprint, is another tokenizer than the checkpoint's",
    )
    from pretrain.convert.checkpoint_tokenizer import add_override_args

    add_override_args(p)
    p.add_argument("--prompt", default="First Citizen:", help="text the --verify sample continues")
    p.add_argument("--max-new-tokens", type=int, default=24, help="length of the --verify sample")
    return p.parse_args(argv)


def _check_output_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse a file, a non-empty folder (without --overwrite), and with --overwrite a folder
    that is not one of this tool's exports, naming what replacing it would delete."""
    from pretrain.convert.hf_folder import foreign_entries

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(
            f"--output-dir {out_dir} is a file (choose a folder name; nothing was written)"
        )
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise UserError(
            f"--output-dir {out_dir} exists and is not an empty folder (choose a new one or remove it; "
            f"or pass --overwrite; nothing was written)"
        )
    foreign = foreign_entries(out_dir) if os.path.isdir(out_dir) else []
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise UserError(
            f"--overwrite --output-dir {out_dir}: not an export of this tool; replacing it would "
            f"delete {', '.join(foreign[:5])}{more} (remove them yourself or choose another "
            f"--output-dir; nothing was written)"
        )


def _move_into_place(tmp: str, out_dir: str) -> None:
    """Rename the complete export to out_dir; an existing out_dir (--overwrite) is removed only after."""
    old = None
    if os.path.isdir(out_dir):
        old = f"{tmp}.old"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old)


def _no_space(err: BaseException, out_dir: str, needed: int) -> UserError | None:
    """One line for a full disk or file-size limit while writing the export (safetensors reports
    it as `SafetensorError: ... (os error N)`), else None."""
    from pretrain.data.files.indexed_dataset import no_space_error

    code = getattr(err, "errno", None)
    found = re.search(r"\(os error (\d+)\)", str(err)) if code is None else None
    code = int(found.group(1)) if found else code
    if code is None:
        return None
    full = no_space_error(out_dir, OSError(code, os.strerror(code)), needed)
    return full and UserError(f"{full}; nothing was written to {out_dir}")


def _verify(ck, tmp: str, tokenizer, has_tokenizer: bool, args) -> None:
    import transformers

    from pretrain.convert.verify import compare_logits, greedy_generate, our_model, token_batch

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, dtype=torch.float32, local_files_only=True
    ).eval()
    result = compare_logits(our_model(ck.state_dict, ck.config), hf, token_batch(ck.config))
    print(result.report())
    if not result.ok:
        raise UserError(
            f"verification failed: {result.failure()}; nothing was written to {args.output_dir} "
            f"(please report this)"
        )
    room = ck.config.max_positions  # learned position embeddings end there
    if has_tokenizer:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        prompt = hf_tokenizer(args.prompt)["input_ids"][: room // 2]
        new = greedy_generate(hf, prompt, min(args.max_new_tokens, room - len(prompt)))
        # repr: a small model's greedy text is often runs of newlines, which would print as nothing
        print(f"sample (greedy, transformers): {args.prompt + hf_tokenizer.decode(new)!r}")
    else:
        prompt = result.tokens[0, :4].tolist()
        new = greedy_generate(hf, prompt, min(args.max_new_tokens, room - len(prompt)))
        print(f"sample (greedy, transformers, token ids): {prompt} -> {new}")


def _export(args, ck, flavour: str, tok_cfg, tokenizer, dtype: torch.dtype) -> None:
    """Write the HF folder for checkpoint `ck` into a temporary folder beside --output-dir,
    verify it (--verify), rename it into place; on any failure remove it, and a full disk or an
    OSError becomes one UserError."""
    from pretrain.convert.hf_adapter import HF_CLASSES
    from pretrain.convert.hf_folder import build_hf_model, save_hf_tokenizer, special_tokens
    from pretrain.convert.model_card import model_card

    parent = os.path.dirname(os.path.abspath(args.output_dir))
    with reported_writes("--output-dir", args.output_dir):
        os.makedirs(parent, exist_ok=True)
        tmp = make_temp_folder(
            parent, f".{os.path.basename(os.path.abspath(args.output_dir))}.partial."
        )
    try:
        model = build_hf_model(ck.state_dict, ck.config, special_tokens(tok_cfg, tokenizer), dtype)
        model.save_pretrained(tmp, max_shard_size=args.max_shard_size)
        del model
        has_tokenizer = save_hf_tokenizer(tok_cfg, tokenizer, tmp)
        if not has_tokenizer:
            what = tok_cfg.tokenizer_type or "the checkpoint records no tokenizer and"
            print(f"note: {what} has no Hugging Face tokenizer files; exported the model only")
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(model_card(ck.meta, ck.config, HF_CLASSES[flavour]))
        if args.verify:
            _verify(ck, tmp, tokenizer, has_tokenizer, args)
        give_plain_modes(tmp)  # safetensors writes 0600 files
        _move_into_place(tmp, args.output_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        needed = sum(v.numel() for v in ck.state_dict.values()) * dtype.itemsize
        full = _no_space(err, args.output_dir, needed)
        if full is not None:
            raise full from None
        if isinstance(err, OSError):
            raise write_error("--output-dir", args.output_dir, err) from None
        raise


def main(argv=None) -> None:
    """Merge the checkpoint's shards, write the HF folder (atomically), optionally verify."""
    args = parse_args(argv)
    ignore_file_size_signal()
    from pretrain.checkpoint.outputs import kept_data

    refuse_output("--output-dir", args.output_dir, [("--load", args.load)], protect=kept_data)
    _check_output_dir(args.output_dir, args.overwrite)
    from pretrain.convert.checkpoint_reader import read_checkpoint
    from pretrain.convert.checkpoint_tokenizer import checkpoint_tokenizer, overrides_from_args
    from pretrain.convert.hf_adapter import HF_CLASSES, hf_flavour

    ck = read_checkpoint(args.load, args.iteration)
    flavour = hf_flavour(ck.config)  # before any writing: an inexpressible model fails here
    tok_cfg, tokenizer, fingerprint = checkpoint_tokenizer(
        ck.tokenizer, ck.meta, args.load, overrides_from_args(args), args.allow_tokenizer_mismatch
    )
    from pretrain.data.checks import check_recorded_data  # the data it was trained on

    check_recorded_data(
        ck.meta.get("data"),
        tok_cfg,
        tokenizer,
        ck.config.vocab_size,
        args.allow_tokenizer_mismatch,
        fingerprint=fingerprint,
    )
    dtype = DTYPES[args.dtype] or next(iter(ck.state_dict.values())).dtype
    print(
        f"read {ck.path} (iteration {ck.iteration}, {sum(v.numel() for v in ck.state_dict.values()):,} "
        f"parameters) -> {HF_CLASSES[flavour]}, {str(dtype).replace('torch.', '')}"
    )
    _export(args, ck, flavour, tok_cfg, tokenizer, dtype)
    print(f"wrote {args.output_dir}: {', '.join(sorted(os.listdir(args.output_dir)))}")


if __name__ == "__main__":
    exit_on_user_error(main)()
