"""Mixture of experts on the CPU: what an MoE step costs and how its tokens spread.

Four measurements, each against a baseline from the same run:

- `moe_vs_dense`: forward + backward of an MoE GPT (E experts, top-k, --moe-ffn-hidden-size f)
  against a dense GPT of equal active parameters per token (FFN k x f), the same batch, steps
  alternating; ratio = MoE / dense median process CPU time (the routing, permutation and
  per-expert GEMM overhead at equal FLOPs).
- `grouped_vs_loop`: one MoE layer forward + backward with `--moe-grouped-gemm`
  (`torch._grouped_mm`) against the per-expert loop; ratio = grouped / loop.
- `all_to_all`: the all-to-all dispatcher at EP 2 and 4 (gloo, one process per rank, each with
  its own micro-batch): seconds per step inside `all_to_all_single` and their share of the step.
- `load_balance`: a short run (AdamW, aux loss) of a small MoE GPT on byte-level text (the demo
  corpus data/shakespeare.jsonl when `make data` has fetched it, else this repository's docs):
  tokens per expert per layer at every iteration, drawn into bench/results/moe_load_balance.png
  (one heat map per MoE layer: iterations x experts, the share of the layer's routed tokens);
  figures: the largest and smallest expert share of any layer (ideal 1 / E), averaged over the
  first and the last 10 iterations.

The last line printed is one JSON object; "ratio" is moe_vs_dense's.

    .venv/bin/python bench/moe.py [--iters 10] [--balance-iters 60] [--skip-all-to-all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.model import GPTModel, ModelConfig  # noqa: E402
from pretrain.model.moe.layer import MoELayer  # noqa: E402
from pretrain.model.moe.metrics import routers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--balance-iters", type=int, default=60)
    parser.add_argument("--balance-lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-all-to-all", action="store_true")
    return parser.parse_args()


def model_config(args, *, moe: bool, **overrides) -> ModelConfig:
    """The Llama-like GPT of the bench: MoE in every layer, or dense with FFN k x f."""
    common = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=8,
        vocab_size=8192,
        seq_length=args.seq_length,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        swiglu=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        position_embedding_type="rope",
        ffn_hidden_size=args.topk * args.moe_ffn_hidden_size,
    )
    if moe:
        common.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_aux_loss_coeff=1e-2,
            moe_grouped_gemm=True,
        )
    return ModelConfig(**(common | overrides))


def _median_cpu_seconds(steps: dict, iters: int) -> dict[str, float]:
    """Run each of `steps` (name -> no-argument callable) `iters` times, alternating, after one
    warm-up each; the median process CPU seconds of each."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            start = time.process_time()
            step()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _train_step(model: GPTModel, tokens: torch.Tensor):
    def step():
        model(tokens, labels=tokens).mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def moe_vs_dense(args) -> dict:
    torch.manual_seed(0)
    moe, dense = GPTModel(model_config(args, moe=True)), GPTModel(model_config(args, moe=False))
    tokens = torch.randint(0, 8192, (args.micro_batch_size, args.seq_length))
    median = _median_cpu_seconds(
        {"moe": _train_step(moe, tokens), "dense": _train_step(dense, tokens)}, args.iters
    )
    return {
        "moe_step_s": median["moe"],
        "dense_step_s": median["dense"],
        "ratio": median["moe"] / median["dense"],
    }


def _layer_step(layer: MoELayer, hidden: torch.Tensor):
    def step():
        x = hidden.clone().requires_grad_()
        layer(x).sum().backward()
        layer.zero_grad(set_to_none=True)

    return step


def grouped_vs_loop(args) -> dict:
    hidden = torch.randn(args.micro_batch_size, args.seq_length, args.hidden_size)
    steps = {}
    for name, grouped in (("grouped", True), ("loop", False)):
        layer = MoELayer(model_config(args, moe=True, moe_grouped_gemm=grouped), 0)
        layer.initialize("layers.0.mlp", 0.02, 0.01)
        steps[name] = _layer_step(layer, hidden)
    median = _median_cpu_seconds(steps, args.iters)
    return {
        "grouped_s": median["grouped"],
        "loop_s": median["loop"],
        "ratio": median["grouped"] / median["loop"],
    }


