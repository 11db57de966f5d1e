"""Three real Megatron launch scripts run here with only the entry point and the data/tokenizer
paths changed.

The fixtures in tests/fixtures/launch_scripts/ are the flags each script passes to its
`pretrain_gpt.py` (one per file, each naming its source file and commit):

- Megatron-LM `examples/pretrain_gpt_distributed.sh` (GPT-2 345M, 8-way data parallel, fp16);
- Megatron-DeepSpeed `examples_deepspeed/pretrain_llama2_distributed.sh` (Llama-2 style, TP2
  PP2, a DeepSpeed JSON, Megatron-DeepSpeed's spellings of GQA/RoPE/RMSNorm);
- Megatron-DeepSpeed `examples_deepspeed/rebase/ds_pretrain_gpt_125M.sh` (GPT-3 125M, TP2 PP2
  ZeRO-1, fp16 loss scaling from its JSON, an LR schedule and a stop in tokens, activation
  checkpointing, Megatron-DeepSpeed's TensorBoard flags).

At full size each parses with a launcher environment of the world size it needs. Then the same
flags with size overrides appended (argparse: the last value wins) train 2 iterations on CPU,
all three in one launched world of 2 ranks.

What changes besides paths, and why (the same on every machine without a GPU):
- `--fp16` becomes `--bf16` (and the JSON's fp16 section a bf16 one): DeepSpeed has no fp16 on
  CPU. `test_fp16_scripts_parse_on_a_gpu_machine` parses them unchanged where CUDA exists.
- `--distributed-backend nccl` gets `--distributed-backend gloo` appended (nccl needs GPUs).
The Llama-2 script keeps its `GPTSentencePieceTokenizer`, with a small SentencePiece model
trained here in place of Llama's tokenizer.model.
"""

import json
import re
import shlex
from pathlib import Path
from string import Template

import numpy as np
import pytest
import torch
from tokenizer_fixtures import MERGES, VOCAB
from training_fixtures import multirun_cmd, read_metrics, run

from pretrain.cli import parse_args
from pretrain.data.files.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from pretrain.errors import UserError
from pretrain.tokenizer import TokenizerConfig, build_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "launch_scripts"
MEGATRON_GPT = "megatron_lm_pretrain_gpt_distributed"
DS_LLAMA2 = "megatron_deepspeed_pretrain_llama2_distributed"
DS_GPT_125M = "megatron_deepspeed_ds_pretrain_gpt_125M"
SCRIPTS = (MEGATRON_GPT, DS_LLAMA2, DS_GPT_125M)
GPT2_EOD = 50256


def read_fixture(name: str) -> tuple[list[str], int]:
    """(the script's flags with ${...} placeholders, the world size its header names)."""
    text = (FIXTURES / f"{name}.flags").read_text()
    world = int(re.search(r"^# world-size: (\d+)$", text, re.MULTILINE).group(1))
    return shlex.split(text, comments=True), world


def launcher_env(world_size: int) -> dict:
    """What torchrun / the deepspeed launcher export to rank 0 of `world_size` ranks."""
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def _sentencepiece_model(prefix: Path) -> str:
    """A small BPE SentencePiece model in place of Llama's tokenizer.model."""
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    words = ["the", "king", "queen", "crown", "sword", "night", "day", "love", "war", "thou"]
    lines = [" ".join(rng.choice(words, size=12)) for _ in range(400)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=200,
        hard_vocab_limit=False,
        model_type="bpe",
        minloglevel=2,
    )
    return f"{prefix}.model"


