"""`--help` a Megatron user can read: every flag of pretrain_gpt.py and of the data tools has a
one-line help, a metavar a user writes (N, FLOAT, PATH, {a,b}; never MODEL__NUM_LAYERS), and its
default in the help text; pretrain_gpt.py's flags are in Megatron-LM's argument groups.

The expected strings are written by hand from Megatron-LM's group titles and the flags' defaults.
"""

import argparse
import importlib.util
import re
import subprocess
import sys

import pytest
from training_fixtures import PYTHON, REPO
from training_fixtures import test_env as clean_env  # (pytest would collect test_env)

from pretrain.cli import build_parser
from pretrain.data.files.preprocess import build_parser as preprocess_parser
from pretrain.flag_help import help_text, metavar_of

# Megatron-LM's argument group titles (megatron/training/arguments.py), in Megatron's order
MEGATRON_TITLES = [
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
]
# flags and the group Megatron-LM core_v0.15 lists them in, where a Megatron user looks for them
GROUP_OF = {
    "--rotary-base": "network size",
    "--normalization": "network size",
    "--clip-grad": "regularization",
    "--adam-beta1": "regularization",
    "--global-batch-size": "training",
    "--train-samples": "training",
    "--rampup-batch-size": "training",
    "--optimizer": "training",
    "--exit-interval": "training",
    "--exit-signal-handler": "training",
    "--iterations-to-skip": "training",
    "--lr-decay-style": "learning rate",
    "--loss-scale": "mixed precision",
    "--distributed-backend": "distributed",
    "--distributed-timeout-minutes": "distributed",
    "--use-distributed-optimizer": "distributed",
    "--eval-interval": "validation",
    "--multiple-validation-sets": "validation",
    "--mock-data": "data and dataloader",
    "--num-workers": "data and dataloader",
    "--vocab-file": "tokenizer",
    "--num-experts": "moe",
    "--expert-model-parallel-size": "moe",
    "--wandb-project": "logging",
    "--num-layers": "network size",
    "--make-vocab-size-divisible-by": "network size",
    "--hidden-dropout": "regularization",
    "--weight-decay": "regularization",
    "--train-iters": "training",
    "--micro-batch-size": "training",
    "--recompute-granularity": "training",
    "--seed": "initialization",
    "--init-method-std": "initialization",
    "--lr": "learning rate",
    "--lr-warmup-iters": "learning rate",
    "--save": "checkpointing",
    "--bf16": "mixed precision",
    "--tensor-model-parallel-size": "distributed",
    "--eval-iters": "validation",
    "--seq-length": "data and dataloader",
    "--data-path": "data and dataloader",
    "--tokenizer-type": "tokenizer",
    "--log-interval": "logging",
}


