"""Worker side of preprocessing: a batch of records -> validated, tokenized, Megatron-shaped arrays.

Per record and key this follows Megatron's `Encoder.encode` (docs/DATA_FORMAT.md §2): the value
is one text or a list of sentences; each sentence is tokenized; sentences without tokens are
dropped, one length per kept sentence; with `--append-eod` the EOD id goes after the last sentence
(its length + 1) when the document has any token. All texts of a batch go to the tokenizer's batch
API in one call. A record that is not valid (bad JSON or UTF-8, missing key, wrong type, lone
surrogate, text the tokenizer rejects) is reported with its line number and not encoded.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field

import numpy as np

from pretrain.data.corpus import RecordBatch
from pretrain.data.indexed_dataset import optimal_dtype
from pretrain.data.sentences import SentenceSplitter
from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig, build_tokenizer


@dataclass
class EncodeOptions:
    tokenizer: TokenizerConfig
    keys: list[str]
    append_eod: bool = False
    split_sentences: bool = False
    lang: str = "english"
    keep_newlines: bool = False


@dataclass
class EncodedKey:
    """The documents of one batch for one key, ready for `IndexedDatasetBuilder.add_document_batch`."""

    tokens: np.ndarray
    lengths: np.ndarray  # int32, one per kept sequence
    sequences_per_document: np.ndarray  # int64, one per document


@dataclass
class EncodedBatch:
    source: str
    documents: int
    nbytes: int
    keys: list[EncodedKey]
    bad: list[tuple[int, str, str]] = field(default_factory=list)  # (line, what is wrong, fix)


class _BadRecord(Exception):
    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix


_SKIP_HINT = "or pass --skip-bad-lines to skip such lines"


class Encoder:
    def __init__(self, opts: EncodeOptions):
        self.opts = opts
        self.tokenizer = build_tokenizer(opts.tokenizer)
        self.tokenizer.prepare()  # e.g. the BPE engine choice, once, before workers fork
        self.eod = self.tokenizer.eod if opts.append_eod else None
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.splitter = (
            SentenceSplitter(opts.lang, opts.keep_newlines) if opts.split_sentences else None
        )

    def _texts(self, record) -> list[list[str]]:
        """The sentences of each key of one record (a dict), validated."""
        if not isinstance(record, dict):
            raise _BadRecord(
                f"the line is a JSON {type(record).__name__}, expected an object",
                f"write one JSON object per line {_SKIP_HINT}",
            )
        out = []
        for key in self.opts.keys:
            if key not in record:
                raise _BadRecord(
                    f"no key {key!r} (keys: {sorted(record)[:10]})",
                    f"choose --json-keys {_SKIP_HINT}",
                )
            value = record[key]
            if isinstance(value, str):
                sentences = self.splitter.split(value) if self.splitter else [value]
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                sentences = value  # pre-split sentences, as Megatron treats a list
            else:
                kind = (
                    "a list with non-string items"
                    if isinstance(value, list)
                    else type(value).__name__
                )
                raise _BadRecord(
                    f"{key!r} is {kind}, expected a string or a list of strings",
                    f"fix the value {_SKIP_HINT}",
                )
            for s in sentences:
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError as err:
                    raise _BadRecord(
                        f"{key!r} holds a lone UTF-16 surrogate {s[err.start]!r} (an unpaired \\ud800-\\udfff escape)",
                        f"remove or pair the escape {_SKIP_HINT}",
                    ) from None
            out.append(sentences)
        return out

    def _parse(self, batch: RecordBatch) -> tuple[list[tuple[int, list[list[str]]]], list]:
        good, bad = [], []
        items = batch.raw if batch.raw is not None else batch.rows
        for line, item in zip(batch.lines, items, strict=False):
            try:
                if batch.raw is not None:
                    try:
                        text = item.decode("utf-8")
                    except UnicodeDecodeError as err:
                        raise _BadRecord(
                            f"invalid UTF-8 at byte {err.start}",
                            f"re-encode the file as UTF-8 {_SKIP_HINT}",
                        ) from None
                    try:
                        record = json.loads(text)
                    except json.JSONDecodeError as err:
                        raise _BadRecord(
                            f"invalid JSON: {err.msg} at column {err.colno}",
                            f"fix the line {_SKIP_HINT}",
                        ) from None
                else:
                    record = item
                good.append((line, self._texts(record)))
            except _BadRecord as err:
                bad.append((line, err.what, err.fix))
        return good, bad

    def _tokenize(self, good, bad) -> tuple[list, list]:
        """Token ids per sentence, one call for the whole batch; on a rejected text, find its record."""
        flat = [s for _, keys in good for sentences in keys for s in sentences]
        try:
            ids = self.tokenizer.tokenize_batch(flat)
        except (ValueError, UserError):
            kept, ids = [], []
            for line, keys in good:
                try:
                    ids.extend(
                        self.tokenizer.tokenize_batch([s for sentences in keys for s in sentences])
                    )
                    kept.append((line, keys))
                except (ValueError, UserError) as err:
                    bad.append(
                        (
                            line,
                            f"the tokenizer rejects the text: {err}",
                            f"fix the text {_SKIP_HINT}",
                        )
                    )
            bad.sort()
            good = kept
        return good, ids

    def encode(self, batch: RecordBatch) -> EncodedBatch:
        good, bad = self._parse(batch)
        good, ids = self._tokenize(good, bad)
        n_keys = len(self.opts.keys)
        pieces = [[] for _ in range(n_keys)]
        lengths = [[] for _ in range(n_keys)]
        per_doc = [np.zeros(len(good), np.int64) for _ in range(n_keys)]
        eod = [self.eod]
        pos = 0
        for d, (_, keys) in enumerate(good):
            for k, sentences in enumerate(keys):
                kept = [t for t in ids[pos : pos + len(sentences)] if len(t)]
                pos += len(sentences)
                if not kept:
                    continue  # an empty document: a boundary with zero sequences
                pieces[k].extend(kept)
                lens = [len(t) for t in kept]
                if self.eod is not None:
                    pieces[k].append(eod)
                    lens[-1] += 1
                lengths[k].extend(lens)
                per_doc[k][d] = len(lens)
        out = []
        for k in range(n_keys):
            lens = np.asarray(lengths[k], dtype=np.int32)
            total = int(lens.sum(dtype=np.int64))
            tokens = np.fromiter(
                itertools.chain.from_iterable(pieces[k]), dtype=self.dtype, count=total
            )
            out.append(EncodedKey(tokens, lens, per_doc[k]))
        return EncodedBatch(batch.source, len(good), batch.nbytes, out, bad)


# --- process-pool plumbing: one Encoder per worker process ---------------------------------------
_WORKER_ENCODER: Encoder | None = None


def share_with_forked_workers(encoder: Encoder | None) -> None:
    """Set in the parent before the pool forks, so workers inherit the built tokenizer."""
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def init_worker(opts: EncodeOptions) -> None:
    """Pool initializer: one tokenizer per worker process, single-threaded."""
    global _WORKER_ENCODER
    # one core per worker: the pool provides the parallelism, not the tokenizer's thread pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _die_with_parent()
    if _WORKER_ENCODER is None or _WORKER_ENCODER.opts != opts:  # spawned, not forked
        _WORKER_ENCODER = Encoder(opts)


def encode_in_worker(batch: RecordBatch) -> EncodedBatch:
    """Tokenize one record batch with this worker's encoder."""
    return _WORKER_ENCODER.encode(batch)


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this worker when the parent dies (e.g. `kill -9` of the run)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
