#!/usr/bin/env python
"""Benchmark tools/preprocess_data.py against Megatron-LM's preprocess recipe and the bare tokenizer,
same cores, same run, same output bytes.

Corpus: data/shakespeare.jsonl (`make data`) repeated to each `--sizes` MB. For every size:
- megatron: Megatron-LM's tools/preprocess_data.py structure (a `multiprocessing.Pool(workers)` whose
  initializer builds the tokenizer, `pool.imap(encode, lines, 32)`, per document `json.loads` and one
  `tokenize` per text, EOD appended, megatron-core's `IndexedDatasetBuilder.add_document` in the
  parent), with transformers' GPT2TokenizerFast from the same vocab/merges (what its
  GPT2BPETokenizer calls), in a subprocess;
- ours: the full CLI (`--workers N --append-eod`, GPT-2 BPE, `--tokenizer-engine` as given) in a
  subprocess. Its .bin/.idx must equal megatron's byte for byte (asserted).
Peak memory is sampled as the sum over each process tree (RSS and PSS, which counts pages shared by
forked workers once). At the largest size the ceiling is `tokenizers.Tokenizer.encode_batch_fast`
in one process with N Rayon threads on the same texts, timing only the encode calls. Throughput is
MB of UTF-8 text per second. The last line printed is one JSON object: `vs_megatron` = ours /
megatron throughput, `vs_encode_batch_fast` = ours / ceiling, `cpu_vs_megatron` = megatron CPU
seconds / ours (all processes) for the same work, which load from other jobs distorts less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def build_corpus(src: str, dest: str, target_mb: float) -> tuple[int, int, int]:
    """Repeat `src` until `dest` holds >= target_mb of JSON lines; returns (json bytes, text bytes, docs)."""
    lines = open(src, "rb").read().splitlines(keepends=True)
    text_bytes = [len(json.loads(line)["text"].encode("utf-8")) for line in lines]
    total = texts = docs = 0
    with open(dest, "wb") as f:
        while total < target_mb * 1e6:
            for line, tb in zip(lines, text_bytes, strict=False):
                f.write(line)
                total, texts, docs = total + len(line), texts + tb, docs + 1
    return total, texts, docs


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


VOCAB = os.path.join(REPO, "data/gpt2/vocab.json")
MERGES = os.path.join(REPO, "data/gpt2/merges.txt")


class MegatronEncoder:
    """Megatron-LM tools/preprocess_data.py's Encoder, for GPT-2 BPE, one key, --append-eod."""

    tokenizer = None

    def initializer(self):
        """Per worker, as Megatron: build the tokenizer once."""
        from transformers import GPT2TokenizerFast

        # from the folder holding vocab.json + merges.txt (transformers 5's constructor takes
        # other arguments); tests/tokenizer_fixtures.py's hf_reference is built the same way
        MegatronEncoder.tokenizer = GPT2TokenizerFast.from_pretrained(os.path.dirname(VOCAB))

    def encode(self, json_line):
        """One line -> ({key: ids}, {key: sentence lengths}, bytes), as Megatron's encode."""
        data = json.loads(json_line)
        text = data["text"]
        sentences = text if isinstance(text, list) else [text]
        doc_ids, lens = [], []
        for sentence in sentences:
            ids = MegatronEncoder.tokenizer(sentence).input_ids
            if ids:
                doc_ids.extend(ids)
                lens.append(len(ids))
        if doc_ids:
            doc_ids.append(50256)
            lens[-1] += 1
        return {"text": doc_ids}, {"text": lens}, len(json_line)


