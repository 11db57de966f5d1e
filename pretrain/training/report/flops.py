"""Model FLOPs per iteration (Megatron-LM's formula) and the peak used for MFU.

FLOPs per iteration = B s [ 12 L h f g  +  12 L h q (1 + ng/nh + s/(2h))  +  6 h V ]
with B = global batch, s = sequence length, L layers, h hidden, f = FFN hidden, g = 3/2 for SwiGLU
else 1, q = kv_channels x heads, ng/nh = query groups / heads, V = padded vocabulary.
12 = 3 (forward + two backward GEMMs) x 2 (FLOPs per multiply-add) x 2 (paired GEMMs); the s/(2h)
term is causal attention (half of QK^T and AV); recomputation is not counted (an MFU-style count).
For a standard GPT this is 72 L h^2 + 6 L h s + 6 h V per token.
"""

from __future__ import annotations

import torch

from pretrain.model.config import ModelConfig

# Dense bf16 peak TFLOP/s per device, by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "V100": 125.0,  # fp16 tensor cores
}


def flops_per_iteration(
    model: ModelConfig, global_batch_size: int, padded_vocab_size: int
) -> float:
    """Model FLOPs of one iteration (the formula in the module docstring)."""
    L, h, s = model.num_layers, model.hidden_size, model.seq_length
    nh, ng = model.num_attention_heads, model.query_groups
    q = model.head_dim * nh
    gate = 1.5 if model.swiglu else 1.0
    mlp = 12 * L * h * model.ffn_size * gate
    attention = 12 * L * h * q * (1 + ng / nh + s / (2 * h))
    head = 6 * h * padded_vocab_size
    return float(global_batch_size * s * (mlp + attention + head))


def peak_tflops_per_device(override: float | None) -> float | None:
    """--peak-tflops, else the table for the local GPU, else None (no MFU reported, e.g. on CPU)."""
    if override is not None:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_BF16_TFLOPS.items():
        if key in name:
            return peak
    return None
