"""Benchmark: index caches of a blend of thousands of small prefixes, cold, ours vs megatron-core.

The data: `--prefixes` prefixes of `--docs` documents each (lengths uniform in 50..400 tokens,
ids < 1000, uint16), written by megatron-core's own `IndexedDatasetBuilder` (so no sidecar, as
Megatron-made data), and a `--data-args-path` file weighting them at random in 1..10.

Cold, each in a fresh process and a fresh cache folder, on the same files and flags
(`--split 100,0,0`, `--train-samples 32000`, `--seq-length 256`, NullTokenizer 1000):

  - megatron: `BlendedMegatronDatasetBuilder(GPTDataset, ...).build()` (the GPTDataset and the
    BlendedDataset caches under `path_to_cache`); it keeps about 3 files open per prefix when it
    maps the `.bin` files (10,000 prefixes fail with "Too many open files" under
    `ulimit -n 20000`), so where 3 per prefix exceed the limit it runs with `mmap_bin_files=False`
    (Megatron's `--no-mmap-bin-files`: the same arrays, fewer files open);
  - ours: `tools/build_data_cache.py` with the training flags (`main(argv)`: the tokenizer, the
    data checks (largest token id of every `.bin`: there is no sidecar), the split checks and the
    build).

Each side is timed inside its process (megatron-core first in even repeats, ours in odd ones) from
the parsed arguments to the written caches (imports excluded), in wall and CPU seconds; the whole
process's wall time (imports included) too. After both, every GPTDataset and the BlendedDataset
cache of both folders are compared array by array (same file names, dtypes, values). The last line
is one JSON object; "ratio" = megatron seconds / our seconds (> 1: we are faster), the median of
`--repeats` runs; "cpu_ratio" and "process_ratio" the same for CPU seconds and whole processes.

Both sides create the same thousands of small files. On ext4 without a journal (this machine's
disk) creating one skips every free inode freed in the last minute, or the last 6 minutes when its
inode-table block is dirty (which creating files beside it makes it): after a mass deletion (a test
run, this bench's own cleanup) a small file costs up to 0.7 ms of kernel CPU instead of 0.02 ms,
at random per new folder. The disk is flushed before each run (`sync`); run the bench when nothing
was deleted in the last 6 minutes (`sleep 360` between two runs of it).

    .venv/bin/python bench/large_blend.py --prefixes 2000 [--repeats 3] [--data /tmp/blend2000]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

VOCAB = 1000
SEQ_LENGTH = 256
SAMPLES = 32_000


def write_prefixes(folder: str, count: int, docs: int, seed: int = 0) -> list[str]:
    """`count` prefixes of `docs` documents each, written by megatron-core's builder (once: a
    folder that holds them already is reused)."""
    done = os.path.join(folder, f"done-{count}-{docs}")
    prefixes = [os.path.join(folder, f"part_{i:05d}") for i in range(count)]
    if os.path.exists(done):
        return prefixes
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix in prefixes:
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for n in rng.integers(50, 400, docs):
            tokens = rng.integers(0, VOCAB, n)
            builder.add_document(tokens, [int(n)])
        builder.finalize(prefix + ".idx")
    open(done, "w").close()
    return prefixes


def write_args_file(path: str, prefixes: list[str], seed: int = 0) -> None:
    """'W PREFIX' per line, weights 1..10."""
    weights = np.random.default_rng(seed).integers(1, 11, len(prefixes))
    with open(path, "w") as f:
        f.writelines(f"{w} {p}\n" for w, p in zip(weights, prefixes, strict=True))


MEGATRON = """
import json, sys, time, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
import torch.distributed as dist
from pretrain.tokenizer import NullTokenizer

# megatron-core's BlendedDataset asks torch.distributed for the rank: a world of one
dist.init_process_group("gloo", init_method="file://{cache}.store", rank=0, world_size=1)

class View:  # our NullTokenizer as megatron reads it (same unique_identifiers: same cache names)
    def __init__(self, tok):
        self.eod, self.pad, self.vocab_size = tok.eod, -1, tok.vocab_size
        self.unique_identifiers = tok.unique_identifiers

t, cpu = time.perf_counter(), time.process_time()
words = open({args!r}).read().split()
blend = (words[1::2], [float(w) for w in words[0::2]])
# megatron-core keeps ~3 files open per prefix with its .bin files memory-mapped: 10,000 prefixes
# fail with "Too many open files" under `ulimit -n 20000`; its file reader keeps fewer
import resource
mmap_bins = 3 * len(blend[0]) + 256 < resource.getrlimit(resource.RLIMIT_NOFILE)[0]
cfg = GPTDatasetConfig(
    random_seed=1234, sequence_length={seq}, blend=blend, split="100,0,0",
    path_to_cache={cache!r}, tokenizer=View(NullTokenizer({vocab})),
    reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    mmap_bin_files=mmap_bins,
)
BlendedMegatronDatasetBuilder(GPTDataset, [{samples}, 0, 0], lambda: True, cfg).build()
print(json.dumps({{"seconds": time.perf_counter() - t, "cpu": time.process_time() - cpu,
                  "mmap_bin_files": mmap_bins}}))
"""

OURS = """
import contextlib, io, json, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {tools!r})
import build_data_cache
argv = {argv!r}
t, cpu = time.perf_counter(), time.process_time()
with contextlib.redirect_stdout(io.StringIO()):
    status = build_data_cache.main(argv)
