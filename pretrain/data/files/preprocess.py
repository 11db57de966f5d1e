"""`tools/preprocess_data.py`: corpus -> `{prefix}_{key}_{document|sentence}.bin/.idx`, Megatron's bytes.

The parent process reads raw records in small batches and hands them to a pool of worker
processes (`pretrain.data.files.encoder`), at most a few batches ahead, and writes the results strictly
in input order as they come back. So memory stays flat in corpus size, the output bytes do not
depend on `--workers`, and nothing final-named appears before the run is complete.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from pretrain.data.files.corpus import expand_inputs, iter_record_batches, total_input_bytes
from pretrain.data.files.encoder import (
    EncodeOptions,
    Encoder,
    encode_in_worker,
    init_worker,
    share_with_forked_workers,
)
from pretrain.data.files.fingerprint import (
    dataset_counts,
    input_files,
    sidecar_path,
    write_sidecar,
)
from pretrain.data.files.indexed_dataset import (
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    remove_stray_temporaries,
)
from pretrain.data.files.output_lock import lock_output
from pretrain.errors import UserError, data_error
from pretrain.flag_help import HelpFormatter
from pretrain.tokenizer import TokenizerConfig, add_tokenizer_args
from pretrain.tokenizer.fingerprint import tokenizer_fingerprint

_MAX_REPORTED_SKIPS = 20


@dataclass
class PreprocessConfig:
    inputs: list[str]
    output_prefix: str
    tokenizer: TokenizerConfig
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    skip_bad_lines: bool = False
    batch_bytes: int = 1 << 20
    allow_empty: bool = (
        False  # write (empty) outputs for a corpus without tokens instead of failing
    )

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> PreprocessConfig:
        if ns.workers < 1:
            raise UserError(f"--workers {ns.workers}: must be at least 1")
        if ns.partitions < 1:
            raise UserError(f"--partitions {ns.partitions}: must be at least 1")
        if not os.path.basename(ns.output_prefix):
            raise UserError(
                f"--output-prefix {ns.output_prefix}: names a folder, not a file prefix (add a "
                f"name, e.g. {os.path.join(ns.output_prefix, 'corpus')})"
            )
        if len(set(ns.json_keys)) != len(ns.json_keys):
            raise UserError(
                f"--json-keys {' '.join(ns.json_keys)}: a key is repeated (name each key once)"
            )
        return cls(
            inputs=ns.input,
            output_prefix=ns.output_prefix,
            tokenizer=TokenizerConfig.from_args(ns),
            json_keys=ns.json_keys,
            split_sentences=ns.split_sentences,
            keep_newlines=ns.keep_newlines,
            lang=ns.lang,
            append_eod=ns.append_eod,
            workers=ns.workers,
            log_interval=ns.log_interval,
            skip_bad_lines=ns.skip_bad_lines,
            allow_empty=ns.allow_empty,
        )

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_prefixes(self) -> list[str]:
        return [f"{self.output_prefix}_{key}_{self.level}" for key in self.json_keys]

    def output_files(self) -> tuple[str, ...]:
        """Real paths of every file the run writes (its temporaries are `FILE.*.tmp`)."""
        return tuple(
            os.path.realpath(f"{prefix}{ext}")
            for prefix in self.output_prefixes()
            for ext in (".bin", ".idx", ".json", ".lock")
        )


def build_parser() -> argparse.ArgumentParser:
    """tools/preprocess_data.py's flags (Megatron's spellings)."""
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        description="Tokenize a corpus into Megatron-LM's mmap dataset format (.bin/.idx), byte for byte "
        "what Megatron's tools/preprocess_data.py writes, in parallel and streaming.",
        epilog="example: tools/preprocess_data.py --input data/shakespeare.jsonl --output-prefix data/shakespeare "
        "--tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2/vocab.json --merge-file data/gpt2/merges.txt "
        "--append-eod --workers 2   (writes data/shakespeare_text_document.bin/.idx)",
    )
    _add_input_args(p)
    add_tokenizer_args(p)
    _add_output_args(p)
    _add_runtime_args(p)
    return p


def _add_input_args(p: argparse.ArgumentParser) -> None:
    """What to read: the corpus, its keys, sentences or documents, malformed lines."""
    g = p.add_argument_group("input")
    g.add_argument(
        "--input",
        nargs="+",
        required=True,
        help=".jsonl/.json (optionally .gz/.zst), .parquet, a save_to_disk folder, a directory or a glob; "
        "several inputs become one output, in the order given",
    )
    g.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="keys to extract; one output per key",
    )
    g.add_argument(
        "--split-sentences", action="store_true", help="split texts into sentences (pysbd, offline)"
    )
    g.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences: keep newlines in sentences",
    )
    g.add_argument(
        "--lang",
        default="english",
        metavar="LANGUAGE",
        help="sentence-splitting language (NLTK name or ISO code)",
    )
    g.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip and count malformed lines instead of stopping at the first one",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """What to write: the output prefix, empty outputs, the EOD."""
    g = p.add_argument_group("output")
    g.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="writes {prefix}_{key}_{document|sentence}.bin/.idx",
    )
    g.add_argument(
        "--allow-empty",
        action="store_true",
        help="write outputs even when the corpus holds no tokens (default: warn and exit "
        "non-zero, so an empty dataset never reaches training)",
    )
    g.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document id to every non-empty document",
    )


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """How: worker processes, progress lines, and Megatron's flags that change nothing here."""
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help=f"tokenizer processes [default: {os.cpu_count() or 1}, the cores here]",
    )
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="accepted for Megatron compatibility; the output never depends on it (input order is kept)",
    )
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="accepted for Megatron compatibility; documents always keep the input order",
    )
    g.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="documents between progress lines when stderr is not a terminal",
    )


