"""The layout-independent training state (pretrain/checkpoint/full_state.py): TP shards written at
one layout read back as the original full tensors and re-cut for another TP, vocabulary padding
adjusted; damaged or foreign files are refused in one line."""

from __future__ import annotations

import dataclasses
import os
import pickle

import pytest
import torch

from pretrain.checkpoint.full_state import (
    VOCAB_PARAMS,
    has_full_state,
    local_shard,
    read_full_state,
    shard_file,
    write_shard,
)
from pretrain.convert.state_dict import parameter_partitions
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel

GPT2 = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=12,
    max_position_embeddings=16,
    make_vocab_size_divisible_by=8,
)
LLAMA = dataclasses.replace(
    GPT2,
    num_attention_heads=8,
    num_query_groups=4,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def _full_training_state(config: ModelConfig, padded: int) -> dict[str, dict]:
    """A model's real parameters (TP = 1) with random Adam moments, vocabulary padded by zeros."""
    torch.manual_seed(0)
    model = GPTModel(config)
    state = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        tensors = {"param": p.detach().clone()}
        tensors["exp_avg"] = torch.randn_like(tensors["param"])
        tensors["exp_avg_sq"] = torch.rand_like(tensors["param"])
        if tensors["param"].shape[0] == padded:
            for t in tensors.values():
                t[config.vocab_size :] = 0
        state[name] = {**tensors, "step": 7 + i}
    return state


def _write_at(step_dir: str, full: dict, partitions: dict, tp: int, pp_of: dict) -> None:
    """Cut `full` the way a TP = `tp` run holds it (sharding code independent of the reader)."""
    from pretrain.convert.state_dict import split_tp

    for t in range(tp):
        per_key = {
            k: split_tp({n: e[k] for n, e in full.items()}, partitions, tp)[t]
            for k in ("param", "exp_avg", "exp_avg_sq")
        }
        for stage in set(pp_of.values()):
            entries = {
                n: {
                    "partition": (
                        (partitions[n].dim, partitions[n].stride) if partitions[n] else None
                    ),
                    **{k: per_key[k][n] for k in per_key},
                    "step": full[n]["step"],
                }
                for n in full
                if pp_of[n] == stage
            }
            write_shard(step_dir, tp_rank=t, tp_size=tp, pp_stage=stage, entries=entries)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_tp2_pp2_shards_read_back_full_and_recut_for_tp4(tmp_path, config):
    padded2, padded4 = config.padded_vocab_size(2), config.padded_vocab_size(4)
    assert (padded2, padded4) == (112, 128)  # the padded size depends on TP
    full = _full_training_state(config, padded2)
    partitions = parameter_partitions(config)
    pp_of = {n: (0 if n.startswith(("embedding.", "layers.0.")) else 1) for n in full}
    _write_at(str(tmp_path), full, partitions, tp=2, pp_of=pp_of)
    assert has_full_state(str(tmp_path))

    read = read_full_state(str(tmp_path), config.vocab_size)
    assert read.keys() == full.keys()
    for name, entry in read.items():
        rows = config.vocab_size if name in VOCAB_PARAMS else None
        for key in ("param", "exp_avg", "exp_avg_sq"):
            want = full[name][key][:rows] if rows else full[name][key]
            assert torch.equal(getattr(entry, key), want), (name, key)
        assert entry.step == full[name]["step"]

    # TP = 4: each rank's piece, concatenated independently of the reader, is the padded tensor.
    qkv = "layers.1.attention.qkv.weight"
    pieces = [
        local_shard(read[qkv], qkv, tp_rank=t, tp_size=4, padded_vocab_size=padded4)["exp_avg"]
        for t in range(4)
    ]
    assert torch.equal(torch.cat(pieces), full[qkv]["exp_avg"])
    emb = "embedding.word_embeddings.weight"
    pieces = [
        local_shard(read[emb], emb, tp_rank=t, tp_size=4, padded_vocab_size=padded4)["param"]
        for t in range(4)
    ]
    merged = torch.cat(pieces)
    assert merged.shape[0] == padded4
    assert torch.equal(merged[: config.vocab_size], full[emb]["param"][: config.vocab_size])
    assert not merged[config.vocab_size :].any()


def test_swiglu_fc1_keeps_gate_and_up_halves_across_tp(tmp_path):
    full = _full_training_state(LLAMA, LLAMA.padded_vocab_size(2))
    partitions = parameter_partitions(LLAMA)
    _write_at(str(tmp_path), full, partitions, tp=2, pp_of=dict.fromkeys(full, 0))
    read = read_full_state(str(tmp_path), LLAMA.vocab_size)
    fc1 = "layers.0.mlp.fc1.weight"
    ffn = LLAMA.ffn_size
    gate, up = full[fc1]["param"][:ffn], full[fc1]["param"][ffn:]
    for t in range(4):  # rank t of TP 4 holds [gate_t; up_t] (Megatron's stride-2 layout)
        local = local_shard(read[fc1], fc1, tp_rank=t, tp_size=4, padded_vocab_size=128)["param"]
        q = ffn // 4
        assert torch.equal(local, torch.cat([gate[t * q : (t + 1) * q], up[t * q : (t + 1) * q]]))


def test_missing_tp_rank_is_refused(tmp_path):
    full = _full_training_state(GPT2, GPT2.padded_vocab_size(2))
    partitions = parameter_partitions(GPT2)
    pp_of = {n: (0 if n.startswith(("embedding.", "layers.0.")) else 1) for n in full}
    _write_at(str(tmp_path), full, partitions, tp=2, pp_of=pp_of)
    os.unlink(shard_file(str(tmp_path), 1, 1))
    with pytest.raises(UserError, match="incomplete"):
        read_full_state(str(tmp_path), GPT2.vocab_size)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_pickled_global_is_refused_not_run(tmp_path, writer, capfd):
    path = shard_file(str(tmp_path), 0, 0)
    payload = {"format_version": 1, "entries": _Evil()}
    with open(path, "wb") as f:
        (pickle.dump if writer == "pickle" else torch.save)(payload, f)
    # torch.save's zip: the global is named; a bare pickle cannot be memory-mapped: unreadable
    refusal = r"refused to load: .*system" if writer == "torch.save" else "cannot be read"
    with pytest.raises(UserError, match=refusal):
        read_full_state(str(tmp_path), 100)
    assert "pwned" not in capfd.readouterr().out
