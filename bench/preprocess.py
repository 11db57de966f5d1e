#!/usr/bin/env python
"""Benchmark tools/preprocess_data.py against the bare tokenizer (the ceiling), same cores, same run.

Corpus: data/shakespeare.jsonl (`make data`) repeated to each `--sizes` MB. For every size, ours is
the full CLI (`--workers N --append-eod`, GPT-2 BPE) in a subprocess, its peak memory sampled as the
sum over the process tree (RSS and PSS, which counts pages shared by forked workers once). The
ceiling is `tokenizers.Tokenizer.encode_batch_fast` in one process with N Rayon threads on the same
texts, timing only the encode calls (texts read beforehand, batch by batch). Throughput is in MB of
UTF-8 text per second for both. The last line printed is one JSON object; `ratio` = ours / ceiling
throughput at the largest size (wall clock); `cpu_ratio` = ceiling CPU seconds / ours (all processes)
for the same work, which load from other jobs does not distort.
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


def run_ours(corpus: str, prefix: str, workers: int) -> dict:
    import psutil

    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "preprocess_data.py"),
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--workers",
        str(workers),
        "--append-eod",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        os.path.join(REPO, "data/gpt2/vocab.json"),
        "--merge-file",
        os.path.join(REPO, "data/gpt2/merges.txt"),
    ]
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
    out, _ = proc.communicate()
    seconds = time.monotonic() - start
    cpu = _children_cpu() - cpu_before  # the CLI and its workers (reaped, so counted)
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"preprocess_data.py failed with status {proc.returncode}")
    tokens = int(out.split(" tokens,")[0].split()[-1].replace(",", ""))
    for ext in (".bin", ".idx"):
        os.remove(f"{prefix}_text_document{ext}")
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "tokens": tokens,
        "peak_rss_mb": peak["rss"] / 1e6,
        "peak_pss_mb": peak["pss"] / 1e6,
    }


def run_ceiling(corpus: str, workers: int, batch_docs: int = 64) -> dict:
    os.environ["RAYON_NUM_THREADS"] = str(workers)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from pretrain.tokenizer import GPT2BPETokenizer

    backend = GPT2BPETokenizer(
        os.path.join(REPO, "data/gpt2/vocab.json"), os.path.join(REPO, "data/gpt2/merges.txt")
    )._backend
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


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=[50, 200],
        help="corpus sizes in MB (default 50 200)",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", default=os.path.join(REPO, "bench", "results"))
    args = p.parse_args()
    src = os.path.join(REPO, "data", "shakespeare.jsonl")
    if not os.path.exists(src):
        raise SystemExit("data/shakespeare.jsonl is missing: run `make data` first")
    os.makedirs(args.workdir, exist_ok=True)
    results = {}
    for size in args.sizes:
        corpus = os.path.join(args.workdir, f"shakespeare_{size:g}MB.jsonl")
        json_bytes, text_bytes, docs = build_corpus(src, corpus, size)
        ours = run_ours(corpus, os.path.join(args.workdir, "out"), args.workers)
        entry = {"json_mb": json_bytes / 1e6, "text_mb": text_bytes / 1e6, "ours": ours}
        ours["mb_s"] = text_bytes / 1e6 / ours["seconds"]
        ours["tokens_s"] = ours["tokens"] / ours["seconds"]
        print(
            f"{size:g} MB: ours {ours['mb_s']:.2f} MB/s, {ours['tokens_s']:,.0f} tokens/s, "
            f"peak PSS {ours['peak_pss_mb']:.0f} MB (RSS sum {ours['peak_rss_mb']:.0f} MB)",
            flush=True,
        )
        if size == max(args.sizes):
            ceiling = run_ceiling(corpus, args.workers)
            ceiling["mb_s"] = text_bytes / 1e6 / ceiling["seconds"]
            ceiling["tokens_s"] = ceiling["tokens"] / ceiling["seconds"]
            entry["ceiling"] = ceiling
            print(
                f"{size:g} MB: ceiling encode_batch_fast {ceiling['mb_s']:.2f} MB/s, "
                f"{ceiling['tokens_s']:,.0f} tokens/s (same tokens as ours minus one EOD per document: {ceiling['tokens'] == ours['tokens'] - docs})",
                flush=True,
            )
        results[f"{size:g}MB"] = entry
        os.remove(corpus)
    largest = results[f"{max(args.sizes):g}MB"]
    smallest = results[f"{min(args.sizes):g}MB"]
    summary = {
        "bench": "preprocess",
        "workers": args.workers,
        "sizes_mb": args.sizes,
        "ours_mb_s": round(largest["ours"]["mb_s"], 3),
        "ours_tokens_s": round(largest["ours"]["tokens_s"]),
        "ceiling_mb_s": round(largest["ceiling"]["mb_s"], 3),
        "ceiling_tokens_s": round(largest["ceiling"]["tokens_s"]),
        "peak_pss_mb": {k: round(v["ours"]["peak_pss_mb"]) for k, v in results.items()},
        "peak_rss_sum_mb": {k: round(v["ours"]["peak_rss_mb"]) for k, v in results.items()},
        "memory_growth": round(largest["ours"]["peak_pss_mb"] / smallest["ours"]["peak_pss_mb"], 3),
        "ours_cpu_s": round(largest["ours"]["cpu_seconds"], 1),
        "ceiling_cpu_s": round(largest["ceiling"]["cpu_seconds"], 1),
        # wall time is noisy on a shared machine; CPU seconds for the same work are not
        "cpu_ratio": round(largest["ceiling"]["cpu_seconds"] / largest["ours"]["cpu_seconds"], 3),
        "ratio": round(largest["ours"]["mb_s"] / largest["ceiling"]["mb_s"], 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
