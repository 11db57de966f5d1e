"""The torch backend (FSDP2) against DeepSpeed: peak memory and step time per rank, and the
training time a checkpoint costs with and without --async-save.

    .venv/bin/python bench/torch_backend.py [--nproc 2] [--iters 8] [--num-layers 12 ...]

A GPT-2-small-shaped model (12 layers, hidden 768, 12 heads, vocab 50,257: 124M parameters;
short sequences so that a step is quick on CPU), fp32 (bf16 on a GPU), DP = `--nproc`, each
configuration a real `pretrain_gpt.py` run (`pretrain(parse_args(argv))`) in its own launch of
the deepspeed launcher, so a process's peak memory is that configuration's:

- memory and step time: `fsdp2` (--use-torch-fsdp2), `zero3` and `zero1` (DeepSpeed). Peak
  memory per rank is, on a GPU, `torch.cuda.max_memory_allocated`; on the CPU the growth of the
  process's peak resident set (`ru_maxrss`) over its resident set just before the engine is
  built (weights, gradients, optimizer state and activations, plus whatever the library
  allocates); the largest over the ranks. Step time: the median `iteration-time` of the
  metrics file after `--warmup` iterations. `ratio` = fsdp2 / zero3 step time (the same
  sharding; goal <= 1.0), `memory_ratio` = fsdp2 / zero3 peak memory; `step_cpu_s` and
  `ratio_cpu`: the same in the process's CPU seconds (every thread), steadier than wall time on
  a shared machine.
- save stall: the torch backend saving every `--save-every` iterations, blocking and with
  --async-save, against the same run without saves; `stall_wall_s` = (the time from the end of
  iteration 1 to the end of the last iteration, minus the run without saves') / the saves in
  that span; a save at the last iteration (the final one, waited for at exit) is outside it;
  `stall_cpu_s` the same in the rank's CPU seconds (the background writer's included).

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (DP = nproc) [2]")
    p.add_argument("--iters", type=int, default=8, help="iterations of a memory/step run [8]")
    p.add_argument("--warmup", type=int, default=2, help="iterations not timed [2]")
    p.add_argument("--save-every", type=int, default=3, help="save interval of the stall runs")
    p.add_argument("--saves", type=int, default=2, help="saves inside the timed span [2]")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--part", choices=["all", "memory", "stall"], default="all", help="what to run")
    p.add_argument("--workdir", help="where corpus and checkpoints go [a temporary folder]")
    p.add_argument("--worker", nargs=3, metavar=("ARGV", "REPORT", "LABEL"), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args()


# ---------------------------------------------------------------- inside the launched processes


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(argv_file: str, report: str, label: str) -> None:
    """Run one configuration, recording this rank's peak memory and the iteration ends."""
    import torch
    import torch.distributed as dist

    import pretrain.training.backends.factory as engine_module
    import pretrain.training.run as run_module
    from pretrain.cli import parse_args
    from pretrain.errors import exit_on_user_error
    from pretrain.training.report.logging import MetricsLogger

    before = {}
    build = engine_module.build_engine

    def measured_build(**kwargs):
        before["rss"] = _resident_bytes()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return build(**kwargs)

    engine_module.build_engine = measured_build  # run.py imports it when it builds the engine
    ends, cpu_ends = [], []
    record = MetricsLogger.record_iteration

    def stamped(self, **kwargs):
        record(self, **kwargs)
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())  # every thread of this rank, the writer's too

    MetricsLogger.record_iteration = stamped

    @exit_on_user_error
    def main() -> None:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
        pretrain_argv = json.loads(Path(argv_file).read_text())
        run_module.pretrain(parse_args(pretrain_argv))
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before["rss"]
        with open(f"{report}.rank{os.environ.get('RANK', '0')}", "w") as f:
            json.dump({"label": label, "peak_bytes": peak, "ends": ends, "cpu_ends": cpu_ends}, f)

    main()


# ---------------------------------------------------------------- the driver


