"""Benchmark: start-up of a training run on a blend of thousands of prefixes, on N ranks.

The data of bench/large_blend.py (`--prefixes` Megatron-made prefixes of 20 documents, random
weights, in a `--data-args-path` file). A tiny GPT (2 layers, hidden 64) trains 1 iteration on
`--ranks` CPU ranks under the deepspeed launcher (DP = ranks, ZeRO 0, `--split 99,1,0`: most
prefixes get no validation document), twice: cold (no cache of any kind: index caches and token
scans are built) and warm (everything cached). For each run: the seconds from launch to the first
iteration line, the lines printed before it, and each rank's peak resident memory (VmHWM, polled
from /proc every 0.2 s). A run on one prefix with the same flags is the reference for what
start-up costs without a blend (imports, process group, DeepSpeed).

The last line is one JSON object; "ratio" = 30 s (the issue's goal) / the cold start-up seconds
(> 1: the goal is met).

    .venv/bin/python bench/blend_startup.py --prefixes 10000 [--ranks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from large_blend import write_args_file, write_prefixes  # noqa: E402

from pretrain.launch import free_port  # noqa: E402

GOAL_S = 30.0


def command(ranks: int, args_file: str, cache: str) -> list[str]:
    python_bin = os.path.dirname(sys.executable)
    return [
        os.path.join(python_bin, "deepspeed"), "--num_gpus", str(ranks), "--master_port",
        str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"),
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--max-position-embeddings", "256",
        "--micro-batch-size", "1", "--global-batch-size", str(ranks), "--train-iters", "1",
        "--lr", "1e-4", "--data-args-path", args_file, "--split", "99,1,0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--eval-interval", "1", "--eval-iters", "1", "--num-workers", "0",
        "--distributed-backend", "gloo", "--log-interval", "1", "--data-cache-path", cache,
    ]  # fmt: skip


def _rank_of(cmdline: bytes) -> int | None:
    """The local rank of a pretrain_gpt.py rank process (its `--local_rank=K`), else None."""
    if b"pretrain_gpt.py" not in cmdline:
        return None
    for arg in cmdline.split(b"\0"):
        if arg.startswith(b"--local_rank="):
            return int(arg.split(b"=", 1)[1])
    return None


def _ranks_peak_rss(stop: threading.Event, peaks: dict[int, int]) -> None:
    """{local rank: peak RSS kB} of the rank processes (a process a rank forks shares its
    command line and counts as that rank), polled until `stop`."""
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    rank = _rank_of(f.read())
                if rank is None:
                    continue
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peaks[rank] = max(peaks.get(rank, 0), int(line.split()[1]))
            except OSError:
                continue
        stop.wait(0.2)


def run_once(ranks: int, args_file: str, cache: str) -> dict:
    """One launch: seconds to the first iteration line, lines before it, peak RSS per rank. The
    disk is flushed first, as in bench/large_blend.py (whose docstring says why small-file
    creation on this disk wants nothing deleted in the 6 minutes before)."""
    os.sync()
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT
    peaks: dict[int, int] = {}
    stop = threading.Event()
    poller = threading.Thread(target=_ranks_peak_rss, args=(stop, peaks), daemon=True)
    poller.start()
    start = time.perf_counter()
    proc = subprocess.Popen(
        command(ranks, args_file, cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    first, before, tail = None, 0, []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if first is None and " iteration " in line and "consumed samples" in line:
            first = time.perf_counter() - start
        elif first is None:
            before += 1
    code = proc.wait()
    total = time.perf_counter() - start
    stop.set()
    poller.join()
    if code != 0 or first is None:
        raise SystemExit(f"training failed ({code}):\n{''.join(tail)}")
    mb = [round(peaks[rank] / 1024) for rank in sorted(peaks)]
    return {
        "first_iteration_s": round(first, 1),
        "total_s": round(total, 1),
        "lines_before_first_iteration": before,
        "peak_rss_mb_per_rank": mb,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prefixes", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--data", default=None, help="folder for the prefixes [default: /tmp/...]")
    args = ap.parse_args()
    folder = args.data or os.path.join(tempfile.gettempdir(), f"large_blend_{args.prefixes}")
    prefixes = write_prefixes(folder, args.prefixes, 20)
    args_file = os.path.join(folder, "blend.txt")
    write_args_file(args_file, prefixes)
    one = os.path.join(folder, "one.txt")
    write_args_file(one, prefixes[:1])
    result = {"bench": "blend_startup", "prefixes": args.prefixes, "ranks": args.ranks}
    with tempfile.TemporaryDirectory(dir=folder) as work:
        for prefix in prefixes:  # cold: no token scan kept beside the data either
            shutil.rmtree(os.path.join(prefix, "cache"), ignore_errors=True)
        for name, blend in (("one_prefix", one), ("cold", args_file), ("warm", args_file)):
            cache = os.path.join(work, "one" if name == "one_prefix" else "cache")
            result[name] = run_once(args.ranks, blend, cache)
            result[name]["load"] = round(os.getloadavg()[0], 1)
            print(f"{name}: {json.dumps(result[name])}", flush=True)
    result["ratio"] = round(GOAL_S / result["cold"]["first_iteration_s"], 3)
    result["ratio_definition"] = "30 s goal / launch-to-first-iteration seconds, cold"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