@dataclass
class Summary:
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    skipped: int = 0
    bytes: int = 0
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)

    def line(self) -> str:
        s = max(self.seconds, 1e-9)
        return (
            f"{self.documents:,} documents, {self.sequences:,} sequences, {self.tokens:,} tokens, "
            f"{self.skipped:,} skipped lines, {self.bytes / 1e6:,.1f} MB in {self.seconds:.1f} s "
            f"({self.bytes / 1e6 / s:.2f} MB/s, {self.tokens / s:,.0f} tokens/s)"
        )


def _ordered_results(pool, batches, window: int):
    """Apply the encoder to batches in the pool, at most `window` in flight; yield in input order."""
    pending = collections.deque()
    try:
        for batch in batches:
            pending.append(pool.submit(encode_in_worker, batch))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise UserError(
            "a tokenizer worker process died (out of memory? try fewer --workers)"
        ) from None


class _Progress:
    def __init__(self, total_bytes: int | None, log_interval: int):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            file=sys.stderr,
            disable=None,
            desc="preprocess",
            dynamic_ncols=True,
        )
        self.log_interval, self.next_log, self.start = log_interval, log_interval, time.monotonic()

    def update(self, summary: Summary, nbytes: int) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rates = (
            f"{summary.documents / elapsed:,.0f} docs/s, {summary.bytes / 1e6 / elapsed:.2f} MB/s, "
            f"{summary.tokens / elapsed:,.0f} tokens/s"
        )
        if not self.bar.disable:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(rates, refresh=False)
        elif summary.documents >= self.next_log:
            print(
                f"processed {summary.documents:,} documents ({rates})", file=sys.stderr, flush=True
            )
            self.next_log = summary.documents + self.log_interval

    def close(self) -> None:
        self.bar.close()


def _report_bad(cfg: PreprocessConfig, summary: Summary, source: str, bad) -> None:
    for line, what, fix in bad:
        err = data_error(source, line, what, fix)
        if not cfg.skip_bad_lines:
            raise err
        if summary.skipped < _MAX_REPORTED_SKIPS:
            print(f"warning: skipped {err}", file=sys.stderr)
        elif summary.skipped == _MAX_REPORTED_SKIPS:
            print("warning: further skipped lines are only counted", file=sys.stderr)
        summary.skipped += 1