def make_corpus(prefix: str, vocab: int, tokens: int) -> None:
    import numpy as np

    from pretrain.data.files.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    for _ in range(max(1, tokens // 1000)):
        builder.add_item(rng.integers(0, vocab, size=1000))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def base_argv(a, corpus: str, iters: int, metrics: str) -> list[str]:
    import torch

    gbs = a.micro_batch_size * a.nproc
    return [
        *("--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size)),
        *("--num-attention-heads", str(a.num_attention_heads)),
        *("--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length)),
        *("--attention-dropout", "0", "--hidden-dropout", "0"),
        *("--micro-batch-size", str(a.micro_batch_size), "--global-batch-size", str(gbs)),
        *("--train-iters", str(iters), "--lr", "1e-4", "--seed", "1"),
        *("--data-path", corpus, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer"),
        *("--vocab-size", str(a.vocab_size), "--log-interval", "1", "--eval-iters", "0"),
        *("--num-workers", "0", "--metrics-file", metrics),
        *(["--bf16"] if torch.cuda.is_available() else []),
    ]


def launch(a, label: str, argv: list[str], work: str) -> list[dict]:
    """One deepspeed-launcher run of `argv`; each rank's report."""
    argv_file = os.path.join(work, f"{label}.argv.json")
    Path(argv_file).write_text(json.dumps(argv))
    report = os.path.join(work, f"{label}.report")
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(a.nproc)]
    cmd += ["--master_port", str(29500 + os.getpid() % 1000), str(Path(__file__).resolve())]
    cmd += ["--worker", argv_file, report, label]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{label} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    print(f"{label}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(a.nproc)]


def step_time(metrics: str, warmup: int) -> float:
    times = [json.loads(line)["iteration-time"] for line in Path(metrics).read_text().splitlines()]
    return statistics.median(times[warmup:])


def _deltas(stamps: list[float]) -> list[float]:
    """Seconds between consecutive iteration ends (the first iteration's start is not stamped)."""
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def memory_and_steps(a, corpus: str, work: str) -> dict:
    configs = {
        "fsdp2": ["--use-torch-fsdp2"],
        "zero3": ["--zero-stage", "3"],
        "zero1": ["--zero-stage", "1"],
    }
    out = {}
    for label, flags in configs.items():
        metrics = os.path.join(work, f"{label}.jsonl")
        reports = launch(a, label, base_argv(a, corpus, a.iters, metrics) + flags, work)
        cpu_steps = [statistics.median(_deltas(r["cpu_ends"])[a.warmup :]) for r in reports]
        out[label] = {
            "peak_mib_per_rank": round(max(r["peak_bytes"] for r in reports) / 2**20, 1),
            "step_s": round(step_time(metrics, a.warmup), 4),
            "step_cpu_s": round(max(cpu_steps), 4),
        }
    return out


def save_stall(a, corpus: str, work: str) -> dict:
    iters = 1 + a.save_every * a.saves + 1  # the timed span holds `saves` saves, not the last
    flags = ["--use-torch-fsdp2"]
    spans, cpu = {}, {}
    for label, extra in (
        ("no_save", []),
        ("blocking", ["--save", os.path.join(work, "blocking")]),
        ("async", ["--save", os.path.join(work, "async"), "--async-save"]),
    ):
        if extra:
            extra += ["--save-interval", str(a.save_every), "--save-total-limit", "1"]
        metrics = os.path.join(work, f"stall_{label}.jsonl")
        argv = base_argv(a, corpus, iters, metrics) + flags + extra
        reports = launch(a, f"stall_{label}", argv, work)
        spans[label] = reports[0]["ends"][-1] - reports[0]["ends"][0]
        cpu[label] = max(r["cpu_ends"][-1] - r["cpu_ends"][0] for r in reports)
    lost = {"wall": spans, "cpu": cpu}
    return {
        "span_s": {k: round(v, 2) for k, v in spans.items()},
        "span_cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        **{
            f"stall_{kind}_s": {
                k: round((lost[kind][k] - lost[kind]["no_save"]) / a.saves, 2)
                for k in ("blocking", "async")
            }
            for kind in ("wall", "cpu")
        },
    }


def main() -> None:
    a = parse()
    if a.worker:
        worker(*a.worker)
        return
    with tempfile.TemporaryDirectory(dir=a.workdir) as work:
        corpus = os.path.join(work, "corpus")
        make_corpus(corpus, a.vocab_size, 200_000)
        figures = {"model": f"GPT {a.num_layers} x {a.hidden_size}, vocab {a.vocab_size}"}
        figures["nproc"] = a.nproc
        if a.part in ("all", "memory"):
            steps = memory_and_steps(a, corpus, work)
            figures |= steps | {
                "ratio": round(steps["fsdp2"]["step_s"] / steps["zero3"]["step_s"], 3),
                "ratio_vs_zero1": round(steps["fsdp2"]["step_s"] / steps["zero1"]["step_s"], 3),
                "ratio_cpu": round(steps["fsdp2"]["step_cpu_s"] / steps["zero3"]["step_cpu_s"], 3),
                "memory_ratio": round(
                    steps["fsdp2"]["peak_mib_per_rank"] / steps["zero3"]["peak_mib_per_rank"], 3
                ),
            }
        if a.part in ("all", "stall"):
            figures |= save_stall(a, corpus, work)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
