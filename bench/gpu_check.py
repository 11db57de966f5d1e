"""The GPU check (`make gpu-check`): everything on the GPU path, on one GPU, within --budget-s.

Checks, in order of value (each one's figures go into the --json report as soon as it ends):
1. `tests`: `pytest -m gpu` with PRETRAIN_REQUIRE_GPU=1 (a skipped test fails it).
2. `flex_training`: `pretrain_gpt.py --bf16 --reset-attention-mask` (4 x 512, head dim 64,
   s = 1024, no dropout: document attention on compiled FlexAttention, forward and backward).
3. Per model (GPT-2 124M at s=1024, then its `hf_export` with `tools/convert_to_hf.py --dtype
   bf16 --verify`, then a GPT-3-XL-shaped 1.3B at s=2048): `pretrain_gpt.py --bf16` on a
   random-token corpus; tokens/s, TFLOP/s (the log's formula), MFU; beside it a plain PyTorch
   step of the same model (torch modules, SDPA is_causal, fused AdamW, bf16 autocast), "ratio" =
   ours / plain tokens/s.
4. `moe_training` (after the export, before the 1.3B): `pretrain_gpt.py --bf16` of a Mixtral-like
   MoE (8 experts, top-2, grouped GEMM, all-to-all dispatcher, aux loss) on one GPU; tokens/s,
   the log's TFLOP/s, the last load_balancing_loss and largest expert share, losses finite.
5. `torch_backend` (last): the 124M model on the torch backend (`--use-torch-fsdp2 --bf16`: FSDP2's
   bf16 MixedPrecisionPolicy over fp32 masters, one rank); tokens/s, TFLOP/s, MFU, and
   "vs_deepspeed" = its tokens/s / the DeepSpeed run's (check 3's gpt2_124m).
A check starts only when elapsed + its estimate fits the budget; otherwise, or when a check it
needs failed, its entry says "not started: why". Exit 1 unless every check is "ok". The report
is rewritten atomically after each check and printed as the last stdout line at the end.
`--dry-run` (no GPU): one "planned" entry per check with its exact command and env, every
training command's flags checked by pretrain.cli, the plain step of a tiny model on the CPU.

    .venv/bin/python bench/gpu_check.py [--dry-run] [--json FILE] [--budget-s 480] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pretrain.model.config import ModelConfig  # noqa: E402
from pretrain.training.report.flops import flops_per_iteration, peak_tflops_per_device  # noqa: E402

VOCAB = 50257  # GPT-2's: padded to 50304


class CheckFailed(Exception):
    """A step of the GPU check broke (the message names it)."""


@dataclass(frozen=True)
class Shape:
    """One benchmarked model and its batch."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int

    def config(self) -> ModelConfig:
        """Its ModelConfig (GPT-2 flavour, no dropout: the throughput setting)."""
        return ModelConfig(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            vocab_size=VOCAB,
            seq_length=self.seq,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )


