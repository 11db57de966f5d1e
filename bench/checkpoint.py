"""Checkpoint save/load time and disk use: with the layout-independent full state vs without it.

    .venv/bin/python bench/checkpoint.py [--nproc 2] [--repeats 2] [--num-layers 12 ...]

A GPT-2-small-shaped model (12 layers, hidden 768, 12 heads, vocab 50,257: 124M parameters; short
sequences so that a step is quick on CPU), fp32, trained for `--iters` iterations by real
`pretrain_gpt.py` runs (`pretrain(parse_args(argv))` in a world of `--nproc` ranks started by the
deepspeed launcher, DP = nproc, ZeRO-1), each saving once at its last iteration:

- `full`: today's checkpoint, DeepSpeed's files + RNG files + `full_state_*.pt`;
- `deepspeed` (the baseline): the same with `--no-save-full-state`: DeepSpeed's files + RNG files,
  i.e. the format before the layout-independent state existed.

The two alternate, `--repeats` times each. Then runs that only load (`--train-iters` equal to the
checkpoint's iteration: nothing to train) resume them:

- `same layout`: DeepSpeed's own load (`engine.load_checkpoint`), from each kind of checkpoint;
- `other layout`: the `full` checkpoint at TP = nproc (and at ZeRO-2) through the full state
  (`pretrain/training/backends/deepspeed/full_state.py`).

Times are wall-clock seconds on rank 0 of `Checkpointer.save` and of `load_checkpoint`, each
between two barriers (every rank done), taken by wrapping those functions in the launched
processes; the save time includes every file's fsync. Before each load the page cache of the
checkpoint's files is dropped (posix_fadvise DONTNEED on those files only), so loads read the
disk. Bytes are the step folder's files (`du`-free: the sum of file sizes). `ratio` = full /
deepspeed for saves and bytes, other layout / same layout for loads (medians). The last line
printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--nproc", type=int, default=2, help="ranks (DP = nproc, ZeRO-1) [2]")
    p.add_argument("--repeats", type=int, default=2, help="saves (and loads) of each kind [2]")
    p.add_argument("--iters", type=int, default=1, help="iterations before the save [1]")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--workdir", help="where the checkpoints go [a temporary folder, removed]")
    p.add_argument("--worker", nargs=2, metavar=("RUNS", "TIMINGS"), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args()


# ---------------------------------------------------------------- inside the launched processes


def _drop_page_cache(folder: str) -> None:
    """Evict `folder`'s files from the page cache (they are clean after their fsync), so that a
    load reads the disk; other files on the machine are untouched."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _install_timers(timings: Path, label: list[str]) -> None:
    """Wrap the real save and load functions with barrier-bracketed timers (rank 0 records)."""
    import torch.distributed as dist

    import pretrain.training.run as run_module
    from pretrain.training.checkpoints.checkpointing import Checkpointer

    def record(**fields) -> None:
        if dist.get_rank() == 0:
            with open(timings, "a") as f:
                f.write(json.dumps({"label": label[0], **fields}) + "\n")

    save = Checkpointer.save

    def timed_save(self, engine, train_state):
        dist.barrier()
        start = time.perf_counter()
        tag = save(self, engine, train_state)
        dist.barrier()
        record(
            event="save",
            seconds=time.perf_counter() - start,
            step_dir=os.path.join(self.config.save, tag),
            params=engine.params_total,
        )
        return tag

    Checkpointer.save = timed_save
    load = run_module.load_checkpoint

    def timed_load(config, engine, choice, parallel=None):
        step_dir = os.path.join(config.load, choice.tag)
        if dist.get_rank() == 0:
            _drop_page_cache(step_dir)
        dist.barrier()
        start = time.perf_counter()
        out = load(config, engine, choice, parallel)
        dist.barrier()
        record(event="load", seconds=time.perf_counter() - start, step_dir=step_dir)
        return out

    run_module.load_checkpoint = timed_load
    import pretrain.training.backends.deepspeed.full_state as reshard

    for name in ("save_full_state", "write_shard"):  # the full state's part of a save
        setattr(reshard, name, _timed(getattr(reshard, name), name, record))