def _all_to_all_rank(rank: int, world: int, port: int, args, out) -> None:
    """One EP rank: an all-to-all MoE layer's forward + backward, timing its exchanges."""
    import torch.distributed as dist

    from pretrain.parallel import state

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    state.initialize_model_parallel(1, 1, world, 1)
    exchange, spent = dist.all_to_all_single, [0.0]

    def timed(*a, **k):
        start = time.perf_counter()
        result = exchange(*a, **k)
        spent[0] += time.perf_counter() - start
        return result

    dist.all_to_all_single = timed
    config = model_config(args, moe=True, moe_token_dispatcher_type="alltoall")
    layer = MoELayer(config, 0)
    layer.initialize("layers.0.mlp", 0.02, 0.01)
    torch.manual_seed(rank)
    step = _layer_step(layer, torch.randn(args.micro_batch_size, args.seq_length, args.hidden_size))
    step()
    spent[0], start = 0.0, time.perf_counter()
    for _ in range(args.iters):
        step()
    total = time.perf_counter() - start
    if rank == 0:
        out.put({"step_s": total / args.iters, "all_to_all_s": spent[0] / args.iters})
    dist.barrier()
    dist.destroy_process_group()


def all_to_all(args) -> dict:
    import multiprocessing

    from pretrain.launch import free_port

    context = multiprocessing.get_context("spawn")
    figures = {}
    for ep in (2, 4):
        out = context.Queue()
        port = free_port()
        procs = [
            context.Process(target=_all_to_all_rank, args=(r, ep, port, args, out))
            for r in range(ep)
        ]
        for p in procs:
            p.start()
        result = out.get(timeout=600)
        for p in procs:
            p.join()
        result["share"] = result["all_to_all_s"] / result["step_s"]
        figures[f"ep{ep}"] = result
    return figures


def _corpus_bytes() -> tuple[torch.Tensor, str]:
    """Byte-level tokens of the demo corpus if fetched, else of this repository's docs."""
    demo = REPO / "data" / "shakespeare.jsonl"
    if demo.exists():
        text = "".join(json.loads(line)["text"] for line in demo.read_text().splitlines()[:200])
        source = str(demo.relative_to(REPO))
    else:
        text = "".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
        source = "docs/*.md"
    return torch.tensor(list(text.encode()), dtype=torch.long), source


def load_balance(args) -> dict:
    torch.manual_seed(0)
    config = model_config(
        args, moe=True, num_layers=2, hidden_size=64, vocab_size=256, moe_ffn_hidden_size=64
    )
    model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.balance_lr)
    data, source = _corpus_bytes()
    generator = torch.Generator().manual_seed(0)
    history = []  # iteration -> [layer][expert] tokens
    for _ in range(args.balance_iters):
        starts = torch.randint(0, len(data) - args.seq_length - 1, (8,), generator=generator)
        batch = torch.stack([data[s : s + args.seq_length + 1] for s in starts])
        model(batch[:, :-1], labels=batch[:, 1:]).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(
            [torch.as_tensor(r.stats.tokens_per_expert).tolist() for r in routers(model)]
        )
        for router in routers(model):
            router.stats.reset()
    shares = torch.tensor(history)
    shares = shares / shares.sum(-1, keepdim=True)
    picture = _draw(shares, source)
    return {
        "source": source,
        "iterations": args.balance_iters,
        "max_share_first10": shares[:10].amax((1, 2)).mean().item(),
        "max_share_last10": shares[-10:].amax((1, 2)).mean().item(),
        "min_share_last10": shares[-10:].amin((1, 2)).mean().item(),
        "ideal_share": 1 / config.num_moe_experts,
        "picture": picture,
    }


def _draw(shares: torch.Tensor, source: str) -> str:
    """Heat maps of `shares` [iterations, layers, experts] into bench/results/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = shares.shape[1]
    fig, axes = plt.subplots(layers, 1, figsize=(8, 2.2 * layers), squeeze=False)
    for i, ax in enumerate(axes[:, 0]):
        image = ax.imshow(shares[:, i].T, aspect="auto", cmap="viridis", origin="lower")
        ax.set_ylabel(f"layer {i}\nexpert")
        fig.colorbar(image, ax=ax, label="share of tokens")
    axes[-1, 0].set_xlabel(f"iteration (byte-level run on {source})")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "moe_load_balance.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path.relative_to(REPO))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    figures = {"moe_vs_dense": moe_vs_dense(args), "grouped_vs_loop": grouped_vs_loop(args)}
    print(json.dumps({"moe_vs_dense": figures["moe_vs_dense"]}))
    print(json.dumps({"grouped_vs_loop": figures["grouped_vs_loop"]}))
    if not args.skip_all_to_all:
        figures["all_to_all"] = all_to_all(args)
        print(json.dumps({"all_to_all": figures["all_to_all"]}))
    figures["load_balance"] = load_balance(args)
    print(json.dumps({"ratio": figures["moe_vs_dense"]["ratio"], **figures}))


if __name__ == "__main__":
    main()
