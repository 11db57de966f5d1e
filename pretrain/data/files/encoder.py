"""Worker side of preprocessing: a batch of records -> validated, tokenized, Megatron-shaped arrays.

Per record and key this follows Megatron's `Encoder.encode` (docs/DATA_FORMAT.md §2): the value
is one text or a list of sentences; each sentence is tokenized; sentences without tokens are
dropped, one length per kept sentence; with `--append-eod` the EOD id goes after the last sentence
(its length + 1) when the document has any token. All texts of a batch go to the tokenizer's batch
API in one call. A record that is not valid (bad JSON or UTF-8, missing key, wrong type, lone
surrogate, JSON nested too deeply, an integer too long to convert, text the tokenizer rejects) is
reported with its line number and not encoded.

A very long text (a whole book on one line) is tokenized in pieces of about `LONG_TEXT` characters,
cut only at a space between two letters, where every byte-level BPE pre-tokenizer (GPT-2's,
cl100k's, o200k's regex) ends one pre-token and starts the next with that space: the ids equal those
of the whole text, and the tokenizer never holds per-byte bookkeeping for megabytes at once. A
tokenizer for which a probe shows that tokenizing two pieces differs from tokenizing their
concatenation (one that adds BOS, or a SentencePiece-style normalizer that prepends a space marker)
gets the whole text in one call, as before.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from pretrain.data.files.corpus import RecordBatch
from pretrain.data.files.indexed_dataset import optimal_dtype
from pretrain.data.files.sentences import SentenceSplitter
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

LONG_TEXT = 1 << 18  # characters; longer texts are tokenized in pieces of about this size
_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")  # a space between two word characters
# (a, b) pairs: tokenizing a + b must equal tokenizing a, then b, for pieces to be exact
_PROBES = (
    ("Hello", " world"),
    ("naïve", " café"),
    ("Straße", " Ωμέγα"),
    ("字", " 漢"),
    ("x", " y"),
)


def _cuts(text: str, size: int) -> list[int]:
    """Positions, about `size` apart, of a space between two letters (`str.isalpha`), or []."""
    cuts, pos = [], size
    while pos < len(text) - size // 2:
        m = _CUT.search(text, pos)
        while m is not None and not (text[m.start() - 1].isalpha() and text[m.end()].isalpha()):
            m = _CUT.search(text, m.end())  # a digit-like word character, not a letter
        if m is None:
            break
        cuts.append(m.start())
        pos = m.start() + size
    return cuts


def _pieces_are_exact(tokenizer) -> bool:
    """Whether this tokenizer gives the same ids for a text and for its pieces at `_cuts`."""
    try:
        whole = tokenizer.tokenize_batch([a + b for a, b in _PROBES])
        parts = tokenizer.tokenize_batch([t for pair in _PROBES for t in pair])
    except (ValueError, UserError):
        return False
    return all(w == parts[2 * i] + parts[2 * i + 1] for i, w in enumerate(whole))


def _parse_json(raw: bytes):
    """One JSON line -> the record; every way a line can fail becomes a `_BadRecord`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _BadRecord(
            f"invalid UTF-8 at byte {err.start}", f"re-encode the file as UTF-8 {_SKIP_HINT}"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise _BadRecord(
            f"invalid JSON: {err.msg} at column {err.colno}", f"fix the line {_SKIP_HINT}"
        ) from None
    except RecursionError:
        raise _BadRecord(
            "JSON nested too deeply to parse", f"flatten the line {_SKIP_HINT}"
        ) from None
    except ValueError as err:  # an integer with more digits than Python converts (4300)
        raise _BadRecord(
            f"invalid JSON value: {str(err).split(';')[0]}", f"fix the line {_SKIP_HINT}"
        ) from None


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
        self.pieces_are_exact = _pieces_are_exact(self.tokenizer)

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
                record = _parse_json(item) if batch.raw is not None else item
                good.append((line, self._texts(record)))
            except _BadRecord as err:
                bad.append((line, err.what, err.fix))
        return good, bad

    def _tokenize_flat(self, flat: list[str]) -> list:
        """Ids per text: short texts in one batch call, long ones piece by piece (a numpy array)."""
        cuts = [
            _cuts(t, LONG_TEXT) if self.pieces_are_exact and len(t) > LONG_TEXT else []
            for t in flat
        ]
        short = [t for t, c in zip(flat, cuts, strict=True) if not c]
        ids = iter(self.tokenizer.tokenize_batch(short))
        out = []
        for text, c in zip(flat, cuts, strict=True):
            if not c:
                out.append(next(ids))
                continue
            bounds = [0, *c, len(text)]
            out.append(
                np.concatenate(
                    [
                        np.asarray(
                            self.tokenizer.tokenize_batch([text[lo:hi]])[0], dtype=self.dtype
                        )
                        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
                    ]
                )
            )
        return out

    def _tokenize(self, good, bad) -> tuple[list, list]:
        """Token ids per sentence, one call for the whole batch; on a rejected text, find its record."""
        flat = [s for _, keys in good for sentences in keys for s in sentences]
        try:
            ids = self._tokenize_flat(flat)
        except (ValueError, UserError):
            kept, ids = [], []
            for line, keys in good:
                try:
                    ids.extend(self._tokenize_flat([s for sentences in keys for s in sentences]))
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
            tokens = _flatten(pieces[k], self.dtype, total)
            out.append(EncodedKey(tokens, lens, per_doc[k]))
        return EncodedBatch(batch.source, len(good), batch.nbytes, out, bad)


def _flatten(pieces: list, dtype, total: int) -> np.ndarray:
    """Concatenate id lists and arrays (long texts) into one array of `total` ids."""
    out = np.empty(total, dtype=dtype)
    pos, run, run_len = 0, [], 0
    for piece in [*pieces, None]:
        if piece is None or isinstance(piece, np.ndarray):
            if run:  # consecutive lists in one pass: much faster than one array per list
                out[pos : pos + run_len] = np.fromiter(
                    itertools.chain.from_iterable(run), dtype, run_len
                )
                pos, run, run_len = pos + run_len, [], 0
            if piece is not None:
                out[pos : pos + len(piece)] = piece
                pos += len(piece)
        else:
            run.append(piece)
            run_len += len(piece)
    return out


# --- process-pool plumbing: one Encoder per worker process ---------------------------------------
_WORKER_ENCODER: Encoder | None = None


def share_with_forked_workers(encoder: Encoder | None) -> None:
    """Set in the parent before the pool forks, so workers inherit the built tokenizer."""
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def init_worker(opts: EncodeOptions) -> None:
    """Pool initializer: one encoder per worker process (inherited when forked)."""
    global _WORKER_ENCODER
    # one core per worker: the pool provides the parallelism, not the tokenizer's thread pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _die_with_parent()
    if _WORKER_ENCODER is None or _WORKER_ENCODER.opts != opts:  # spawned, not forked
        _WORKER_ENCODER = Encoder(opts)


def encode_in_worker(batch: RecordBatch) -> EncodedBatch:
    """Encode one batch with this worker's encoder."""
    return _WORKER_ENCODER.encode(batch)


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this worker when the parent dies (e.g. `kill -9` of the run)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
