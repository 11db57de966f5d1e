"""tools/convert_from_hf.py: HF -> ours -> HF and ours -> HF -> ours give identical weights, and
pretrain_gpt.py --finetune from an imported checkpoint (at another TP/PP) starts at the loss the
original checkpoint gives."""

from __future__ import annotations

import json
import struct

import pytest
import tokenizers
import torch
import transformers
from convert_fixtures import (
    launch_runs,
    layout_flags,
    load_tool,
    model_flags,
    train_flags,
)
from safetensors.torch import load_file
from training_fixtures import read_metrics

from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.errors import UserError
from pretrain.model.config import model_flags as flags_of_config

convert_to_hf = load_tool("convert_to_hf")
convert_from_hf = load_tool("convert_from_hf")

SPECIALS = dict(bos_token_id=None, eos_token_id=199)  # what the exported tokenizer's </s> gives
HF_MODELS = {
    "gpt2-tied": transformers.GPT2Config(
        **SPECIALS,
        vocab_size=200,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function="gelu",
    ),
    "gpt2-untied": transformers.GPT2Config(
        **SPECIALS,
        vocab_size=200,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=48,
        activation_function="gelu",
        tie_word_embeddings=False,
    ),
    "llama-gqa-untied": transformers.LlamaConfig(
        **SPECIALS,
        vocab_size=200,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "gpt2-openai-gelu_new": transformers.GPT2Config(
        **SPECIALS,
        vocab_size=200,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
    ),
    "llama3-rope-scaling": transformers.LlamaConfig(
        **SPECIALS,
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    ),
    "llama-bias-tied": transformers.LlamaConfig(
        **SPECIALS,
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=32,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
}


def _save_tokenizer(folder) -> None:
    """A 200-token word-level tokenizer with </s> as its end-of-document token."""
    vocab = {f"w{i}": i for i in range(199)} | {"</s>": 199}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>"
    ).save_pretrained(folder)


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_to_ours_to_hf_is_identical(tmp_path, capsys, name):
    """HF -> ours (TP 2, PP 2) -> HF (verified: logits equal ours) -> ours -> HF: the tensors
    equal the original's and the two exports' safetensors files are byte-identical."""
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(HF_MODELS[name])
    with torch.no_grad():  # biases and norms start at 0/1: make every tensor distinct
        for p in original.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    original.save_pretrained(tmp_path / "hf")
    _save_tokenizer(tmp_path / "hf")

    convert_from_hf.main(
        [
            "--load",
            str(tmp_path / "hf"),
            "--save",
            str(tmp_path / "ours"),
            "--target-tensor-parallel-size",
            "2",
            "--target-pipeline-parallel-size",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    assert "continue pretraining with: pretrain_gpt.py" in printed
    # learned absolute positions (GPT-2) have no RoPE base to give; rotary ones (Llama) do
    learned = HF_MODELS[name].model_type == "gpt2"
    assert ("--position-embedding-type learned_absolute" in printed) == learned, printed
    assert ("--rotary-base" in printed) != learned, printed
    convert_to_hf.main(
        [
            "--load",
            str(tmp_path / "ours"),
            "--output-dir",
            str(tmp_path / "back"),
            "--verify",
            "--prompt",
            "w5 w7",
            "--max-new-tokens",
            "4",
        ]
    )

    assert "verify: max abs logit difference" in capsys.readouterr().out
    convert_from_hf.main(["--load", str(tmp_path / "back"), "--save", str(tmp_path / "ours2")])
    convert_to_hf.main(["--load", str(tmp_path / "ours2"), "--output-dir", str(tmp_path / "back2")])
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "back2" / name).read_bytes()

    before, after = _weights(tmp_path / "hf"), _weights(tmp_path / "back")
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", local_files_only=True
    )
    unset = {"transformers_version": 0, "architectures": 0, "dtype": 0}
    assert exported.config.to_diff_dict() | unset == original.config.to_diff_dict() | unset
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "back", local_files_only=True)
    assert tokenizer("w3 </s>")["input_ids"] == [3, 199] and tokenizer.eos_token == "</s>"


