"""Fixtures shared across test modules."""

pytest_plugins = ["convert_fixtures", "tokenizer_fixtures"]
