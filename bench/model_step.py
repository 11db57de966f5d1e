"""Forward + backward time of our TP=1 GPT vs transformers' model of the same architecture.

Same process, same batch, same sizes; the two models alternate step by step so machine noise hits
both alike, and median step times are compared. ratio = ours / reference in process CPU time
(robust on a shared machine; with --threads 1 it is the compute time), wall_ratio in wall time.
Target: ratio <= 1.05.
GPT-2 flavour vs GPT2LMHeadModel (activation "gelu" = our exact GELU); Llama flavour (RoPE,
RMSNorm, SwiGLU, GQA, untied) vs LlamaForCausalLM. Both compute a mean token loss from their own
logits. The last line printed is one JSON object; its "ratio" is the worse of the flavours run.

    .venv/bin/python bench/model_step.py [--flavour gpt2|llama|both] [--threads 1] ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from pretrain.model import GPTModel, ModelConfig


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flavour", choices=("gpt2", "llama", "both"), default="both")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=4, help="Llama flavour only")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument(
        "--vocab-size", type=int, default=8192, help="a multiple of 128: no padding difference"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="1 keeps a shared machine from oversubscribing"
    )
    return parser.parse_args()


def configs(args, flavour: str) -> tuple[ModelConfig, object]:
    common = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if flavour == "gpt2":
        ours = ModelConfig(**common)
        reference = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=ours.padded_vocab_size(),
                n_positions=ours.max_positions,
                n_embd=ours.hidden_size,
                n_layer=ours.num_layers,
                n_head=ours.num_attention_heads,
                n_inner=ours.ffn_size,
                activation_function="gelu",
                layer_norm_epsilon=ours.norm_epsilon,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
        return ours, reference
    ours = ModelConfig(
        **common,
        num_query_groups=args.num_query_groups,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    reference = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=ours.padded_vocab_size(),
            hidden_size=ours.hidden_size,
            intermediate_size=ours.ffn_size,
            num_hidden_layers=ours.num_layers,
            num_attention_heads=ours.num_attention_heads,
            num_key_value_heads=ours.query_groups,
            head_dim=ours.head_dim,
            rms_norm_eps=ours.norm_epsilon,
            max_position_embeddings=ours.max_positions,
            tie_word_embeddings=False,
        )
    )
    return ours, reference


def timed(step, model, tokens, labels) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward + backward."""
    wall, cpu = time.perf_counter(), time.process_time()
    step(model, tokens, labels)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    model.zero_grad(set_to_none=True)
    return wall, cpu


def step_ours(model, tokens, labels) -> None:
    model(tokens, labels=labels).mean().backward()


def step_reference(model, tokens, labels) -> None:
    logits = model(tokens).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()


def measure(args, flavour: str) -> dict:
    ours_config, reference = configs(args, flavour)
    ours = GPTModel(ours_config).train()
    reference = reference.train()
    # the reference's own loss path shifts labels; both get identical, pre-shifted inputs instead
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(
        0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=generator
    )
    tokens, labels = data[:, :-1], data[:, 1:]
    ours_times, reference_times = [], []
    for i in range(args.warmup + args.iters):
        a, b = (
            timed(step_ours, ours, tokens, labels),
            timed(step_reference, reference, tokens, labels),
        )
        if i >= args.warmup:
            ours_times.append(a)
            reference_times.append(b)

    def median_ms(times, which):
        return 1e3 * statistics.median(t[which] for t in times)

    figures = {
        "ours_ms": median_ms(ours_times, 0),
        "reference_ms": median_ms(reference_times, 0),
        "ours_cpu_ms": median_ms(ours_times, 1),
        "reference_cpu_ms": median_ms(reference_times, 1),
    }
    figures["wall_ratio"] = figures["ours_ms"] / figures["reference_ms"]
    figures["ratio"] = figures["ours_cpu_ms"] / figures["reference_cpu_ms"]
    n_ours = sum(p.numel() for p in ours.parameters())
    n_ref = sum(p.numel() for p in reference.parameters())
    print(
        f"{flavour}: ours {figures['ours_ms']:.1f} ms/step wall ({figures['ours_cpu_ms']:.1f} CPU), "
        f"{type(reference).__name__} {figures['reference_ms']:.1f} ms/step wall ({figures['reference_cpu_ms']:.1f} CPU), "
        f"ratio {figures['ratio']:.3f} CPU, {figures['wall_ratio']:.3f} wall (params {n_ours:,} vs {n_ref:,})",
        flush=True,
    )
    return {key: round(value, 4) for key, value in figures.items()} | {"params": n_ours}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    flavours = ("gpt2", "llama") if args.flavour == "both" else (args.flavour,)
    results = {flavour: measure(args, flavour) for flavour in flavours}
    summary = {
        "bench": "model_step",
        "threads": args.threads,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "vocab_size": args.vocab_size,
        **{f"{flavour}_{key}": value for flavour, r in results.items() for key, value in r.items()},
        "ratio": max(r["ratio"] for r in results.values()),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
