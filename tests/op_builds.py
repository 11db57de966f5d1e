"""DeepSpeed's JIT-compiled C++ ops, built in the background while the suite runs.

Two tests need ops DeepSpeed compiles on first use: tests/test_offload_cpu_adam.py
(`cpu_adam`) and tests/test_offload_nvme.py (`async_io`, with libaio). Each build takes minutes
of CPU. At session start one `nice -n 19` process builds both into torch's extension cache, so
the build runs on the CPU the suite leaves idle (its single-process stretches) instead of in
front of those tests; a test that reaches an op first waits on torch's own build lock
(`FileBaton`) and then loads the finished op. The build starts only when the session collected
a test that needs an op; a build still running at session end is stopped by its pid, and the
build locks it held are removed (a stale lock would make the next build wait forever).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

BUILD = """
import sys
from deepspeed.accelerator import get_accelerator
for name in ("CPUAdamBuilder", "AsyncIOBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible(verbose=False):
        builder.load(verbose=False)
        print(f"built {name}", file=sys.stderr, flush=True)
"""

OPS = {"cpu_adam": "test_offload_cpu_adam.py", "async_io": "test_offload_nvme.py"}
"""Each op's extension name (its build folder) and the test file that needs it."""

_process: subprocess.Popen | None = None

NO_BUILD = "PRETRAIN_TEST_NO_OP_BUILD"
"""Set in a pytest run inside the suite (tests/test_apt_skips.py): it starts no build, and so
stops none and removes no build lock of the outer session's build at its end."""

ASYNC_IO_MISSING = (
    "DeepSpeed's async_io op cannot build here: libaio is not installed "
    "(apt-get install -y libaio-dev)"
)


@functools.cache
def async_io_buildable() -> bool:
    """Whether DeepSpeed's async_io op can build on this machine (its own check: a test program
    linked with -laio)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


@pytest.fixture(autouse=True)
def _skip_without_async_io(request):
    """Tests marked `needs_async_io` skip, naming the apt package, where the op cannot build."""
    if request.node.get_closest_marker("needs_async_io") and not async_io_buildable():
        pytest.skip(ASYNC_IO_MISSING)


def pytest_collection_finish(session) -> None:
    """Start the background build when a collected test needs one of the ops."""
    global _process
    files = {os.path.basename(str(item.fspath)) for item in session.items}
    if not files & set(OPS.values()) or os.environ.get(NO_BUILD):
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    _process = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", BUILD],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def pytest_sessionfinish(session, exitstatus) -> None:
    """Stop the build if it is still running (its process group, by pid), and remove the build
    locks it leaves behind."""
    if _process is None or _process.poll() is not None:
        return
    try:
        os.killpg(_process.pid, 15)
        _process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(_process.pid, 9)
        _process.wait(timeout=30)
    except ProcessLookupError:
        pass
    from torch.utils.cpp_extension import _get_build_directory

    root = os.path.dirname(_get_build_directory("cpu_adam", False))
    for name in os.listdir(root):  # the ops and what they build first (async_io: pin_memory)
        lock = os.path.join(root, name, "lock")
        if os.path.exists(lock):
            os.remove(lock)
