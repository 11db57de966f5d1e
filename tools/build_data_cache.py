#!/usr/bin/env python
"""Build every dataset index cache a training run needs, before the run.

Put this script in front of your training arguments; it reads only the data, tokenizer and
sample-count flags, skips the other pretrain_gpt.py flags, and refuses anything else (a typo):

    python tools/build_data_cache.py --data-path data/shakespeare_text_document --split 949,50,1 \\
        --seq-length 1024 --train-iters 2000 --global-batch-size 16 --eval-interval 200 --eval-iters 10 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2/vocab.json --merge-file data/gpt2/merges.txt \\
        [--data-cache-path DIR] [... any other training flags ...]

Training started with the same flags finds the caches and loads them (memory-mapped) instead of
building. With a node-local --data-cache-path, run it once per node (or let training build it).
With --data-schedule, or --load CKPT of a run whose blend changes on resume, it builds the train
split training then builds: the phases' (docs/DATA.md).
With --plan it prints the blend plan of tools/plan_blend.py instead and builds nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plan_blend import add_plan_args, run_plan  # noqa: E402  (tools/, beside this script)
from tqdm import tqdm  # noqa: E402

from pretrain.cli import data_tool_parser, parse_data_tool_args  # noqa: E402
from pretrain.cli.data_tools import load_meta, run_mixture  # noqa: E402
from pretrain.data.builder import (  # noqa: E402
    build_train_valid_test_datasets,
    check_splits_before_launch,
    count_builds,
)
from pretrain.data.caches import cache_writer  # noqa: E402
from pretrain.data.checks import check_data  # noqa: E402
from pretrain.data.config import (  # noqa: E402
    SPLIT_NAMES,
    DataConfig,
    train_valid_test_num_samples,
)
from pretrain.data.files.fingerprint import PrefixFiles  # noqa: E402
from pretrain.errors import exit_on_user_error  # noqa: E402
from pretrain.outputs import ignore_file_size_signal, refuse_output  # noqa: E402
from pretrain.tokenizer import TokenizerConfig, build_tokenizer  # noqa: E402
from pretrain.training.report.logging import rank0_level  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The data, sample-count and tokenizer flags (training's own definitions), and --plan's."""
    parser = add_plan_args(data_tool_parser(__doc__))
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the blend plan (tools/plan_blend.py), build nothing",
    )
    parser.add_argument(
        "--load",
        default=None,
        help="build for the resume of this checkpoint directory (its latest step): its recorded "
        "data phases up to its iteration, these flags' from there on, as training builds them",
    )
    return parser


@exit_on_user_error
def main(argv=None) -> int:
    """Build (or verify) every split's index caches; returns the exit status."""
    ignore_file_size_signal()
    ns = parse_data_tool_args(build_parser(), argv)
    cache_writer.caller_reports()  # a writer's failure is this tool's error, not a warning
    logging.basicConfig(level=rank0_level(ns.logging_level), format="%(message)s")
    cfg = DataConfig.from_args(ns)
    if ns.plan:
        run_plan(ns, cfg)
        return 0
    if cfg.data_cache_path:  # the caches go into a folder: never over a dataset or checkpoint file
        from pretrain.checkpoint.outputs import kept_data

        refuse_output("--data-cache-path", cfg.data_cache_path, protect=kept_data)
    tok_cfg = TokenizerConfig.from_args(ns)
    tokenizer = build_tokenizer(tok_cfg)
    files = PrefixFiles(cfg.data_cache_path)  # each prefix opened once, for every step below
    check_data(cfg, tok_cfg, tokenizer, tokenizer.vocab_size, files)  # before any work
    counts = train_valid_test_num_samples(
        ns.train_iters, ns.train_samples, ns.eval_interval, ns.eval_iters, ns.global_batch_size
    )
    check_splits_before_launch(
        cfg, counts, ns.eval_iters, lambda msg: print(f"warning: {msg}", file=sys.stderr), files
    )
    # the train split training builds: --data-schedule's phases, or a re-weighted --load's
    mixture = run_mixture(cfg, counts[0], ns.global_batch_size, load_meta(ns.load))
    start = time.time()
    with tqdm(total=count_builds(cfg), desc="index caches", unit="dataset") as bar:

        def progress(what: str) -> None:
            bar.set_postfix_str(what[-60:], refresh=False)  # tqdm redraws at its own pace
            bar.update()

        datasets = build_train_valid_test_datasets(
            cfg, tokenizer, counts, progress=progress, files=files, mixture=mixture
        )
        cache_writer.wait_all()  # Megatron's per-prefix files: this tool's job, not training's
    for name, requested, ds in zip(SPLIT_NAMES, counts, datasets, strict=False):
        if ds is None:
            print(f"{name:5s}: not built (empty split)")
        else:
            print(f"{name:5s}: {type(ds).__name__} with {len(ds)} samples (requested {requested})")
    where = cfg.data_cache_path or "PREFIX/cache/GPTDataset_indices beside each prefix"
    print(f"caches ready in {where} ({time.time() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
