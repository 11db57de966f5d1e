"""What a `--load` path means: a checkpoint folder, one step of it, or nothing to resume.

`choose_load(load, save)` is what training resumes from (docs/CHECKPOINTS.md, "What --load
accepts"):

- a `--save` folder (`latest`, `global_step<N>` folders): `integrity.choose_checkpoint`;
- one step folder (`X/global_step<N>`, holding `pretrain_meta.json`): exactly that step, as
  `tools/convert_to_hf.py --load` takes it; an incomplete one is refused (no fallback: it was
  named);
- `--save` itself, not there yet or without a checkpoint: None, a fresh start (the first launch
  of a job that resumes itself: the same command, `--load` = `--save`, launched again and again);
- refused in one line: a file, a Hugging Face export (`config.json` + weights: the way in is
  `tools/convert_from_hf.py`), and a path that does not exist or a folder without a checkpoint,
  either not `--save` (a wrong path would otherwise train from scratch).
"""

from __future__ import annotations

import glob
import os

from pretrain.checkpoint.format import LATEST_FILE, META_FILE, read_latest_tag
from pretrain.checkpoint.integrity import Choice, choose_checkpoint, step_problem
from pretrain.errors import UserError

_HF_WEIGHTS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")


def same_folder(a: str | None, b: str | None) -> bool:
    """True when both name the same folder (symbolic links and `..` resolved)."""
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def is_hf_export(folder: str) -> bool:
    """True for a Hugging Face model folder: `config.json` beside safetensors or `.bin` weights."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return False
    return any(glob.glob(os.path.join(glob.escape(folder), pattern)) for pattern in _HF_WEIGHTS)


def _step_folder(step_dir: str) -> Choice:
    """The step `--load` names directly; refused (one line) if it is incomplete."""
    problem, meta = step_problem(step_dir)
    if problem is not None:
        raise UserError(
            f"--load {step_dir}: this step folder is not a complete checkpoint ({problem}); "
            f"point --load at its parent folder to resume from the newest complete step"
        )
    parent, tag = os.path.split(os.path.normpath(step_dir))
    parent = parent or "."
    try:
        latest = read_latest_tag(parent)
    except UserError:
        latest = None
    also = "" if latest in (None, tag) else f" ({os.path.join(parent, LATEST_FILE)} names {latest})"
    note = f"a step folder: resuming exactly {tag}{also}"
    return Choice(tag, meta, note, folder=parent)


def choose_load(load: str, save: str | None) -> Choice | None:
    """The step a run with `--load load --save save` resumes from, or None for a fresh start
    (see the module docstring); `UserError` (one line naming the path and the fix) otherwise."""
    if os.path.exists(load) and not os.path.isdir(load):
        raise UserError(
            f"--load {load} is a file; --load takes a checkpoint folder (the --save folder of a "
            f"run, or one of its global_step<N> folders); a Hugging Face model is imported with "
            f"tools/convert_from_hf.py"
        )
    if os.path.isfile(os.path.join(load, META_FILE)):
        return _step_folder(load)
    if os.path.isdir(load) and is_hf_export(load):
        raise UserError(
            f"--load {load} is a Hugging Face model folder (config.json + weights), not a "
            f"pretrain_gpt.py checkpoint: import it with tools/convert_from_hf.py --load {load} "
            f"--save NEW_DIR, then train with --load NEW_DIR --finetune (docs/CONVERSION.md)"
        )
    if not os.path.exists(load) and not same_folder(load, save):
        raise UserError(
            f"--load {load} does not exist: check the path, drop --load to start from scratch, "
            f"or give the same folder to --load and --save (a job that resumes itself starts "
            f"from scratch there the first time)"
        )
    choice = choose_checkpoint(load)
    if choice is not None or same_folder(load, save):
        return choice
    raise UserError(
        f"--load {load} holds no checkpoint (no {LATEST_FILE} file, no global_step<N> folders) "
        f"and is not the --save folder: point --load at a checkpoint folder, drop --load to "
        f"start from scratch, or give the same folder to --load and --save (a job that resumes "
        f"itself starts from scratch there the first time)"
    )
