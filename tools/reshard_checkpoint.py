#!/usr/bin/env python
"""Re-cut a pretrain_gpt.py checkpoint for another tensor/pipeline-parallel layout, offline.

    python tools/reshard_checkpoint.py --load checkpoints/run_tp2_pp2 --save checkpoints/run_tp8 \\
        --target-tensor-parallel-size 8 --target-pipeline-parallel-size 1

`pretrain_gpt.py --load` already resumes any checkpoint at any layout, but then every rank of
every job merges its parameters from all the saved TP shards. This tool does that work once: the
output holds the same training state (fp32 master weights, Adam moments and steps, LR schedule,
data position) cut into one file per target (TP rank, pipeline stage), so each rank of a job at
the target TP/PP reads only its own file. Data parallelism, the ZeRO stage and an MoE model's
expert parallelism stay free at launch.
Resume with `pretrain_gpt.py --load NEW --tensor-model-parallel-size T
--pipeline-model-parallel-size P ...` (the run's other flags unchanged). The output is written
under a temporary name and renamed when complete. docs/CHECKPOINTS.md has details.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # reading checkpoints needs no accelerator

from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import ignore_file_size_signal, refuse_output  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--load", required=True, help="checkpoint directory (pretrain_gpt.py --save DIR)"
    )
    p.add_argument(
        "--iteration", type=int, help="which global_step<N> (default: the one --load resumes)"
    )
    p.add_argument("--save", required=True, help="checkpoint directory to create (must not exist)")
    p.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        required=True,
        help="the --tensor-model-parallel-size of the jobs that will load it",
    )
    p.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        default=1,
        help="the --pipeline-model-parallel-size of those jobs (default 1)",
    )
    args = p.parse_args(argv)
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def _source(load: str, iteration: int | None) -> tuple[str, dict]:
    """(step folder, metadata) of the checkpoint to reshard: a complete one, as --load picks."""
    from pretrain.checkpoint.format import refuse_foreign_checkpoint, tag_for
    from pretrain.checkpoint.integrity import choose_checkpoint, step_problem

    if not os.path.isdir(load):
        raise UserError(f"--load {load}: no such directory")
    refuse_foreign_checkpoint(load)
    if iteration is not None:
        step_dir = os.path.join(load, tag_for(iteration))
        problem, meta = step_problem(step_dir)
        if problem is not None:
            raise UserError(f"--iteration {iteration}: {problem}")
        return step_dir, meta
    choice = choose_checkpoint(load)
    if choice is None:
        raise UserError(f"--load {load}: no checkpoint there (no `latest`, no global_step<N>)")
    if choice.note:
        print(f"note: {choice.note}")
    return os.path.join(load, choice.tag), choice.meta


def main(argv=None) -> None:
    """Reshard --load's checkpoint into --save."""
    args = parse_args(argv)
    ignore_file_size_signal()
    from tqdm import tqdm

    from pretrain.checkpoint.relayout import TargetLayout, reshard

    refuse_output("--save", args.save, [("--load", args.load)], nested=True)
    if os.path.exists(args.save):
        raise UserError(f"--save {args.save} exists; give a new directory (nothing was written)")
    step_dir, meta = _source(args.load, args.iteration)
    target = TargetLayout(
        tensor_parallel_size=args.target_tensor_parallel_size,
        pipeline_parallel_size=args.target_pipeline_parallel_size,
    )
    files = target.tensor_parallel_size * target.pipeline_parallel_size
    with tqdm(total=files, unit="file", desc="writing", disable=None) as bar:
        out = reshard(step_dir, meta, args.save, target, progress=bar.update)
    saved = meta["parallel"]
    print(
        f"wrote {out}: {step_dir} (iteration {meta['iteration']}, saved at TP"
        f"{saved['tensor_model_parallel_size']} PP{saved['pipeline_model_parallel_size']}) "
        f"resharded to TP{target.tensor_parallel_size} PP{target.pipeline_parallel_size}"
    )
    print(
        f"resume with: pretrain_gpt.py --load {args.save} --tensor-model-parallel-size "
        f"{target.tensor_parallel_size} --pipeline-model-parallel-size "
        f"{target.pipeline_parallel_size} (any data-parallel size and --zero-stage; the run's "
        f"other flags unchanged)"
    )


if __name__ == "__main__":
    exit_on_user_error(main)()
