"""Errors a user can cause, and how entry points report them.

Anything a user can fix (a bad flag, a missing file, a malformed line) raises `UserError` with a
message that names the flag/file/line and says how to fix it. Entry points wrap their `main` with
`exit_on_user_error`, which prints that message on one line and exits non-zero, without a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_USER_ERROR = 2

F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """A problem with the user's input; the message says what is wrong and how to fix it."""


def data_error(path: str, line: int | None, what: str, fix: str) -> UserError:
    """`FILE:LINE: what is wrong (how to fix)`, the format of every bad-data error."""
    where = f"{path}:{line}" if line is not None else str(path)
    return UserError(f"{where}: {what} ({fix})")


def print_user_error(err: UserError) -> None:
    """The one line an entry point ends with: `error: MESSAGE` on stderr, in one write (under
    `python -u` print writes the text and the newline apart, and ranks sharing the launcher's
    pipe then run their lines together)."""
    sys.stderr.write(f"error: {err}\n")
    sys.stderr.flush()


def exit_on_user_error(main: F) -> F:
    """Decorate a CLI `main`: a `UserError` becomes `error: ...` on stderr and exit status 2; a
    reader that stops early (`| head`) ends the tool with status 0 and nothing on stderr, not a
    BrokenPipeError traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()  # inside the try: the last buffered lines may meet the closed pipe
            return result
        except UserError as err:
            print_user_error(err)
            sys.exit(EXIT_USER_ERROR)
        except BrokenPipeError:
            # Python flushes stdout once more at exit: send that to /dev/null, silently
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)

    return wrapper  # type: ignore[return-value]


_JSON_NAMES = {int: "an integer", float: "a number", bool: "true/false", str: "a string",
               dict: "an object", list: "a list", None: "null"}  # fmt: skip


def _fits(value, kind) -> bool:
    if kind is None:
        return value is None
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def check_json_types(
    values: dict, types: dict[str, tuple], *, path: str, fix: str, prefix: str = ""
) -> None:
    """Refuse, with one line `PATH: entry PREFIXKEY is VALUE, not TYPE; FIX`, the first entry of
    the parsed JSON object `values` whose type is none of `types[key]` (int, float, bool, str,
    dict, list; None for null; a bool is not a number, a float may be written as an integer).
    Absent entries pass."""
    for key, kinds in types.items():
        if key in values and not any(_fits(values[key], kind) for kind in kinds):
            wanted = " or ".join(_JSON_NAMES[kind] for kind in kinds)
            raise UserError(
                f"{path}: entry {prefix}{key} is {json.dumps(values[key])[:40]}, not {wanted}; "
                f"{fix}"
            )
