"""Summarise a `make demo` run from its training log, as any Megatron log parser would read it.

    python tools/demo_summary.py --log runs/demo/train.log --checkpoint checkpoints/demo \
        --hf-export hf_export/demo --dataset data/shakespeare_text_document \
        --tensorboard-dir runs/demo

Reads the Megatron-format iteration lines (`iteration N/ M | consumed samples: ... | lm loss: ...`),
so it doubles as a check that the log format stays parseable.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.training.report.log_parse import read_run_log  # noqa: E402


def human_size(num_bytes: int) -> str:
    """`num_bytes` as B/KB/MB/GB with one decimal."""
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{num_bytes} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def tree_size(path: Path) -> int:
    """Bytes in a file or a folder tree."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sample(hf_dir: Path, prompt: str, new_tokens: int, temperature: float, top_k: int, seed: int):
    """Text the exported model writes after `prompt` (transformers, sampled with a fixed seed)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    room = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            max_new_tokens=min(new_tokens, room - ids.shape[1]),
            pad_token_id=tok.eos_token_id,
        )
    return tok.decode(out[0], skip_special_tokens=True)


def _parse_args() -> argparse.Namespace:
    """This tool's flags."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log", type=Path, required=True, help="training log (rank 0's stdout)")
    parser.add_argument(
        "--seq-length", type=int, required=True, help="tokens per sample, as trained"
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--hf-export", type=Path, required=True)
    parser.add_argument("--dataset", required=True, help="dataset prefix (PREFIX.bin/.idx)")
    parser.add_argument("--tensorboard-dir", type=Path, required=True)
    parser.add_argument("--curves", type=Path, default=None, help="the plot_run.py PNG, if drawn")
    g = parser.add_argument_group("sample")
    g.add_argument("--prompt", default="ROMEO:", help="text the sample continues")
    g.add_argument("--sample-tokens", type=int, default=120, help="new tokens to sample")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument(
        "--sample-seed", type=int, default=1234, help="torch seed: the same text each run"
    )
    return parser.parse_args()


def _print_run(args: argparse.Namespace, run) -> None:
    """The files the demo produced, the tokens it saw, its loss, throughput and validation
    (`run`: the parsed log, at least one iteration line)."""
    rows = run.rows
    first, last = rows[0], rows[-1]
    consumed = int(last["consumed samples"])
    tokens_per_s = [float(r["tokens per second"]) for r in rows if "tokens per second" in r]
    print("=" * 78)
    print(" make demo: done")
    print("=" * 78)
    print(" files produced:")
    for path in (
        Path(args.dataset + ".bin"),
        Path(args.dataset + ".idx"),
        args.checkpoint,
        args.hf_export,
    ):
        if path.exists():
            print(f"   {str(path):<48} {human_size(tree_size(path)):>10}")
    print(
        f" tokens seen:     {consumed * args.seq_length:,} ({consumed:,} samples x {args.seq_length})"
    )
    print(
        f" lm loss:         {float(first['lm loss']):.4f} at iteration {first['iteration']}"
        f" -> {float(last['lm loss']):.4f} at iteration {last['iteration']}"
    )
    if tokens_per_s:
        print(
            f" throughput:      {sum(tokens_per_s) / len(tokens_per_s):,.0f} tokens/s"
            f" (mean of {len(tokens_per_s)} log lines; CPU, gloo)"
        )
    if run.validation:
        it, loss = run.validation[-1]
        print(
            f" validation:      lm loss {loss:.4f}, perplexity {math.exp(min(loss, 20.0)):,.1f}"
            f" at iteration {it}"
        )


def _print_sample(args: argparse.Namespace) -> None:
    """A sample from the Hugging Face export, when there is one."""
    if (args.hf_export / "config.json").is_file():
        text = sample(
            args.hf_export, args.prompt, args.sample_tokens, args.temperature, args.top_k,
            args.sample_seed,
        )  # fmt: skip
        print(
            f" sample:          transformers, temperature {args.temperature}, top-k {args.top_k}, "
            f"seed {args.sample_seed}"
        )
        print("-" * 78)
        print(text.strip())
        print("-" * 78)


def _print_next(args: argparse.Namespace) -> None:
    """Where the outputs are and what to run next."""
    if args.curves is not None and args.curves.is_file():
        print(f" curves:          {args.curves}")
    print(" next:")
    print(f"   training log        {args.log}")
    print(f"   TensorBoard         .venv/bin/tensorboard --logdir {args.tensorboard_dir}")
    print(f"   Hugging Face model  AutoModelForCausalLM.from_pretrained({str(args.hf_export)!r})")
    print("   your own corpus     make preprocess CORPUS=path/to/corpus.jsonl, then docs/LAUNCH.md")
    print("=" * 78)


@exit_on_user_error
def main() -> None:
    """Print the demo's summary: losses from the log, sizes, the export and a sample."""
    args = _parse_args()
    if not args.log.is_file():
        raise UserError(f"{args.log}: no training log (run `make demo` or `make train` first)")
    run = read_run_log(args.log, args.seq_length)
    if not run.rows:
        raise UserError(f"{args.log}: no Megatron-format iteration lines found (did training run?)")
    _print_run(args, run)
    _print_sample(args)
    _print_next(args)


if __name__ == "__main__":
    main()
