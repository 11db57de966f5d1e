"""Every tool's `main` goes through `pretrain.errors.exit_on_user_error`: a reader that stops early
(`tool | head -1`) ends the tool quietly with status 0, and a UserError is one line, status 2."""

from __future__ import annotations

import os
import subprocess
import sys

from training_fixtures import REPO

_TOOL = """
import sys
from pretrain.errors import UserError, exit_on_user_error

@exit_on_user_error
def main():
    if sys.argv[1] == "fail":
        raise UserError("--flag X: what to do instead")
    for i in range(200_000):  # far more than a pipe holds
        print(f"line {i}")

main()
"""


def _start(mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _TOOL, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": REPO},
    )


def test_a_reader_that_stops_early_ends_the_tool_quietly():
    proc = _start("print")
    assert proc.stdout.readline() == b"line 0\n"
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == "", err


def test_a_user_error_is_one_line_and_status_2():
    proc = _start("fail")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.decode() == "error: --flag X: what to do instead\n"
