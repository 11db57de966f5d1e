"""Is a checkpoint complete, which one does `--load` resume from, and are its numbers finite.

A step folder `global_step<N>` is *complete* when its `pretrain_meta.json` is present and
parseable, and every file its manifest (the "files" entry: name -> size in bytes, written by the
saver after every rank's files were on disk) lists is present with exactly that size. A
checkpoint without a manifest (written by a converter) is complete when its metadata is.

`choose_checkpoint(load_dir)` applies the rules of docs/CHECKPOINTS.md ("Loading"): the step
`latest` names if it is complete; else the newest complete step, with a note saying why; never a
fresh start over existing steps; never a folder outside `load_dir`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pretrain.checkpoint.format import (
    FILES_KEY,
    LATEST_FILE,
    OutsideLoadDir,
    available_tags,
    read_latest_tag,
    read_meta,
)
from pretrain.errors import UserError


def manifest(step_dir: str) -> dict[str, int]:
    """{file name: size in bytes} of every file in a step folder (what the saver records)."""
    return {
        name: os.path.getsize(os.path.join(step_dir, name))
        for name in sorted(os.listdir(step_dir))
        if os.path.isfile(os.path.join(step_dir, name))
    }


def step_problem(step_dir: str) -> tuple[str | None, dict | None]:
    """(None, metadata) if the step is complete, else (one line naming the damaged file, None)."""
    if not os.path.isdir(step_dir):
        return f"{step_dir} does not exist", None
    try:
        meta = read_meta(step_dir)
    except UserError as err:
        return str(err), None
    files = meta.get(FILES_KEY)
    if files is None:
        return None, meta
    for name, size in sorted(files.items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            return f"{path} is missing (the checkpoint lists it, {size} bytes)", None
        actual = os.path.getsize(path)
        if actual != size:
            return f"{path} has {actual} bytes, the checkpoint lists {size} (truncated?)", None
    return None, meta


@dataclass(frozen=True)
class Choice:
    """The checkpoint `--load` resumes from."""

    tag: str
    """The step folder's name (global_step<N>)."""
    meta: dict
    """Its parsed pretrain_meta.json."""
    note: str | None
    """Why this is not the step `latest` names (a warning to print), or None."""
    folder: str | None = None
    """The folder holding the step, when --load named the step folder itself (None: --load)."""


def _newest_complete(load_dir: str, skip: str | None) -> tuple[str | None, dict | None, str | None]:
    """(tag, meta, problem of the newest incomplete step passed over) for the newest complete
    step other than `skip`; tag and meta are None when there is none."""
    first_problem = None
    for tag in reversed(available_tags(load_dir)):
        if tag == skip:
            continue
        problem, meta = step_problem(os.path.join(load_dir, tag))
        if problem is None:
            return tag, meta, first_problem
        first_problem = first_problem or problem
    return None, None, first_problem


def choose_checkpoint(load_dir: str) -> Choice | None:
    """The complete step to resume from in `load_dir`, or None when it holds no checkpoint at
    all. `UserError` (one line naming the file) when steps exist but none is complete, or when
    `latest` points outside `load_dir`."""
    if not os.path.isdir(load_dir):
        return None
    latest = os.path.join(load_dir, LATEST_FILE)
    try:
        tag = read_latest_tag(load_dir)
    except UserError as err:
        if isinstance(err, OutsideLoadDir):
            raise
        tag, why = None, str(err)
    else:
        why = None if tag is not None else f"no {latest} file"
    if tag is not None:
        problem, meta = step_problem(os.path.join(load_dir, tag))
        if problem is None:
            return Choice(tag, meta, None)
        why = f"{latest} names {tag}, but {problem}"
    found, meta, skipped = _newest_complete(load_dir, skip=tag)
    if found is None:
        tags = available_tags(load_dir)
        if tag is None and not tags and why == f"no {latest} file":
            return None  # an empty (or new) folder: a fresh start
        listed = ", ".join(tags) or "no global_step<N> folders"
        also = f"; {skipped}" if skipped else ""
        raise UserError(
            f"--load {load_dir}: no complete checkpoint ({why}{also}; it holds {listed}); "
            f"restore the damaged files or point --load at another checkpoint directory"
        )
    also = f"; newer {skipped}" if skipped else ""
    return Choice(found, meta, f"{why}{also}: resuming from {found}, the newest complete step")


def nonfinite_tensors(tree, prefix: str = "") -> Iterator[str]:
    """The dotted names of floating-point tensors in nested dicts/lists that hold NaN or Inf."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and tree.numel() and not torch.isfinite(tree).all():
            yield prefix or "<tensor>"
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from nonfinite_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from nonfinite_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def nonfinite_summary(tree, what: str = "weights") -> str | None:
    """`non-finite values (NaN/Inf) in <what> <first tensor>[ (and N more)]`, or None when every
    floating-point tensor of `tree` is finite."""
    bad = list(nonfinite_tensors(tree))
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"non-finite values (NaN/Inf) in {what} {bad[0]}{more}"


def check_finite(tree, where: str, what: str = "weights") -> None:
    """Refuse (one line naming the tensor) a checkpoint whose tensors hold NaN or Inf."""
    summary = nonfinite_summary(tree, what)
    if summary is not None:
        raise UserError(
            f"{where}: {summary}; the run diverged before this save or the file is damaged: "
            f"use an earlier checkpoint"
        )
