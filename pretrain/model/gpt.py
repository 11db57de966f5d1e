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
    layers.<i>.attention.{q,k}_norm.weight  [d]                       qk_layernorm only (before RoPE)
    layers.<i>.post_attention_norm.{weight,bias}
    layers.<i>.mlp.fc1.{weight,bias}        [2f or f, h]
    layers.<i>.mlp.fc2.{weight,bias}        [h, f]
    layers.<i>.mlp.{router,experts,shared_experts}.*   an MoE layer's, where config.moe_layers
                                            says (pretrain/model/moe/layer.py lists them)
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

Sequence parallelism (`sequence_parallel`, TP > 1; Megatron's): between the TP linears the
activations are [b, s/tp, h], this TP rank's chunk of the sequence: the embedding ends with a
scatter (learned positions) or a reduce-scatter (RoPE) to the chunk, the norms, dropout and
residual adds run on it, each column-parallel linear (QKV, fc1, the LM head) all-gathers the
sequence and each row-parallel one (proj, fc2) reduce-scatters back to the chunk. Attention and the
MLP nonlinearity see the whole sequence, for this rank's heads / FFN slice. Norm weights and
row-parallel biases are replicated but see s/tp tokens: their gradients are summed over TP in
backward (`sum_grad_over_tensor_parallel`). Dropout in the chunked regions draws from the
per-TP-rank generator (different tokens, different masks), as Megatron does.

Recompute (Megatron's definitions): `recompute_granularity="selective"` recomputes the attention
core (softmax(QK^T)V with its dropout) in backward; "full" recomputes whole layers, chunked by
`recompute_segments`: "uniform" checkpoints the input of every chunk of `recompute_num_layers`
layers, "block" the input of each of the first `recompute_num_layers` layers of the stage, the rest
keep their activations. Recomputation replays both dropout generators (`parallel.random.checkpoint`).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.config import ModelConfig
from pretrain.model.document_attention import document_causal_attention
from pretrain.model.mlp import MLP, uses_sequence_parallel
from pretrain.model.moe.layer import MoELayer
from pretrain.parallel import state
from pretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    mask_padded_vocab_,
    sum_grad_over_tensor_parallel,
)
from pretrain.parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from pretrain.parallel.random import checkpoint, init_normal_, tensor_parallel_rng


def validate_for_layout(config: ModelConfig) -> None:
    """`config.validate` for this process's TP, EP and expert-TP sizes."""
    config.validate(
        tp=state.get_tensor_model_parallel_world_size(),
        ep=state.get_expert_model_parallel_world_size(),
        etp=state.get_expert_tensor_parallel_world_size(),
    )


class _SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm on a sequence chunk: weight and bias gradients summed over TP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = sum_grad_over_tensor_parallel(self.weight), self.bias
        bias = None if bias is None else sum_grad_over_tensor_parallel(bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class _SequenceParallelRMSNorm(nn.RMSNorm):
    """RMSNorm on a sequence chunk: weight gradient summed over TP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sum_grad_over_tensor_parallel(self.weight)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def build_norm(config: ModelConfig, size: int | None = None, summed: bool | None = None):
    """LayerNorm or RMSNorm over the hidden size (or `size`), as configured. Its gradient is summed
    over TP when `summed` (default: under sequence parallelism, where each TP rank normalises its
    own sequence chunk); the variant that sums has the same parameters and names."""
    summed = uses_sequence_parallel(config) if summed is None else summed
    if config.normalization == "RMSNorm":
        kind = _SequenceParallelRMSNorm if summed else nn.RMSNorm
    else:
        kind = _SequenceParallelLayerNorm if summed else nn.LayerNorm
    size = config.hidden_size if size is None else size
    norm = kind(size, eps=config.norm_epsilon, dtype=config.params_dtype)
    for param in norm.parameters():
        param.sequence_parallel = summed
    return norm


def dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout; on a sequence chunk (sequence parallelism) from the per-TP-rank generator."""
    if not training or p == 0.0:
        return x
    with tensor_parallel_rng() if sequence_parallel else contextlib.nullcontext():
        return F.dropout(x, p, True)


def default_position_ids(tokens: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Positions 0..S-1 (S = `length`, else the tokens' length), broadcast over the batch."""
    length = tokens.shape[1] if length is None else length
    return torch.arange(length, device=tokens.device).unsqueeze(0)


def recompute_segments(config: ModelConfig, num_layers: int) -> list[tuple[int, int, bool]]:
    """(start, end, recomputed) runs covering a stage's `num_layers` layers, as Megatron's full
    recompute chunks them ("uniform": every chunk of recompute_num_layers layers; "block": the
    first recompute_num_layers layers one by one, then the rest without recomputation)."""
    if config.recompute_granularity != "full" or num_layers == 0:
        return [(0, num_layers, False)]
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
    recomputed = [(i, i + 1, True) for i in range(min(n, num_layers))]
    return recomputed + ([(n, num_layers, False)] if n < num_layers else [])


def recomputing(module: nn.Module) -> bool:
    """Activations are being kept for a backward pass (training with autograd on)."""
    return module.training and torch.is_grad_enabled()


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
        self.selective_recompute = config.recompute_granularity == "selective"
        sequence_parallel = uses_sequence_parallel(config)
        qkv_size = (config.num_attention_heads + 2 * config.query_groups) * config.head_dim
        self.qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            bias=config.add_bias_linear,
            dtype=config.params_dtype,
            sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.add_bias_linear,
            dtype=config.params_dtype,
            sequence_parallel=sequence_parallel,
        )
        self.q_norm = self.k_norm = None
        if config.qk_layernorm:  # replicated; each TP rank normalises its own heads with it
            self.q_norm = build_norm(config, config.head_dim, summed=tp > 1)
            self.k_norm = build_norm(config, config.head_dim, summed=tp > 1)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        mixed = self.qkv(
            x
        )  # [b, s, local qkv]: the whole sequence, also under sequence parallelism
        b, s, _ = mixed.shape
        mixed = mixed.view(b, s, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q = (
            mixed[:, :, :, : self.heads_per_group]
            .reshape(b, s, self.local_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = mixed[:, :, :, self.heads_per_group].transpose(1, 2)  # [b, groups, s, d]
        v = mixed[:, :, :, self.heads_per_group + 1].transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.selective_recompute and recomputing(self):
            out = checkpoint(self.core_attention, q, k, v, document_ids)
        else:
            out = self.core_attention(q, k, v, document_ids)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def core_attention(self, q, k, v, document_ids: torch.Tensor | None) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V with attention dropout, causal (within documents):
        [b, heads, s, d] -> [b, heads, s, d]. What selective recompute recomputes."""
        p = self.dropout if self.training else 0.0
        gqa = self.local_groups != self.local_heads
        # attention probabilities belong to this rank's heads: their dropout differs per TP rank
        with tensor_parallel_rng() if p > 0 else contextlib.nullcontext():
            if document_ids is None:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, dropout_p=p, enable_gqa=gqa
                )
            return document_causal_attention(q, k, v, document_ids, p, gqa)


class Embedding(nn.Module):
    """Word embedding (vocab-parallel) + learned positions (GPT-2 flavour) + embedding dropout;
    under sequence parallelism the output is this TP rank's [b, s/tp, h] chunk."""

    prefix = "embedding"

    def __init__(self, config: ModelConfig):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        self.dropout = config.hidden_dropout
        self.sequence_parallel = uses_sequence_parallel(config)
        learned = config.position_embedding_type == "learned_absolute"
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(tp),
            config.hidden_size,
            dtype=config.params_dtype,
            vocab_size=config.vocab_size,
            # without positions to add, the word embedding reduce-scatters straight to the chunk
            reduce_scatter=self.sequence_parallel and not learned,
        )
        self.word_embeddings.initialize(
            f"{self.prefix}.word_embeddings", config.seed, config.init_method_std
        )
        self.position_embeddings = None
        if learned:
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
            if self.sequence_parallel:
                hidden = scatter_to_sequence_parallel_region(hidden)
        return dropout(hidden, self.dropout, self.training, self.sequence_parallel)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(.))).

    `layer_number` is the 0-based global index (layers.<layer_number>.* in GPTModel). Under
    sequence parallelism `hidden` is this TP rank's [b, s/tp, h] chunk; `position_ids` and
    `document_ids` always cover the whole sequence [b, s].
    """

    def __init__(self, config: ModelConfig, layer_number: int):
        super().__init__()
        # built alone as a pipeline stage, too
        validate_for_layout(config)
        self.layer_number = layer_number
        self.dropout = config.hidden_dropout
        self.sequence_parallel = uses_sequence_parallel(config)
        self.tp = state.get_tensor_model_parallel_world_size()
        self.input_norm = build_norm(config)
        self.attention = Attention(config)
        self.post_attention_norm = build_norm(config)
        self.mlp = (
            MoELayer(config, layer_number) if config.moe_layers[layer_number] else MLP(config)
        )
        self.rotary = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        prefix, std = f"layers.{layer_number}", config.init_method_std
        # Megatron's scaled init for output projections
        output_std = std / math.sqrt(2.0 * config.num_layers)
        self.attention.qkv.initialize(f"{prefix}.attention.qkv", config.seed, std)
        self.attention.proj.initialize(f"{prefix}.attention.proj", config.seed, output_std)
        self.mlp.initialize(f"{prefix}.mlp", std, output_std)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rotary = None
        if self.rotary is not None:
            if position_ids is None:
                length = hidden.shape[1] * (self.tp if self.sequence_parallel else 1)
                position_ids = default_position_ids(hidden, length)
            rotary = self.rotary(position_ids, hidden.dtype)
        attn = self.attention(self.input_norm(hidden), rotary, document_ids)
        hidden = hidden + dropout(attn, self.dropout, self.training, self.sequence_parallel)
        mlp = self.mlp(self.post_attention_norm(hidden))
        return hidden + dropout(mlp, self.dropout, self.training, self.sequence_parallel)


def run_layers(layers, hidden: torch.Tensor, position_ids=None, document_ids=None) -> torch.Tensor:
    """`hidden` through consecutive TransformerLayers."""
    for layer in layers:
        hidden = layer(hidden, position_ids, document_ids)
    return hidden


def run_segments(
    module: nn.Module, layers, segments, hidden: torch.Tensor, position_ids=None, document_ids=None
) -> torch.Tensor:
    """`hidden` through consecutive TransformerLayers in the (start, end, recomputed) runs of
    `recompute_segments`; recomputed runs go under `checkpoint` while `module` keeps activations
    for a backward pass."""
    for start, end, recompute in segments:
        run = functools.partial(run_layers, layers[start:end])
        if recompute and recomputing(module):
            hidden = checkpoint(run, hidden, position_ids, document_ids)
        else:
            hidden = run(hidden, position_ids, document_ids)
    return hidden


def lm_head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, sequence_parallel: bool = False
) -> torch.Tensor:
    """TP-local logits hidden @ weight-shard^T [b, s, V_padded/tp], -inf at padded vocabulary ids
    (`sequence_parallel`: `hidden` is this rank's sequence chunk, gathered first)."""
    logits = column_parallel_linear(hidden, weight, sequence_parallel=sequence_parallel)
    return mask_padded_vocab_(logits, vocab_size)


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
        self.sequence_parallel = uses_sequence_parallel(config)
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                config.padded_vocab_size(tp),
                bias=False,
                dtype=config.params_dtype,
                sequence_parallel=self.sequence_parallel,
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
        return lm_head_logits(normed, output_weight, self.vocab_size, self.sequence_parallel)


class GPTModel(nn.Module):
    """The whole model on one pipeline stage (any TP size)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        validate_for_layout(config)
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(config.num_layers))
        self.head = FinalNormAndHead(config)
        self.segments = recompute_segments(config, config.num_layers)

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
        hidden = run_segments(self, self.layers, self.segments, hidden, position_ids, document_ids)
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
