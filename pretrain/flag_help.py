"""How every command line here prints its flags in `--help` (pretrain_gpt.py and the data tools).

One mechanism instead of per-flag spelling: `HelpFormatter` shows each value flag with the metavar
a user writes (`N` for int, `FLOAT` for float, `PATH` for a file or folder flag, `{a,b}` for
choices, else the row's own `metavar=`) and ends its help with `[default: X]` whenever argparse
holds a default and the help does not state one. Switches (store_true/store_false) are off
unless given, so they show no default. `argument_group` finds a group by title, so flags defined
in different modules land in the same Megatron-LM group (`MEGATRON_GROUPS`, Megatron's titles
and order).
"""

from __future__ import annotations

import argparse

# Megatron-LM's argument group titles (megatron/training/arguments.py), in its order; the
# groups only this project has (loss spikes, script compatibility) follow them.
MEGATRON_GROUPS = (
    "network size",
    "regularization",
    "training",
    "initialization",
    "learning rate",
    "checkpointing",
    "mixed precision",
    "distributed",
    "validation",
    "data and dataloader",
    "tokenizer",
    "moe",
    "logging",
)

# the last word of a flag that takes a file or folder (`--data-cache-path`, `--vocab-file`, ...)
_PATH_WORDS = {"path", "file", "dir", "config", "model", "save", "load", "input", "output"}


def argument_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """`parser`'s argument group called `title`, created (after the existing ones) if missing."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_megatron_groups(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Create Megatron's groups in Megatron's order; `--help` leaves out those that stay empty."""
    for title in MEGATRON_GROUPS:
        argument_group(parser, title)
    return parser


def _names_a_path(action: argparse.Action) -> bool:
    last_word = action.option_strings[-1].lstrip("-").replace("_", "-").split("-")[-1]
    return last_word in _PATH_WORDS


def default_metavar(action: argparse.Action) -> str:
    """The metavar of a value flag without `metavar=` or choices: from its type or its name."""
    if action.type is int:
        return "N"
    if action.type is float:
        return "FLOAT"
    if _names_a_path(action):
        return "PATH"
    return "STR"


def metavar_of(action: argparse.Action) -> str | tuple[str, ...]:
    """What `--help` writes after the flag: its `metavar=`, `{choices}` or `default_metavar`."""
    if action.metavar is not None:
        return action.metavar
    if action.choices is not None:
        return "{" + ",".join(str(choice) for choice in action.choices) + "}"
    return default_metavar(action)


def format_default(value) -> str:
    """A default as a user would type it: 0.1, 1.0, 1e-05, linear (lists space separated)."""
    if isinstance(value, (list, tuple)):
        return " ".join(format_default(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def shows_default(action: argparse.Action) -> bool:
    """True for a value flag whose default argparse fills in (not a switch, None or [])."""
    return (
        bool(action.option_strings)
        and action.nargs != 0
        and action.default not in (None, [], argparse.SUPPRESS)
    )


def help_text(action: argparse.Action) -> str:
    """The flag's help as `--help` prints it, `[default: X]` appended where the help lacks one
    (an argparse template: a `%` of the default is doubled)."""
    text = action.help or ""
    if shows_default(action) and "[default:" not in text:
        shown = format_default(action.default).replace("%", "%%")
        text = f"{text} [default: {shown}]".strip()
    return text


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with `default_metavar` and `help_text`."""

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return default_metavar(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        return help_text(action)


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`HelpFormatter` that prints the description and epilog as written (a tool's docstring)."""
