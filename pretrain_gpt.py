"""Pretrain a GPT with Megatron-LM flags: `deepspeed pretrain_gpt.py --tensor-model-parallel-size 2 ...`.

Also runs under torchrun, Slurm's srun, or plain `python pretrain_gpt.py ...` (one process).
`python pretrain_gpt.py --help` lists every flag; docs/TRAINING.md explains them.
"""

import sys
import time

from pretrain.cli import parse_args
from pretrain.errors import EXIT_USER_ERROR, UserError, exit_on_user_error
from pretrain.launch import SILENT_EXIT_DELAY_SECONDS, reports_start_up_errors
from pretrain.training.run import pretrain


@exit_on_user_error
def main() -> None:
    """Parse the flags, then train. A bad command line is said once per node, not once per rank."""
    try:
        cfg = parse_args(sys.argv[1:])
    except UserError:
        if not reports_start_up_errors():
            time.sleep(
                SILENT_EXIT_DELAY_SECONDS
            )  # the launcher ends us once the first rank said it
            sys.exit(EXIT_USER_ERROR)
        raise
    pretrain(cfg)


if __name__ == "__main__":
    main()