def _make_output_dir(cfg: PreprocessConfig) -> None:
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise UserError(
            f"--output-prefix {cfg.output_prefix}: cannot create {out_dir} ({err.strerror})"
        ) from None
    if not os.access(out_dir, os.W_OK):
        raise UserError(
            f"--output-prefix {cfg.output_prefix}: directory {out_dir} is not writable (choose another prefix)"
        )


def _open_builders(cfg: PreprocessConfig, dtype) -> list[IndexedDatasetBuilder]:
    builders = []
    try:
        for prefix in cfg.output_prefixes():
            builders.append(IndexedDatasetBuilder(get_bin_path(prefix), dtype))
    except UserError:
        for builder in builders:
            builder.abort()
        raise
    return builders


def _lock_outputs(cfg: PreprocessConfig) -> list:
    """Lock every output's final name (`PREFIX_KEY_LEVEL.lock`), not the prefix: two prefixes
    and key lists can name the same files. All or none are held."""
    locks = []
    try:
        for prefix in cfg.output_prefixes():
            locks.append(lock_output(prefix, label=f"--output-prefix {cfg.output_prefix}"))
    except UserError:
        for lock in locks:
            lock.remove()
        raise
    return locks


def _refuse_folders(cfg: PreprocessConfig) -> None:
    """An output name taken by a folder would fail only at the final rename, after all the work."""
    for path in cfg.output_files():
        if os.path.isdir(path):
            raise UserError(
                f"--output-prefix {cfg.output_prefix}: {path} is a folder, so the output cannot "
                "be written there (move it away or choose another --output-prefix; nothing was "
                "written)"
            )


def _remove_strays(cfg: PreprocessConfig) -> None:
    """Under the outputs' locks, a temporary whose owner is dead was left by a killed run."""
    for prefix in cfg.output_prefixes():
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            removed, kept = remove_stray_temporaries(path)
            for stray in removed:
                print(f"removed {stray} (left by an interrupted run)", file=sys.stderr)
            for stray in kept:
                print(f"warning: kept {stray} (its owner may still run)", file=sys.stderr)


def _check_not_empty(cfg: PreprocessConfig, summary: Summary) -> None:
    """An empty corpus is a warning with --allow-empty, else an error (nothing is written)."""
    if summary.tokens:
        return
    what = f"{summary.documents:,} documents" + (", 0 tokens" if summary.documents else "")
    print(f"warning: {what} in {' '.join(cfg.inputs)}", file=sys.stderr, flush=True)
    if not cfg.allow_empty:
        raise UserError(
            f"--input {' '.join(cfg.inputs)}: {what}, nothing written (check --input and "
            "--json-keys, or pass --allow-empty to write empty outputs)"
        )


def _write_sidecars(
    cfg: PreprocessConfig, encoder: Encoder, sources: list[str], largest: list[int]
) -> None:
    """`PREFIX.json` beside each output pair: what made it and what it holds (pretrain/data/files/fingerprint.py)."""
    tokenizer = tokenizer_fingerprint(cfg.tokenizer, encoder.tokenizer)
    tokenizer["append_eod"] = cfg.append_eod
    inputs = input_files(sources)
    for key, prefix, max_id in zip(cfg.json_keys, cfg.output_prefixes(), largest, strict=True):
        write_sidecar(
            prefix,
            {
                "tokenizer": tokenizer,
                "tokenizer_flags": cfg.tokenizer.record(),  # tools/inspect_data.py decodes with it
                "json_keys": cfg.json_keys,
                "json_key": key,
                "level": cfg.level,
                "inputs": inputs,
                **dataset_counts(prefix),
                "max_token_id": max_id,
            },
        )


