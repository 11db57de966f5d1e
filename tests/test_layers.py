"""The package's layers point one way (docs/ARCHITECTURE.md): no module imports a higher layer,
the converters never import training code, and `import pretrain.convert` stays light."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Bottom up; a module may import its own layer and the layers below it.
LAYERS = [
    {
        "pretrain.errors",
        "pretrain.atomic",
        "pretrain.testing_hooks",
        "pretrain.launch",
        "pretrain.flag_help",
        "pretrain.outputs",
    },
    {"pretrain.parallel", "pretrain.tokenizer"},
    {"pretrain.data", "pretrain.model"},
    {"pretrain.checkpoint"},
    {"pretrain.training", "pretrain.convert"},
    {"pretrain.cli"},
]
# Same layer, still never: the converters read checkpoints through pretrain.checkpoint only.
FORBIDDEN = {("pretrain.convert", "pretrain.training"), ("pretrain.training", "pretrain.convert")}


def component(module: str) -> str:
    """`pretrain.training.loop.loop` -> `pretrain.training` (the unit the layer table names)."""
    return ".".join(module.split(".")[:2])


def layer_of(module: str) -> int:
    name = component(module)
    for level, members in enumerate(LAYERS):
        if name in members:
            return level
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `pretrain` import in a file, including function-level ones."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pretrain":  # from pretrain import errors
                found += [(node.lineno, f"pretrain.{a.name}") for a in node.names]
            elif node.module.startswith("pretrain."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("pretrain")]
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_a_higher_layer():
    violations = []
    for path in sorted((REPO / "pretrain").rglob("*.py")):
        me = module_name(path)
        for line, target in imports(path):
            if layer_of(target) > layer_of(me) or (component(me), component(target)) in FORBIDDEN:
                violations.append(f"{path.relative_to(REPO)}:{line}: {me} imports {target}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule above is not vacuous: a data module importing the CLI is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from pretrain.cli import parse_args\n")
    assert imports(bad) == [(2, "pretrain.cli")]
    assert layer_of("pretrain.cli") > layer_of("pretrain.data.builder")


# --- The rooms of pretrain.data (docs/ARCHITECTURE.md, "pretrain/data/") ---------------------
# Bottom up, like LAYERS: a data module imports only its own room and the rooms below it.
DATA_ROOMS = [
    {"pretrain.data.files"},
    {"pretrain.data.caches"},
    {"pretrain.data.config", "pretrain.data.schedule"},
    {"pretrain.data.datasets"},
    {"pretrain.data.blends"},
    {"pretrain.data.builder", "pretrain.data.checks", "pretrain.data.gc_pause"},
]


def data_room_of(module: str) -> int:
    """`pretrain.data.files.corpus` -> the index of `pretrain.data.files` in DATA_ROOMS."""
    name = ".".join(module.split(".")[:3])
    for level, members in enumerate(DATA_ROOMS):
        if name in members:
            return level
    raise AssertionError(f"{module} is in no data room: add it to DATA_ROOMS and ARCHITECTURE.md")


def upward_data_imports(path: Path, me: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `path` (module `me`) of a higher data room."""
    return [
        (line, target)
        for line, target in imports(path)
        if target.startswith("pretrain.data.") and data_room_of(target) > data_room_of(me)
    ]


def test_no_data_module_imports_a_higher_data_room():
    violations = []
    for path in sorted((REPO / "pretrain" / "data").rglob("*.py")):
        me = module_name(path)
        if me != "pretrain.data":
            for line, target in upward_data_imports(path, me):
                violations.append(f"{path.relative_to(REPO)}:{line}: {me} imports {target}")
    assert not violations, "\n".join(violations)