def megatron_recipe(corpus: str, prefix: str, workers: int) -> None:
    """Megatron-LM's process_json_file: Pool + imap(encode, lines, 32) + megatron-core's builder."""
    import multiprocessing
    import warnings

    import numpy as np

    warnings.filterwarnings("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    encoder = MegatronEncoder()
    with open(corpus, encoding="utf-8") as fin:
        pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
        builder = IndexedDatasetBuilder(prefix + "_text_document.bin", dtype=np.uint16)
        for doc, lens, _ in pool.imap(encoder.encode, fin, 32):
            builder.add_document(doc["text"], lens["text"])
        builder.finalize(prefix + "_text_document.idx")
        pool.close()
        pool.join()


def run_measured(cmd: list[str]) -> dict:
    """Run `cmd`; wall and CPU seconds (all its processes) and peak memory of its process tree."""
    import psutil

    peak = {"rss": 0, "pss": 0}
    cpu_before = _children_cpu()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    parent = psutil.Process(proc.pid)

    def sample():
        while proc.poll() is None:
            rss = pss = 0
            try:
                for p in [parent] + parent.children(recursive=True):
                    m = p.memory_full_info()
                    rss, pss = rss + m.rss, pss + m.pss
            except psutil.Error:
                pass
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    proc.communicate()
    seconds = time.monotonic() - start
    cpu = _children_cpu() - cpu_before  # the process and its workers (reaped, so counted)
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed with status {proc.returncode}")
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_rss_mb": peak["rss"] / 1e6,
        "peak_pss_mb": peak["pss"] / 1e6,
    }


def run_ours(corpus: str, prefix: str, workers: int, engine: str) -> dict:
    """tools/preprocess_data.py, measured."""
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus]
    cmd += ["--output-prefix", prefix, "--workers", str(workers), "--append-eod"]
    cmd += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]
    return run_measured(cmd + ["--tokenizer-engine", engine])


def run_megatron(corpus: str, prefix: str, workers: int) -> dict:
    """Megatron's recipe (this file's --megatron-recipe mode), measured."""
    cmd = [sys.executable, os.path.abspath(__file__), "--megatron-recipe", corpus, prefix]
    return run_measured(cmd + ["--workers", str(workers)])


def same_bytes(a: str, b: str) -> bool:
    """Whether the .bin and .idx of two prefixes are identical."""
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as f, open(b + ext, "rb") as g:
            if f.read() != g.read():
                return False
    return True


def run_ceiling(corpus: str, workers: int, batch_docs: int = 64) -> dict:
    os.environ["RAYON_NUM_THREADS"] = str(workers)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from pretrain.tokenizer import GPT2BPETokenizer

    backend = GPT2BPETokenizer(VOCAB, MERGES, engine="hf")._backend
    seconds, cpu, tokens, batch = 0.0, 0.0, 0, []

    def encode():
        nonlocal seconds, cpu, tokens
        t, c = time.monotonic(), time.process_time()
        encodings = backend.encode_batch_fast(batch)
        seconds += time.monotonic() - t
        cpu += time.process_time() - c  # all threads of this process
        tokens += sum(len(e.ids) for e in encodings)

    with open(corpus, "rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == batch_docs:
                encode()
                batch = []
    if batch:
        encode()
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens}


def only_ours(src: str, args: argparse.Namespace) -> None:
    """Ours alone at each size: MB/s and peak PSS (is memory flat as the corpus grows?)."""
    peaks = {}
    for size in args.sizes:
        corpus = os.path.join(args.workdir, f"shakespeare_{size:g}MB.jsonl")
        _, text_bytes, _ = build_corpus(src, corpus, size)
        prefix = os.path.join(args.workdir, "ours")
        ours = run_ours(corpus, prefix, args.workers, args.engine)
        peaks[f"{size:g}MB"] = round(ours["peak_pss_mb"])
        print(
            f"{size:g} MB: ours {text_bytes / 1e6 / ours['seconds']:.2f} MB/s, peak PSS "
            f"{ours['peak_pss_mb']:.0f} MB",
            flush=True,
        )
        for ext in (".bin", ".idx"):
            os.remove(f"{prefix}_text_document{ext}")
        os.remove(corpus)
    smallest, largest = peaks[f"{min(args.sizes):g}MB"], peaks[f"{max(args.sizes):g}MB"]
    print(
        json.dumps(
            {
                "bench": "preprocess",
                "only_ours": True,
                "peak_pss_mb": peaks,
                "ratio": round(largest / smallest, 3),
            }  # memory growth, largest vs smallest corpus
        )
    )


