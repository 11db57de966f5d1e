#!/usr/bin/env python
"""Import a local Hugging Face folder (GPT-2, Llama, Mixtral, Qwen3-MoE, GLM-4.5) as a checkpoint to
continue pretraining from.

    python tools/convert_from_hf.py --load hf_export/demo --save checkpoints/from_hf \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    deepspeed --num_gpus 4 pretrain_gpt.py --load checkpoints/from_hf --finetune \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 <the model flags printed> ...

The checkpoint holds weights only (what --finetune loads) at the target TP/PP; the training run
chooses its data-parallel size and ZeRO stage 0-2 freely. The model flags the run must pass are
printed at the end (pretrain_gpt.py checks them against the checkpoint). No network access: the
folder must be local. docs/CONVERSION.md has details.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import ignore_file_size_signal, refuse_output, reported_writes  # noqa: E402

# flags that must be at least 1 when given
_POSITIVE = (
    "target_tensor_parallel_size",
    "target_pipeline_parallel_size",
    "target_expert_tensor_parallel_size",
    "make_vocab_size_divisible_by",
    "seq_length",
)


def parse_args(argv=None) -> argparse.Namespace:
    """This tool's flags."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--load", required=True, help="local Hugging Face model folder (config.json + safetensors)"
    )
    p.add_argument(
        "--save", required=True, help="checkpoint directory to create (must not exist, or be empty)"
    )
    p.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=1,
        help="the --tensor-model-parallel-size of the run that will load it",
    )
    p.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        default=1,
        help="the --pipeline-model-parallel-size of the run that will load it",
    )
    p.add_argument(
        "--target-expert-tensor-parallel-size",
        type=int,
        help="MoE models: the --expert-tensor-parallel-size of that run (1 or the tensor-parallel "
        "size; default: the tensor-parallel size, as that flag defaults)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="the training run's flag of that name: the vocabulary is padded to a multiple of it x TP",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        help="training sequence length (default: the model's maximum positions)",
    )
    args = p.parse_args(argv)
    for name in _POSITIVE:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    return args


def _expert_tp_flags(config, args) -> list[str]:
    etp = args.target_expert_tensor_parallel_size
    if not config.is_moe or etp is None:
        return []
    return ["--expert-tensor-parallel-size", str(etp)]


def main(argv=None) -> None:
    """Read the HF folder, write our checkpoint at the target TP/PP, print the launch flags."""
    args = parse_args(argv)
    ignore_file_size_signal()
    from pretrain.checkpoint.outputs import kept_data
    from pretrain.convert.checkpoint_writer import config_for_layout, write_checkpoint
    from pretrain.convert.hf_folder import hf_folder_tokenizer, read_hf_folder
    from pretrain.model.config import model_flags

    refuse_output("--save", args.save, [("--load", args.load)], protect=kept_data)
    config, state_dict = read_hf_folder(
        args.load, args.seq_length, args.make_vocab_size_divisible_by
    )
    tokenizer = hf_folder_tokenizer(args.load)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    config = config_for_layout(config, tp)
    with reported_writes("--save", args.save):
        write_checkpoint(
            args.save,
            state_dict,
            config,
            tp=tp,
            pp=pp,
            source=os.path.abspath(args.load),
            tokenizer=None if tokenizer is None else dataclasses.asdict(tokenizer),
            expert_tp=args.target_expert_tensor_parallel_size,
        )
    print(
        f"wrote {args.save} (TP={tp}, PP={pp}, {sum(v.numel() for v in state_dict.values()):,} parameters)"
    )
    print(
        "continue pretraining with: pretrain_gpt.py --load",
        args.save,
        "--finetune --tensor-model-parallel-size",
        tp,
        "--pipeline-model-parallel-size",
        pp,
        " ".join(model_flags(config) + _expert_tp_flags(config, args)),
        "(plus the tokenizer, data and training flags; the tokenizer must have",
        config.vocab_size,
        "tokens)",
    )


if __name__ == "__main__":
    exit_on_user_error(main)()
