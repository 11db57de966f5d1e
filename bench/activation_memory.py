"""Activation memory of one training forward pass: recompute settings and sequence parallelism.

What is measured: the bytes a forward pass (tokens -> per-token loss -> mean, in training mode)
leaves allocated for its backward pass, i.e. the activations kept for backward. On CPU there is
no allocator counter, so:
- recompute rows: the forward runs under `torch.profiler` with `profile_memory=True` and the self
  allocations minus frees of every recorded op are summed (each allocation counted once, at the
  op that made it); this also sees the inputs a recompute checkpoint holds;
- sequence-parallel rows: the tensors autograd saves (`saved_tensors_hooks`, each storage once),
  since gloo frees its collective buffers after the op returns and the profiler would count them.
The model's weights exist before the forward and are not counted.

Rows, all in one run, same model and batch (Megatron's default dropout 0.1 unless changed):
- TP 1: no recompute (the baseline), `--recompute-granularity selective`, full uniform 1, full
  block (half of the layers);
- TP 2 and TP 4 (real gloo ranks, one process per rank): per rank without and with
  `--sequence-parallel`.
"ratio" in the last JSON line is each setting's bytes over its baseline's (smaller is better).

    .venv/bin/python bench/activation_memory.py [--seq-length 512 --hidden-size 256 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from pretrain.launch import free_port
from pretrain.model import GPTModel, ModelConfig
from pretrain.parallel import state

MIB = 2**20


def forward_activation_bytes(model: torch.nn.Module, tokens, labels) -> int:
    """Bytes allocated by one training forward (to the mean loss) and still alive after it."""
    model.train()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(tokens, labels=labels).mean()
    alive = sum(event.self_cpu_memory_usage for event in prof.events())
    del loss
    return int(alive)


def saved_activation_bytes(model: torch.nn.Module, tokens, labels) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward (each storage
    once, parameters excluded). Used with collectives, where gloo releases its buffers after the
    op returns and the profiler's net count would include them; blind to what a recompute
    checkpoint keeps outside autograd, so not used for the recompute rows."""
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, labels=labels).mean()
    del loss
    return sum(storages.values())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--tp", type=int, nargs="*", default=[2, 4])
    return parser.parse_args(argv)


def model_config(args) -> ModelConfig:
    """The benchmarked GPT-2-style model."""
    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
    )


def batch(args):
    """A fixed random batch (the same on every rank)."""
    generator = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_length)
    return (
        torch.randint(0, args.vocab_size, shape, generator=generator),
        torch.randint(0, args.vocab_size, shape, generator=generator),
    )


RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full_uniform_1": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full_block_half": {"recompute_granularity": "full", "recompute_method": "block"},
}


def recompute_rows(args) -> dict[str, int]:
    """TP 1 bytes per recompute setting."""
    config, (tokens, labels) = model_config(args), batch(args)
    rows = {}
    for name, change in RECOMPUTE.items():
        if name == "full_block_half":
            change = {**change, "recompute_num_layers": max(1, args.num_layers // 2)}
        model = GPTModel(dataclasses.replace(config, **change))
        rows[name] = forward_activation_bytes(model, tokens, labels)
    return rows


def _rank(rank: int, tp: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=tp, timeout=datetime.timedelta(seconds=300)
    )
    state.initialize_model_parallel(tp, 1)
    tokens, labels = batch(args)
    out = {}
    for sp in (False, True):
        model = GPTModel(dataclasses.replace(model_config(args), sequence_parallel=sp))
        out[sp] = saved_activation_bytes(model, tokens, labels)
    if rank == 0:
        results.put(out)
    dist.barrier()
    state.destroy_model_parallel()
    dist.destroy_process_group()


def sequence_parallel_rows(args, tp: int) -> dict[str, int]:
    """Rank 0's bytes at TP `tp` without and with sequence parallelism."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, tp, port, args, results)) for r in range(tp)]
    for proc in procs:
        proc.start()
    out = results.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    return {"off": out[False], "on": out[True]}


def main(argv=None) -> dict:
    """Measure, print a table and the JSON line; return the figures."""
    args = parse_args(argv)
    recompute = recompute_rows(args)
    sp = {f"tp{tp}": sequence_parallel_rows(args, tp) for tp in args.tp}
    print(f"{'setting':32s} {'MiB':>9s} {'ratio':>7s}")
    for name, value in recompute.items():
        print(f"{'tp1 ' + name:32s} {value / MIB:9.2f} {value / recompute['none']:7.3f}")
    for name, row in sp.items():
        for key in ("off", "on"):
            label = f"{name} per rank, sequence parallel {key}"
            print(f"{label:32s} {row[key] / MIB:9.2f} {row[key] / row['off']:7.3f}")
    figures = {
        "model": vars(args),
        "mib": {
            **{f"tp1_{k}": round(v / MIB, 2) for k, v in recompute.items()},
            **{f"{n}_sp_{k}": round(v / MIB, 2) for n, row in sp.items() for k, v in row.items()},
        },
        "ratio": {
            **{k: round(v / recompute["none"], 3) for k, v in recompute.items() if k != "none"},
            **{f"{n}_sequence_parallel": round(row["on"] / row["off"], 3) for n, row in sp.items()},
        },
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
