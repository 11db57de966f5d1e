"""A rank exits when training is done although its DataLoader workers ignore SIGTERM: a loader
whose iterator is still referenced at exit (as a DeepSpeed engine keeps its data iterator) made
multiprocessing's exit hook SIGTERM the workers and join them forever, so `make train` printed
"done:" and never returned."""

import subprocess
import sys

import psutil
import pytest
from training_fixtures import REPO
from training_fixtures import test_env as clean_env

_HELD_AT_EXIT = """
import torch
from pretrain.data.config import DataConfig
from pretrain.data.datasets.samplers import build_pretraining_data_loader
loader = build_pretraining_data_loader(
    torch.arange(64), 0, 2, 0, 1, DataConfig(seq_length=4, mock=True, num_workers=2)
)
batches = iter(loader)
next(batches)
class Engine:
    pass
engine = Engine()
engine.cycle, engine.data_iterator = engine, batches  # alive until the interpreter ends
print(*(child.pid for child in __import__("multiprocessing").active_children()), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_process_holding_a_loader_at_exit_ends_with_its_workers():
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD_AT_EXIT],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workers: list[int] = []
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(workers) == 2
        assert proc.wait(timeout=120) == 0
        assert not [pid for pid in workers if psutil.pid_exists(pid)]
    finally:
        for pid in [proc.pid, *workers]:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
