"""Fixtures shared across test modules."""

import pytest

pytest_plugins = ["cluster_fixtures", "convert_fixtures", "op_builds", "tokenizer_fixtures"]


@pytest.fixture(autouse=True)
def _cache_writers_finish():
    """A test that built a blend in process ends when its writer of Megatron's per-prefix
    caches has (`pretrain/data/caches/cache_writer.py`), so no writer outlives its test's folders."""
    yield
    from pretrain.data.caches import cache_writer

    cache_writer.wait_all()
