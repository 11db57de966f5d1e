"""`make gpu-check`'s CPU-safe parts run here (CI), so the GPU run starts from working code.

- `bench/gpu_check.py --dry-run` (what `make gpu-check DRY_RUN=1` runs): the JSON report holds
  one entry per planned check, in order of value, with the exact command and env the GPU run
  uses (DS_ACCELERATOR=cuda; the bf16 FlexAttention run with --reset-attention-mask at s % 128 = 0,
  head dim 64); every training command passes pretrain_gpt.py's checks; the plain PyTorch step
  trains a tiny model on the CPU; under 60 s.
- The Makefile picks DS_ACCELERATOR=cuda when a GPU is listed and keeps a CUDA torch in .venv.
- Without a GPU and without --dry-run the check fails loudly (exit 1, one message naming the
  step), instead of skipping.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from training_fixtures import PYTHON, REPO, run
from training_fixtures import test_env as clean_env


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_dry_run_writes_each_planned_command_and_env(tmp_path):
    report = tmp_path / "report.json"
    cmd = [PYTHON, str(REPO / "bench" / "gpu_check.py"), "--dry-run", "--work-dir", str(tmp_path)]
    result = run([*cmd, "--json", str(report)], timeout=60, env=clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    line = _gpu_check().parse_result_line(result.stdout)
    assert json.loads(report.read_text()) == line  # the file holds what the run reported
    assert line["dry_run"] is True and line["budget_s"] == 480
    # the order of value: GPU tests, FlexAttention training, 124M and its export, MoE, then 1.3B,
    # then the torch backend's 124M
    checks = line["checks"]
    assert list(checks) == [
        "tests",
        "flex_training",
        "gpt2_124m",
        "hf_export",
        "moe_training",
        "gpt_1_3b",
        "torch_backend",
    ]
    torch_backend = checks["torch_backend"]["cmd"]
    assert "--use-torch-fsdp2" in torch_backend and "--bf16" in torch_backend
    for name, check in checks.items():
        assert check["status"] == "planned", name
        assert check["env"]["DS_ACCELERATOR"] == "cuda" and check["env"]["PRETRAIN_REQUIRE_GPU"]
    assert checks["tests"]["cmd"][1:5] == ["-m", "pytest", "-q", "-m"]
    flex = checks["flex_training"]["cmd"]
    assert flex[1] == "pretrain_gpt.py" and "--reset-attention-mask" in flex and "--bf16" in flex
    seq = int(flex[flex.index("--seq-length") + 1])
    head_dim = int(flex[flex.index("--hidden-size") + 1]) // int(
        flex[flex.index("--num-attention-heads") + 1]
    )
    assert seq % 128 == 0 and head_dim == 64 and flex[flex.index("--attention-dropout") + 1] == "0"
    moe = checks["moe_training"]["cmd"]
    assert moe[moe.index("--num-experts") + 1] == "8" and "--moe-grouped-gemm" in moe
    assert checks["hf_export"]["cmd"][1] == "tools/convert_to_hf.py"
    assert "--verify" in checks["hf_export"]["cmd"]
    assert line["dry_run_plain"]["tokens_per_s"] > 0
    assert (tmp_path / "corpus.bin").exists() and (tmp_path / "corpus.idx").exists()


def _make(*args: str, env: dict | None = None) -> str:
    result = subprocess.run(
        ["make", *args], cwd=REPO, capture_output=True, text=True, env=env, check=True
    )
    return result.stdout


def test_make_target_runs_the_script():
    dry = _make("-n", "gpu-check", "DRY_RUN=1")
    assert "DS_ACCELERATOR=cpu" in dry and "bench/gpu_check.py --dry-run" in dry
    assert "--json bench/results/gpu_check.json" in dry
    full = _make("-n", "gpu-check")
    assert "DS_ACCELERATOR=cuda" in full and "--dry-run" not in full


def test_make_picks_cuda_and_keeps_a_cuda_torch_on_a_gpu_machine(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    assert "GPU= DS_ACCELERATOR=cpu TORCH_SPEC=torch==2.13.0" in _make(
        "-s", "help", "GPU=", env=env
    )
    assert "DS_ACCELERATOR=cuda" in _make("-s", "help", "GPU=1", env=env)
    # a .venv python whose torch reports CUDA 12.8 (no CUDA torch here): no pin is installed
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 12.8\n")
    python.chmod(0o755)
    shown = _make("-s", "help", "GPU=1", f"PY={python}", env=env)
    assert "DS_ACCELERATOR=cuda TORCH_SPEC=)" in shown


def test_result_lines_are_checked():
    module = _gpu_check()
    with pytest.raises(ValueError, match="not a gpu-check result line"):
        module.parse_result_line('log line\n{"loss": 1.0}\n')
    good = '{"device": "x", "checks": {}, "budget_s": 480}'
    assert module.parse_result_line("noise\n" + good + "\n\n")["budget_s"] == 480


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: it would run")
def test_without_a_gpu_the_check_fails_loudly(tmp_path):
    report = tmp_path / "report.json"
    cmd = [PYTHON, str(REPO / "bench" / "gpu_check.py"), "--json", str(report)]
    result = run(cmd, timeout=60, env=clean_env())
    assert result.returncode == 1
    assert "gpu-check FAILED: torch.cuda.is_available() is False" in result.stdout
    assert "torch.cuda.is_available() is False" in json.loads(report.read_text())["error"]