def _load_tool(name: str):
    """tools/<name>.py as a module (tools/ on sys.path, as when it runs as a script)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        spec = importlib.util.spec_from_file_location(f"help_{name}", REPO / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "tools"))
    return module


def _parsers() -> dict[str, argparse.ArgumentParser]:
    tools = {name: _load_tool(name).build_parser() for name in TOOLS}
    return {"pretrain_gpt.py": build_parser(), "preprocess_data.py": preprocess_parser(), **tools}


TOOLS = ("build_data_cache", "plan_blend", "explain_batch")


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def _expected_default(value) -> str:
    """How a Megatron user writes the default: 0.1, 1e-05, 1.0, linear, text."""
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


@pytest.fixture(scope="module")
def parsers():
    return _parsers()


def test_every_flag_has_a_one_line_help(parsers):
    for name, parser in parsers.items():
        for action in _flags(parser):
            flag = f"{name} {action.option_strings[0]}"
            assert action.help and action.help.strip(), f"{flag}: no help"
            assert "\n" not in action.help, f"{flag}: help is not one line"


def test_metavars_are_what_a_user_writes(parsers):
    for name, parser in parsers.items():
        for action in _flags(parser):
            if action.nargs == 0:
                continue
            shown = metavar_of(action)
            for part in shown if isinstance(shown, tuple) else (shown,):
                flag = f"{name} {action.option_strings[0]}"
                assert "__" not in part, f"{flag}: internal metavar {part}"
                assert part != action.dest.upper(), f"{flag}: metavar is the dest {part}"


def test_every_default_is_in_the_help(parsers):
    for name, parser in parsers.items():
        for action in _flags(parser):
            flag = f"{name} {action.option_strings[0]}"
            text = help_text(action)
            assert text.count("[default:") <= 1, f"{flag}: two defaults in {text!r}"
            if action.nargs == 0:  # a switch: off unless given, or its help says otherwise
                if action.default is True and isinstance(action, argparse._StoreTrueAction):
                    assert "on by default" in text, flag
                continue
            assert "(default" not in text, f"{flag}: write the default as [default: X]"
            if action.default not in (None, []):
                shown = f"[default: {_expected_default(action.default)}"
                assert shown in text, f"{flag}: {shown}] missing from {text!r}"


def _help(command: list[str]) -> str:
    out = subprocess.run(
        command + ["--help"],
        capture_output=True,
        text=True,
        env=clean_env(COLUMNS="300"),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _sections(text: str) -> dict[str, str]:
    """{group title: its lines} of an argparse --help text."""
    parts = re.split(r"^(\S[^\n]*):\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_pretrain_gpt_help_reads_like_megatron():
    text = _help([PYTHON, str(REPO / "pretrain_gpt.py")])
    assert "__" not in text
    assert re.search(r"\b(MODEL|PARALLEL|SCHEDULE|TRAINING|CHECKPOINT)_", text) is None
    sections = _sections(text)
    titles = [t for t in sections if t in MEGATRON_TITLES]
    assert titles == MEGATRON_TITLES  # all of Megatron's groups, in Megatron's order
    for flag, title in GROUP_OF.items():
        assert re.search(rf"^  {flag}(?![-\w])", sections[title], re.MULTILINE), (flag, title)
    expected = [
        r"--num-layers N\s+number of transformer layers \(required\)",
        r"--hidden-dropout FLOAT\s+dropout probability .* \[default: 0\.1\]",
        r"--attention-dropout FLOAT\s+.* \[default: 0\.1\]",
        r"--tensor-model-parallel-size N\s+.* \[default: 1\]",
        r"--norm-epsilon FLOAT\s+.* \[default: 1e-05\]",
        r"--clip-grad FLOAT\s+.* \[default: 1\.0\]",
        r"--distributed-timeout-minutes FLOAT\s+minutes .* \[default: 10\.0\]",
        r"--lr-decay-style \{constant,linear,cosine,inverse-square-root,WSD\}\s+.* \[default: linear\]",
        r"--normalization \{LayerNorm,RMSNorm\}\s+.* \[default: LayerNorm\]",
        r"--seed N\s+.* \[default: 1234\]",
        r"--eval-interval N\s+.* \[default: 1000\]",
        r"--lr-decay-iters N\s+.* \[default: --train-iters\]",
        r"--save PATH\s+checkpoint directory",
        r"--load PATH\s+",
        r"--deepspeed_config PATH, --deepspeed-config PATH\s+",
        r"--data-path \[PREFIX \.\.\.\]\s+",
        r"--vocab-file PATH\s+",
        r"--iterations-to-skip N\|A-B \[N\|A-B \.\.\.\]\s+",
        r"--rampup-batch-size START INCREMENT SAMPLES\s+",
    ]
    for pattern in expected:
        assert re.search(pattern, text), pattern


@pytest.mark.parametrize("tool", ["preprocess_data", "inspect_data", "explain_batch"])
def test_data_tool_help(tool):
    text = _help([PYTHON, str(REPO / "tools" / f"{tool}.py")])
    assert "__" not in text
    sections = _sections(text)
    assert re.search(
        r"^  --tokenizer-type NAME\s+one of GPT2BPETokenizer", sections["tokenizer"], re.M
    )
    assert re.search(r"--tokenizer-engine \{auto,hf,tiktoken\}\s+.* \[default: auto\]", text)
    if tool == "preprocess_data":
        assert re.search(r"--input PATH \[PATH \.\.\.\]", text)
        assert re.search(
            r"--workers N\s+tokenizer processes \[default: \d+, the cores here\]", text
        )
        assert "--output-prefix PREFIX" in text
    if tool == "inspect_data":
        assert re.search(r"--input PREFIX\s+dataset prefix", text)
        assert re.search(r"--document N\s+decode document N", text)
    if tool == "explain_batch":  # training's flags, in training's groups
        assert re.search(
            r"^  --seq-length N\s+tokens per sample", sections["data and dataloader"], re.M
        )
        assert re.search(r"^  --seed N\s+.* \[default: 1234\]", sections["initialization"], re.M)
        assert re.search(r"--iteration N\|A-B\s+.* \[default: 1\]", text)
        assert re.search(r"--split TRAIN,VALID,TEST\s+.*\[default: 969,30,1", text)