def _timed(function, name: str, record):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = function(*args, **kwargs)
        record(event=name, seconds=time.perf_counter() - start)
        return out

    return timed


def worker(runs_file: str, timings: str) -> None:
    """Run every {label, argv} of RUNS in this launched world, timing saves and loads."""
    import torch.distributed as dist

    from pretrain.cli import parse_args
    from pretrain.errors import exit_on_user_error
    from pretrain.training.run import pretrain

    label = [""]
    _install_timers(Path(timings), label)

    @exit_on_user_error
    def main() -> None:
        dist.init_process_group("gloo")  # env:// from the launcher; every run below reuses it
        for run in json.loads(Path(runs_file).read_text()):
            label[0] = run["label"]
            pretrain(parse_args(run["argv"]))
        dist.destroy_process_group()

    main()


# ---------------------------------------------------------------- the driver


def base_argv(a, corpus: str, iters: int) -> list[str]:
    gbs = 2 * a.nproc
    return [
        *("--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size)),
        *("--num-attention-heads", str(a.num_attention_heads)),
        *("--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length)),
        *("--attention-dropout", "0", "--hidden-dropout", "0"),
        *("--micro-batch-size", "1", "--global-batch-size", str(gbs)),
        *("--train-iters", str(iters), "--lr", "1e-4", "--seed", "1"),
        *("--data-path", corpus, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer"),
        *("--vocab-size", str(a.vocab_size), "--log-interval", "1", "--eval-iters", "0"),
        *("--num-workers", "0", "--distributed-backend", "gloo"),
    ]


def layout(tp: int, zero: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(zero)]


def plan(a, corpus: str, work: str) -> list[dict]:
    """Save runs (full and deepspeed alternating), then load-only runs of each checkpoint."""
    runs, loads = [], []
    for r in range(a.repeats):
        for kind in ("full", "deepspeed"):
            ckpt = os.path.join(work, f"{kind}_{r}")
            extra = ["--no-save-full-state"] if kind == "deepspeed" else []
            argv = base_argv(a, corpus, a.iters) + layout(1, 1)
            argv += ["--save", ckpt, "--save-interval", str(a.iters), *extra]
            runs.append({"label": f"save {kind}", "argv": argv})
        for label, kind, target in (
            ("load deepspeed, same layout", "deepspeed", layout(1, 1)),
            ("load full, same layout", "full", layout(1, 1)),
            (f"load full, other layout TP{a.nproc}", "full", layout(a.nproc, 1)),
            ("load full, other layout ZeRO-2", "full", layout(1, 2)),
        ):
            ckpt = os.path.join(work, f"{kind}_{r}")
            argv = base_argv(a, corpus, a.iters) + target + ["--load", ckpt]
            loads.append({"label": label, "argv": argv})
    return runs + loads


def step_bytes(step_dir: str) -> dict[str, int]:
    """The step folder's bytes by kind of file."""
    kinds = {"deepspeed": 0, "full_state": 0, "rng": 0, "meta": 0}
    for name in os.listdir(step_dir):
        size = os.path.getsize(os.path.join(step_dir, name))
        if name.startswith("full_state_"):
            kinds["full_state"] += size
        elif name.startswith("rng_state_"):
            kinds["rng"] += size
        elif name.endswith(".json"):
            kinds["meta"] += size
        else:
            kinds["deepspeed"] += size
    return kinds


def launch(a, runs: list[dict], work: str) -> list[dict]:
    """Each run in a world of its own (one world for all would keep every run's engine in
    memory: DeepSpeed holds references to them)."""
    from pretrain.launch import free_port

    runs_file, timings = os.path.join(work, "runs.json"), os.path.join(work, "timings.jsonl")
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for run in runs:
        Path(runs_file).write_text(json.dumps([run]))
        cmd = [deepspeed, "--num_gpus", str(a.nproc), "--master_port", str(free_port())]
        cmd += [str(Path(__file__).resolve()), "--worker", runs_file, timings]
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{run['label']} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        print(f"{run['label']}: done", flush=True)
    return [json.loads(line) for line in Path(timings).read_text().splitlines()]


def summarize(a, records: list[dict]) -> dict:
    def median(label: str, event: str) -> float:
        times = [r["seconds"] for r in records if r["label"] == label and r["event"] == event]
        return statistics.median(times)

    saves = {
        kind: [r for r in records if r["label"] == f"save {kind}" and r["event"] == "save"]
        for kind in ("full", "deepspeed")
    }
    sizes = {kind: step_bytes(saves[kind][0]["step_dir"]) for kind in saves}
    total = {kind: sum(s.values()) for kind, s in sizes.items()}
    save_s = {kind: median(f"save {kind}", "save") for kind in saves}
    load_labels = sorted({r["label"] for r in records if r["event"] == "load"})
    load_s = {label: median(label, "load") for label in load_labels}
    same = load_s["load deepspeed, same layout"]
    params = saves["full"][0]["params"]
    print(f"model: {params:,} parameters, fp32, DP{a.nproc} ZeRO-1, {a.repeats} repeat(s)")
    print(f"{'checkpoint':<12}{'save s':>9}{'step folder MB':>16}{'full_state MB':>15}")
    for kind in ("deepspeed", "full"):
        print(
            f"{kind:<12}{save_s[kind]:>9.2f}{total[kind] / 1e6:>16.1f}"
            f"{sizes[kind]['full_state'] / 1e6:>15.1f}"
        )
    full_state_s = median("save full", "save_full_state")
    write_s = median("save full", "write_shard")
    print(
        f"of the full save: full state {full_state_s:.2f} s (gathering over DP and copying "
        f"{full_state_s - write_s:.2f} s, DP rank 0 writing its share {write_s:.2f} s)"
    )
    print(
        f"full / deepspeed: save time x{save_s['full'] / save_s['deepspeed']:.2f}, "
        f"bytes x{total['full'] / total['deepspeed']:.2f} "
        f"({sizes['full']['full_state'] / params:.1f} bytes/parameter added)"
    )
    for label in load_labels:
        print(f"{label:<36}{load_s[label]:>8.2f} s  x{load_s[label] / same:.2f}")
    other = next(label for label in load_labels if "TP" in label)
    return {
        "bench": "checkpoint",
        "params": params,
        "layout": f"DP{a.nproc} ZeRO-1 fp32",
        "repeats": a.repeats,
        "save_s": {k: round(v, 3) for k, v in save_s.items()},
        "full_state_save_s": round(full_state_s, 3),
        "full_state_write_s": round(write_s, 3),
        "step_bytes": total,
        "full_state_bytes": sizes["full"]["full_state"],
        "deepspeed_bytes": sizes["full"]["deepspeed"],
        "load_s": {k: round(v, 3) for k, v in load_s.items()},
        "all_s": {  # every measurement, in run order: the spread on a shared machine
            label: [
                round(r["seconds"], 2)
                for r in records
                if r["label"] == label and r["event"] in ("save", "load")
            ]
            for label in [f"save {kind}" for kind in saves] + load_labels
        },
        "save_ratio": round(save_s["full"] / save_s["deepspeed"], 3),
        "bytes_ratio": round(total["full"] / total["deepspeed"], 3),
        "ratio": round(load_s[other] / same, 3),
    }


def main() -> None:
    a = parse()
    if a.worker:
        worker(*a.worker)
        return
    with tempfile.TemporaryDirectory(dir=a.workdir) as work:
        corpus = os.path.join(work, "corpus")
        tokens = 4 * a.iters * 2 * a.nproc * (a.seq_length + 1) + 10_000
        from train_step import make_corpus  # bench/: the same synthetic corpus as that bench

        make_corpus(corpus, a.vocab_size, tokens)
        records = launch(a, plan(a, corpus, work), work)
        result = summarize(a, records)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
