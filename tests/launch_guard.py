"""The fast set's promise: a test not marked `slow` starts no multi-process launch.

`make test-fast` (`pytest -m "not slow"`) runs the tests that start no launcher (`deepspeed`,
`torchrun`, `srun`, `sbatch`, `python -m torch.distributed.run`) and spawn no gloo ranks
(`distributed.run_on_ranks`). tests/conftest.py holds every test that is not marked `slow` to
that in every run, `make test` included: such a launch fails the test with one line saying to
mark it `slow`, so the fast set cannot grow a launch unnoticed.
"""

from __future__ import annotations

import os
import shlex

import pytest

LAUNCHERS = frozenset({"deepspeed", "torchrun", "srun", "sbatch", "salloc", "mpirun"})
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})

_refusing: str | None = None
"""The node id of the running test when it is not marked `slow`; None otherwise."""


def refuse_launches(test_id: str | None) -> None:
    """From now on launches fail naming `test_id` (None: allow them again)."""
    global _refusing
    _refusing = test_id


def is_launch(args) -> bool:
    """Whether a subprocess argv (a list, or one shell string) starts a multi-process launcher."""
    argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    if not argv:
        return False
    if os.path.basename(argv[0]) in LAUNCHERS:
        return True
    return any(a == "-m" and b in LAUNCHER_MODULES for a, b in zip(argv, argv[1:], strict=False))


def check(what: str) -> None:
    """Fail the running test when it is not marked `slow` (`what`: the launch, for the line)."""
    if _refusing is not None:
        pytest.fail(
            f"{_refusing} is not marked slow but starts a multi-process launch ({what}): "
            "mark it @pytest.mark.slow (tests/launch_guard.py)",
            pytrace=False,
        )


def check_popen(args) -> None:
    """`check` for a subprocess about to start with `args`, when it is a launcher."""
    if is_launch(args):
        check(" ".join(shlex.split(args) if isinstance(args, str) else map(str, args))[:200])
