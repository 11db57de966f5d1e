"""The fast set starts no multi-process launch: a test not marked `slow` that starts a launcher
or gloo ranks fails before anything starts (tests/launch_guard.py, tests/conftest.py)."""

import subprocess

import launch_guard
import pytest
from distributed import run_on_ranks
from training_fixtures import BIN, PYTHON, deepspeed_cmd, run, torchrun_cmd


def _rank(rank, world_size):
    return rank


@pytest.mark.parametrize(
    "argv",
    [
        deepspeed_cmd(2, ["--help"]),
        torchrun_cmd(2, ["--help"]),
        ["srun", "-N2", "true"],
        [str(BIN / "accelerate"), "launch", "pretrain_gpt.py"],
        [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "x.py"],
        "deepspeed --num_gpus 2 pretrain_gpt.py",
    ],
    ids=[
        "deepspeed",
        "torchrun",
        "srun",
        "accelerate",
        "python-m-torch.distributed.run",
        "shell-string",
    ],
)
def test_a_launcher_in_a_test_not_marked_slow_fails_before_it_starts(argv):
    with pytest.raises(pytest.fail.Exception, match="is not marked slow but starts a multi-proc"):
        subprocess.Popen(argv)
    if isinstance(argv, list):
        with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow"):
            run(argv, timeout=5)


def test_a_rank_started_by_hand_in_a_test_not_marked_slow_fails_before_it_starts():
    with pytest.raises(pytest.fail.Exception, match="is not marked slow"):
        subprocess.Popen([PYTHON, "-c", "pass"], env={"WORLD_SIZE": "2", "RANK": "1"})
    # a lone rank 0 of a larger world (refused before it rendezvous) is one process
    assert not launch_guard.is_launch([PYTHON, "-c", "pass"], {"WORLD_SIZE": "4", "RANK": "0"})


def test_gloo_ranks_in_a_test_not_marked_slow_fail_before_they_spawn():
    with pytest.raises(pytest.fail.Exception, match=r"run_on_ranks\(_rank, world_size=2\)"):
        run_on_ranks(_rank, world_size=2)


def test_a_single_process_subprocess_is_not_a_launch():
    assert not launch_guard.is_launch([PYTHON, "-c", "pass"])
    assert not launch_guard.is_launch(["bash", "-c", "echo deepspeed"])
    assert subprocess.run([PYTHON, "-c", "print(1)"], capture_output=True).stdout == b"1\n"


@pytest.mark.slow
def test_a_test_marked_slow_may_launch():
    out = subprocess.run([str(BIN / "torchrun"), "--help"], capture_output=True, text=True)
    assert "nproc" in out.stdout + out.stderr
