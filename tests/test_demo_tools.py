"""The demo's pieces: tools/train_demo_tokenizer.py writes a tokenizer that our HuggingFaceTokenizer
and transformers' AutoTokenizer load with the same ids; tools/demo_summary.py reports the validation
perplexity from the log, and samples the same text twice with a fixed seed."""

import json
import math
import os
import subprocess
import sys

import pytest
from test_plot_run import write_log

from pretrain.tokenizer import HuggingFaceTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
LINES = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
]


def tool(name, *args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", name), *args],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    corpus = d / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES * 20))
    out = d / "tok"
    r = tool("train_demo_tokenizer.py", "--input", str(corpus), "--output-dir", str(out),
             "--vocab-size", "300")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


def test_demo_tokenizer_loads_in_ours_and_transformers(demo_tokenizer):
    from transformers import AutoTokenizer

    ours = HuggingFaceTokenizer(str(demo_tokenizer))
    theirs = AutoTokenizer.from_pretrained(str(demo_tokenizer), local_files_only=True)
    assert ours.vocab_size == 300 == len(theirs)
    assert ours.eod == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|endoftext|>")
    for text in LINES:
        assert ours.tokenize(text) == theirs(text)["input_ids"]
        assert ours.detokenize(ours.tokenize(text)) == text
    assert "keeping it" in tool("train_demo_tokenizer.py", "--input", "x", "--output-dir",
                                str(demo_tokenizer)).stdout  # fmt: skip


@pytest.mark.slow  # an end-to-end run over 5 s: not in `make test-fast`
def test_summary_prints_perplexity_and_a_seeded_sample(tmp_path, demo_tokenizer):
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    log = write_log(tmp_path / "train.log", range(10, 101, 10))
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2)
                    ).save_pretrained(hf)  # fmt: skip
    AutoTokenizer.from_pretrained(str(demo_tokenizer)).save_pretrained(hf)
    args = ["--log", str(log), "--seq-length", "64", "--checkpoint", str(tmp_path), "--hf-export",
            str(hf), "--dataset", str(tmp_path / "d"), "--tensorboard-dir", str(tmp_path),
            "--sample-tokens", "20"]  # fmt: skip
    first, second = tool("demo_summary.py", *args), tool("demo_summary.py", *args)
    assert first.returncode == 0, first.stderr
    loss = float(f"{7.4 / math.sqrt(100):.6E}")  # the final validation block
    assert (
        f"validation:      lm loss {loss:.4f}, perplexity {math.exp(loss):,.1f} at iteration 100"
        in first.stdout
    )
    assert "temperature 0.8, top-k 40, seed 1234" in first.stdout
    sample = first.stdout.split("-" * 78)[1]
    assert sample.strip().startswith("ROMEO:") and len(sample.strip()) > len("ROMEO:")
    assert first.stdout == second.stdout  # fixed seed: the same sample
