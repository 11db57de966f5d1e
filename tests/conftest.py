"""Fixtures shared across test modules."""

import subprocess

import launch_guard
import pytest

pytest_plugins = ["cluster_fixtures", "convert_fixtures", "op_builds", "tokenizer_fixtures"]


@pytest.fixture(autouse=True)
def _cache_writers_finish():
    """A test that built a blend in process ends when its writer of Megatron's per-prefix
    caches has (`pretrain/data/caches/cache_writer.py`), so no writer outlives its test's folders."""
    yield
    from pretrain.data.caches import cache_writer

    cache_writer.wait_all()


class _GuardedPopen(subprocess.Popen):
    """subprocess.Popen that refuses a launcher while a test not marked `slow` runs."""

    def __init__(self, args, *rest, **kwargs):
        launch_guard.check_popen(args, kwargs.get("env"))
        super().__init__(args, *rest, **kwargs)


def pytest_configure(config) -> None:
    """Every subprocess of the session starts through `_GuardedPopen` (tests/launch_guard.py)."""
    subprocess.Popen = _GuardedPopen


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test not marked `slow` that starts a launcher or gloo ranks fails, in its fixtures'
    set-up (any scope) as in its body (tests/launch_guard.py)."""
    launch_guard.refuse_launches(None if item.get_closest_marker("slow") else item.nodeid)
    yield
    launch_guard.refuse_launches(None)
