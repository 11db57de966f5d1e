"""The GPT model (GPT-2 and Llama flavours) built from tensor-parallel layers.

Activations are batch-first, [b, s, h] (what scaled_dot_product_attention and Hugging Face use).
Attention is causal through SDPA's `is_causal` (flash on GPU). With `document_ids` [b, s] (the
loader's, with --reset-attention-mask) it is causal within each document
(`pretrain.model.document_attention`); no [s, s] mask exists anywhere.

The model is three kinds of parts, each usable alone as a pipeline stage:
    Embedding          tokens, position_ids -> hidden              (first stage)
    TransformerLayer   hidden, position_ids, document_ids -> hidden       (layer_number = global index)
    FinalNormAndHead   hidden [, output_weight] -> TP-local logits  (last stage)
GPTModel chains them; with tied embeddings (the default) the head multiplies by the word embedding.

Every parameter is initialised from the layout-independent name it has in GPTModel
(`embedding.*`, `layers.<i>.*`, `head.*`), so a pipeline stage built from the parts, or a TP=k
rank, starts from exactly the TP=1 model's weights.

State-dict names (h = hidden, nh heads, ng query groups, d head dim, f ffn, V padded vocab; the
shapes are TP=1's, TP shards split the dimension noted by `partition_dim`):
    embedding.word_embeddings.weight        [V, h]
    embedding.position_embeddings.weight    [max_positions, h]        learned_absolute only
    layers.<i>.input_norm.{weight,bias}     [h]                       bias: LayerNorm only
    layers.<i>.attention.qkv.{weight,bias}  [(nh + 2 ng) d, h]        bias: add_bias_linear
    layers.<i>.attention.proj.{weight,bias} [h, nh d]
    layers.<i>.post_attention_norm.{weight,bias}
    layers.<i>.mlp.fc1.{weight,bias}        [2f or f, h]
    layers.<i>.mlp.fc2.{weight,bias}        [h, f]
    head.final_norm.{weight,bias}
    head.output_layer.weight                [V, h]                    untied only

Layouts (the conversion contract):
- attention.qkv.weight [(nh + 2 ng) d / tp, h]: per query group g, its nh/ng query heads' rows,
  then its key rows, then its value rows (MHA: per head [q; k; v]). A contiguous TP slice holds
  whole groups.
- mlp.fc1.weight with SwiGLU: full = [gate; up] (2 ffn rows); each TP rank holds [gate_r; up_r]
  (partition_stride = 2). Without SwiGLU: [ffn, h].
- Padded vocabulary rows (padded_vocab_size(tp)) are part of the embedding and of the TP-local
  logits, but never of a softmax: they are initialised to zeros and their logits are -inf (so
  their gradient is zero). The model is the same function at every padded size, i.e. every TP.
- GELU is the exact erf GELU (Megatron's default; HF GPT-2 calls it activation_function="gelu"),
  or with `openai_gelu` the tanh approximation (Megatron's --openai-gelu, HF's "gelu_new").
- RoPE is HF's rotate-half convention, applied at `position_ids` (so reset position ids restart it);
  `use_rope_scaling` applies Llama 3.x's frequency scaling (HF rope_type "llama3").
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.document_attention import document_causal_attention
from pretrain.parallel import state
from pretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    mask_padded_vocab_,
)
from pretrain.parallel.mappings import gather_from_tensor_model_parallel_region
from pretrain.parallel.random import checkpoint, init_normal_, tensor_parallel_rng


def build_norm(config: ModelConfig) -> nn.Module:
    """LayerNorm or RMSNorm over the hidden size, as configured."""
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)


def default_position_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Positions 0..S-1, broadcast over the batch."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)


def llama3_scaled_frequencies(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Llama 3.x RoPE scaling: wavelengths beyond original_max / low_freq_factor are stretched by
    `factor`, those below original_max / high_freq_factor kept, and the band between interpolated
    linearly in original_max / wavelength."""
    factor, original = (
        config.rope_scaling_factor,
        config.rope_scaling_original_max_position_embeddings,
    )
    low, high = config.rope_scaling_low_freq_factor, config.rope_scaling_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for HF-style rotate-half RoPE at given positions."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        head_dim = config.head_dim
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (config.rotary_base**exponents)
        if config.use_rope_scaling:
            inv_freq = llama3_scaled_frequencies(inv_freq, config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq  # [b, s, d/2]
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [b, 1, s, d]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` by RoPE angles (the half-split convention of Megatron and HF Llama)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    """Self-attention with fused per-query-group QKV (column-parallel) and row-parallel output."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.local_heads = config.num_attention_heads // tp
        self.local_groups = config.query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.dropout = config.attention_dropout
        qkv_size = (config.num_attention_heads + 2 * config.query_groups) * config.head_dim
        self.qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, bias=config.add_bias_linear, dtype=config.params_dtype
        )
        self.proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.add_bias_linear,
            dtype=config.params_dtype,
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        mixed = self.qkv(x).view(b, s, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q = (
            mixed[:, :, :, : self.heads_per_group]
            .reshape(b, s, self.local_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = mixed[:, :, :, self.heads_per_group].transpose(1, 2)  # [b, groups, s, d]
        v = mixed[:, :, :, self.heads_per_group + 1].transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        dropout = self.dropout if self.training else 0.0
        gqa = self.local_groups != self.local_heads
        # attention probabilities belong to this rank's heads: their dropout differs per TP rank
        with tensor_parallel_rng() if dropout > 0 else contextlib.nullcontext():
            if document_ids is None:
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa
                )
            else:
                out = document_causal_attention(q, k, v, document_ids, dropout, gqa)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """fc1 (column-parallel; [gate; up] with SwiGLU) -> GELU or SiLU-gate -> fc2 (row-parallel)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        fc1_out = 2 * config.ffn_size if config.swiglu else config.ffn_size
        self.fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_out,
            bias=config.add_bias_linear,
            stride=2 if config.swiglu else 1,
            dtype=config.params_dtype,
        )
        self.fc2 = RowParallelLinear(
            config.ffn_size,
            config.hidden_size,
            bias=config.add_bias_linear,
            dtype=config.params_dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.fc2(y)


class Embedding(nn.Module):
    """Word embedding (vocab-parallel) + learned positions (GPT-2 flavour) + embedding dropout."""

    prefix = "embedding"

    def __init__(self, config: ModelConfig):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        self.dropout = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(tp),
            config.hidden_size,
            dtype=config.params_dtype,
            vocab_size=config.vocab_size,
        )
        self.word_embeddings.initialize(
            f"{self.prefix}.word_embeddings", config.seed, config.init_method_std
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_positions, config.hidden_size, dtype=config.params_dtype
            )
            init_normal_(
                self.position_embeddings.weight,
                f"{self.prefix}.position_embeddings.weight",
                config.seed,
                config.init_method_std,
            )

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = default_position_ids(tokens)
            hidden = hidden + self.position_embeddings(position_ids)
        return F.dropout(hidden, self.dropout, self.training)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(.))).

    `layer_number` is the 0-based global index (layers.<layer_number>.* in GPTModel).
    """

    def __init__(self, config: ModelConfig, layer_number: int):
        super().__init__()
        # built alone as a pipeline stage, too
        config.validate(tp=state.get_tensor_model_parallel_world_size())
        self.layer_number = layer_number
        self.dropout = config.hidden_dropout
        self.recompute = config.recompute_activations
        self.input_norm = build_norm(config)
        self.attention = Attention(config)
        self.post_attention_norm = build_norm(config)
        self.mlp = MLP(config)
        self.rotary = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        prefix, std = f"layers.{layer_number}", config.init_method_std
        # Megatron's scaled init for output projections
        output_std = std / math.sqrt(2.0 * config.num_layers)
        self.attention.qkv.initialize(f"{prefix}.attention.qkv", config.seed, std)
        self.attention.proj.initialize(f"{prefix}.attention.proj", config.seed, output_std)
        self.mlp.fc1.initialize(f"{prefix}.mlp.fc1", config.seed, std)
        self.mlp.fc2.initialize(f"{prefix}.mlp.fc2", config.seed, output_std)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, hidden, position_ids, document_ids)
        return self._forward(hidden, position_ids, document_ids)

    def _forward(self, hidden, position_ids, document_ids):
        rotary = None
        if self.rotary is not None:
            if position_ids is None:
                position_ids = default_position_ids(hidden)
            rotary = self.rotary(position_ids, hidden.dtype)
        attn = self.attention(self.input_norm(hidden), rotary, document_ids)
        hidden = hidden + F.dropout(attn, self.dropout, self.training)
        mlp = self.mlp(self.post_attention_norm(hidden))
        return hidden + F.dropout(mlp, self.dropout, self.training)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """TP-local logits hidden @ weight-shard^T [b, s, V_padded/tp], -inf at padded vocabulary ids."""
    return mask_padded_vocab_(column_parallel_linear(hidden, weight), vocab_size)


class FinalNormAndHead(nn.Module):
    """Final norm and the column-parallel LM head; returns TP-local logits [b, s, V_padded/tp]
    (-inf at the padded ids, see `lm_head_logits`).

    With tied embeddings there is no output layer of its own: the caller passes the (local shard
    of the) word-embedding weight as `output_weight`.
    """

    prefix = "head"

    def __init__(self, config: ModelConfig):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        self.final_norm = build_norm(config)
        self.vocab_size = config.vocab_size
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                config.padded_vocab_size(tp),
                bias=False,
                dtype=config.params_dtype,
            )
            init_normal_(  # padding rows zero, real rows independent of the padded size
                self.output_layer.weight,
                f"{self.prefix}.output_layer.weight",
                config.seed,
                config.init_method_std,
                real_rows=config.vocab_size,
            )

    def forward(
        self, hidden: torch.Tensor, output_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.logits(self.final_norm(hidden), output_weight)

    def logits(
        self, normed: torch.Tensor, output_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The LM head alone, on the final norm's output."""
        if self.output_layer is not None:  # its own forward: ZeRO-3 gathers the weight in a hook
            return mask_padded_vocab_(self.output_layer(normed), self.vocab_size)
        if output_weight is None:
            raise ValueError("tied embeddings: pass the word-embedding weight as output_weight")
        return lm_head_logits(normed, output_weight, self.vocab_size)


class GPTModel(nn.Module):
    """The whole model on one pipeline stage (any TP size)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate(tp=state.get_tensor_model_parallel_world_size())
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(config.num_layers))
        self.head = FinalNormAndHead(config)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        gather_logits: bool = False,
    ) -> torch.Tensor:
        """Per-token loss [b, s] (fp32) if `labels` is given; else logits [b, s, V_padded/tp]
        (this rank's vocabulary shard, -inf at padded ids), or the real vocabulary's [b, s, V]
        (padding dropped) with `gather_logits=True`. `document_ids` [b, s] keeps documents apart
        in attention (None: causal over the sample)."""
        hidden = self.embedding(tokens, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, position_ids, document_ids)
        tied = (
            None
            if self.config.untie_embeddings_and_output_weights
            else self.embedding.word_embeddings.weight
        )
        logits = self.head(hidden, tied)
        if labels is not None:
            return vocab_parallel_cross_entropy(logits, labels)
        if not gather_logits:
            return logits
        return gather_from_tensor_model_parallel_region(logits)[..., : self.config.vocab_size]
