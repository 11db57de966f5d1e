"""The README's canonical CPU training command is the one `make train` runs and the one
docs/TRAINING.md shows: the README quick start's `ARGS=(...)` array, the flags of the Makefile's
train recipe (printed by `make -n`, defaults) and TRAINING.md's `deepspeed` block are the same
words in the same order, and the quick start hands that array to the cache builder and to
`deepspeed --num_gpus 4 pretrain_gpt.py`."""

import os
import re
import shlex
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = ["deepspeed", "--num_gpus", "4", "pretrain_gpt.py"]


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def words(command: str) -> list[str]:
    """The shell words of a command written over several backslash-continued lines."""
    return shlex.split(command.replace("\\\n", " "))


def readme_args() -> list[str]:
    """The words inside the README's (only) `ARGS=(...)` array."""
    found = re.findall(r"^ARGS=\((.*?)\)", read("README.md"), flags=re.S | re.M)
    assert len(found) == 1, "README.md should define ARGS=(...) exactly once"
    return shlex.split(found[0], comments=True)


def makefile_train() -> list[str]:
    """`make train`'s deepspeed command with the Makefile's defaults, the launcher as on PATH."""
    # run under `make test` (CI), the parent make's MAKEFLAGS/MAKELEVEL would make this one print
    # "make[1]: Entering directory": a clean environment shows the command alone
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    shown = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", ".venv/.installed",
         "-o", "data/shakespeare_bpe_text_document.idx", "train"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    command = words(shown)
    assert command[0] == ".venv/bin/deepspeed", shown
    return ["deepspeed", *command[1:]]


def training_md_cpu_command() -> list[str]:
    """The first bash block after TRAINING.md's "CPU (what `make train` runs" paragraph."""
    text = read("docs/TRAINING.md")
    start = text.index("CPU (what `make train` runs")
    block = re.search(r"```bash\n(.*?)```", text[start:], flags=re.S)
    return words(block.group(1))


def test_readme_makefile_and_training_md_show_one_command():
    args = readme_args()
    assert "--train-iters" in args and "--data-path" in args
    assert makefile_train() == LAUNCH + args
    assert training_md_cpu_command() == LAUNCH + args


def test_quick_start_hands_the_array_to_the_cache_builder_and_the_launcher():
    readme = read("README.md")
    assert 'python tools/build_data_cache.py "${ARGS[@]}"' in readme
    assert shlex.join(LAUNCH) + ' "${ARGS[@]}"' in readme