def test_the_data_room_checker_sees_an_upward_import(tmp_path):
    """The rule above is not vacuous: a file module importing a blend or the config is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from pretrain.data.files.indexed_dataset import IndexedDataset\n"
        "def f():\n"
        "    from pretrain.data.blends.mixture import MixturePlan\n"
        "    from pretrain.data.config import DataConfig\n"
    )
    assert upward_data_imports(bad, "pretrain.data.files.corpus") == [
        (3, "pretrain.data.blends.mixture"),
        (4, "pretrain.data.config"),
    ]


def test_importing_the_converters_loads_neither_deepspeed_nor_the_cli():
    modules = [module_name(p) for p in sorted((REPO / "pretrain" / "convert").glob("*.py"))]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(sorted(m for m in sys.modules if m == 'deepspeed' or m.startswith('pretrain.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "deepspeed" not in loaded
    assert not [m for m in loaded if m.startswith(("pretrain.cli", "pretrain.training"))], loaded


# A backend's library is imported by that backend's package only. The exceptions read other
# tools' checkpoint *files*: the unpickling allowlist names DeepSpeed's pickled classes, the
# converter reads ZeRO partitions with DeepSpeed's own zero_to_fp32, and every DCP folder (ours,
# Megatron-LM's torch_dist) is read through the one guarded reader, pretrain/checkpoint/dcp_reader.
BACKEND_LIBRARIES = {
    "deepspeed": "pretrain.training.backends.deepspeed",
    "torch.distributed.fsdp": "pretrain.training.backends.torch",
    "torch.distributed.pipelining": "pretrain.training.backends.torch",
    "torch.distributed.checkpoint": "pretrain.training.backends.torch",
}
FILE_FORMAT_READERS = {
    ("pretrain.checkpoint.safe_load", "deepspeed"),
    ("pretrain.convert.checkpoint_reader", "deepspeed"),
    ("pretrain.checkpoint.dcp_reader", "torch.distributed.checkpoint"),
}


def library_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a backend library in a file, function-level included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            for library in BACKEND_LIBRARIES:
                if name == library or name.startswith(library + "."):
                    found.append((node.lineno, library))
    return sorted(set(found))


def test_only_a_backend_imports_its_library():
    violations = []
    for path in sorted((REPO / "pretrain").rglob("*.py")):
        me = module_name(path)
        for line, library in library_imports(path):
            owner = BACKEND_LIBRARIES[library]
            if me == owner or me.startswith(owner + "."):
                continue
            if (me, library) in FILE_FORMAT_READERS:
                continue
            violations.append(f"{path.relative_to(REPO)}:{line}: {me} imports {library}")
    assert not violations, "\n".join(violations)


def test_the_backend_checker_sees_a_library_import(tmp_path):
    """The rule above is not vacuous: both import forms of each library are caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import deepspeed\n"
        "def f():\n"
        "    from torch.distributed import fsdp\n"
        "    from torch.distributed.pipelining import Schedule1F1B\n"
        "    import torch.distributed.checkpoint as dcp\n"
    )
    assert library_imports(bad) == [
        (1, "deepspeed"),
        (3, "torch.distributed.fsdp"),
        (4, "torch.distributed.pipelining"),
        (5, "torch.distributed.checkpoint"),
    ]


# Inside pretrain.training, the rooms (docs/ARCHITECTURE.md, "Training rooms"): what each may
# not import. "top" is the shared modules at the top of training/ (the engine interface, step,
# state, distributed, precision, rank_agreement); "setup" is run.py, run_config.py and
# data_feed.py, which only the setup (and the CLI above training) imports.
ROOM_MAY_NOT_IMPORT = {
    "top": {"loop", "backends", "setup"},
    "schedules": {"top", "loop", "checkpoints", "report", "backends", "setup"},
    "report": {"loop", "checkpoints", "schedules", "backends", "setup"},
    "checkpoints": {"loop", "backends", "setup"},
    "loop": {"backends", "setup"},
    "backends": {"loop", "setup"},
    "setup": set(),
}
SETUP = {"pretrain.training.run", "pretrain.training.run_config", "pretrain.training.data_feed"}


def room_of(module: str) -> str | None:
    """`pretrain.training.loop.spikes` -> "loop"; None outside pretrain.training."""
    parts = module.split(".")
    if parts[:2] != ["pretrain", "training"] or len(parts) < 3:
        return None
    if parts[2] in ROOM_MAY_NOT_IMPORT:
        return parts[2]
    return "setup" if ".".join(parts[:3]) in SETUP else "top"


def test_each_training_room_imports_only_what_it_may():
    violations = []
    for path in sorted((REPO / "pretrain" / "training").rglob("*.py")):
        me = module_name(path)
        mine = room_of(me)
        for line, target in imports(path):
            theirs = room_of(target)
            if mine is not None and theirs in ROOM_MAY_NOT_IMPORT[mine]:
                violations.append(f"{path.relative_to(REPO)}:{line}: {mine} room imports {target}")
    assert not violations, "\n".join(violations)


def test_the_room_checker_sees_a_forbidden_import(tmp_path):
    """The rule above is not vacuous: the interface importing a backend, a schedule importing
    the loop and a report module importing the checkpointer are each caught."""
    assert room_of("pretrain.training.backends.factory") in ROOM_MAY_NOT_IMPORT["top"]
    assert room_of("pretrain.training.loop.loop") in ROOM_MAY_NOT_IMPORT["schedules"]
    assert room_of("pretrain.training.checkpoints") in ROOM_MAY_NOT_IMPORT["report"]
    assert room_of("pretrain.training.engine") == "top"
    assert room_of("pretrain.training.run") == "setup"


def product_modules() -> dict[str, Path]:
    """Every module under pretrain/, by dotted name."""
    return {module_name(p): p for p in sorted((REPO / "pretrain").rglob("*.py"))}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the product modules it imports (function-level and TYPE_CHECKING imports
    included; `from pkg import sub` is an import of `pkg.sub` where that is a module)."""
    graph = {}
    for me, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets |= {n if n in modules else node.module for n in names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[me] = {t for t in targets if t in modules and t != me}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph[module]):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_no_import_cycle_among_product_modules():
    cycle = find_cycle(import_graph(product_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_cycle():
    """The rule above is not vacuous: a two-module circle and a longer one are named."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": set()}) == ["b", "c", "b"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
