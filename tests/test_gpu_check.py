"""`make gpu-check`'s CPU-safe parts run here (CI), so the GPU run starts from working code.

- `bench/gpu_check.py --dry-run` (what `make gpu-check DRY_RUN=1` runs): the training flags of
  both benchmarked models pass pretrain_gpt.py's checks, the plain PyTorch step trains a tiny
  model on the CPU, and the last line is the JSON object the GPU run prints, read back by the
  same parser a reader uses; under 60 s.
- Without a GPU and without --dry-run the check fails loudly (exit 1, one message naming the
  step), instead of skipping.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from training_fixtures import PYTHON, REPO, run, test_env


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_dry_run_runs_the_cpu_safe_parts(tmp_path):
    result = run(
        [PYTHON, str(REPO / "bench" / "gpu_check.py"), "--dry-run", "--work-dir", str(tmp_path)],
        timeout=60,
        env=test_env(),
    )
    assert result.returncode == 0, result.stdout[-4000:]
    line = _gpu_check().parse_result_line(result.stdout)
    assert line["dry_run"] is True and line["ratio"] is None
    plain = line["models"]["tiny"]["plain"]
    assert plain["tokens_per_s"] > 0 and plain["tflops"] >= 0
    assert (tmp_path / "corpus.bin").exists() and (tmp_path / "corpus.idx").exists()


def test_make_target_runs_the_script():
    dry = subprocess.run(
        ["make", "-n", "gpu-check", "DRY_RUN=1"], cwd=REPO, capture_output=True, text=True
    )
    assert "DS_ACCELERATOR=cpu" in dry.stdout and "bench/gpu_check.py --dry-run" in dry.stdout
    full = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True)
    assert "DS_ACCELERATOR=cuda" in full.stdout and "--dry-run" not in full.stdout


def test_result_lines_are_checked():
    module = _gpu_check()
    with pytest.raises(ValueError, match="not a gpu-check result line"):
        module.parse_result_line('log line\n{"loss": 1.0}\n')
    good = '{"device": "x", "models": {}, "ratio": 1.2}'
    assert module.parse_result_line("noise\n" + good + "\n\n")["ratio"] == 1.2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: it would run")
def test_without_a_gpu_the_check_fails_loudly():
    result = run([PYTHON, str(REPO / "bench" / "gpu_check.py")], timeout=60, env=test_env())
    assert result.returncode == 1
    assert "gpu-check FAILED: torch.cuda.is_available() is False" in result.stdout
