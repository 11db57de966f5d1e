"""No product function grows past a length a reader takes in at once (docs/ARCHITECTURE.md):
every function and method in `pretrain/`, `tools/` and `pretrain_gpt.py`, nested ones included,
is at most `LIMIT` lines from its `def` to its last line. The guideline is ~60; the limit leaves
slack, so a function that reaches it is split where a reader would want a name."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 80


def product_modules() -> list[Path]:
    """Every Python file of the product: the package, the tools and the entry point."""
    return [
        *sorted((REPO / "pretrain").rglob("*.py")),
        *sorted((REPO / "tools").glob("*.py")),
        REPO / "pretrain_gpt.py",
    ]


def long_functions(path: Path, limit: int = LIMIT) -> list[str]:
    """`FILE:LINE: NAME is N lines` for each function or method in `path` longer than `limit`
    (its length: the `def` line through its last line; decorators not counted)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{path}:{node.lineno}: {node.name} is {length} lines")
    return found


def test_no_product_function_is_over_the_limit():
    offenders = [
        line.removeprefix(f"{REPO}/") for path in product_modules() for line in long_functions(path)
    ]
    assert not offenders, f"{len(offenders)} functions over {LIMIT} lines (split them):\n" + (
        "\n".join(offenders)
    )


def test_the_checker_sees_a_long_method(tmp_path):
    """The rule above is not vacuous: a method of LIMIT + 1 lines is named, one of LIMIT is not."""

    def method(name: str, lines: int) -> str:
        return f"    def {name}(self):\n" + "".join(
            f"        x{i} = {i}\n" for i in range(lines - 1)
        )

    source = tmp_path / "long.py"
    source.write_text("class C:\n" + method("ok", LIMIT) + method("long", LIMIT + 1))
    assert long_functions(source) == [f"{source}:{LIMIT + 2}: long is {LIMIT + 1} lines"]