@pytest.mark.parametrize(
    "config, refusal",
    [
        (
            transformers.LlamaConfig(
                vocab_size=10,
                hidden_size=8,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
            ),
            "rope_type='yarn' is not supported",
        ),
        (
            transformers.GPT2Config(
                vocab_size=10,
                n_positions=8,
                n_embd=8,
                n_layer=1,
                n_head=2,
                activation_function="relu",
            ),
            "activation_function='relu'",
        ),
    ],
    ids=["yarn", "relu"],
)
def test_inexpressible_models_are_refused(tmp_path, config, refusal):
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match=refusal):
        convert_from_hf.main(["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_not_a_hf_folder(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        convert_from_hf.main(["--load", str(tmp_path / "x"), "--save", str(tmp_path / "out")])
    transformers.AutoModelForCausalLM.from_config(HF_MODELS["gpt2-tied"]).save_pretrained(
        tmp_path / "hf"
    )
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        convert_from_hf.main(["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ours_to_hf_to_ours_is_identical_and_training_continues_at_the_same_loss(
    checkpoints, corpus, tmp_path
):
    runs, metrics = [], {}
    for flavour in ("gpt2", "llama"):
        source = str(checkpoints[flavour, "110"])
        hf, back = tmp_path / f"{flavour}_hf", tmp_path / f"{flavour}_back"
        convert_to_hf.main(["--load", source, "--output-dir", str(hf)])
        convert_from_hf.main(
            [
                "--load",
                str(hf),
                "--save",
                str(back),
                "--target-tensor-parallel-size",
                "2",
                "--target-pipeline-parallel-size",
                "2",
            ]
        )
        original, imported = read_checkpoint(source), read_checkpoint(str(back))
        assert imported.state_dict.keys() == original.state_dict.keys()
        for key, tensor in original.state_dict.items():
            assert torch.equal(imported.state_dict[key], tensor), key

        # one iteration of --finetune from each: the original at its layout, the import at TP=2, PP=2
        for tag, load, model, layout in (
            ("original", source, model_flags(flavour), (1, 1, 0)),
            ("imported", str(back), flags_of_config(imported.config), (2, 2, 1)),
        ):
            metrics[flavour, tag] = tmp_path / f"{flavour}_{tag}.jsonl"
            runs.append(
                model
                + train_flags(corpus, iters=1)
                + layout_flags(*layout)
                + ["--load", load, "--finetune", "--metrics-file", str(metrics[flavour, tag])]
            )
    launch_runs(runs, tmp_path)
    for flavour in ("gpt2", "llama"):
        original, imported = (read_metrics(metrics[flavour, t]) for t in ("original", "imported"))
        assert list(original) == list(imported) == [1]  # --finetune restarts at iteration 0
        assert abs(original[1]["lm-loss"] - imported[1]["lm-loss"]) < 2e-6, (original, imported)


def _header(entries: dict, data: bytes = b"\0" * 16) -> bytes:
    """A safetensors file: its 8-byte header length, the JSON header, the data."""
    header = json.dumps(entries).encode()
    return struct.pack("<Q", len(header)) + header + data


HOSTILE_WEIGHTS = {
    # model.safetensors: safetensors checks the header before it allocates anything
    "huge-header-length": struct.pack("<Q", 1 << 60) + b"{}",
    "header-past-the-end": struct.pack("<Q", 1000) + b"{}",
    "bad-json": struct.pack("<Q", 5) + b"{abc}",
    "offsets-out-of-range": _header(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}
    ),
    "unknown-dtype": _header({"w": {"dtype": "Q8", "shape": [4], "data_offsets": [0, 16]}}),
    "shape-past-the-data": _header(
        {"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 16]}}
    ),
    # model.safetensors.index.json (before: a traceback; a shard outside the folder was read)
    "index-bad-json": "{nope",
    "index-without-weight-map": "{}",
    "index-weight-map-a-list": '{"weight_map": ["model.safetensors"]}',
    "index-shard-outside-the-folder": '{"weight_map": {"w": "../outside.bin"}}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE_WEIGHTS))
def test_a_hostile_weights_file_is_one_line_naming_it(tmp_path, case):
    """A damaged or doctored safetensors header or shard index in the folder convert_from_hf.py
    reads: one UserError line naming the file, nothing written."""
    hf = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(HF_MODELS["gpt2-tied"]).save_pretrained(hf)
    content = HOSTILE_WEIGHTS[case]
    if case.startswith("index-"):
        torch.save({"w": torch.ones(1)}, tmp_path / "outside.bin")
        name = "model.safetensors.index.json"
        (hf / name).write_text(content)
    else:
        name = "model.safetensors"
        (hf / name).write_bytes(content)
    with pytest.raises(UserError) as refused:
        convert_from_hf.main(["--load", str(hf), "--save", str(tmp_path / "out")])
    line = str(refused.value)
    assert line.startswith(f"{hf / name}: ") and "\n" not in line, line
    assert not (tmp_path / "out").exists()
