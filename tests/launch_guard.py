"""The fast set's promise: a test not marked `slow` starts no multi-process launch.

`make test-fast` (`pytest -m "not slow"`) runs the tests that start no launcher (`deepspeed`,
`torchrun`, `accelerate`, `srun`, `sbatch`, `python -m torch.distributed.run`), no process whose
environment says `RANK` >= 1 (a world started rank by rank) and spawn no gloo ranks
(`distributed.run_on_ranks`). tests/conftest.py holds every test that is not marked `slow` to
that in every run, `make test` included: such a launch fails the test with one line saying to
mark it `slow`, so the fast set cannot grow a launch unnoticed.
"""

from __future__ import annotations

import os
import shlex

import pytest

LAUNCHERS = frozenset({"deepspeed", "torchrun", "accelerate", "srun", "sbatch", "salloc", "mpirun"})
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})

_refusing: str | None = None
"""The node id of the running test when it is not marked `slow`; None otherwise."""


def refuse_launches(test_id: str | None) -> None:
    """From now on launches fail naming `test_id` (None: allow them again)."""
    global _refusing
    _refusing = test_id


def is_launch(args, env: dict | None = None) -> bool:
    """Whether a subprocess argv (a list, or one shell string) with environment `env` starts a
    multi-process launcher or one rank of a world of several."""
    argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    if not argv:
        return False
    if env is not None and str(env.get("RANK", "0")).strip() not in ("", "0"):
        return True  # rank 1 or later of a world started by hand (a lone rank 0 may be refused)
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


def check_popen(args, env: dict | None = None) -> None:
    """`check` for a subprocess about to start with `args` and `env`, when it is a launch."""
    if is_launch(args, env):
        check(" ".join(shlex.split(args) if isinstance(args, str) else map(str, args))[:200])