def main() -> None:
    """Parse flags; run every size; print the figures and one JSON line."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=float, nargs="+", default=[30], help="corpus MB (default 30)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", default="auto", help="ours: --tokenizer-engine (default auto)")
    p.add_argument("--workdir", default=os.path.join(REPO, "bench", "results"))
    p.add_argument(
        "--only-ours",
        action="store_true",
        help="skip Megatron's recipe: ours' throughput and peak memory only (large sizes)",
    )
    p.add_argument(
        "--megatron-recipe", nargs=2, metavar=("CORPUS", "PREFIX"), help=argparse.SUPPRESS
    )
    args = p.parse_args()
    if args.megatron_recipe:
        megatron_recipe(*args.megatron_recipe, args.workers)
        return
    src = os.path.join(REPO, "data", "shakespeare.jsonl")
    if not os.path.exists(src):
        raise SystemExit("data/shakespeare.jsonl is missing: run `make data` first")
    os.makedirs(args.workdir, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.1f} on {os.cpu_count()} cores", flush=True)
    if args.only_ours:
        only_ours(src, args)
        return
    results = {}
    for size in args.sizes:
        corpus = os.path.join(args.workdir, f"shakespeare_{size:g}MB.jsonl")
        _, text_bytes, docs = build_corpus(src, corpus, size)
        mb = text_bytes / 1e6
        theirs_prefix, ours_prefix = (
            os.path.join(args.workdir, "megatron"),
            os.path.join(args.workdir, "ours"),
        )
        theirs = run_megatron(corpus, theirs_prefix, args.workers)
        ours = run_ours(corpus, ours_prefix, args.workers, args.engine)
        same = same_bytes(theirs_prefix + "_text_document", ours_prefix + "_text_document")
        assert same, "ours and Megatron's recipe wrote different bytes"
        entry = {"text_mb": mb, "docs": docs, "megatron": theirs, "ours": ours, "same_bytes": same}
        for r in (theirs, ours):
            r["mb_s"] = mb / r["seconds"]
            r["mb_s_per_core"] = mb / r["cpu_seconds"]
        print(
            f"{size:g} MB: megatron {theirs['mb_s']:.2f} MB/s ({theirs['mb_s_per_core']:.2f} per "
            f"CPU-s), ours {ours['mb_s']:.2f} MB/s ({ours['mb_s_per_core']:.2f} per CPU-s), "
            f"{ours['mb_s'] / theirs['mb_s']:.2f}x; peak PSS megatron "
            f"{theirs['peak_pss_mb']:.0f} MB, ours {ours['peak_pss_mb']:.0f} MB; same bytes",
            flush=True,
        )
        if size == max(args.sizes):
            ceiling = run_ceiling(corpus, args.workers)
            ceiling["mb_s"] = mb / ceiling["seconds"]
            ceiling["mb_s_per_core"] = mb / ceiling["cpu_seconds"]
            entry["ceiling"] = ceiling
            print(f"{size:g} MB: bare encode_batch_fast {ceiling['mb_s']:.2f} MB/s", flush=True)
        results[f"{size:g}MB"] = entry
        for prefix in (theirs_prefix, ours_prefix):
            for ext in (".bin", ".idx"):
                os.remove(f"{prefix}_text_document{ext}")
        os.remove(corpus)
    largest = results[f"{max(args.sizes):g}MB"]
    ours, theirs, ceiling = largest["ours"], largest["megatron"], largest["ceiling"]
    summary = {
        "bench": "preprocess",
        "workers": args.workers,
        "engine": args.engine,
        "load_average_start": round(load, 1),
        "load_average_end": round(os.getloadavg()[0], 1),
        "sizes_mb": args.sizes,
        "same_bytes": all(v["same_bytes"] for v in results.values()),
        "megatron_mb_s": round(theirs["mb_s"], 3),
        "ours_mb_s": round(ours["mb_s"], 3),
        "ceiling_mb_s": round(ceiling["mb_s"], 3),
        "megatron_mb_s_per_core": round(theirs["mb_s_per_core"], 3),
        "ours_mb_s_per_core": round(ours["mb_s_per_core"], 3),
        "vs_megatron": round(ours["mb_s"] / theirs["mb_s"], 3),
        "cpu_vs_megatron": round(theirs["cpu_seconds"] / ours["cpu_seconds"], 3),
        "vs_encode_batch_fast": round(ours["mb_s"] / ceiling["mb_s"], 3),
        "peak_pss_mb": {k: round(v["ours"]["peak_pss_mb"]) for k, v in results.items()},
        "megatron_peak_pss_mb": {
            k: round(v["megatron"]["peak_pss_mb"]) for k, v in results.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
