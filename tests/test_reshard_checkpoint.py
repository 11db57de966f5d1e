"""tools/reshard_checkpoint.py on full states written the way a TP2 PP2 run writes them: the
output holds the same tensors, cut for the target layout by a sharder independent of the tool
(`_megatron_tp_piece`: hand-written slices of Megatron's tensor-parallel layout); bad targets, paths and sources are one-line errors, and
a full disk leaves nothing behind. Resuming the output in real training runs is in
tests/test_reshard_resume.py."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from test_full_state import GPT2, LLAMA, _full_training_state, _write_at

from pretrain.atomic import atomic_write_bytes
from pretrain.checkpoint.commit import commit_latest
from pretrain.checkpoint.format import META_FILE, build_metadata, tag_for
from pretrain.checkpoint.full_state import (
    TENSOR_KEYS,
    VOCAB_PARAMS,
    read_full_state,
    shard_file,
)
from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.convert.state_dict import parameter_partitions
from pretrain.errors import UserError
from pretrain.parallel.config import ParallelConfig
from tools.reshard_checkpoint import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATION = 6


def _source(root, config, tp=2, pp=2):
    """A checkpoint folder holding a TP2 PP2 run's full state and metadata; returns (folder, the
    TP = 1 state it was cut from)."""
    step_dir = root / tag_for(ITERATION)
    step_dir.mkdir(parents=True)
    padded = config.padded_vocab_size(tp)
    full = _full_training_state(config, config.padded_vocab_size(1))
    for name in VOCAB_PARAMS:  # a TP run's rows: the vocabulary, then zeros up to its padding
        for key in TENSOR_KEYS:
            if name in full:
                real = full[name][key][: config.vocab_size]
                full[name][key] = torch.cat(
                    [real, real.new_zeros(padded - len(real), *real.shape[1:])]
                )
    layers_per_stage = config.num_layers // pp
    pp_of = {
        n: 0
        if n.startswith("embedding.")
        else pp - 1
        if n.startswith("head.")
        else int(n.split(".")[1]) // layers_per_stage
        for n in full
    }
    _write_at(str(step_dir), full, parameter_partitions(config), tp=tp, pp_of=pp_of)
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp
    )
    meta = build_metadata(
        iteration=ITERATION,
        consumed_train_samples=48,
        consumed_valid_samples=16,
        model=config,
        parallel=parallel,
        pipeline_engine=pp > 1,
        tokenizer={"tokenizer_type": "GPT2BPETokenizer"},
    )
    atomic_write_bytes(str(step_dir / META_FILE), json.dumps(meta).encode())
    commit_latest(str(root), tag_for(ITERATION))
    return root, full


def _reshard(src, out, tp, pp=1):
    main(
        [
            "--load",
            str(src),
            "--save",
            str(out),
            "--target-tensor-parallel-size",
            str(tp),
            "--target-pipeline-parallel-size",
            str(pp),
        ]
    )


def _megatron_tp_piece(name: str, tensor: torch.Tensor, t: int, tp: int, swiglu: bool):
    """TP rank `t`'s piece of a TP = 1 tensor, cut from first principles (not by the code under
    test): Megatron's vocabulary-parallel embedding and output layer and its column-parallel QKV
    and fc1 hold rows [t*n, (t+1)*n) (SwiGLU's fc1, [gate; up], holds those rows of each half);
    the row-parallel proj and fc2 weights hold those columns; norms, position embeddings and the
    row-parallel biases are whole on every rank."""
    module, kind = name.rsplit(".", 2)[-2:]
    if module in ("proj", "fc2"):
        if kind == "bias":
            return tensor
        n = tensor.shape[1] // tp
        return tensor[:, t * n : (t + 1) * n]
    if module == "fc1" and swiglu:
        half = tensor.shape[0] // 2
        n = half // tp
        return torch.cat([tensor[t * n : (t + 1) * n], tensor[half + t * n : half + (t + 1) * n]])
    if module in ("word_embeddings", "output_layer", "qkv", "fc1"):
        n = tensor.shape[0] // tp
        return tensor[t * n : (t + 1) * n]
    return tensor


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_tp2_pp2_to_tp4_cuts_each_rank_as_an_independent_sharder_does(tmp_path, config):
    src, full = _source(tmp_path / "src", config)
    out = tmp_path / "tp4"
    _reshard(src, out, tp=4)

    step_dir = out / tag_for(ITERATION)
    assert (out / "latest").read_text() == tag_for(ITERATION)
    assert sorted(os.listdir(step_dir)) == sorted(
        [f"full_state_tp{t:02d}_pp00.pt" for t in range(4)] + [META_FILE]
    )
    padded4 = config.padded_vocab_size(4)
    for key in TENSOR_KEYS:
        expected = {}
        for name, entry in full.items():  # re-pad the vocabulary for TP 4, then cut
            tensor = entry[key]
            if name in VOCAB_PARAMS:
                tensor = torch.cat(
                    [
                        tensor[: config.vocab_size],
                        tensor.new_zeros(padded4 - config.vocab_size, *tensor.shape[1:]),
                    ]
                )
            expected[name] = tensor
        for t in range(4):
            saved = torch.load(shard_file(str(step_dir), t, 0), weights_only=True)["entries"]
            assert saved.keys() == full.keys()
            for name in full:
                piece = _megatron_tp_piece(name, expected[name], t, 4, config.swiglu)
                assert torch.equal(saved[name][key], piece), (t, name, key)
                assert saved[name]["step"] == full[name]["step"]

    meta = json.loads((step_dir / META_FILE).read_text())
    assert meta["full_state_only"] is True
    assert meta["parallel"]["tensor_model_parallel_size"] == 4
    assert meta["padded_vocab_size"] == padded4
    assert meta["resharded_from"]["parallel"]["tensor_model_parallel_size"] == 2
    assert meta["consumed_train_samples"] == 48 and meta["iteration"] == ITERATION
    assert sorted(meta["files"]) == sorted(n for n in os.listdir(step_dir) if n != META_FILE)


def test_round_trip_through_tp1_gives_back_the_original_files(tmp_path):
    src, _ = _source(tmp_path / "src", LLAMA)
    _reshard(src, tmp_path / "tp1", tp=1)
    _reshard(tmp_path / "tp1", tmp_path / "back", tp=2, pp=2)
    for t in range(2):
        for p in range(2):
            a = torch.load(shard_file(str(src / tag_for(ITERATION)), t, p), weights_only=True)
            b = torch.load(
                shard_file(str(tmp_path / "back" / tag_for(ITERATION)), t, p), weights_only=True
            )
            assert a["entries"].keys() == b["entries"].keys(), (t, p)
            for name, entry in a["entries"].items():
                for key in TENSOR_KEYS:
                    assert torch.equal(entry[key], b["entries"][name][key]), (t, p, name, key)


def test_the_converter_reads_a_resharded_checkpoint(tmp_path):
    src, _ = _source(tmp_path / "src", GPT2)
    _reshard(src, tmp_path / "tp1", tp=1)
    weights = read_checkpoint(str(tmp_path / "tp1")).state_dict
    expected = read_full_state(str(src / tag_for(ITERATION)), GPT2.vocab_size)
    assert weights.keys() == expected.keys()
    for name, entry in expected.items():
        assert torch.equal(weights[name], entry.param), name


@pytest.mark.parametrize(
    ("tp", "pp", "message"),
    [
        (3, 1, "--num-attention-heads 4 is not divisible by --target-tensor-parallel-size 3"),
        (1, 3, "--num-layers 2 is not divisible by --target-pipeline-parallel-size 3"),
        (0, 1, "--target-tensor-parallel-size must be >= 1"),
    ],
)
def test_a_target_the_model_cannot_take_is_refused(tmp_path, tp, pp, message):
    src, _ = _source(tmp_path / "src", GPT2)
    with pytest.raises(UserError, match=message):
        _reshard(src, tmp_path / "out", tp=tp, pp=pp)
    assert not (tmp_path / "out").exists()


def test_bad_paths_are_refused(tmp_path):
    src, _ = _source(tmp_path / "src", GPT2)
    with pytest.raises(UserError, match="lies inside --load"):
        _reshard(src, src / "resharded", tp=1)
    (tmp_path / "taken").mkdir()
    with pytest.raises(UserError, match="exists; give a new directory"):
        _reshard(src, tmp_path / "taken", tp=1)
    with pytest.raises(UserError, match="no such directory"):
        _reshard(tmp_path / "nowhere", tmp_path / "out", tp=1)


def test_a_checkpoint_without_full_state_names_the_way_out(tmp_path):
    src, _ = _source(tmp_path / "src", GPT2)
    step_dir = src / tag_for(ITERATION)
    for name in os.listdir(step_dir):
        if name.startswith("full_state_"):
            os.unlink(step_dir / name)
    with pytest.raises(UserError, match="--no-save-full-state.*resume it there and save once"):
        _reshard(src, tmp_path / "out", tp=1)


@pytest.mark.parametrize("limit", [1000, 20000])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, limit):
    """A file-size limit (ulimit -f) hit inside torch.save's zip writer (1000 bytes: the RuntimeError
    "unexpected pos") or in a plain write: exit 2, one line naming the file and the bytes needed."""
    src, _ = _source(tmp_path / "src", GPT2)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "tools/reshard_checkpoint.py", "--load", str(src), "--save", str(out)]
        + ["--target-tensor-parallel-size", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {tmp_path}/.out.tmp-"), lines[0]
    assert "cannot write, file too large (" in lines[0] and "bytes needed" in lines[0]
    assert lines[0].endswith(f"nothing was written to {out}")
    assert os.listdir(tmp_path) == ["src"]


def test_a_state_holding_nan_is_refused_and_leaves_nothing(tmp_path):
    src, _ = _source(tmp_path / "src", GPT2)
    path = shard_file(str(src / tag_for(ITERATION)), 1, 0)
    payload = torch.load(path, weights_only=True)
    name = next(iter(payload["entries"]))
    payload["entries"][name]["exp_avg"].view(-1)[0] = float("nan")
    torch.save(payload, path)
    with pytest.raises(UserError, match=rf"non-finite values \(NaN/Inf\) in the full state {name}"):
        _reshard(src, tmp_path / "out", tp=1)
    assert os.listdir(tmp_path) == ["src"]
