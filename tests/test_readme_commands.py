"""The commands the README and docs/ show stay true.

- The canonical CPU training command is one: docs/QUICKSTART.md's `ARGS=(...)` array, the flags
  of the Makefile's train recipe (printed by `make -n`, defaults) and docs/LAUNCH.md's `deepspeed`
  block are the same words in the same order, and QUICKSTART.md hands that array to the cache
  builder and to `deepspeed --num_gpus 4 pretrain_gpt.py`.
- The README's short quick start is QUICKSTART.md's pipeline: each of its commands is one of
  QUICKSTART.md's, word for word (`make train` standing for the launch it runs).
"""

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


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[list[str]]:
    """The commands of a bash block: continued lines joined, comments dropped, split at `&&`."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        command: list[str] = []
        for word in shlex.split(line, comments=True) + ["&&"]:
            if word != "&&":
                command.append(word)
            elif command:
                found.append(command)
                command = []
    return found


def quickstart_args() -> list[str]:
    """The words inside docs/QUICKSTART.md's (only) `ARGS=(...)` array."""
    found = re.findall(r"^ARGS=\((.*?)\)", read("docs/QUICKSTART.md"), flags=re.S | re.M)
    assert len(found) == 1, "docs/QUICKSTART.md should define ARGS=(...) exactly once"
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


def launch_md_cpu_command() -> list[str]:
    """The first bash block of docs/LAUNCH.md's "CPU, one machine" section."""
    text = read("docs/LAUNCH.md")
    return words(bash_blocks(text[text.index("## CPU, one machine") :])[0])


def test_quickstart_makefile_and_launch_md_show_one_command():
    args = quickstart_args()
    assert "--train-iters" in args and "--data-path" in args
    assert makefile_train() == LAUNCH + args
    assert launch_md_cpu_command() == LAUNCH + args


def test_quickstart_hands_the_array_to_the_cache_builder_and_the_launcher():
    quickstart = read("docs/QUICKSTART.md")
    assert 'python tools/build_data_cache.py "${ARGS[@]}"' in quickstart
    assert shlex.join(LAUNCH) + ' "${ARGS[@]}"' in quickstart


def test_the_readme_quick_start_is_the_quickstart_pipeline():
    readme = read("README.md")
    short = commands(bash_blocks(readme[readme.index("## Quick start") :])[0])
    full = commands(bash_blocks(read("docs/QUICKSTART.md"))[0])
    launch = [*LAUNCH, "${ARGS[@]}"]
    assert any(c[:2] == ["make", "train"] for c in short), "the README's quick start should train"
    for command in short:
        shown = launch + command[2:] if command[:2] == ["make", "train"] else command
        assert shown in full, (
            f"README quick start: {shlex.join(command)} is not docs/QUICKSTART.md's"
        )