SHAPES = {
    "gpt2_124m": Shape("gpt2_124m", 12, 768, 12, 1024, 16),
    "gpt_1_3b": Shape("gpt_1_3b", 24, 2048, 16, 2048, 8),
}
EXPORTED = "gpt2_124m"  # the model whose checkpoint goes to Hugging Face (bf16, --verify)
TINY = Shape("tiny", 2, 64, 4, 128, 2)  # the dry run's plain step
# document attention on FlexAttention: s a multiple of its 128 block, head dim 64, no dropout
FLEX = Shape("flex_training", 4, 512, 8, 1024, 8)
FLEX_FLAGS = ("--reset-attention-mask",)
# the torch backend (FSDP2, bf16 mixed precision) on the 124M shape
TORCH_BACKEND = Shape("torch_backend", 12, 768, 12, 1024, 16)
TORCH_FLAGS = ("--use-torch-fsdp2",)
MOE = Shape("moe_training", 4, 512, 8, 1024, 8)
MOE_FLAGS = (
    *("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512"),
    *("--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"),
    *("--moe-aux-loss-coeff", "1e-2"),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU-safe parts only, no GPU")
    parser.add_argument("--iters", type=int, default=30, help="training iterations per model")
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians")
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--work-dir", help="where the corpus, checkpoints and export go [tmp]")
    parser.add_argument("--test-timeout", type=int, default=180, help="seconds for pytest -m gpu")
    parser.add_argument("--budget-s", type=int, default=480, help="no check starts past this")
    parser.add_argument("--json", help="the report, rewritten after each check [WORK_DIR/...]")
    return parser.parse_args(argv)


def write_corpus(prefix: Path, tokens: int, seed: int = 0) -> str:
    """A random-token corpus (documents of 200-3000 GPT-2 ids + EOD) as PREFIX.bin/.idx."""
    from pretrain.data.files.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    written = 0
    while written < tokens:
        doc = rng.integers(0, VOCAB - 1, size=int(rng.integers(200, 3000)), dtype=np.int64)
        builder.add_item(np.append(doc, VOCAB - 1))  # the eod of NullTokenizer --vocab-size VOCAB-1
        builder.end_document()
        written += len(doc) + 1
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


def training_argv(shape: Shape, corpus: str, iters: int, out: Path, save: bool) -> list[str]:
    """pretrain_gpt.py's flags for `shape` on one GPU in bf16 (`save`: a checkpoint at the end)."""
    return [
        *("--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden)),
        *("--num-attention-heads", str(shape.heads), "--seq-length", str(shape.seq)),
        *("--max-position-embeddings", str(shape.seq)),
        *("--attention-dropout", "0", "--hidden-dropout", "0"),
        *("--micro-batch-size", str(shape.micro_batch)),
        *("--global-batch-size", str(shape.micro_batch), "--train-iters", str(iters)),
        *("--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2"),
        *("--lr-decay-style", "cosine", "--clip-grad", "1.0", "--bf16"),
        *("--data-path", corpus, "--split", "100,0,0"),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)),
        *("--eval-iters", "0", "--eval-interval", str(iters), "--log-interval", "1"),
        *("--num-workers", "2", "--metrics-file", str(out / f"{shape.name}.jsonl")),
        *(
            ("--save", str(out / f"{shape.name}_ckpt"), "--save-interval", str(iters))
            if save
            else ()
        ),
    ]


def check_argv(argv: list[str]) -> None:
    """The flags parse and pass every check of pretrain_gpt.py (one process)."""
    from pretrain.cli import parse_args as parse_training_args

    parse_training_args(argv, env={})


