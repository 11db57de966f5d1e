#!/usr/bin/env python
"""Tokenize a corpus into Megatron's .bin/.idx files. See `--help` and pretrain/data/files/preprocess.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pretrain.data.files.preprocess import main  # noqa: E402
from pretrain.errors import exit_on_user_error  # noqa: E402

if __name__ == "__main__":
    exit_on_user_error(main)()