def _tokenize_into(
    cfg: PreprocessConfig, sources, opts: EncodeOptions, builders, summary: Summary
) -> list[int]:
    """Run the worker pool over `sources` and append every result to `builders`, in input order;
    return the largest token id per output (for the fingerprint sidecar)."""
    largest = [-1] * len(builders)
    progress = _Progress(total_input_bytes(sources), cfg.log_interval)
    try:
        ctx = multiprocessing.get_context(
            "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        )
        # ProcessPoolExecutor, not multiprocessing.Pool: a worker that dies raises instead of hanging
        pool = ProcessPoolExecutor(
            cfg.workers, mp_context=ctx, initializer=init_worker, initargs=(opts,)
        )
        try:
            batches = iter_record_batches(sources, cfg.json_keys, cfg.batch_bytes)
            for encoded in _ordered_results(pool, batches, window=2 * cfg.workers + 2):
                _report_bad(cfg, summary, encoded.source, encoded.bad)
                for i, (builder, key) in enumerate(zip(builders, encoded.keys, strict=True)):
                    builder.add_document_batch(key.tokens, key.lengths, key.sequences_per_document)
                    if len(key.tokens):
                        largest[i] = max(largest[i], int(key.tokens.max()))
                    summary.sequences += len(key.lengths)
                    summary.tokens += len(key.tokens)
                summary.documents += encoded.documents
                summary.bytes += encoded.nbytes
                progress.update(summary, encoded.nbytes)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        progress.close()
    return largest


def run(cfg: PreprocessConfig) -> Summary:
    """Tokenize the corpus into the outputs of `cfg`, holding their locks throughout."""
    # a missing input, or one the run would write, fails before anything is created
    sources = expand_inputs(cfg.inputs, own=cfg.output_files())
    _refuse_folders(cfg)
    opts = EncodeOptions(
        cfg.tokenizer,
        cfg.json_keys,
        cfg.append_eod,
        cfg.split_sentences,
        cfg.lang,
        cfg.keep_newlines,
    )
    # Build here first: bad flags fail before the pool starts (a worker that fails to start is
    # respawned forever), and forked workers inherit this encoder instead of rebuilding it.
    encoder = Encoder(opts)
    summary = Summary()
    start = time.monotonic()
    _make_output_dir(cfg)
    locks = _lock_outputs(cfg)
    finished = False
    try:
        _remove_strays(cfg)
        builders = _open_builders(cfg, encoder.dtype)
        try:
            share_with_forked_workers(encoder)
            largest = _tokenize_into(cfg, sources, opts, builders, summary)
            _check_not_empty(cfg, summary)
            for builder, prefix in zip(builders, cfg.output_prefixes(), strict=True):
                builder.prepare(get_idx_path(prefix))
            for builder, prefix in zip(builders, cfg.output_prefixes(), strict=True):
                if os.path.exists(
                    sidecar_path(prefix)
                ):  # an old fingerprint never describes new data
                    os.remove(sidecar_path(prefix))
                builder.commit()  # every index is written: only renames remain
            _write_sidecars(cfg, encoder, sources, largest)
            finished = True
        finally:
            share_with_forked_workers(None)
            if not finished:
                for builder in builders:
                    builder.abort()
    finally:
        for lock in locks:  # finished or failed, the run leaves no lock file
            lock.remove()
    summary.seconds = time.monotonic() - start
    summary.outputs = cfg.output_prefixes()
    return summary


def main(argv: list[str] | None = None) -> Summary:
    """`tools/preprocess_data.py`: parse the flags, run, print the summary."""
    # A file-size limit (ulimit -f) would kill us with SIGXFSZ and no message; ignored, the write
    # fails with EFBIG and the run says which file did not fit.
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    cfg = PreprocessConfig.from_args(build_parser().parse_args(argv))
    summary = run(cfg)
    print(f"done: {summary.line()}")
    for prefix in summary.outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx")
        print(f"wrote {prefix}.json (fingerprint: tokenizer, inputs, counts, largest token id)")
    return summary