class PlainBlock(nn.Module):
    """A pre-norm GPT-2 block from torch modules."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    """GPT-2 from torch modules: tied embedding, learned positions, the padded vocabulary."""

    def __init__(self, shape: Shape, vocab: int):
        super().__init__()
        self.wte, self.wpe = (
            nn.Embedding(vocab, shape.hidden),
            nn.Embedding(shape.seq, shape.hidden),
        )
        self.blocks = nn.ModuleList(
            PlainBlock(shape.hidden, shape.heads) for _ in range(shape.layers)
        )
        self.ln_f = nn.LayerNorm(shape.hidden)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def plain_step_seconds(shape: Shape, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Seconds per training step of PlainGPT (bf16 autocast, fused AdamW, clipping)."""
    padded = shape.config().padded_vocab_size(1)
    model = PlainGPT(shape, padded).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, VOCAB, (shape.micro_batch, shape.seq + 1), generator=generator)
    tokens, labels = batch[:, :-1].to(device), batch[:, 1:].to(device)
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    if not math.isfinite(float(loss.detach())):
        raise CheckFailed(f"plain step of {shape.name}: loss is {float(loss.detach())}")
    return times[warmup:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def figures(shape: Shape, seconds: float, peak: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU of one iteration of `shape` taking `seconds`."""
    config = shape.config()
    flops = flops_per_iteration(config, shape.micro_batch, config.padded_vocab_size(1))
    tflops = flops / seconds / 1e12
    return {
        "tokens_per_s": round(shape.micro_batch * shape.seq / seconds, 1),
        "tflops": round(tflops, 2),
        "mfu": None if peak is None else round(tflops / peak, 4),
    }


def run_step(what: str, cmd: list[str], timeout: float, env: dict) -> str:
    """Run `cmd`; its output, or CheckFailed naming `what` with the output's tail."""
    try:
        result = subprocess.run(
            cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired as err:
        raise CheckFailed(f"{what}: no result after {timeout:.0f} s") from err
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise CheckFailed(f"{what}: exit status {result.returncode}\n{output[-4000:]}")
    return output


def logged_figures(shape: Shape, metrics: Path, warmup: int, peak) -> dict:
    """The medians of a training run's logged throughput after `warmup`; its losses, finite."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "iteration-time" in r and r["iteration"] > warmup]
    if not steps:
        raise CheckFailed(f"training {shape.name}: no iterations logged after the warmup")
    losses = [r["lm-loss"] for r in steps]
    if not all(math.isfinite(x) for x in losses):
        raise CheckFailed(f"training {shape.name}: non-finite loss {losses}")
    return {
        **figures(shape, statistics.median(r["iteration-time"] for r in steps), peak),
        "logged_tflops": round(statistics.median(r["tflops-per-device"] for r in steps), 2),
        "first_loss": round(records[0]["lm-loss"], 4),
        "last_loss": round(losses[-1], 4),
    }


def moe_figures(metrics: Path, warmup: int) -> dict:
    """The MoE run's logged throughput after `warmup` (its own FLOP count: active parameters),
    its router statistics at the end; its losses, finite."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "iteration-time" in r and r["iteration"] > warmup]
    if not steps or not all(math.isfinite(r["lm-loss"]) for r in steps):
        raise CheckFailed(f"training {MOE.name}: no finite losses logged after the warmup")
    seconds = statistics.median(r["iteration-time"] for r in steps)
    return {
        "tokens_per_s": round(MOE.micro_batch * MOE.seq / seconds, 1),
        "logged_tflops": round(statistics.median(r["tflops-per-device"] for r in steps), 2),
        "last_loss": round(steps[-1]["lm-loss"], 4),
        "load_balancing_loss": round(steps[-1]["load_balancing_loss"], 4),
        "max_expert_share": round(steps[-1]["moe/max_share"], 4),
    }


@dataclass(frozen=True)
class Check:
    """One planned step: its command (run in the repo with the check's env), its time estimate."""

    name: str
    cmd: list[str]
    estimate_s: float
    shape: Shape | None = None
    needs: str | None = None  # a check that must have passed first


def plan(args, corpus: str, work: Path) -> list[Check]:
    """The checks in order of value: GPU tests, FlexAttention training, throughput, HF export."""
    py = sys.executable
    tests = [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    checks = [Check("tests", tests, args.test_timeout)]
    flex = training_argv(FLEX, corpus, args.iters, work, save=False)
    checks.append(Check("flex_training", [py, "pretrain_gpt.py", *flex, *FLEX_FLAGS], 90, FLEX))
    for name in args.models:
        argv = training_argv(SHAPES[name], corpus, args.iters, work, save=name == EXPORTED)
        estimate = 120 if name == EXPORTED else 180
        checks.append(Check(name, [py, "pretrain_gpt.py", *argv], estimate, SHAPES[name]))
        if name == EXPORTED:
            checks.append(Check("hf_export", export_cmd(work), 60, needs=EXPORTED))
            moe = training_argv(MOE, corpus, args.iters, work, save=False)
            checks.append(Check("moe_training", [py, "pretrain_gpt.py", *moe, *MOE_FLAGS], 30, MOE))
    torch_backend = training_argv(TORCH_BACKEND, corpus, args.iters, work, save=False)
    checks.append(
        Check(
            "torch_backend",
            [py, "pretrain_gpt.py", *torch_backend, *TORCH_FLAGS],
            120,
            TORCH_BACKEND,
        )
    )
    return checks


def export_cmd(work: Path) -> list[str]:
    """convert_to_hf.py --dtype bf16 --verify on the exported model's checkpoint."""
    return [
        sys.executable,
        "tools/convert_to_hf.py",
        *("--load", str(work / f"{EXPORTED}_ckpt"), "--dtype", "bf16", "--verify"),
        *("--output-dir", str(work / f"{EXPORTED}_hf"), "--overwrite"),
    ]


def check_env() -> dict:
    """What the GPU run adds to the environment of every command."""
    return {"DS_ACCELERATOR": "cuda", "PRETRAIN_REQUIRE_GPU": "1", "PYTHONPATH": str(REPO)}


class Report:
    """The JSON file, rewritten (atomically) after every check, so a run cut short still reports."""

    def __init__(self, path: Path, header: dict):
        self.path, self.data = path, {**header, "checks": {}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def record(self, name: str, entry: dict) -> None:
        """Set the entry of check `name` and write the file."""
        self.data["checks"][name] = entry
        self.write()

    def write(self) -> None:
        """The file, via a temporary name and a rename."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


def run_check(
    check: Check, args, work: Path, env: dict, timeout: float, peak, report_ours: dict
) -> dict:
    """Run one check on the GPU; its figures (`report_ours`: the earlier checks' "ours"
    figures by check name)."""
    output = run_step(check.name, check.cmd, timeout, env)
    if check.name == "tests":
        summary = output.strip().splitlines()[-1]
        if "skipped" in summary or "passed" not in summary:
            raise CheckFailed(f"pytest -m gpu: {summary} (every GPU test must run)")
        return {"summary": summary}
    if check.name == "hf_export":
        return {"model": EXPORTED, "dtype": "bf16", "verified": True}
    if check.shape is MOE:
        return moe_figures(work / f"{MOE.name}.jsonl", args.warmup)
    ours = logged_figures(check.shape, work / f"{check.shape.name}.jsonl", args.warmup, peak)
    if check.shape is FLEX:
        return {"ours": ours}
    if check.shape is TORCH_BACKEND:
        deepspeed = report_ours.get(EXPORTED)
        ratio = None if deepspeed is None else ours["tokens_per_s"] / deepspeed["tokens_per_s"]
        return {"ours": ours, "vs_deepspeed": None if ratio is None else round(ratio, 3)}
    plain_times = plain_step_seconds(check.shape, torch.device("cuda"), args.iters, args.warmup)
    plain = figures(check.shape, statistics.median(plain_times), peak)
    torch.cuda.empty_cache()
    return {
        "ours": ours,
        "plain": plain,
        "ratio": round(ours["tokens_per_s"] / plain["tokens_per_s"], 3),
    }


def gpu_run(args, work: Path, report: Report, start: float) -> bool:
    """Every check on the GPU, in order, within the budget; True when all passed."""
    if not torch.cuda.is_available():
        raise CheckFailed("torch.cuda.is_available() is False: no GPU for the GPU check")
    peak = peak_tflops_per_device(None)
    report.data.update(
        device=torch.cuda.get_device_name(), peak_tflops=peak, torch=torch.__version__
    )
    env = {**os.environ, **check_env()}
    env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
    corpus = write_corpus(work / "corpus", tokens=40 * 16 * 2048)
    passed = True
    for check in plan(args, corpus, work):
        elapsed = time.monotonic() - start
        if check.needs and report.data["checks"].get(check.needs, {}).get("status") != "ok":
            entry = {"status": f"not started: {check.needs} did not pass"}
        elif elapsed + check.estimate_s > args.budget_s:
            entry = {
                "status": f"not started: budget ({elapsed:.0f} s + ~{check.estimate_s:.0f} s > {args.budget_s} s)"
            }
        else:
            try:
                ours = {n: e["ours"] for n, e in report.data["checks"].items() if "ours" in e}
                entry = {
                    "status": "ok",
                    **run_check(check, args, work, env, args.budget_s - elapsed, peak, ours),
                }
            except CheckFailed as err:
                print(f"gpu-check FAILED: {err}", file=sys.stderr)
                entry = {"status": "failed", "error": str(err)[:2000]}
        entry["wall_s"] = round(time.monotonic() - start - elapsed, 1)
        passed &= entry["status"] == "ok"
        report.record(check.name, entry)
    return passed


def dry_run(args, work: Path, report: Report) -> bool:
    """The CPU-safe parts: each planned command and its env in the JSON, every training command's
    flags checked by pretrain.cli, the plain step of a tiny model on the CPU."""
    corpus = write_corpus(work / "corpus", tokens=20_000)
    for check in plan(args, corpus, work):
        if check.cmd[1] == "pretrain_gpt.py":
            check_argv(check.cmd[2:])
        env = check_env()
        report.record(
            check.name,
            {"status": "planned", "cmd": check.cmd, "env": env, "estimate_s": check.estimate_s},
        )
    times = plain_step_seconds(TINY, torch.device("cpu"), iters=3, warmup=1)
    report.data["dry_run_plain"] = figures(TINY, statistics.median(times), None)
    return True


def parse_result_line(output: str) -> dict:
    """The JSON object on the last non-empty line of the check's output."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    result = json.loads(lines[-1])
    if not {"device", "checks", "budget_s"} <= result.keys():
        raise ValueError(f"not a gpu-check result line: {lines[-1][:200]}")
    return result


def main(argv=None) -> int:
    """Run the check; the JSON file after each step, its whole content as the last stdout line;
    0 when everything ran and passed, 1 (and why, on stderr) when not."""
    args = parse_args(argv)
    start = time.monotonic()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else work / "gpu_check.json"
    header = {"device": "cpu (dry run)" if args.dry_run else None, "dry_run": args.dry_run}
    report = Report(json_path, {**header, "budget_s": args.budget_s})
    try:
        passed = dry_run(args, work, report) if args.dry_run else gpu_run(args, work, report, start)
    except CheckFailed as err:
        print(f"gpu-check FAILED: {err}", file=sys.stderr)
        report.data["error"] = str(err)
        passed = False
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    report.data["wall_s"] = round(time.monotonic() - start, 1)
    report.write()
    print(json.dumps(report.data))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