def _corpus(prefix: Path, vocab: int, eod: int, dtype) -> str:
    """200 documents of random ids below `vocab`, each ending with `eod`."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=dtype)
    for _ in range(200):
        builder.add_item(np.append(rng.integers(0, vocab, size=int(rng.integers(5, 60))), eod))
        builder.end_document()
    builder.finalize(get_idx_path(str(prefix)))
    return str(prefix)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    """The user-supplied paths of the scripts, filled in for this machine."""
    tmp = tmp_path_factory.mktemp("scripts")
    model = _sentencepiece_model(tmp / "llama_tokenizer")
    llama = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model)
    )
    return {
        "gpt2_data": _corpus(tmp / "gpt2_text_document", GPT2_EOD, GPT2_EOD, np.uint16),
        "llama_data": _corpus(tmp / "llama_text_document", llama.vocab_size, llama.eod, np.uint16),
        "tokenizer_model": model,
        "tmp": tmp,
    }


def _ds_config(name: str, out: Path, *, cpu: bool, **sizes: int) -> str:
    """The script's DeepSpeed JSON; on CPU its fp16 section becomes bf16, and `sizes`
    (train_batch_size, train_micro_batch_size_per_gpu) follow the size overrides."""
    ds = json.loads((FIXTURES / f"{name}.ds_config.json").read_text())
    if cpu and ds.get("fp16", {}).get("enabled"):
        del ds["fp16"]
        ds["bf16"] = {"enabled": True}
    ds.update(sizes)
    out.write_text(json.dumps(ds))
    return str(out)


def script_argv(name: str, paths: dict, *, cpu: bool, label: str, **ds_sizes: int) -> list[str]:
    """The fixture's flags with this machine's paths (and the CPU substitutions)."""
    flags, _ = read_fixture(name)
    folder = paths["tmp"] / f"{name}_{label}"
    folder.mkdir()
    llama = name == DS_LLAMA2
    values = {
        "DATA_PATH": paths["llama_data"] if llama else paths["gpt2_data"],
        "VOCAB_FILE": VOCAB,
        "MERGE_FILE": MERGES,
        "TOKENIZER_MODEL": paths["tokenizer_model"],
        "CHECKPOINT_PATH": str(folder / "checkpoints"),
        "TENSORBOARD_DIR": str(folder / "tensorboard"),
    }
    if (FIXTURES / f"{name}.ds_config.json").exists():
        values["DS_CONFIG"] = _ds_config(name, folder / "ds.json", cpu=cpu, **ds_sizes)
    argv = [Template(flag).substitute(values) for flag in flags]
    if cpu:
        argv = ["--bf16" if flag == "--fp16" else flag for flag in argv]
        argv += ["--distributed-backend", "gloo"]
    return argv


def test_fixtures_are_the_scripts_flags_only():
    for name in SCRIPTS:
        flags, world = read_fixture(name)
        text = (FIXTURES / f"{name}.flags").read_text()
        assert re.search(r"^# Source: \S+/Megatron-\S+ \S+\.sh$", text, re.MULTILINE), name
        assert re.search(r"at commit [0-9a-f]{40}", text), name
        assert flags[0].startswith("--") and world >= 8
        assert "pretrain_gpt.py" not in flags  # flags only: no launcher, no entry point


def _full_size(name: str, paths: dict) -> tuple:
    argv = script_argv(name, paths, cpu=not torch.cuda.is_available(), label="full")
    _, world = read_fixture(name)
    return parse_args(argv, env=launcher_env(world)), argv


def test_megatron_lm_gpt_345m_parses_at_full_size(paths):
    cfg, _ = _full_size(MEGATRON_GPT, paths)
    m, t, p = cfg.model, cfg.training, cfg.parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (
        24,
        1024,
        16,
        1024,
    )
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (1, 1)
    assert (p.data_parallel_size, t.micro_batch_size, t.global_batch_size) == (8, 8, 64)
    assert t.num_microbatches == 1 and t.train_iters == 500_000
    assert cfg.tokenizer.tokenizer_type == "GPT2BPETokenizer"  # pretrain_gpt.py's default
    # --lr-decay-iters 320000 x 64 samples; --lr-warmup-fraction .01 of it
    assert cfg.schedule.decay_samples == 320_000 * 64
    assert cfg.schedule.warmup_samples == int(0.01 * 320_000 * 64)
    assert cfg.data.split == "949,50,1" and cfg.checkpoint.save == cfg.checkpoint.load


def test_megatron_deepspeed_llama2_parses_at_full_size(paths):
    cfg, _ = _full_size(DS_LLAMA2, paths)
    m, p = cfg.model, cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (2, 2)
    assert p.data_parallel_size == 2 and p.zero_stage == 0
    assert cfg.training.num_microbatches == 32 // (4 * 2)
    assert m.num_query_groups == 4 and m.position_embedding_type == "rope"
    assert (m.normalization, m.swiglu, m.add_bias_linear) == ("RMSNorm", True, False)
    assert m.untie_embeddings_and_output_weights and m.ffn_hidden_size == 5504
    assert cfg.precision.bf16 and cfg.deepspeed_json["bf16"] == {"enabled": True}
    assert cfg.data.blend == ([paths["llama_data"]], [1.0])  # "--data-path 1 PREFIX"
    assert cfg.schedule.warmup_samples == 2000 * 32


def test_megatron_deepspeed_gpt_125m_parses_at_full_size(paths):
    cfg, _ = _full_size(DS_GPT_125M, paths)
    m, t, p, s = cfg.model, cfg.training, cfg.parallel, cfg.schedule
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (2, 2)
    assert p.data_parallel_size == 2 and p.zero_stage == 1
    assert (m.num_layers, m.hidden_size, m.init_method_std) == (12, 768, 0.02)
    # --checkpoint-activations: Megatron-DeepSpeed's full recompute, one layer per chunk
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    # --train-samples sizes the run, --train-tokens stops it; the schedule is in tokens
    assert t.train_samples == 292_968_750 and t.train_iters == 292_968_750 // 256
    assert t.train_tokens == 300_000_000_000
    assert s.decay_samples == 300_000_000_000 / 2048 and s.warmup_samples == 3e9 / 2048
    assert cfg.logging.tensorboard_dir.endswith("tensorboard")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--fp16 needs a GPU")
def test_fp16_scripts_parse_on_a_gpu_machine(paths):
    cfg, _ = _full_size(DS_GPT_125M, paths)
    # the JSON's fp16 section gives the loss scaling the flags leave unset (--hysteresis agrees)
    assert cfg.precision.fp16 and cfg.precision.initial_loss_scale == 2.0**11
    assert cfg.precision.loss_scale_window == 500 and cfg.precision.loss_scale is None
    assert _full_size(MEGATRON_GPT, paths)[0].precision.fp16


def test_fp16_json_loss_scaling_fills_the_flags_not_given(paths, monkeypatch):
    """The 125M script's fp16 JSON (initial_scale_power 11, window 500) with --fp16 as written.
    Parsing only: the GPU check is the one step that needs CUDA, so it is told CUDA exists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = script_argv(DS_GPT_125M, paths, cpu=False, label="fp16")
    cfg = parse_args(argv, env=launcher_env(8))
    p = cfg.precision
    assert p.fp16 and (p.initial_loss_scale, p.loss_scale_window, p.hysteresis) == (2048, 500, 2)
    assert p.loss_scale is None and p.min_loss_scale == 1.0  # "loss_scale": 0 is dynamic
    with pytest.raises(
        UserError, match="fp16.loss_scale_window=500 but --loss-scale-window is 900"
    ):
        parse_args(argv + ["--loss-scale-window", "900"], env=launcher_env(8))


