"""Run `pretrain_gpt.py`'s `pretrain(parse_args(argv))` several times in one launched world.

    deepspeed --num_gpus 4 tests/training_multirun.py RUNS.json

RUNS.json is a list of argv lists. Each run parses its own flags, builds its own groups and engine
and tears them down; the launcher's process group is shared, so a test pays the launcher and
import cost once per world size instead of once per layout.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from pretrain.cli import parse_args  # noqa: E402
from pretrain.errors import exit_on_user_error  # noqa: E402
from pretrain.training.run import pretrain  # noqa: E402


@exit_on_user_error
def main() -> None:
    """Run every argv list of RUNS.json in this launched world, one after another."""
    runs_file = next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    dist.init_process_group("gloo")  # env:// from the launcher; every run below reuses it
    for argv in json.loads(Path(runs_file).read_text()):
        pretrain(parse_args(argv + [a for a in sys.argv[1:] if a.startswith("--local_rank")]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
