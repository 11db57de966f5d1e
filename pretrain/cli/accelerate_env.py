"""`accelerate launch pretrain_gpt.py ...`: Hugging Face Accelerate starts the ranks (through
torchrun, or the deepspeed launcher with `--use_deepspeed`) and hands its own settings to the
script in environment variables. pretrain_gpt.py takes its settings from its flags; where one of
Accelerate's settings names the same thing as a flag, the two must agree, or the run would not
be what one of them says (docs/CLUSTERS.md, "Accelerate", has the table).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pretrain.errors import UserError
from pretrain.training.run_config import RunConfig

_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}

# (variable Accelerate sets, its launch option, our flag, our value as Accelerate writes it);
# the Megatron-LM plugin's degrees only with --use_megatron_lm
SETTINGS: tuple[tuple[str, str, str, Callable[[RunConfig], str]], ...] = (
    ("ACCELERATE_MIXED_PRECISION", "--mixed_precision", "--bf16/--fp16 (neither: no)",
     lambda c: _PRECISION[c.precision.name]),
    ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "--zero_stage", "--zero-stage",
     lambda c: str(c.parallel.zero_stage)),
    ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "--gradient_accumulation_steps",
     "--global-batch-size / (--micro-batch-size x DP)", lambda c: str(c.training.num_microbatches)),
    ("ACCELERATE_GRADIENT_CLIPPING", "--gradient_clipping", "--clip-grad",
     lambda c: str(c.optimizer.clip_grad)),
    ("MEGATRON_LM_TP_DEGREE", "--megatron_lm_tp_degree", "--tensor-model-parallel-size",
     lambda c: str(c.parallel.tensor_model_parallel_size)),
    ("MEGATRON_LM_PP_DEGREE", "--megatron_lm_pp_degree", "--pipeline-model-parallel-size",
     lambda c: str(c.parallel.pipeline_model_parallel_size)),
)  # fmt: skip


def _same(theirs: str, ours: str) -> bool:
    try:
        return float(theirs) == float(ours)
    except ValueError:
        return theirs.lower() == ours.lower()


def check_accelerate_env(env: Mapping[str, str], cfg: RunConfig) -> None:
    """One UserError naming every Accelerate setting in `env` that disagrees with the flags."""
    megatron = env.get("ACCELERATE_USE_MEGATRON_LM") == "true"
    problems = [
        f"accelerate launch {option} {env[var]} ({var}) but pretrain_gpt.py {flag} gives {ours}"
        for var, option, flag, value in SETTINGS
        if var in env
        and (megatron or not var.startswith("MEGATRON_LM_"))
        and not _same(env[var], ours := value(cfg))
    ]
    if problems:
        raise UserError(
            "; ".join(problems) + " (the flags decide what pretrain_gpt.py trains: make the "
            "Accelerate config or launch options agree with them, or drop those options)"
        )
