"""One run's configuration: `RunConfig` (every component's config, built by `pretrain.cli`)
and `Prepared` (what the checks before launch built, handed on so nothing is built twice).
`pretrain.training.run.pretrain` runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.data.config import DataConfig
from pretrain.data.files.fingerprint import PrefixFiles
from pretrain.launch import LaunchEnv
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer import Tokenizer, TokenizerConfig, build_tokenizer
from pretrain.tokenizer.fingerprint import tokenizer_fingerprint
from pretrain.training.checkpoints.checkpointing import CheckpointConfig
from pretrain.training.loop.loop import TrainingConfig
from pretrain.training.precision import PrecisionConfig
from pretrain.training.report.evaluator import EvalConfig
from pretrain.training.report.logging import LoggingConfig
from pretrain.training.schedules.lr_schedule import LRScheduleConfig
from pretrain.training.schedules.optimizer import OptimizerConfig


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What the checks before launch built (`pretrain.cli`), handed to `pretrain` so that a
    process builds its tokenizer and opens (validates) each data prefix once."""

    tokenizer_config: TokenizerConfig
    """The config `tokenizer` was built from."""
    tokenizer: Tokenizer
    """The built tokenizer (its files read, its vocabulary size known)."""
    tokenizer_fingerprint: dict
    """`tokenizer_fingerprint(tokenizer_config, tokenizer)`: its behaviour and files hashed once
    per process (the data check, the resume check and the checkpoints' record use it)."""
    data_config: DataConfig
    """The data config `files` was made for."""
    files: PrefixFiles
    """The data prefixes' `.idx` files, sidecars and largest token ids as already read."""

    @classmethod
    def build(
        cls,
        tokenizer_config: TokenizerConfig,
        data_config: DataConfig,
        tokenizer: Tokenizer | None = None,
    ) -> Prepared:
        """`tokenizer` (built from `tokenizer_config` now when not given) fingerprinted, and no
        data files read yet."""
        if tokenizer is None:
            tokenizer = build_tokenizer(tokenizer_config)
        return cls(
            tokenizer_config=tokenizer_config,
            tokenizer=tokenizer,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer_config, tokenizer),
            data_config=data_config,
            files=PrefixFiles(data_config.data_cache_path),
        )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one pretrain_gpt.py run is configured with (built by `pretrain.cli`)."""

    model: ModelConfig
    """The architecture."""
    parallel: ParallelConfig
    """TP/PP/DP layout, ZeRO stage, backend."""
    training: TrainingConfig
    """Iterations, batch sizes, early exits."""
    schedule: LRScheduleConfig
    """The learning-rate schedule, in samples."""
    optimizer: OptimizerConfig
    """AdamW and gradient clipping."""
    precision: PrecisionConfig
    """fp32/bf16/fp16 and loss scaling."""
    evaluation: EvalConfig
    """When and how long to evaluate."""
    data: DataConfig
    """Data prefixes, blends, splits, sample shape."""
    tokenizer: TokenizerConfig
    """The tokenizer that made the data."""
    checkpoint: CheckpointConfig
    """Saving and resuming."""
    logging: LoggingConfig
    """Log lines, TensorBoard, metrics file."""
    launch: LaunchEnv
    """This process's rank and the rendezvous, from the launcher."""
    deepspeed_json: dict | None = None
    """The user's --deepspeed_config, already checked against the flags."""
    argv: tuple[str, ...] = ()
    """The command line, recorded in checkpoints and dashboards."""
    prepared: Prepared | None = field(default=None, compare=False, repr=False)
    """The tokenizer and data files the checks before launch built; None: `pretrain` builds them.
    Not part of the configuration (equal configs may differ here)."""
