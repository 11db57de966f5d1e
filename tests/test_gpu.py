"""The tests that use CUDA when it is there (`pytest -m gpu`; `make gpu-check` runs them on a GPU).

On a machine without CUDA they run on the CPU where that means something (the model and the TP
layers on the device, the model's attention restricted to the flash SDPA kernel, which the CPU
has too) and skip where only CUDA has the path (compiled FlexAttention for document attention);
with PRETRAIN_REQUIRE_GPU=1 (set by bench/gpu_check.py) a missing GPU fails them instead.
References: the same computation on the CPU in fp32 (torch.nn layers, SDPA's math kernel,
per-document SDPA).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from test_model_gpt import LLAMA
from torch.nn.attention import SDPBackend, sdpa_kernel

from pretrain.model import GPTModel
from pretrain.model.document_attention import (
    FLEX_BLOCK,
    document_causal_attention,
    per_document_attention,
)
from pretrain.parallel.layers import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def device() -> torch.device:
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons mean fp32
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda")
    if os.environ.get("PRETRAIN_REQUIRE_GPU"):
        pytest.fail("PRETRAIN_REQUIRE_GPU is set but torch.cuda.is_available() is False")
    return torch.device("cpu")


def _cuda_only(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        pytest.skip(f"{what} needs CUDA")


def test_tp_layers_on_device_equal_torch_linear(device):
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 96)
    x = torch.randn(2, 16, 64)
    for layer in (ColumnParallelLinear(64, 96), RowParallelLinear(64, 96)):
        with torch.no_grad():
            layer.weight.copy_(ref.weight)
            layer.bias.copy_(ref.bias)
        layer = layer.to(device)
        x_dev = x.to(device, copy=True).requires_grad_(True)
        out = layer(x_dev)
        out.square().sum().backward()
        x_ref = x.clone().requires_grad_(True)
        ref(x_ref).square().sum().backward()
        torch.testing.assert_close(out.cpu(), ref(x).detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_dev.grad.cpu(), x_ref.grad, rtol=1e-5, atol=1e-5)
        ref.zero_grad()


def test_model_forward_backward_on_device_equals_cpu(device):
    config = dataclasses.replace(LLAMA, seq_length=64, max_position_embeddings=64)
    tokens = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    ref = GPTModel(config)
    ref_loss = ref(tokens, labels=tokens)
    ref_loss.mean().backward()
    model = GPTModel(config).to(device)
    loss = model(tokens.to(device), labels=tokens.to(device))
    loss.mean().backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-4)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), p_ref.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_bf16_model_runs_on_the_flash_sdpa_kernel(device):
    """With SDPA restricted to flash attention, the bf16 model trains a step (SDPA raises if its
    calls were not flash-eligible) and its loss tracks the fp32 math-kernel model's."""
    # flash attention has dropout on CUDA only
    dropout = 0.1 if device.type == "cuda" else 0.0
    # head dim 64 (512 / 8): CUDA's flash kernel takes multiples of 8 up to 256, not LLAMA's 4
    config = dataclasses.replace(
        LLAMA,
        hidden_size=512,
        seq_length=256,
        max_position_embeddings=256,
        attention_dropout=dropout,
    )
    tokens = torch.randint(0, 100, (2, 256), generator=torch.Generator().manual_seed(2))
    tokens = tokens.to(device)
    model = GPTModel(dataclasses.replace(config, params_dtype=torch.bfloat16)).to(device).train()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        loss = model(tokens, labels=tokens)
        loss.mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    eval_model = GPTModel(dataclasses.replace(config, params_dtype=torch.bfloat16)).to(device)
    reference = GPTModel(config).to(device).eval()
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = eval_model.eval()(tokens, labels=tokens)
        with sdpa_kernel(SDPBackend.MATH):
            math = reference(tokens, labels=tokens)
    torch.testing.assert_close(flash.mean(), math.mean(), rtol=0.0, atol=0.05)


def test_document_attention_flex_path_equals_per_document_sdpa(device):
    _cuda_only(device, "compiled FlexAttention (its CPU path has no backward)")
    generator = torch.Generator().manual_seed(3)
    b, heads, s, d = 2, 4, 2 * FLEX_BLOCK, 64
    q, k, v = (torch.randn(b, heads, s, d, generator=generator, device="cpu") for _ in range(3))
    ids = torch.zeros(b, s, dtype=torch.int32)
    ids[0, 40:] = 1
    ids[0, 200:] = 2
    ids[1, 130:] = 1
    leaves = [t.to(device).requires_grad_(True) for t in (q, k, v)]
    out = document_causal_attention(*leaves, ids.to(device))
    out.square().sum().backward()
    refs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = per_document_attention(*refs, ids)
    expected.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-2, atol=1e-2)
    for got, ref in zip(leaves, refs, strict=True):
        torch.testing.assert_close(got.grad.cpu(), ref.grad, rtol=1e-2, atol=1e-2)
    # the documents are really apart
    assert not torch.allclose(expected, F.scaled_dot_product_attention(q, k, v, is_causal=True))
