"""Which LR schedule a resume continues: Megatron's three behaviours.

A checkpoint records its scheduler's position and values by the names of Megatron's
`OptimizerParamScheduler.state_dict` (`lr_schedule.STATE_NAMES`; spans in samples, as Megatron
counts them). Megatron's `load_state_dict` compares five of them with this run's flags:
max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style. After the load, `resolve`:

- neither flag: a value that differs is refused in one line naming each (the flag that sets it,
  the checkpoint's value, this run's) and the two flags below as the fixes (Megatron asserts);
- `--override-opt_param-scheduler`: this run's flags' schedule, from the checkpoint's position;
- `--use-checkpoint-opt_param-scheduler`: the checkpoint's five values win over the flags (one
  line says so).

The values Megatron's state_dict omits (--lr-warmup-init, the WSD anneal) come from the flags in
every case, as in Megatron. Megatron also compares its weight-decay increment (start/end weight
decay and its span, the run's length); our weight decay is constant (--weight-decay), so nothing
of it is compared. `--finetune` loads no scheduler state and decides nothing.
"""

from __future__ import annotations

from pretrain.errors import UserError
from pretrain.training.checkpoints.checkpointing import CheckpointConfig
from pretrain.training.report.logging import logger
from pretrain.training.schedules.lr_schedule import SampleLRScheduler

OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"

# Megatron's compared values -> the flags that set them.
COMPARED = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("lr_warmup_steps", "--lr-warmup-iters/-samples/-fraction, in samples"),
    ("lr_decay_steps", "--lr-decay-iters/-samples (default the training length), in samples"),
    ("lr_decay_style", "--lr-decay-style"),
)


def check_flags(override: bool, use_checkpoint: bool) -> None:
    """Refuse both flags together (Megatron asserts 'both override and use-checkpoint are set')."""
    if override and use_checkpoint:
        raise UserError(
            f"{OVERRIDE} (this run's LR schedule) and {USE_CHECKPOINT} (the checkpoint's) are "
            f"exclusive (keep one)"
        )


def differences(saved: dict, current: dict) -> list[str]:
    """'name (flags) X in the checkpoint, Y now' for each compared value that differs; a value
    the checkpoint does not record is not compared."""
    return [
        f"{name} ({flags}) {saved[name]} in the checkpoint, {current[name]} now"
        for name, flags in COMPARED
        if name in saved and saved[name] != current[name]
    ]


def _megatron_values(saved: dict) -> dict:
    """The compared values a checkpoint records (a value it lacks comes from the flags)."""
    return {name: saved[name] for name, _ in COMPARED if name in saved}


def resolve(scheduler: SampleLRScheduler, config: CheckpointConfig) -> None:
    """After `scheduler.load_state_dict`, continue the schedule `config`'s flags choose (module
    docstring) and set the lr at the loaded position, or refuse in one line. Every rank loaded
    the same values, so every rank decides alike."""
    _choose(
        scheduler,
        override=config.override_opt_param_scheduler,
        use_checkpoint=config.use_checkpoint_opt_param_scheduler,
        path=config.load,
    )
    scheduler.step(increment=0)


def _choose(scheduler: SampleLRScheduler, *, override: bool, use_checkpoint: bool, path: str):
    """Refuse, keep this run's values, or take the checkpoint's (module docstring)."""
    saved = _megatron_values(scheduler.loaded or {})
    where = f"--load {path}"
    diffs = differences(saved, scheduler.values())
    position = f"at its position ({scheduler.num_samples} samples)"
    if use_checkpoint:
        if saved.get("lr_decay_style") == "WSD" and scheduler.values()["wsd_decay_steps"] is None:
            raise UserError(
                f"{where}: {USE_CHECKPOINT}: the checkpoint's LR schedule is WSD, whose anneal "
                f"length comes from the flags (as in Megatron): give --lr-wsd-decay-iters/-samples"
            )
        scheduler.use_values(saved)
        overrides = f", over this run's flags: {'; '.join(diffs)}" if diffs else ""
        logger.info(
            f"{where}: {USE_CHECKPOINT}: the checkpoint's LR schedule {position}{overrides}"
        )
    elif override:
        changed = f": {'; '.join(diffs)}" if diffs else " (the same as the checkpoint's)"
        logger.info(f"{where}: {OVERRIDE}: this run's LR schedule {position}{changed}")
    elif diffs:
        raise UserError(
            f"{where}: this run's LR schedule differs from the checkpoint's: {'; '.join(diffs)}; "
            f"pass {OVERRIDE} (this run's schedule from the checkpoint's position) or "
            f"{USE_CHECKPOINT} (the checkpoint's schedule)"
        )
