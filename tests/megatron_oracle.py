"""Megatron-LM checkpoints written by megatron-core itself, and megatron-core's own logits.

`save_checkpoints` runs on real gloo ranks (tests/distributed.py): for each requested model and
(TP, PP[, virtual PP]) layout it initialises megatron-core's parallel state, builds megatron-core's
GPTModel (local spec) for this rank's pipeline stage, makes every tensor distinct (seeded noise on
top of megatron-core's init, norms and biases included), runs megatron-core's forward through the
pipeline (stage outputs passed with send/recv), gathers the TP-split logits on the last stage, and
writes the checkpoint exactly as Megatron-LM's `--ckpt-format torch` does (file layout and dict
keys of megatron/training/checkpointing.py: `iter_<N:07d>/mp_rank_<tp:02d>[_<pp:03d>]/
model_optim_rng.pt` holding args, checkpoint_version 3.0, iteration, model / model0.., optimizer,
opt_param_scheduler, rng_state; `latest_checkpointed_iteration.txt`).

`fused_norms=True` renames the layer norms as Transformer Engine's spec saves them (fused into the
next linear: `linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, plus `_extra_state`
entries), which megatron-core cannot build without TE installed.

CPU shims (megatron-core assumes CUDA in three places that do not change any value): the RoPE
table is moved to `torch.cuda.current_device()`, the tied-embedding all-reduce calls `.cuda()`,
and attention forks the CUDA RNG tracker (dropout is 0 here).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import warnings
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

ITERATION = 7
SEQ, BATCH = 24, 2
VOCAB, TOKENS = 128, 127  # padded (what the model holds) and the tokenizer's size
FLAVOURS = {
    # GPT-2 style: learned positions, LayerNorm, biases, MHA, tied head, OpenAI's tanh GELU
    "gpt2": dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=128,
        kv_channels=8,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=1e-5,
        swiglu=False,
        openai_gelu=True,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
        group_query_attention=False,
        num_query_groups=None,
        rotary_base=10000,
        use_rope_scaling=False,
    ),
    # Llama 3 style: RoPE (theta 5e5, Llama 3.x scaling), RMSNorm, SwiGLU, GQA, no biases, untied,
    # head_dim 16 != hidden / heads
    "llama": dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        kv_channels=16,
        position_embedding_type="rope",
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        swiglu=True,
        openai_gelu=False,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        group_query_attention=True,
        num_query_groups=2,
        rotary_base=500000,
        use_rope_scaling=True,
        rope_scaling_factor=8.0,
    ),
}


def megatron_args(flavour: str, tp: int, pp: int, vp: int | None) -> argparse.Namespace:
    """The `args` Megatron-LM would save for this model (the model keys, plus a few others that
    real args hold, including one of Megatron's enums)."""
    from megatron.core.transformer.enums import AttnBackend

    f = FLAVOURS[flavour]
    return argparse.Namespace(
        **f,
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_per_virtual_pipeline_stage=None if vp is None else f["num_layers"] // (pp * vp),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        rotary_percent=1.0,
        add_qkv_bias=False,
        attention_backend=AttnBackend.auto,
        tokenizer_type="NullTokenizer",
        vocab_size=TOKENS - 1,  # NullTokenizer: ids 0..TOKENS-2 + eod = TOKENS tokens
        ckpt_format="torch",
        iteration=ITERATION,
        lr=3e-4,
        seed=1234,
    )


def _cpu_shims() -> None:
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _build(flavour: str, pre: bool, post: bool, vp_stage: int | None):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    f = FLAVOURS[flavour]
    activation = F.silu if f["swiglu"] else (openai_gelu if f["openai_gelu"] else F.gelu)
    config = TransformerConfig(
        num_layers=f["num_layers"],
        hidden_size=f["hidden_size"],
        num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"],
        ffn_hidden_size=f["ffn_hidden_size"],
        kv_channels=f["kv_channels"],
        normalization=f["normalization"],
        layernorm_epsilon=f["norm_epsilon"],
        gated_linear_unit=f["swiglu"],
        activation_func=activation,
        add_bias_linear=f["add_bias_linear"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=f["normalization"]),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=not f["untie_embeddings_and_output_weights"],
        position_embedding_type=f["position_embedding_type"],
        rotary_base=f["rotary_base"],
        rope_scaling=f["use_rope_scaling"],
        rope_scaling_factor=f.get("rope_scaling_factor", 8.0),
        vp_stage=vp_stage,
    ).eval()


def _perturb(model, stage: int, tied_copy: bool) -> None:
    """Seeded noise on every parameter (distinct norms and biases; replicated parameters get the
    same noise on every TP rank); the last stage's copy of a tied embedding is then
    re-synchronised as megatron-core does at init (zero + all-reduce)."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, p in model.named_parameters():
            if tied_copy and name == "output_layer.weight":
                continue
            split = getattr(p, "tensor_model_parallel", False)
            seed = zlib.crc32(name.encode()) + 1000 * stage
            seed += 100 * ps.get_tensor_model_parallel_rank() if split else 0
            generator = torch.Generator().manual_seed(seed)
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        if not (
            model.share_embeddings_and_output_weights
            and ps.get_pipeline_model_parallel_world_size() > 1
        ):
            return
        if model.post_process and not model.pre_process:
            model.output_layer.weight.zero_()
        if model.pre_process or model.post_process:
            weight = model.shared_embedding_or_output_weight()
            dist.all_reduce(weight.data, group=ps.get_embedding_group())


def _forward(chunks: list, tokens: torch.Tensor) -> torch.Tensor | None:
    """megatron-core's forward through all stages (and virtual chunks): full logits on the last
    stage's ranks, None elsewhere."""
    from megatron.core import parallel_state as ps

    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked (Megatron's)
    pp, first, last = (
        ps.get_pipeline_model_parallel_world_size(),
        ps.is_pipeline_first_stage(ignore_virtual=True),
        ps.is_pipeline_last_stage(ignore_virtual=True),
    )
    hidden_size = chunks[0].config.hidden_size
    out = None
    with torch.no_grad():
        for v, model in enumerate(chunks):
            if not (first and v == 0):
                received = torch.empty(SEQ, BATCH, hidden_size)
                dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(received)
            out = model(tokens, positions, causal)
            if not (last and v == len(chunks) - 1):
                dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        if pp > 1 and not last:
            return None
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _fused_names(state: dict) -> dict:
    """Rename the local spec's norms as Transformer Engine's spec saves them."""
    out = {}
    for name, value in state.items():
        name = name.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
        name = name.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
        out[name] = value if not name.endswith("._extra_state") else io.BytesIO(b"te-fp8-meta")
    return out


def _save(root: str, args, chunks: list, fused_norms: bool) -> None:
    """Write this rank's file as Megatron-LM's --ckpt-format torch does (DP rank 0 only)."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0:
        return
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp_rank:02d}" + (
        f"_{pp_rank:03d}" if args.pipeline_model_parallel_size > 1 else ""
    )
    folder = os.path.join(root, f"iter_{ITERATION:07d}", name)
    os.makedirs(folder, exist_ok=True)
    states = [m.state_dict_for_save_checkpoint() for m in chunks]
    if fused_norms:
        states = [_fused_names(s) for s in states]
    checkpoint = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    if len(states) == 1:
        checkpoint["model"] = states[0]
    else:
        checkpoint.update({f"model{i}": s for i, s in enumerate(states)})
    params = [p for m in chunks for p in m.parameters()]
    checkpoint["optimizer"] = torch.optim.Adam(params).state_dict()
    checkpoint["opt_param_scheduler"] = {"max_lr": 3e-4, "num_steps": ITERATION * 8}
    checkpoint["rng_state"] = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {},
        }
    ]
    torch.save(checkpoint, os.path.join(folder, "model_optim_rng.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def save_checkpoints(rank: int, world_size: int, runs: list[tuple]) -> dict:
    """For each (name, root, flavour, tp, pp, vp, fused_norms): write the checkpoint under root;
    returns {name: megatron-core's logits [BATCH, SEQ, VOCAB]} from the ranks that hold them."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    _cpu_shims()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    logits = {}
    for name, root, flavour, tp, pp, vp, fused_norms in runs:
        ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
        torch.manual_seed(100 + ps.get_pipeline_model_parallel_rank())
        pp_rank = ps.get_pipeline_model_parallel_rank()
        chunks = []
        for v in range(vp or 1):
            vp_stage = None if vp is None else v
            pre = pp_rank == 0 and v == 0
            post = pp_rank == pp - 1 and v == (vp or 1) - 1
            chunks.append(_build(flavour, pre, post, vp_stage))
        for v, model in enumerate(chunks):
            _perturb(
                model, v * pp + pp_rank, tied_copy=model.post_process and not model.pre_process
            )
        result = _forward(chunks, tokens)
        _save(root, megatron_args(flavour, tp, pp, vp), chunks, fused_norms)
        if result is not None and ps.get_data_parallel_rank() == 0:
            logits[name] = result
        dist.barrier()
        ps.destroy_model_parallel()
    return {"tokens": tokens, **logits}


def finish_model(folders: list[str], result, logits: dict, name: str) -> None:
    """The end of one saved model, on every rank: global rank 0 marks each of `folders` as
    holding ITERATION (Megatron's `latest_checkpointed_iteration.txt`), data-parallel rank 0 of
    the last stage keeps megatron-core's logits `result` under `name`, then the model-parallel
    state goes."""
    from megatron.core import parallel_state as ps

    if dist.get_rank() == 0:
        for folder in folders:
            with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))
    if result is not None and ps.get_data_parallel_rank() == 0:
        logits[name] = result
    dist.barrier()
    ps.destroy_model_parallel()


def saved_on_ranks(save, root, world_size: int) -> dict:
    """`save(rank, world_size, root)` on `world_size` gloo ranks; their results merged."""
    from distributed import run_on_ranks

    merged = {}
    for result in run_on_ranks(save, world_size=world_size, args=(str(root),), timeout=600):
        merged.update(result)
    return merged
