"""Checkpoints of the torch backend (--use-torch-fsdp2): they move between backends and layouts,
an --async-save run resumes bit for bit, and the tools read them.

One launch of two ranks (tests/training_multirun.py), GPT-2, fp32, dropout 0, one schedule
(--lr-decay-iters) whatever --train-iters a run has:
- `ref`: DeepSpeed TP2, iterations 1..6, uninterrupted;
- DeepSpeed TP2 stops at 2 (saved) -> the torch backend at DP2 resumes it, stops at 4 (saved)
  -> DeepSpeed TP1 DP2 ZeRO-1 resumes that to 6: each resumed run's own metrics file starts at
  the iteration after the step it loaded, with the uninterrupted losses, grad norms and LRs
  within 1e-5 (through the layout-independent full state, Adam moments included);
- `async`: the torch backend at TP2 with --async-save every 2 iterations, 1..6, training on while
  each save is written; `async_resumed` loads its step 2 (written while iterations 3 and 4 ran)
  and trains 3..5: the same losses and grad norms, bit for bit; its --exit-interval exit at 5
  waits for step 4's background write, then saves 5.
The converter, tools/reshard_checkpoint.py and tools/explain_batch.py then read the torch
backend's step 4. A copy of `async`'s step 2 whose DCP index lacks one weight (and whose
metadata records the index's new size) is refused in one line with --dist-ckpt-strictness
ignore_all (the mode that lets Megatron-LM load it partially: the flag changes no load here), by
a second two-rank launch.
"""

import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from convert_fixtures import load_tool
from training_fixtures import (
    REPO,
    deepspeed_cmd,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
    training_batch,
)

from pretrain.checkpoint import fingerprints
from pretrain.checkpoint.format import FINGERPRINTS_KEY, read_meta
from pretrain.convert.checkpoint_reader import read_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ITERS = 6
TORCH = ["--use-torch-fsdp2"]
TP2 = ["--tensor-model-parallel-size", "2"]


def _flags(corpus, name, tmp, *extra):
    return (
        model_flags("gpt2", vocab_divisible_by=None)
        + train_flags(corpus, iters=ITERS)
        + ["--lr-decay-iters", str(ITERS), "--metrics-file", str(tmp / f"{name}.jsonl"), *extra]
    )


