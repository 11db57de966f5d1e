"""`ModelConfig`: the GPT model's only input, with Megatron's defaults and shape checks.

The command line (pretrain/cli/) builds it from Megatron's flags; tests and tools build it
directly. Each field's metadata names the flag that sets it: the one field<->flag mapping that the
`--finetune` hint and the checkpoint shape check read through `flag_for`. Derived sizes (`ffn_size`, `head_dim`, `query_groups`) resolve Megatron's `None`
defaults in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from pretrain.errors import UserError
from pretrain.model.moe.config import moe_layer_pattern, moe_problems


def _flag(
    flag: str | None,
    *,
    named: str | None = None,
    after: tuple[str, ...] = (),
    only_with: str | None = None,
) -> dict:
    """Field metadata: the pretrain_gpt.py `flag` that sets the field (None: no model flag sets it,
    `named` says what does), flags that must come before it (`after`), and the switch without
    which the field has no effect (`only_with`: `model_flags` then leaves it out)."""
    return {"flag": flag, "named": named or flag, "after": after, "only_with": only_with}


def _moe(flag: str) -> dict:
    """Metadata of a mixture-of-experts field: it has effect only with --num-experts."""
    return _flag(flag, only_with="is_moe")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT's architecture; Megatron's defaults. Each field names its flag in its metadata."""

    num_layers: int = field(metadata=_flag("--num-layers"))
    """Transformer blocks."""
    hidden_size: int = field(metadata=_flag("--hidden-size"))
    """Model width h."""
    num_attention_heads: int = field(metadata=_flag("--num-attention-heads"))
    """Query heads."""
    vocab_size: int = field(metadata=_flag(None, named="the tokenizer's vocabulary size"))
    """True tokenizer size; the embedding is padded (see `padded_vocab_size`)."""
    seq_length: int = field(default=1024, metadata=_flag("--seq-length"))
    """Tokens per sample."""
    max_position_embeddings: int | None = field(
        default=None, metadata=_flag("--max-position-embeddings")
    )
    """Learned position table size; None = seq_length."""
    num_query_groups: int | None = field(
        default=None, metadata=_flag("--num-query-groups", after=("--group-query-attention",))
    )
    """Key/value groups (GQA); None = one per head (MHA)."""
    ffn_hidden_size: int | None = field(default=None, metadata=_flag("--ffn-hidden-size"))
    """MLP width; None = 4h, or int((4h*2/3)/64)*64 with SwiGLU."""
    kv_channels: int | None = field(default=None, metadata=_flag("--kv-channels"))
    """Per-head dimension; None = h / heads."""
    make_vocab_size_divisible_by: int = field(
        default=128, metadata=_flag("--make-vocab-size-divisible-by")
    )
    """The padded vocabulary is a multiple of this times TP."""
    position_embedding_type: str = field(
        default="learned_absolute", metadata=_flag("--position-embedding-type")
    )
    """"learned_absolute" or "rope"."""
    rotary_base: int = field(default=10000, metadata=_flag("--rotary-base", only_with="uses_rope"))
    """RoPE base (theta)."""
    use_rope_scaling: bool = field(default=False, metadata=_flag("--use-rope-scaling"))
    """Llama 3.x frequency scaling of RoPE (HF rope_type "llama3")."""
    rope_scaling_factor: float = field(
        default=8.0, metadata=_flag("--rope-scaling-factor", only_with="use_rope_scaling")
    )
    """Llama 3.x: low frequencies are divided by this (Megatron's default 8)."""
    rope_scaling_low_freq_factor: float = field(
        default=1.0, metadata=_flag("--rope-scaling-low-freq-factor", only_with="use_rope_scaling")
    )
    """Llama 3.x: wavelengths above original_max / this are scaled (Megatron fixes 1; our flag)."""
    rope_scaling_high_freq_factor: float = field(
        default=4.0, metadata=_flag("--rope-scaling-high-freq-factor", only_with="use_rope_scaling")
    )
    """Llama 3.x: wavelengths below original_max / this are kept (Megatron fixes 4; our flag)."""
    rope_scaling_original_max_position_embeddings: int = field(
        default=8192,
        metadata=_flag(
            "--rope-scaling-original-max-position-embeddings", only_with="use_rope_scaling"
        ),
    )
    """Llama 3.x: the pretraining context the scaling refers to (Megatron fixes 8192; our flag)."""
    normalization: str = field(default="LayerNorm", metadata=_flag("--normalization"))
    """"LayerNorm" or "RMSNorm"."""
    norm_epsilon: float = field(default=1e-5, metadata=_flag("--norm-epsilon"))
    """Epsilon of every norm."""
    qk_layernorm: bool = field(default=False, metadata=_flag("--qk-layernorm"))
    """A norm of the --normalization type over each query and key head before RoPE (Qwen3)."""
    swiglu: bool = field(default=False, metadata=_flag("--swiglu"))
    """Gated SiLU MLP (Llama)."""
    openai_gelu: bool = field(default=False, metadata=_flag("--openai-gelu"))
    """Tanh-approximate GELU (OpenAI GPT-2, HF "gelu_new") instead of the exact erf GELU."""
    add_bias_linear: bool = field(default=True, metadata=_flag("--disable-bias-linear"))
    """Biases in the linear layers (the flag turns them off)."""
    untie_embeddings_and_output_weights: bool = field(
        default=False, metadata=_flag("--untie-embeddings-and-output-weights")
    )
    """A separate LM head instead of the input embedding's transpose."""
    hidden_dropout: float = field(default=0.1, metadata=_flag("--hidden-dropout"))
    """Dropout after attention and MLP."""
    attention_dropout: float = field(default=0.1, metadata=_flag("--attention-dropout"))
    """Dropout on attention probabilities."""
    init_method_std: float = field(default=0.02, metadata=_flag("--init-method-std"))
    """Standard deviation of the normal weight init."""
    sequence_parallel: bool = field(default=False, metadata=_flag("--sequence-parallel"))
    """Norms, dropout and residuals on [b, s/tp, h] sequence chunks (Megatron's; a no-op at TP 1)."""
    recompute_granularity: str | None = field(
        default=None, metadata=_flag("--recompute-granularity")
    )
    """None, "selective" (the attention core) or "full" (whole layers, per recompute_method)."""
    recompute_method: str | None = field(default=None, metadata=_flag("--recompute-method"))
    """With "full": "uniform" (chunks of recompute_num_layers) or "block" (the first N per stage)."""
    recompute_num_layers: int | None = field(default=None, metadata=_flag("--recompute-num-layers"))
    """With "full": layers per recomputed chunk (uniform) or recomputed layers per stage (block)."""
    num_moe_experts: int | None = field(default=None, metadata=_flag("--num-experts"))
    """Experts per MoE layer; None = a dense model (no MoE layer)."""
    moe_router_topk: int = field(default=2, metadata=_moe("--moe-router-topk"))
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = field(default=None, metadata=_moe("--moe-ffn-hidden-size"))
    """Each expert's MLP width; None = the dense MLP width (ffn_size)."""
    moe_layer_freq: int | tuple[int, ...] = field(default=1, metadata=_moe("--moe-layer-freq"))
    """Which layers are MoE: int N = layers 0, N, 2N, ...; or one 0/1 per layer."""
    moe_shared_expert_intermediate_size: int | None = field(
        default=None, metadata=_moe("--moe-shared-expert-intermediate-size")
    )
    """Width of the shared expert(s) every token also goes through (all of them together)."""
    moe_router_score_function: str = field(
        default="softmax", metadata=_moe("--moe-router-score-function")
    )
    """"softmax" or "sigmoid" router scores."""
    moe_router_pre_softmax: bool = field(default=False, metadata=_moe("--moe-router-pre-softmax"))
    """Softmax over all experts before top-k (else softmax over the k selected logits)."""
    moe_router_topk_scaling_factor: float | None = field(
        default=None, metadata=_moe("--moe-router-topk-scaling-factor")
    )
    """Multiplies the selected experts' weights (DeepSeek's routed_scaling_factor)."""
    moe_router_num_groups: int | None = field(
        default=None, metadata=_moe("--moe-router-num-groups")
    )
    """Expert groups for group-limited routing."""
    moe_router_group_topk: int | None = field(
        default=None, metadata=_moe("--moe-router-group-topk")
    )
    """Groups each token may route into (group-limited routing; None = off)."""
    moe_router_load_balancing_type: str = field(
        default="aux_loss", metadata=_moe("--moe-router-load-balancing-type")
    )
    """Load-balancing loss scope: aux_loss (micro-batch), seq_aux_loss, global_aux_loss, none."""
    moe_aux_loss_coeff: float = field(default=0.0, metadata=_moe("--moe-aux-loss-coeff"))
    """Weight of the load-balancing loss (0 = none)."""
    moe_z_loss_coeff: float | None = field(default=None, metadata=_moe("--moe-z-loss-coeff"))
    """Weight of the router z-loss (None = none)."""
    moe_router_enable_expert_bias: bool = field(
        default=False, metadata=_moe("--moe-router-enable-expert-bias")
    )
    """DeepSeek-V3 aux-loss-free balancing: a per-expert bias that only picks experts."""
    moe_router_bias_update_rate: float = field(
        default=1e-3, metadata=_moe("--moe-router-bias-update-rate")
    )
    """Step of the expert-bias update, once per iteration."""
    moe_expert_capacity_factor: float | None = field(
        default=None, metadata=_moe("--moe-expert-capacity-factor")
    )
    """Expert capacity = ceil(tokens x topk / experts x factor) per rank; None = dropless."""
    moe_token_drop_policy: str = field(default="probs", metadata=_moe("--moe-token-drop-policy"))
    """Over capacity, keep the highest-probability tokens ("probs") or the first ("position")."""
    moe_pad_expert_input_to_capacity: bool = field(
        default=False, metadata=_moe("--moe-pad-expert-input-to-capacity")
    )
    """Pad every expert's input to exactly its capacity (padding tokens have weight 0)."""
    moe_grouped_gemm: bool = field(default=False, metadata=_moe("--moe-grouped-gemm"))
    """The local experts as one grouped GEMM (torch._grouped_mm) instead of a loop."""
    moe_token_dispatcher_type: str = field(
        default="allgather", metadata=_moe("--moe-token-dispatcher-type")
    )
    """How tokens reach the experts over the expert-parallel ranks: allgather or alltoall."""
    moe_router_dtype: str | None = field(default=None, metadata=_moe("--moe-router-dtype"))
    """Router logits and probabilities in "fp32" or "fp64"; None = the activations' dtype."""
    seed: int = field(default=1234, metadata=_flag(None, named="--seed"))
    """Seed of the layout-independent weight init."""
    params_dtype: torch.dtype = field(
        default=torch.float32, metadata=_flag(None, named="--bf16/--fp16")
    )
    """Parameter dtype (float32; bfloat16 with --bf16, float16 with --fp16)."""

    def __post_init__(self) -> None:
        # a layer pattern read back from JSON (checkpoint metadata) is a list
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return (
            self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads
        )

    @property
    def uses_rope(self) -> bool:
        """Positions are rotary (RoPE), not a learned table: the RoPE fields take effect."""
        return self.position_embedding_type == "rope"

    @property
    def is_moe(self) -> bool:
        """The model has mixture-of-experts layers (--num-experts)."""
        return self.num_moe_experts is not None

    @property
    def moe_ffn_size(self) -> int:
        """Each expert's MLP width (Megatron: --moe-ffn-hidden-size, else --ffn-hidden-size)."""
        return self.ffn_size if self.moe_ffn_hidden_size is None else self.moe_ffn_hidden_size

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: is it an MoE layer (all False for a dense model)."""
        if not self.is_moe:
            return (False,) * self.num_layers
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    @property
    def max_positions(self) -> int:
        return (
            self.max_position_embeddings
            if self.max_position_embeddings is not None
            else self.seq_length
        )

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's padding: the smallest multiple of divisible_by * tp that holds the vocabulary."""
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate(self, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
        """Raise one UserError listing every shape problem for this TP/PP layout (and, with MoE,
        expert-parallel size `ep` and expert TP `etp`, None = `tp`), with the fix."""
        self._check_sizes_positive()
        problems = (
            self._layout_problems(tp, pp)
            + self._position_problems()
            + self._layer_problems(tp)
            + self._recompute_problems(pp)
        )
        if self.is_moe:
            problems += moe_problems(self, tp, ep, tp if etp is None else etp)
        if problems:
            raise UserError("invalid model configuration: " + "; ".join(problems))

    def _check_sizes_positive(self) -> None:
        """One UserError naming every size below 1 (the other checks divide by them)."""
        problems = []
        for name, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("vocab size", self.vocab_size),
            ("--seq-length", self.seq_length),
            ("--num-query-groups", self.query_groups),
            ("--ffn-hidden-size", self.ffn_size),
        ):
            if value < 1:
                problems.append(f"{name} must be >= 1 (got {value})")
        if problems:
            raise UserError("; ".join(problems))

    def _layout_problems(self, tp: int, pp: int) -> list[str]:
        """Heads, query groups and FFN width split over TP; layers over PP: what does not divide."""
        problems = []
        h, heads, groups = self.hidden_size, self.num_attention_heads, self.query_groups
        if self.kv_channels is None and h % heads != 0:
            problems.append(
                f"--hidden-size {h} is not divisible by --num-attention-heads {heads} "
                f"(choose a hidden size that is a multiple of the head count, or set --kv-channels)"
            )
        if heads % groups != 0:
            problems.append(
                f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups} "
                f"(each query group must hold the same number of heads)"
            )
        if heads % tp != 0:
            problems.append(
                f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp} "
                f"(use a tensor-parallel size that divides the head count)"
            )
        if groups % tp != 0:
            problems.append(
                f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp} "
                f"(use a tensor-parallel size that divides the number of query groups)"
            )
        if self.ffn_size % tp != 0:
            problems.append(
                f"--ffn-hidden-size {self.ffn_size} is not divisible by --tensor-model-parallel-size "
                f"{tp} (set --ffn-hidden-size to a multiple of {tp})"
            )
        if self.num_layers % pp != 0:
            problems.append(
                f"--num-layers {self.num_layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp} (each pipeline stage holds the same number of layers)"
            )
        return problems

    def _position_problems(self) -> list[str]:
        """The position embedding: enough positions for --seq-length, a known type, RoPE's even
        head dimension and its scaling factors."""
        problems = []
        if self.max_positions < self.seq_length:
            problems.append(
                f"--max-position-embeddings {self.max_positions} is smaller than --seq-length "
                f"{self.seq_length} (raise --max-position-embeddings)"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            problems.append(
                f"--position-embedding-type {self.position_embedding_type!r} is not supported "
                f"(use learned_absolute or rope)"
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2 != 0:
            problems.append(
                f"rope needs an even head dimension, got {self.head_dim} (change --kv-channels "
                f"or --hidden-size / --num-attention-heads)"
            )
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            problems.append("--use-rope-scaling needs --position-embedding-type rope")
        if self.use_rope_scaling and not (
            self.rope_scaling_factor > 0
            and 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor
            and self.rope_scaling_original_max_position_embeddings > 0
        ):
            problems.append(
                "RoPE scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor (got "
                f"{self.rope_scaling_factor}, {self.rope_scaling_low_freq_factor}, "
                f"{self.rope_scaling_high_freq_factor})"
            )
        return problems

    def _layer_problems(self, tp: int) -> list[str]:
        """A known normalization, dropouts in [0, 1), and a sequence TP can split."""
        problems = []
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            problems.append(
                f"--normalization {self.normalization!r} is not supported (use LayerNorm or RMSNorm)"
            )
        for name, p in (
            ("--hidden-dropout", self.hidden_dropout),
            ("--attention-dropout", self.attention_dropout),
        ):
            if not 0.0 <= p < 1.0:
                problems.append(f"{name} {p} must be in [0, 1)")
        if self.sequence_parallel and tp > 1 and self.seq_length % tp != 0:
            problems.append(
                f"--sequence-parallel splits --seq-length {self.seq_length} over "
                f"--tensor-model-parallel-size {tp}, which does not divide it (use a sequence "
                f"length that is a multiple of {tp})"
            )
        return problems

    def _recompute_problems(self, pp: int) -> list[str]:
        """Megatron's rules for the recompute flags."""
        granularity, method, n = (
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
        )
        per_stage = self.num_layers // pp
        if granularity not in (None, "full", "selective"):
            return [f"--recompute-granularity {granularity!r} is not full or selective"]
        if method not in (None, "uniform", "block"):
            return [f"--recompute-method {method!r} is not uniform or block"]
        if granularity is None:
            if method is not None or n is not None:
                return [
                    "--recompute-method/--recompute-num-layers need --recompute-granularity full"
                ]
            return []
        if granularity == "selective":
            if method is not None or n is not None:
                return [
                    "--recompute-granularity selective recomputes the attention core of every "
                    "layer: drop --recompute-method/--recompute-num-layers (they are for full)"
                ]
            return []
        if method is None:
            return ["--recompute-granularity full needs --recompute-method uniform or block"]
        if n is None or not 1 <= n <= per_stage:
            return [
                f"--recompute-granularity full needs --recompute-num-layers between 1 and the "
                f"layers per pipeline stage ({per_stage}), got {n}"
            ]
        return []


# The settings that decide parameter shapes, compared as resolved sizes (an explicit
# --ffn-hidden-size equal to the default is the same model): (attribute, the field that sets it).
SHAPE_ATTRIBUTES = (
    ("num_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("query_groups", "num_query_groups"),
    ("ffn_size", "ffn_hidden_size"),
    ("head_dim", "kv_channels"),
    ("position_embedding_type", "position_embedding_type"),
    ("normalization", "normalization"),
    ("qk_layernorm", "qk_layernorm"),
    ("swiglu", "swiglu"),
    ("add_bias_linear", "add_bias_linear"),
    ("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights"),
    ("vocab_size", "vocab_size"),
    ("max_positions", "max_position_embeddings"),  # the learned position table only
    ("num_moe_experts", "num_moe_experts"),
    ("moe_ffn_size", "moe_ffn_hidden_size"),
    ("moe_layers", "moe_layer_freq"),
    ("moe_shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
    ("moe_router_enable_expert_bias", "moe_router_enable_expert_bias"),
)


def flag_for(field_name: str) -> str:
    """What sets ModelConfig's `field_name` on the command line (e.g. "--num-layers")."""
    for f in fields(ModelConfig):
        if f.name == field_name:
            return f.metadata["named"]
    raise KeyError(field_name)


def shape_mismatches(saved: ModelConfig, ours: ModelConfig) -> list[str]:
    """One phrase per shape-deciding setting where `ours` differs from `saved`."""
    learned = "learned_absolute" in (saved.position_embedding_type, ours.position_embedding_type)
    return [
        f"{attr}={getattr(saved, attr)} but this run has {getattr(ours, attr)} ({flag_for(name)})"
        for attr, name in SHAPE_ATTRIBUTES
        if getattr(saved, attr) != getattr(ours, attr) and (attr != "max_positions" or learned)
    ]


def model_flags(config: ModelConfig) -> list[str]:
    """The pretrain_gpt.py model flags that rebuild exactly `config` (read from the field metadata:
    a switch is given when its value differs from the default, any other set value always)."""
    flags: list[str] = []
    for f in fields(config):
        flag, value = f.metadata["flag"], getattr(config, f.name)
        switch = f.metadata["only_with"]
        if flag is None or value is None or (switch and not getattr(config, switch)):
            continue
        if isinstance(value, bool):
            flags += [flag] if value != f.default else []
        else:
            shown = f"[{','.join(map(str, value))}]" if isinstance(value, tuple) else str(value)
            flags += [*f.metadata["after"], flag, shown]
    return flags
