"""`accelerate launch pretrain_gpt.py ...` (Hugging Face Accelerate's launcher) with an Accelerate
config file as `accelerate config` writes it: two ranks on CPU (Accelerate starts them through
torchrun: `distributed_type: MULTI_GPU`; its MULTI_CPU type needs MPI) train the recipes' tiny
model at TP2 with the losses of one process (1e-6 relative). An Accelerate setting that names the
same thing as a flag and disagrees with it (`--mixed_precision bf16` against an fp32 command line)
stops the run in one line naming both, before any process group."""

from __future__ import annotations

import re

import pytest
from cluster_fixtures import assert_equals_one_process, one_process_argv, recipe_env
from training_fixtures import BIN, REPO, read_metrics, run

from pretrain.launch import free_port

pytestmark = pytest.mark.slow  # launches (tests/launch_guard.py)

CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_port: {port}
mixed_precision: 'no'
use_cpu: false
gpu_ids: all
rdzv_backend: static
same_network: true
main_training_function: main
"""


def _accelerate(tmp_path, corpus: str, *options: str) -> tuple[list[str], str]:
    """(the `accelerate launch` command for the recipes' flags at TP2, its metrics file)."""
    config = tmp_path / "accelerate.yaml"
    config.write_text(CONFIG.format(port=free_port()))
    metrics = tmp_path / "m.jsonl"
    argv = one_process_argv(recipe_env(corpus, tmp_path / "ckpt", metrics))
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config), *options]
    cmd += [str(REPO / "pretrain_gpt.py"), *argv, "--tensor-model-parallel-size", "2"]
    return cmd, metrics


@pytest.mark.timeout(300)
def test_accelerate_launch_equals_one_process(recipe_corpus, one_process, tmp_path):
    cmd, metrics = _accelerate(tmp_path, recipe_corpus)
    result = run(cmd, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "2 rank(s) via accelerate (torchrun), backend gloo" in result.stdout
    assert "TP=2  PP=1  DP=1" in result.stdout
    assert_equals_one_process(
        {i: m["lm-loss"] for i, m in read_metrics(metrics).items()}, one_process
    )


@pytest.mark.timeout(300)
def test_an_accelerate_setting_that_disagrees_with_a_flag_is_one_line(recipe_corpus, tmp_path):
    cmd, _ = _accelerate(tmp_path, recipe_corpus, "--mixed_precision", "bf16")
    result = run(cmd, timeout=240)
    errors = re.findall(r"^error: .*$", result.stdout, re.MULTILINE)
    assert result.returncode != 0 and errors == [
        "error: accelerate launch --mixed_precision bf16 (ACCELERATE_MIXED_PRECISION) but "
        "pretrain_gpt.py --bf16/--fp16 (neither: no) gives no (the flags decide what "
        "pretrain_gpt.py trains: make the Accelerate config or launch options agree with them, "
        "or drop those options)"
    ], result.stdout[-6000:]
    assert "exitcode  : 2" in result.stdout  # torchrun's report of the ranks' status
