#!/usr/bin/env python
"""Convert a Megatron-LM checkpoint (megatron-core GPT, any TP/PP/EP) to ours and/or Hugging Face.

    python tools/convert_from_megatron.py --load megatron_ckpt --save checkpoints/from_megatron \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1
    python tools/convert_from_megatron.py --load megatron_ckpt --output-dir hf_export/from_megatron

Reads Megatron-LM's `torch` format (iter_<N>/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt, the iteration
named by latest_checkpointed_iteration.txt unless --iteration) and its `torch_dist` format
(.metadata + __*.distcp + common.pt, read with torch's distributed-checkpoint reader). The
model is described by the checkpoint's saved `args`; weights only (no optimizer state). With
--save the result is a weights-only checkpoint for `pretrain_gpt.py --load DIR --finetune` at
the target TP/PP (the flags to pass are printed); with --output-dir a Hugging Face folder. No
code from the checkpoint runs (docs/CHECKPOINTS.md). docs/CONVERSION.md has details.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from pretrain.atomic import give_plain_modes, make_temp_folder  # noqa: E402
from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import ignore_file_size_signal, refuse_output, reported_writes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--load", required=True, help="Megatron-LM --save directory (or an iter_<N>)")
    p.add_argument("--iteration", type=int, help="which iter_<N> (default: the tracker file's)")
    p.add_argument("--save", help="our checkpoint directory to create (for --finetune)")
    p.add_argument("--output-dir", help="Hugging Face folder to create")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="for --save")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="for --save")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="the tokenizer's true vocabulary size (default: from the tokenizer in args if its "
        "files exist here, else every padded row is kept)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="Hugging Face safetensors shard size")
    args = p.parse_args(argv)
    if not (args.save or args.output_dir):
        raise UserError("give --save (our checkpoint) and/or --output-dir (Hugging Face)")
    return args


def _tokenizer(megatron_args):
    """(TokenizerConfig, tokenizer or None) from Megatron's args, if its files are here."""
    from pretrain.convert.hf_folder import build_tokenizer_from_checkpoint
    from pretrain.tokenizer import TokenizerConfig

    config = TokenizerConfig.from_args(megatron_args)
    try:
        return config, build_tokenizer_from_checkpoint(config)
    except UserError as err:
        print(f"note: no tokenizer ({err})")
        return TokenizerConfig(), None


def _write_hf(out_dir: str, ck, tok_config, tokenizer, max_shard_size: str) -> None:
    from pretrain.convert.hf_folder import build_hf_model, save_hf_tokenizer, special_tokens

    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"--output-dir {out_dir} exists and is not empty (nothing was written)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = make_temp_folder(parent, f".{os.path.basename(os.path.abspath(out_dir))}.partial.")
    try:
        dtype = next(iter(ck.state_dict.values())).dtype
        model = build_hf_model(
            ck.state_dict, ck.config, special_tokens(tok_config, tokenizer), dtype
        )
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        save_hf_tokenizer(tok_config, tokenizer, tmp)
        give_plain_modes(tmp)  # safetensors writes 0600 files
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out_dir}: {', '.join(sorted(os.listdir(out_dir)))}")


def _refuse_outputs(args) -> None:
    """Neither output may be --load (or hold or lie in it), the other output, or an existing
    dataset's or checkpoint's file."""
    from pretrain.checkpoint.outputs import kept_data

    inputs = [("--load", args.load)]
    for flag, out in (("--save", args.save), ("--output-dir", args.output_dir)):
        if out:
            refuse_output(flag, out, inputs, protect=kept_data)
            inputs.append((flag, out))


def main(argv=None) -> None:
    """Read the Megatron-LM checkpoint, then write the requested outputs."""
    args = parse_args(argv)
    ignore_file_size_signal()
    _refuse_outputs(args)
    from pretrain.convert.checkpoint_writer import config_for_layout, write_checkpoint
    from pretrain.convert.hf_adapter import hf_flavour
    from pretrain.convert.megatron import read_megatron_checkpoint, with_vocab_size
    from pretrain.model.config import model_flags

    ck = read_megatron_checkpoint(args.load, args.iteration, args.vocab_size)
    tok_config, tokenizer = _tokenizer(ck.args)
    if args.vocab_size is None and tokenizer is not None:
        ck = with_vocab_size(ck, tokenizer.vocab_size)
    if args.output_dir:
        hf_flavour(ck.config)  # an inexpressible model fails before anything is written
    print(
        f"read {ck.path} ({ck.checkpoint_format} format, {ck.layout.describe()}, iteration "
        f"{ck.iteration}, {sum(v.numel() for v in ck.state_dict.values()):,} parameters, "
        f"vocabulary {ck.config.vocab_size})"
    )
    if args.save:
        ttp, tpp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
        config = config_for_layout(ck.config, ttp)
        with reported_writes("--save", args.save):
            write_checkpoint(
                args.save,
                ck.state_dict,
                config,
                tp=ttp,
                pp=tpp,
                tokenizer=tok_config.record(),
                source=os.path.abspath(ck.path),
            )
        print(f"wrote {args.save} (TP={ttp}, PP={tpp})")
        print(
            "continue pretraining with: pretrain_gpt.py --load",
            args.save,
            "--finetune --tensor-model-parallel-size",
            ttp,
            "--pipeline-model-parallel-size",
            tpp,
            " ".join(model_flags(config)),
        )
    if args.output_dir:
        with reported_writes("--output-dir", args.output_dir):
            _write_hf(args.output_dir, ck, tok_config, tokenizer, args.max_shard_size)


if __name__ == "__main__":
    exit_on_user_error(main)()
