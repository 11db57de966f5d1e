"""Fixtures shared across test modules."""

pytest_plugins = ["cluster_fixtures", "convert_fixtures", "op_builds", "tokenizer_fixtures"]
