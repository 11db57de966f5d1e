#!/usr/bin/env python
"""Which documents were in the batch of iteration N? (e.g. the one where the loss spiked)

Put this script in front of the run's data, batch and tokenizer flags (other training flags are
ignored); it opens, or builds, the same index caches as training and never trains:

    python tools/explain_batch.py --data-path data/shakespeare_text_document --split 949,50,1 \\
        --seq-length 256 --train-iters 300 --global-batch-size 8 --micro-batch-size 4 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2/vocab.json \\
        --merge-file data/gpt2/merges.txt --iteration 120 [--data-parallel-size 2 --dp-rank 1] [--json]

For every sample of the iteration's global batch: iteration, dp_rank, micro_batch, sample (its
position in the train dataset's order), dataset (the prefix), dataset_sample (its index in that
prefix's GPTDataset) and documents ([document_id, first_token, end_token] the sample's window
covers), then the decoded start of each document. --json prints one JSON object per sample.
--iteration A-B explains a range; --grep TEXT lists the iterations (from --iteration, at most
--max-iterations of them) whose batch holds a document containing TEXT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from pretrain.cli import data_tool_parser, parse_data_tool_args  # noqa: E402
from pretrain.cli.data_tools import load_meta, run_mixture  # noqa: E402
from pretrain.data.blends.explain import SampleOrigin, explain_iteration  # noqa: E402
from pretrain.data.builder import build_train_valid_test_datasets  # noqa: E402
from pretrain.data.checks import check_data  # noqa: E402
from pretrain.data.config import (  # noqa: E402
    DataConfig,
    train_valid_test_num_samples,
)
from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import refuse_output  # noqa: E402
from pretrain.tokenizer import TokenizerConfig, build_tokenizer  # noqa: E402
from pretrain.training.loop.skip import flatten_iterations, iteration_spec, skipped_in  # noqa: E402

PREVIEW_TOKENS = 24
PREVIEW_CHARS = 70


def build_parser() -> argparse.ArgumentParser:
    """The run's data, sample-count and tokenizer flags, plus what to explain."""
    parser = data_tool_parser(__doc__)
    g = parser.add_argument_group("what to explain")
    g.add_argument(
        "--iteration", default="1", metavar="N|A-B", help="N or A-B (1-indexed, as in the log)"
    )
    g.add_argument(
        "--data-parallel-size", type=int, default=1, help="the run's DP size (world / (TP x PP))"
    )
    g.add_argument("--dp-rank", type=int, default=None, help="only this DP rank [default: all]")
    g.add_argument("--json", action="store_true", help="one JSON object per sample")
    g.add_argument(
        "--iterations-to-skip",
        type=iteration_spec,
        nargs="+",
        action="extend",
        default=None,
        metavar="N|A-B",
        help="the run's skipped iterations (N or A-B): their samples are marked skipped",
    )
    g.add_argument(
        "--load",
        default=None,
        help="the run's checkpoint directory (its latest step): mark the skipped sample ranges "
        "it records, and explain a re-weighted or scheduled run's iterations with the data "
        "phases it records (with this run's flags from the checkpoint's iteration on)",
    )
    g.add_argument(
        "--grep",
        default=None,
        metavar="TEXT",
        help="find iterations with a document containing TEXT",
    )
    g.add_argument(
        "--max-iterations", type=int, default=1000, help="--grep searches at most this many"
    )
    return parser


def parse_iterations(text: str) -> tuple[int, int]:
    """'N' -> (N, N); 'A-B' -> (A, B); 1-indexed and inclusive."""
    try:
        lo, _, hi = text.partition("-")
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"--iteration {text}: give N or A-B (e.g. 120 or 100-140)") from None
    if first < 1 or last < first:
        raise UserError(f"--iteration {text}: iterations start at 1 and A-B needs A <= B")
    return first, last


class _Texts:
    """Decoded document text, per (prefix, document), decoded once."""

    def __init__(self, dataset, tokenizer):
        gpts = getattr(dataset, "datasets", [dataset])
        self.indexed = {g.dataset_path: g.indexed for g in gpts if hasattr(g, "indexed")}
        self.tokenizer = tokenizer
        self._full: dict[tuple[str, int], str] = {}

    def start(self, prefix: str, doc: int, offset: int = 0) -> str:
        """The decoded start of document `doc` (from token `offset`), shortened, as repr."""
        tokens = self.indexed[prefix].get(doc, offset=offset)[:PREVIEW_TOKENS]
        text = self.tokenizer.detokenize(tokens.tolist())
        return repr(text[:PREVIEW_CHARS] + ("..." if len(text) > PREVIEW_CHARS else ""))

    def full(self, prefix: str, doc: int) -> str:
        """The whole decoded document (cached: --grep asks for the same documents often)."""
        key = (prefix, doc)
        if key not in self._full:
            self._full[key] = self.tokenizer.detokenize(self.indexed[prefix].get(doc).tolist())
        return self._full[key]


