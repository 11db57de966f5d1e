"""No pickled code runs from a checkpoint, also when resuming (pretrain/checkpoint/safe_load.py,
dcp_reader.py).

Real checkpoints of a tiny run at two ranks (DP2 ZeRO-0, DP2 ZeRO-1 bf16, DP2 ZeRO-2, DP2 ZeRO-3,
PP2: model, optimizer, pipeline-layer, RNG and full-state files; DP2 on the torch backend: DCP
`.metadata` and `.distcp` shards, `train_state.pt`), each saved at iteration 2. One file at a
time gets a payload (a pickled global that calls `os.system("touch MARKER")` while it is
unpickled; in a DCP step, an object appended to `__0_0.distcp` that `.metadata` points a tensor
at, marked a byte item or not), and the checkpoint's file list in pretrain_meta.json is
re-written with the new sizes and fingerprints, as an attacker would, so the checkpoint is
"complete" and its own. Then every reader of that file
(`pretrain_gpt.py --load` at the saved layout, at another layout, with --finetune;
`tools/reshard_checkpoint.py`; `tools/convert_to_hf.py`) must stop with the one-line refusal
naming the file and the global, exit non-zero, and the MARKER must not exist.

The clean checkpoints resume through the same readers: each resumed run writes its own metrics
file, starting at iteration 3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from dcp_fixtures import point_at_object
from training_fixtures import (
    REPO,
    deepspeed_cmd,
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)

from pretrain.checkpoint import fingerprints
from pretrain.checkpoint.format import FINGERPRINTS_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SAVED_AT, ITERS = 2, 4
# name -> (TP, PP, ZeRO, extra flags), all at world 2
LAYOUTS = {
    "z0": (1, 1, 0, []),
    "z1bf16": (1, 1, 1, ["--bf16"]),
    "z2": (1, 1, 2, []),
    "z3": (1, 1, 3, []),
    "pp2": (1, 2, 0, []),
    "fsdp2": (1, 1, None, ["--use-torch-fsdp2"]),  # DP2, FSDP2-sharded, DCP files
}
# clean resumes: name -> (checkpoint, layout the run uses, extra flags)
RESUMES = {
    **{name: (name, name, []) for name in LAYOUTS},
    "z3_finetune": ("z3", "z3", ["--finetune"]),  # ZeRO-3 weights through zero_to_fp32
    "z0_to_z1": ("z0", "z0", ["--zero-stage", "1"]),  # another layout: through the full state
}


class _Payload:
    """Unpickling this runs `touch MARKER`: what a hostile checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _flags(corpus, layout, *extra):
    tp, pp, zero, more = LAYOUTS[layout]
    layout_argv = layout_flags(tp, pp, zero) if zero is not None else []  # no ZeRO flag: FSDP2
    argv = model_flags("gpt2") + train_flags(corpus, iters=ITERS) + layout_argv
    return argv + more + list(extra)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One launch: every layout saves at SAVED_AT, then the clean checkpoints resume."""
    tmp = tmp_path_factory.mktemp("pickles")
    corpus = make_corpus(tmp / "corpus")
    runs = [
        _flags(
            corpus,
            name,
            "--save",
            str(tmp / name),
            "--save-interval",
            "100",
            "--exit-interval",
            str(SAVED_AT),
        )
        for name in LAYOUTS
    ]
    for name, (ckpt, layout, extra) in RESUMES.items():
        metrics = tmp / f"{name}_resumed.jsonl"
        runs.append(
            _flags(
                corpus, layout, "--load", str(tmp / ckpt), "--metrics-file", str(metrics), *extra
            )
        )
    result = run(multirun_cmd(2, runs, tmp / "runs.json"), timeout=600)
    assert result.returncode == 0, result.stdout[-8000:]
    return tmp, corpus


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_a_clean_checkpoint_resumes(saved, name):
    tmp, _ = saved
    metrics = read_metrics(tmp / f"{name}_resumed.jsonl")
    first = 1 if RESUMES[name][2] == ["--finetune"] else SAVED_AT + 1
    assert min(metrics) == first and max(metrics) == ITERS, metrics


def _hostile_copy(tmp, ckpt: str, file: str, legacy: bool = False) -> tuple[str, str, str]:
    """(a copy of checkpoint `ckpt` whose `file` carries the payload (`legacy`: in torch's
    non-zip format; a DCP step's `file` is `DCP_KEY` with the kind of entry: see `_in_dcp`),
    listed at its new size and fingerprint; the path named in the refusal; the MARKER the payload would
    create)."""
    copy = Path(tempfile.mkdtemp(prefix=f"{ckpt}-{file[:-3]}-", dir=tmp)) / "checkpoint"
    shutil.copytree(tmp / ckpt, copy)
    step = copy / f"global_step{SAVED_AT}"
    marker = copy.parent / "MARKER"
    if file in DCP_ENTRIES:
        path = _in_dcp(step, file, _Payload(marker))
    else:
        state = torch.load(step / file, weights_only=False)  # our own clean file
        state["payload"] = _Payload(marker)
        torch.save(state, step / file, _use_new_zipfile_serialization=not legacy)
        path = str(step / file)
    meta = json.loads((step / "pretrain_meta.json").read_text())
    for name in meta["files"]:  # the attacker re-lists the sizes
        meta["files"][name] = os.path.getsize(step / name)
    meta[FINGERPRINTS_KEY] = fingerprints.record(str(step), meta["files"])  # and fingerprints
    (step / "pretrain_meta.json").write_text(json.dumps(meta))
    return str(copy), path, str(marker)


# DCP entries of the torch backend's step that `.metadata` points at a payload appended to
# __0_0.distcp: "bytes" marked a byte item (torch's planner unpickles those with
# weights_only=False), "tensor" left a tensor
DCP_KEY = "tp00.layers.0.attention.qkv.weight.exp_avg"
DCP_ENTRIES = {"bytes.pt": True, "tensor.pt": False}


def _in_dcp(step: Path, entry: str, payload) -> str:
    """Point `DCP_KEY` at `payload` as `entry` says; the `FILE (key)` the refusal names."""
    point_at_object(str(step), DCP_KEY, payload, as_bytes=DCP_ENTRIES[entry])
    return f"{step / '__0_0.distcp'} ({DCP_KEY})"


def _assert_refused(result, path: str, marker: str) -> None:
    """The run exited non-zero with the refusal line for `path`, and the payload did not run."""
    assert result.returncode != 0, result.stdout[-4000:]
    _assert_refusal_line(result.stdout, path, marker)


REFUSAL = r"refused to load: it holds pickled global\(s\) (posix|os)\.system,"
BYTE_ITEM_REFUSAL = r"refused: \.metadata marks it a pickled object \(BytesStorageMetadata\)"


def _assert_refusal_line(output: str, path: str, marker: str, refused: str = REFUSAL) -> None:
    """`output` holds the one-line refusal naming `path` (and the global), no traceback; the
    payload did not run (no MARKER)."""
    refusal = re.compile(rf"^error: (rank \d: )?{re.escape(path)}: {refused}", re.M)
    assert refusal.search(output), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert not os.path.exists(marker)


# (checkpoint, file with the payload, layout of the resuming run, extra flags)
RESUME_ATTACKS = {
    "model_states_z0": ("z0", "mp_rank_00_model_states.pt", "z0", []),
    "optim_states_z1bf16": (
        "z1bf16",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "z1bf16",
        [],
    ),
    "model_states_z3": ("z3", "zero_pp_rank_0_mp_rank_00_model_states.pt", "z3", []),
    "optim_states_z3_finetune": (
        "z3",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "z3",
        ["--finetune"],
    ),
    # read by one stage only: the other must not wait for it in DeepSpeed's collectives
    "layer_pp2": ("pp2", "layer_02-model_00-model_states.pt", "pp2", []),
    "layer_pp2_legacy": ("pp2", "layer_00-model_00-model_states.pt", "pp2", []),
    "rng_state_z0": ("z0", "rng_state_1.pt", "z0", []),
    "full_state_relayout": ("z0", "full_state_tp00_pp00.pt", "z0", ["--zero-stage", "1"]),
    # the torch backend's files: the payload (a byte item at a tensor's key), the same
    # object in a tensor's place, and train_state.pt
    "dcp_byte_item_fsdp2": ("fsdp2", "bytes.pt", "fsdp2", []),
    "dcp_tensor_fsdp2": ("fsdp2", "tensor.pt", "fsdp2", []),
    "train_state_fsdp2": ("fsdp2", "train_state.pt", "fsdp2", []),
}


def _hostile_resume(tmp, corpus, name: str) -> tuple[list[str], str, str]:
    """(the argv of a resume from a copy of the checkpoint with attack `name`'s payload; the
    file's path; its MARKER)."""
    ckpt, file, layout, extra = RESUME_ATTACKS[name]
    load, path, marker = _hostile_copy(tmp, ckpt, file, legacy=name.endswith("_legacy"))
    return _flags(corpus, layout, "--load", load, *extra), path, marker


@pytest.fixture(scope="module")
def refused_resumes(saved):
    """One launch of tests/training_multirun.py resuming every hostile copy in turn: (its
    output, name -> (the file with the payload, its MARKER)). The multirun checks that each run
    stops with a UserError (it exits 0 only if every one did)."""
    tmp, corpus = saved
    attacks = {name: _hostile_resume(tmp, corpus, name) for name in sorted(RESUME_ATTACKS)}
    runs = [{"argv": argv, "refused": True} for argv, _, _ in attacks.values()]
    result = run(multirun_cmd(2, runs, tmp / "refused.json"), timeout=600)
    assert result.returncode == 0, result.stdout[-8000:]
    return result.stdout, {name: (path, marker) for name, (_, path, marker) in attacks.items()}


@pytest.mark.parametrize("name", sorted(RESUME_ATTACKS))
def test_resuming_refuses_a_payload(refused_resumes, name):
    """A resume from a checkpoint with a payload in any file it reads stops with the one-line
    refusal naming that file, and the payload does not run."""
    output, files = refused_resumes
    refused = BYTE_ITEM_REFUSAL if RESUME_ATTACKS[name][1] == "bytes.pt" else REFUSAL
    _assert_refusal_line(output, *files[name], refused)


@pytest.mark.parametrize("name", ["model_states_z0", "dcp_byte_item_fsdp2"])
def test_a_refused_resume_exits_non_zero(saved, name):
    """pretrain_gpt.py under the real launcher ends a refused resume with a non-zero exit
    (`--use-torch-fsdp2 --load` of the issue's payload: before, it ran it and exited 0)."""
    tmp, corpus = saved
    argv, path, marker = _hostile_resume(tmp, corpus, name)
    result = run(deepspeed_cmd(2, argv), timeout=300)
    assert result.returncode != 0, result.stdout[-4000:]
    _assert_refusal_line(
        result.stdout, path, marker, BYTE_ITEM_REFUSAL if "dcp" in name else REFUSAL
    )


def test_reshard_checkpoint_refuses_a_payload(saved):
    tmp, _ = saved
    load, path, marker = _hostile_copy(tmp, "z0", "full_state_tp00_pp00_dp001.pt")
    cmd = [sys.executable, str(REPO / "tools" / "reshard_checkpoint.py"), "--load", load]
    cmd += ["--save", str(tmp / "resharded"), "--target-tensor-parallel-size", "2"]
    _assert_refused(run(cmd, timeout=300), path, marker)


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize(
    ("ckpt", "file"),
    [
        ("z3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("pp2", "layer_02-model_00-model_states.pt"),
    ],
)
def test_convert_to_hf_refuses_a_payload(saved, ckpt, file, legacy):
    tmp, _ = saved
    load, path, marker = _hostile_copy(tmp, ckpt, file, legacy)
    cmd = [sys.executable, str(REPO / "tools" / "convert_to_hf.py"), "--load", load]
    _assert_refused(
        run(cmd + ["--output-dir", str(tmp / f"hf-{ckpt}-{legacy}")], timeout=300), path, marker
    )


@pytest.mark.parametrize("legacy", [False, True])
def test_deepspeeds_own_readers_are_allowlisted_inside_checked_torch_loads(tmp_path, legacy):
    """DeepSpeed's checkpoint engine and zero_to_fp32 call torch.load(weights_only=False); inside
    checked_torch_loads the same calls refuse the payload, and `refusal` finds it unpickling
    nothing. Outside, the same call runs it (the payload is real)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils import zero_to_fp32

    from pretrain.checkpoint import safe_load
    from pretrain.errors import UserError

    marker, path = tmp_path / "MARKER", str(tmp_path / "mp_rank_00_model_states.pt")
    state = {"module": {"w": torch.ones(2)}, "payload": _Payload(marker)}
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    refused = (
        rf"^{re.escape(path)}: refused to load: it holds pickled global\(s\) (posix|os)\.system"
    )
    assert re.match(refused, safe_load.refusal(path, deepspeed=True))
    with safe_load.checked_torch_loads():
        for read in (TorchCheckpointEngine().load, lambda p: zero_to_fp32.parse_model_states([p])):
            with pytest.raises(UserError, match=refused):
                read(path)
    assert not marker.exists()
    TorchCheckpointEngine().load(path)
    assert marker.exists()