assert status == 0, status
print(json.dumps({{"seconds": time.perf_counter() - t, "cpu": time.process_time() - cpu}}))
"""


def our_argv(args_file: str, cache: str) -> list[str]:
    return [
        "--data-args-path",
        args_file,
        "--split",
        "100,0,0",
        "--seq-length",
        str(SEQ_LENGTH),
        "--train-samples",
        str(SAMPLES),
        "--global-batch-size",
        "32",
        "--eval-iters",
        "0",
        "--data-cache-path",
        cache,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
    ]


def run_timed(code: str) -> tuple[float, float, float]:
    """(seconds the process reports for its work, its CPU seconds for it, the process's wall
    seconds). The disk is flushed first (`sync`): on ext4, creating a file skips free inodes
    whose inode-table block is still dirty, so a side run after many deletions or writes (the
    other side's, a test run's) would pay for them (measured: 0.02 ms per small file on a flushed
    disk, up to 0.7 ms after one)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    os.sync()
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}):\n{out.stderr[-3000:]}")
    wall = time.perf_counter() - start
    reported = json.loads(out.stdout.strip().splitlines()[-1])
    return reported["seconds"], reported["cpu"], wall


def clear_token_scans(prefixes: list[str]) -> None:
    """Cold: no cached scan of any `.bin` (our only state outside the cache folder)."""
    for prefix in prefixes:
        shutil.rmtree(os.path.join(prefix, "cache"), ignore_errors=True)


def compare(ours: str, theirs: str) -> int:
    """Every Megatron array file of megatron-core's folder exists in ours with the same dtype and
    values; returns how many were compared."""
    names = [
        os.path.basename(p)
        for p in glob.glob(os.path.join(theirs, "*.npy"))
        if "GPTDataset" in p or "BlendedDataset" in p
    ]
    assert names, "megatron-core wrote no cache"
    for name in names:
        a, b = np.load(os.path.join(ours, name)), np.load(os.path.join(theirs, name))
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    return len(names)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prefixes", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default=None, help="folder for the prefixes [default: /tmp/...]")
    ap.add_argument(
        "--cache-root",
        default=None,
        help="where the cache folders go (e.g. /dev/shm: no disk) [default: beside the data]",
    )
    args = ap.parse_args()
    folder = args.data or os.path.join(tempfile.gettempdir(), f"large_blend_{args.prefixes}")
    t = time.perf_counter()
    prefixes = write_prefixes(folder, args.prefixes, args.docs)
    print(
        f"{len(prefixes)} prefixes of {args.docs} documents in {folder} ({time.perf_counter() - t:.1f} s)"
    )
    args_file = os.path.join(folder, "blend.txt")
    write_args_file(args_file, prefixes)
    fmt = dict(root=ROOT, seq=SEQ_LENGTH, samples=SAMPLES, vocab=VOCAB, args=args_file)
    runs = {"ours": [], "megatron": []}  # (seconds, cpu seconds, process seconds) per repeat
    with tempfile.TemporaryDirectory(dir=args.cache_root or folder) as work:
        for repeat in range(args.repeats):
            mine = os.path.join(work, f"ours{repeat}")
            theirs = os.path.join(work, f"megatron{repeat}")
            clear_token_scans(prefixes)
            tools = os.path.join(ROOT, "tools")
            codes = {
                "ours": OURS.format(root=ROOT, tools=tools, argv=our_argv(args_file, mine)),
                "megatron": MEGATRON.format(cache=theirs, **fmt),
            }
            for side in sorted(codes, reverse=repeat % 2 == 1):  # each side first in turn
                runs[side].append(run_timed(codes[side]))
            print(
                "run {}: ours {:.2f} s (CPU {:.2f} s, process {:.1f} s), megatron-core {:.2f} s "
                "(CPU {:.2f} s, process {:.1f} s), load {:.1f}".format(
                    repeat, *runs["ours"][-1], *runs["megatron"][-1], os.getloadavg()[0]
                )
            )
        compared = compare(mine, theirs)
        print(f"{compared} cache arrays of megatron-core equal ours (names, dtypes, values)")
    med = {side: [statistics.median(r[i] for r in runs[side]) for i in range(3)] for side in runs}
    result = {
        "bench": "large_blend",
        "prefixes": args.prefixes,
        "documents_per_prefix": args.docs,
        "train_samples": SAMPLES,
        "seq_length": SEQ_LENGTH,
        "cache_root": args.cache_root or folder,
        "ours_s": round(med["ours"][0], 3),
        "megatron_core_s": round(med["megatron"][0], 3),
        "ours_cpu_s": round(med["ours"][1], 3),
        "megatron_core_cpu_s": round(med["megatron"][1], 3),
        "ours_process_s": round(med["ours"][2], 2),
        "megatron_core_process_s": round(med["megatron"][2], 2),
        "arrays_compared": compared,
        "load": round(os.getloadavg()[0], 1),
        "cpu_ratio": round(med["megatron"][1] / med["ours"][1], 3),
        "process_ratio": round(med["megatron"][2] / med["ours"][2], 3),
        "ratio": round(med["megatron"][0] / med["ours"][0], 3),
        "ratio_definition": "megatron-core cold build seconds / ours (median of repeats)",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