def _stop(save, at):
    return ["--save", str(save), "--save-interval", "100", "--exit-interval", str(at)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_checkpoints")
    corpus = make_corpus(tmp / "corpus")
    ds_tp2, torch_dp2, ds_back = tmp / "ds_tp2", tmp / "torch_dp2", tmp / "ds_back"
    runs = [
        _flags(corpus, "ref", tmp, *TP2),
        _flags(corpus, "ds_first", tmp, *TP2, *_stop(ds_tp2, 2)),
        _flags(corpus, "torch_resumed", tmp, *TORCH, "--load", str(ds_tp2), *_stop(torch_dp2, 4)),
        _flags(corpus, "ds_resumed", tmp, "--zero-stage", "1", "--load", str(torch_dp2))
        + ["--save", str(ds_back), "--save-interval", "100"],
        _flags(corpus, "async", tmp, *TORCH, *TP2, "--async-save")
        + ["--save", str(tmp / "async"), "--save-interval", "2"],
        _flags(corpus, "async_resumed", tmp, *TORCH, *TP2, "--async-save")
        + ["--load", str(tmp / "async" / "global_step2"), "--save", str(tmp / "async_resumed")]
        + ["--save-interval", "2", "--exit-interval", "5"],
    ]
    result = run(multirun_cmd(2, runs, tmp / "runs.json"), timeout=800)
    assert result.returncode == 0, result.stdout[-8000:]
    return {"tmp": tmp, "corpus": corpus, "output": result.stdout}


def _metrics(saved, name):
    return read_metrics(saved["tmp"] / f"{name}.jsonl")


def test_a_deepspeed_checkpoint_resumes_on_the_torch_backend_and_back(saved):
    ref = _metrics(saved, "ref")
    assert sorted(_metrics(saved, "ds_first")) == [1, 2]
    for name, iterations in (("torch_resumed", [3, 4]), ("ds_resumed", [5, 6])):
        resumed = _metrics(saved, name)
        assert sorted(resumed) == iterations, name  # it resumed: a fresh start would log 1..
        for it in iterations:
            for key in ("lm-loss", "grad-norm", "learning-rate"):
                assert resumed[it][key] == pytest.approx(ref[it][key], rel=1e-5), (name, it, key)
    out = saved["output"]
    assert "saved at TP2 PP1 DP1 ZeRO-0: resharded weights, fp32 master weights, Adam state" in out
    assert "saved at TP1 PP1 DP2 FSDP2: resharded weights, fp32 master weights, Adam state" in out


def test_the_checkpoints_record_their_backend_and_files(saved):
    tmp = saved["tmp"]
    torch_step = tmp / "torch_dp2" / "global_step4"
    meta = read_meta(str(torch_step))
    assert meta["parallel"]["backend"] == "torch"
    assert meta["deepspeed_config"]["backend"] == "torch"
    assert read_meta(str(tmp / "ds_tp2" / "global_step2"))["parallel"]["backend"] == "deepspeed"
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"):
        assert name in meta["files"], name
    assert not any(n.startswith("mp_rank") for n in meta["files"])  # no DeepSpeed files


def test_an_async_save_resumes_bit_for_bit(saved):
    uninterrupted, resumed = _metrics(saved, "async"), _metrics(saved, "async_resumed")
    assert sorted(uninterrupted) == list(range(1, ITERS + 1))
    assert sorted(resumed) == [3, 4, 5]
    for it in resumed:
        for key in ("lm-loss", "grad-norm", "learning-rate"):
            assert resumed[it][key] == uninterrupted[it][key], (it, key)
    for step in (2, 4, 6):  # every background save was committed
        assert (saved["tmp"] / "async" / f"global_step{step}" / ".metadata").is_file()
    assert (saved["tmp"] / "async" / "latest").read_text() == f"global_step{ITERS}"
    exited = saved["tmp"] / "async_resumed"  # the exit waited for step 4, then saved 5
    assert (exited / "latest").read_text() == "global_step5"
    assert (exited / "global_step4" / ".metadata").is_file()
    # training went on while step 2 was written: committed at the end of iteration 3 at the
    # earliest (the first poll after it was staged)
    out = saved["output"]
    staged = out.index("staged checkpoint at iteration        2; writing it in the background")
    iteration_3 = out.index(" iteration        3/       6 |", staged)
    assert out.index("saved checkpoint at iteration        2", staged) > iteration_3


def test_a_torch_dist_checkpoint_missing_a_weight_is_refused_whatever_the_strictness(
    saved, tmp_path
):
    step = tmp_path / "ckpt" / "global_step2"
    shutil.copytree(saved["tmp"] / "async" / "global_step2", step)
    index = pickle.loads((step / ".metadata").read_bytes())  # the test's own copy, trusted
    missing = next(key for key in index.state_dict_metadata if key.endswith("qkv.weight"))
    del index.state_dict_metadata[missing]
    (step / ".metadata").write_bytes(pickle.dumps(index))
    meta = json.loads((step / "pretrain_meta.json").read_text())  # its size, as if written so
    meta["files"][".metadata"] = (step / ".metadata").stat().st_size
    meta[FINGERPRINTS_KEY] = fingerprints.record(str(step), meta["files"])  # and its fingerprint
    (step / "pretrain_meta.json").write_text(json.dumps(meta))
    flags = _flags(saved["corpus"], "strictness", tmp_path, *TORCH, *TP2, "--load", str(step))
    result = run(deepspeed_cmd(2, flags + ["--dist-ckpt-strictness", "ignore_all"]), timeout=300)
    lines = [line for line in result.stdout.splitlines() if "error: " in line]
    assert result.returncode != 0 and len(set(lines)) == 1, result.stdout[-4000:]  # each rank
    assert f"{step}: cannot be loaded" in lines[0] and missing in lines[0], lines[0]
    assert "Traceback" not in result.stdout, result.stdout[-4000:]


def test_the_hf_export_of_a_torch_checkpoint_computes_the_training_loss(saved, tmp_path):
    out = tmp_path / "hf"
    load_tool("convert_to_hf").main(
        ["--load", str(saved["tmp"] / "torch_dp2"), "--output-dir", str(out)]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, local_files_only=True
    ).eval()
    argv = _flags(saved["corpus"], "unused", tmp_path)
    batch = training_batch(argv, 5)
    means = []
    with torch.no_grad():
        for start in range(0, len(batch["tokens"]), 2):
            rows = slice(start, start + 2)
            logits = hf(batch["tokens"][rows]).logits.float()
            per_token = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"][rows].flatten(), reduction="none"
            )
            mask = batch["loss_mask"][rows].flatten().float()
            means.append((per_token * mask).sum() / mask.sum())
    logged = _metrics(saved, "ds_resumed")[5]["lm-loss"]  # the step-4 weights' loss at 5
    assert float(torch.stack(means).mean()) == pytest.approx(logged, rel=1e-6)


def test_reshard_and_explain_batch_read_a_torch_checkpoint(saved, tmp_path):
    source = saved["tmp"] / "torch_dp2"
    cmd = [sys.executable, str(REPO / "tools" / "reshard_checkpoint.py"), "--load", str(source)]
    cmd += ["--save", str(tmp_path / "tp2"), "--target-tensor-parallel-size", "2"]
    result = run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    a, b = (
        read_checkpoint(str(source)).state_dict,
        read_checkpoint(str(tmp_path / "tp2")).state_dict,
    )
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    flags = ["--data-path", saved["corpus"], "--split", "90,10,0", "--seq-length", "16"]
    flags += ["--seed", "7", "--train-iters", str(ITERS), "--global-batch-size", "8"]
    flags += ["--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    cmd = [sys.executable, str(REPO / "tools" / "explain_batch.py"), *flags]
    cmd += ["--iteration", "5", "--data-parallel-size", "2", "--load", str(source), "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    samples = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(samples) == 8
