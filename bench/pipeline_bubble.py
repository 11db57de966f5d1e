"""The pipeline bubble of each schedule of the torch backend, measured from per-stage busy time on
CPU ranks, beside the textbook formula.

    .venv/bin/python bench/pipeline_bubble.py [--pp 2 4] [--microbatches 8] [--iters 4]

For each PP size, PP real gloo ranks (one thread each, TP = DP = 1, every stage module sharded by
FSDP2 as the engine does) train a GPT whose layers dominate the compute (8 layers, hidden 384,
vocabulary 512) under each schedule: 1F1B (one model chunk per rank), interleaved 1F1B,
interleaved zero bubble and ZBV (two chunks per rank). A rank's busy time is the time spent in its
stages' compute (forward, backward and weight-gradient calls, timed around `PipelineStage`'s
methods); its bubble is 1 - busy / step time (the rest is waiting for a neighbour, plus the p2p
copies and the last stage's cross-entropy over a 512-word vocabulary). Reported: the mean over ranks and the median over `--iters`
timed steps (after one warm-up step), beside the formula for equal forward and backward times
and free communication: (p - 1) / (m + p - 1) for 1F1B, (p - 1) / (v m + p - 1) with v chunks
for interleaved 1F1B; the zero-bubble schedules have no closed form here (ideally ~0 when the
forward, input-gradient and weight-gradient passes take equal time). `ratio` is each schedule's
step time over 1F1B's at the same PP.

CPU ranks share the machine's cores with whatever else runs, which inflates the waiting: the
load average at start and end goes with the figures. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEDULES = {  # name -> model chunks per rank
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "interleaved-zero-bubble": 2,
    "zbv-zero-bubble": 2,
}
TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="PP sizes [2 4]")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step [8]")
    p.add_argument("--iters", type=int, default=4, help="timed steps per schedule [4]")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    return p.parse_args()


def formula(schedule: str, pp: int, m: int) -> float | None:
    """The bubble fraction of the step for equal F and B times (None: no closed form here)."""
    if schedule == "1f1b":
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (SCHEDULES[schedule] * m + pp - 1)
    return None


class Busy:
    """Seconds spent inside the wrapped calls."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def micro_batches(a, count: int, seed: int) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    b, s = a.micro_batch_size, a.seq_length
    out = []
    for _ in range(count):
        tokens = torch.randint(0, a.vocab_size, (b, s + 1), generator=generator)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "loss_mask": torch.ones(b, s),
                "position_ids": torch.arange(s).repeat(b, 1),
            }
        )
    return out


def run_schedule(a, config, schedule: str) -> dict:
    """Median step time and this rank's busy seconds per timed step under `schedule`."""
    import torch
    import torch.distributed as dist

    from pretrain.parallel import state
    from pretrain.training.backends.torch.fsdp import ShardingPolicy, device_mesh, shard_model
    from pretrain.training.backends.torch.pipeline import Pipeline
    from pretrain.training.backends.torch.stages import StagePlan, build_stage_modules

    pp = state.get_pipeline_model_parallel_world_size()
    plan = StagePlan(
        num_layers=a.num_layers,
        pipeline_size=pp,
        chunks=SCHEDULES[schedule],
        v_shape=schedule == "zbv-zero-bubble",
    )
    modules = build_stage_modules(config, plan, state.get_pipeline_model_parallel_rank())
    mesh = device_mesh(torch.device("cpu"))
    for module in modules:
        shard_model(
            module, list(module.layers.values()), mesh, ShardingPolicy(reshard_after_forward=False)
        )
    pipeline = Pipeline(config, plan, modules, schedule, torch.device("cpu"))
    busy = Busy()
    steps, busy_seconds = [], []
    for step in range(a.iters + 1):
        batches = micro_batches(a, a.microbatches, seed=step)
        for module in modules:
            module.zero_grad(set_to_none=True)
        dist.barrier()
        busy.seconds, start = 0.0, time.perf_counter()
        pipeline.train(batches, use_document_ids=False)
        elapsed = time.perf_counter() - start
        if step == 0:  # the stages exist now: time their compute from the next step on
            for stage in pipeline.stages:
                for name in TIMED:
                    setattr(stage, name, busy.wrap(getattr(stage, name)))
            continue
        steps.append(elapsed)
        busy_seconds.append(busy.seconds)
    return {"step_s": statistics.median(steps), "busy_s": statistics.median(busy_seconds)}


def worker(rank: int, pp: int, port: int, a, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from pretrain.model.config import ModelConfig
    from pretrain.parallel import state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    state.initialize_model_parallel(1, pp)
    config = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.hidden_size // 64,
        vocab_size=a.vocab_size,
        seq_length=a.seq_length,
        max_position_embeddings=a.seq_length,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    figures = {name: run_schedule(a, config, name) for name in SCHEDULES}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def measure(a, pp: int) -> dict:
    """Each schedule's bubble (mean over ranks), formula and step time at `pp` ranks."""
    import tempfile

    import torch.multiprocessing as mp

    from pretrain.launch import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(pp, free_port(), a, out_dir), nprocs=pp, join=True)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(pp)]
    out = {}
    for name in SCHEDULES:
        step = max(r[name]["step_s"] for r in ranks)
        bubble = statistics.mean(1 - r[name]["busy_s"] / r[name]["step_s"] for r in ranks)
        out[name] = {
            "bubble": round(bubble, 3),
            "formula": None
            if formula(name, pp, a.microbatches) is None
            else round(formula(name, pp, a.microbatches), 3),
            "step_s": round(step, 3),
        }
    for name in SCHEDULES:
        out[name]["ratio"] = round(out[name]["step_s"] / out["1f1b"]["step_s"], 3)
    return out


def main() -> None:
    a = parse()
    if a.num_layers % (2 * max(a.pp)):
        raise SystemExit(f"--num-layers {a.num_layers}: needs a multiple of 2 x PP (two chunks)")
    figures = {
        "bench": "pipeline_bubble",
        **vars(a),
        "load_average_start": round(os.getloadavg()[0], 1),
    }
    for pp in a.pp:
        figures[f"pp{pp}"] = measure(a, pp)
        for name, row in figures[f"pp{pp}"].items():
            print(
                f"PP {pp} {name:24s} bubble {row['bubble']:.3f}  formula {row['formula']}  "
                f"step {row['step_s']:.3f} s  ratio {row['ratio']:.3f}",
                flush=True,
            )
    figures["load_average_end"] = round(os.getloadavg()[0], 1)
    figures["ratio"] = figures[f"pp{max(a.pp)}"]["interleaved-1f1b"]["ratio"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
