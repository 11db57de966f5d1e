"""Run `pretrain_gpt.py`'s `pretrain(parse_args(argv))` several times in one launched world.

    deepspeed --num_gpus 4 tests/training_multirun.py RUNS.json

RUNS.json is a list of runs: an argv list (the run must finish), or `{"argv": [...], "refused":
true}` (the run must stop with a UserError: its one line is printed as pretrain_gpt.py's exit
wrapper prints it, `error: ...` on stderr, and the next run starts; a refused run that finishes
instead ends the launch with an error). Rank 0 prints `multirun: run N` before run N
(`training_fixtures.multirun_outputs` splits a one-rank launch's output there). Each run parses its own flags, builds its own groups and
engine and tears them down; the launcher's process group is shared, so a test pays the launcher
and import cost once per world size instead of once per layout. A refusal is raised on every rank
alike (the ranks agree first), so the shared group is still in step for the next run.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from pretrain.cli import parse_args  # noqa: E402
from pretrain.errors import UserError, exit_on_user_error, print_user_error  # noqa: E402
from pretrain.parallel import state  # noqa: E402
from pretrain.training.run import pretrain  # noqa: E402

RUN_HEADER = "multirun: run "


def run_refused(argv: list[str], number: int) -> None:
    """Run `argv`, which must stop with a UserError; print its line as pretrain_gpt.py would."""
    try:
        pretrain(parse_args(argv))
    except UserError as err:
        print_user_error(err)
        state.destroy_model_parallel()  # the refused run did not get to tear its groups down
        return
    raise UserError(f"run {number} of the multirun was expected to be refused, and finished")


@exit_on_user_error
def main() -> None:
    """Run every entry of RUNS.json in this launched world, one after another."""
    runs_file = next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    local_rank = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    dist.init_process_group("gloo")  # env:// from the launcher; every run below reuses it
    for number, entry in enumerate(json.loads(Path(runs_file).read_text())):
        if dist.get_rank() == 0:
            print(f"{RUN_HEADER}{number}", flush=True)
        if isinstance(entry, dict) and entry.get("refused"):
            run_refused(entry["argv"] + local_rank, number)
        else:
            pretrain(parse_args(entry + local_rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