def skipped_ranges(ns, meta: dict) -> list[tuple[int, int]]:
    """Sample ranges [start, end) not trained on: from --load's checkpoint (`meta`), and from
    --iterations-to-skip at this --global-batch-size."""
    ranges = [(int(a), int(b)) for a, b in meta.get("skipped_train_samples", [])]
    for it in flatten_iterations(ns.iterations_to_skip):
        ranges.append(((it - 1) * ns.global_batch_size, it * ns.global_batch_size))
    return ranges


def print_sample(
    s: SampleOrigin, texts: _Texts, as_json: bool, skipped: bool | None = None
) -> None:
    """One sample: a JSON line, or a text line and the start of each document. `skipped` (a JSON
    field only when --load or --iterations-to-skip is given): not trained on."""
    if as_json:
        print(json.dumps(s.as_dict() | ({} if skipped is None else {"skipped": skipped})))
        return
    print(
        f"iteration {s.iteration} dp_rank {s.dp_rank} micro_batch {s.micro_batch} "
        f"sample {s.sample} dataset {s.dataset} dataset_sample {s.dataset_sample} "
        f"documents {s.documents}"
        + (" SKIPPED (--iterations-to-skip: not trained on)" if skipped else "")
    )
    for doc, first, _ in s.documents:
        print(f"    document {doc}: {texts.start(s.dataset, doc)}")
        if first > 0:  # the window starts inside the document: show where
            print(f"      at token {first}: {texts.start(s.dataset, doc, first)}")


def grep(ns, dataset, cfg, texts: _Texts, first: int, ranks: list[int]) -> int:
    """Print the iterations (and samples) whose documents contain --grep; return how many."""
    total_iters = len(dataset) // ns.global_batch_size
    last = min(total_iters, first + ns.max_iterations - 1)
    found = 0
    for it in range(first, last + 1):
        samples = explain_iteration(
            dataset,
            cfg,
            it,
            ns.global_batch_size,
            ns.micro_batch_size,
            ns.data_parallel_size,
            ranks,
        )
        hits = [
            s
            for s in samples
            if any(ns.grep in texts.full(s.dataset, d) for d, _, _ in s.documents)
        ]
        for s in hits:
            print_sample(s, texts, ns.json)
        found += bool(hits)
    print(
        f"{found} of iterations {first}-{last} hold a document containing {ns.grep!r}",
        file=sys.stderr,
    )
    return found


@exit_on_user_error
def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    ns = parse_data_tool_args(build_parser(), argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    first, last = parse_iterations(ns.iteration)
    dp = ns.data_parallel_size
    if ns.dp_rank is not None and not 0 <= ns.dp_rank < dp:
        raise UserError(f"--dp-rank {ns.dp_rank}: must be in [0, --data-parallel-size {dp})")
    ranks = list(range(dp)) if ns.dp_rank is None else [ns.dp_rank]
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * dp
    cfg = DataConfig.from_args(ns)
    if cfg.data_cache_path:  # it builds missing caches there: never over a dataset/checkpoint
        from pretrain.checkpoint.outputs import kept_data

        refuse_output("--data-cache-path", cfg.data_cache_path, protect=kept_data)
    tok_cfg = TokenizerConfig.from_args(ns)
    tokenizer = build_tokenizer(tok_cfg)
    check_data(cfg, tok_cfg, tokenizer, tokenizer.vocab_size)
    counts = train_valid_test_num_samples(
        ns.train_iters, ns.train_samples, ns.eval_interval, ns.eval_iters, ns.global_batch_size
    )
    meta = load_meta(ns.load)
    mixture = run_mixture(cfg, counts[0], ns.global_batch_size, meta)
    if mixture is not None:  # build every source: any iteration may be asked about
        mixture = dataclasses.replace(mixture, start=0)
    train = build_train_valid_test_datasets(cfg, tokenizer, counts, mixture=mixture)[0]
    if train is None:
        raise UserError("the train split is empty (check --split and the data prefixes)")
    texts = _Texts(train, tokenizer)
    skipped = skipped_ranges(ns, meta)
    known = ns.load is not None or ns.iterations_to_skip is not None
    if ns.grep is not None:
        return 0 if grep(ns, train, cfg, texts, first, ranks) else 1
    for it in range(first, last + 1):
        for s in explain_iteration(
            train, cfg, it, ns.global_batch_size, ns.micro_batch_size, dp, ranks
        ):
            print_sample(
                s, texts, ns.json, skipped_in(skipped, s.sample, s.sample + 1) if known else None
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