# Appended to every script on CPU: a tiny model, 2 iterations, a world of 2 ranks.
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--log-interval", "1",
    "--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2", "--num-workers", "0",
]  # fmt: skip
TINY_BY_SCRIPT = {
    # data parallel over the 2 ranks, as the script over its 8
    MEGATRON_GPT: ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2"],
    # TP2 PP2 -> PP2 (the pipeline, GQA with 2 groups)
    DS_LLAMA2: [
        "--tensor-model-parallel-size", "1", "--ffn-hidden-size", "64", "--num-key-value-heads",
        "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
        "--lr-warmup-iters", "1",
    ],
    # TP2 PP2 -> TP2, ZeRO-1; --train-samples allows 4 iterations, --train-tokens stops at 2
    DS_GPT_125M: [
        "--pipeline-model-parallel-size", "1", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-samples", "16", "--train-tokens", str(2 * 4 * 16),
    ],
}  # fmt: skip
TINY_DS_SIZES = {
    DS_LLAMA2: {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
    DS_GPT_125M: {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2},
}


@pytest.fixture(scope="module")
def tiny_runs(paths):
    """All three scripts, shrunk, trained in one launched world of 2 ranks."""
    argvs, metrics = [], {}
    for name in SCRIPTS:
        metrics[name] = paths["tmp"] / f"{name}.jsonl"
        argv = script_argv(name, paths, cpu=True, label="tiny", **TINY_DS_SIZES.get(name, {}))
        argvs.append(argv + TINY + TINY_BY_SCRIPT[name] + ["--metrics-file", str(metrics[name])])
    result = run(multirun_cmd(2, argvs, paths["tmp"] / "runs.json"), timeout=420)
    assert result.returncode == 0, result.stdout[-8000:]
    return {name: read_metrics(path) for name, path in metrics.items()}, result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", SCRIPTS)
def test_script_trains_two_iterations_on_cpu(tiny_runs, name, paths):
    metrics, _ = tiny_runs
    runs = metrics[name]
    assert [it for it in runs if "lm-loss" in runs[it]] == [1, 2]
    assert all(np.isfinite(runs[it]["lm-loss"]) for it in (1, 2))
    # the script's own --eval-interval/--save-interval were overridden to 2: evaluated and saved
    assert "validation-loss" in runs[2]
    folder = paths["tmp"] / f"{name}_tiny" / "checkpoints"
    assert (folder / "latest").read_text() == "global_step2"
