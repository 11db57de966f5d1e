"""The commands the README and docs/ show stay true, and the README stays a map.

- The canonical CPU training command is one: docs/QUICKSTART.md's `ARGS=(...)` array, the flags
  of the Makefile's train recipe (printed by `make -n`, defaults) and docs/LAUNCH.md's `deepspeed`
  block are the same words in the same order, and QUICKSTART.md hands that array to the cache
  builder and to `deepspeed --num_gpus 4 pretrain_gpt.py`.
- The README's short quick start is QUICKSTART.md's pipeline: each of its commands is one of
  QUICKSTART.md's, word for word (`make train` standing for the launch it runs).
- The README stays a five-minute read (at most 250 lines) whose map names every docs/ page once;
  every Markdown link of the README and docs/ reaches a file, and its `#anchor` a heading there;
  every `docs/<page>.md, "Section"` reference in the repository names a section of that page.
"""

import os
import re
import shlex
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = ["deepspeed", "--num_gpus", "4", "pretrain_gpt.py"]
README_LINES = 250
# where a `docs/<page>.md, "Section"` reference may stand (text read by people)
REFERENCE_FOLDERS = ("docs", "tests", "tools", "pretrain", "examples", "bench")


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def docs_pages() -> list[str]:
    return sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))


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


def test_the_readme_is_short_and_maps_every_docs_page_once():
    readme = read("README.md")
    assert readme.count("\n") <= README_LINES, f"README.md is over {README_LINES} lines"
    mapped = re.findall(r"^- \[(docs/\w+\.md)\]\(\1\): \S", readme, flags=re.M)
    pages = docs_pages()
    missing, extra = sorted(set(pages) - set(mapped)), sorted(set(mapped) - set(pages))
    twice = sorted({m for m in mapped if mapped.count(m) > 1})
    assert not (missing or extra or twice), (
        f"README map: lacks {missing}, names {extra} (no such page), twice {twice}"
    )


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def headings(page: str) -> list[str]:
    return re.findall(r"^#+ (.+)$", prose(read(page)), flags=re.M)


def test_every_markdown_link_reaches_its_file_and_heading():
    broken = []
    for page in ["README.md", *docs_pages()]:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(read(page))):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, path)):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and anchor not in {slug(h) for h in headings(path)}:
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def section_titles(page: str) -> list[str]:
    """A page's headings and bold run-in titles (`**Which schedule.**`), as written."""
    text = prose(read(page))
    bold = re.findall(r"^(?:- )?\*\*([^*]+?)\.?\*\*", text, flags=re.M)
    return [h.replace("`", "") for h in headings(page) + bold]


def reference_files() -> list[str]:
    files = ["README.md"]
    for folder in REFERENCE_FOLDERS:
        for parent, _, names in os.walk(os.path.join(ROOT, folder)):
            files += [
                os.path.relpath(os.path.join(parent, n), ROOT)
                for n in names
                if n.endswith((".md", ".py", ".sh", ".sbatch", ".yaml"))
            ]
    return sorted(files)


def test_every_section_reference_names_a_section_of_its_page():
    stale = []
    for name in reference_files():
        text = re.sub(r"\s+", " ", read(name))
        for page, title in re.findall(r"(docs/\w+\.md),? \(?\\?\"([^\"\\]+)\\?\"", text):
            wanted = title.replace("`", "").lower()
            if not os.path.exists(os.path.join(ROOT, page)):
                stale.append(f"{name}: {page} (no such page)")
            elif not any(wanted in t.lower() for t in section_titles(page)):
                stale.append(f'{name}: {page}, "{title}"')
    assert not stale, "references to sections that do not exist:\n" + "\n".join(sorted(set(stale)))
