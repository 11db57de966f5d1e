"""pretrain/checkpoint/dcp_reader.py: a DCP folder is read without running code from it.

Folders written by the torch backend's own writer (`dcp._Writer`, one process) and Megatron-LM's
torch_dist fixture. The payloads: `.metadata` naming any class of torch.distributed.checkpoint
outside the index's own; `.metadata` marking a tensor a byte item (`BytesStorageMetadata`) at a
`torch.save`d object appended to the `.distcp` whose unpickling runs `touch MARKER` (what torch's
DefaultLoadPlanner would unpickle with `weights_only=False`); the same object in a tensor's place;
a data file outside the folder. Each is refused in one line naming the file (and key), and
MARKER never appears; torch's own reader on the same folder runs the payload (it is real).
"""

from __future__ import annotations

import ast
import importlib
import os
import pickle
import pkgutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_fixtures import Payload, point_at_object
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from pretrain.checkpoint import dcp_reader
from pretrain.errors import UserError

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm" / "llama-torch-dist" / "iter_0000003"
KEY = "tp00.layers.0.mlp.fc1.weight.exp_avg"


def _tensors() -> dict[str, torch.Tensor]:
    return {
        KEY: torch.arange(12.0).reshape(3, 4),
        "tp00.layers.0.mlp.fc1.weight.step": torch.tensor(3.0),
        "tp00.embedding.word_embeddings.weight": torch.ones(5, 2, dtype=torch.bfloat16),
    }


def _ours(folder: Path, state: dict | None = None) -> str:
    """A DCP folder of `state` (default `_tensors()`) written by the torch backend's writer."""
    from pretrain.training.backends.torch.dcp import _Writer

    # unflattened: a list stays one object, a byte item (as Megatron's common_state)
    planner = DefaultSavePlanner(flatten_state_dict=False)
    dcp.save(
        state or _tensors(), storage_writer=_Writer(str(folder)), planner=planner, no_dist=True
    )
    return str(folder)


class _Recorder(pickle.Unpickler):
    def __init__(self, f, seen):
        super().__init__(f)
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_the_allowlist_is_what_both_writers_pickle(tmp_path):
    """Every global of a real index is admitted; together they are the whole allowlist."""
    seen: set = set()
    for folder in (_ours(tmp_path / "ours"), FIXTURE):
        with open(os.path.join(folder, ".metadata"), "rb") as f:
            _Recorder(f, seen).load()
        assert dcp_reader.read_metadata(str(folder)).state_dict_metadata
    dtypes = {(m, n) for m, n in seen if m == "torch" and n != "Size"}
    assert dtypes == {("torch", "float32"), ("torch", "bfloat16")}
    assert seen - dtypes <= dcp_reader.METADATA_CLASSES
    # BytesIOWriteData: the save plans Megatron keeps hold it where a byte item has write data
    assert dcp_reader.METADATA_CLASSES - seen == {
        ("torch.distributed.checkpoint.planner", "BytesIOWriteData")
    }


def _dcp_classes() -> list[tuple[str, str]]:
    """(module, name) of every class each module of torch.distributed.checkpoint exports."""
    import torch.distributed.checkpoint as package

    found = []
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - optional dependencies (fsspec, ...) not installed
            continue
        found += [(info.name, n) for n, v in vars(module).items() if isinstance(v, type)]
    return found + [(package.__name__, n) for n, v in vars(package).items() if isinstance(v, type)]


def test_every_other_class_of_the_dcp_package_is_refused(tmp_path):
    """A `.metadata` naming any other class of any module of the package (`_AsyncCheckpointProcess`
    spawns a process; the planners and readers run code) is refused by name before its module is
    looked at (the previous allowlist returned each of them)."""
    classes = [c for c in _dcp_classes() if c not in dcp_reader.METADATA_CLASSES]
    assert ("torch.distributed.checkpoint._async_process_executor", "_AsyncCheckpointProcess") in (
        classes
    )
    assert len(classes) > 200
    (tmp_path / "step").mkdir()
    metadata = tmp_path / "step" / ".metadata"
    for module, name in classes:
        metadata.write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b".")  # the class
        refusal = f"{metadata}: refused: it names {module}.{name}, which a checkpoint index never"
        with pytest.raises(UserError) as refused:
            dcp_reader.read_metadata(str(tmp_path / "step"))
        assert str(refused.value).startswith(refusal)


def test_a_byte_item_at_a_tensor_key_is_refused(tmp_path):
    """The issue's payload: refused before DCP starts, and by the reader itself under torch's
    own planner; torch's FileSystemReader runs it."""
    folder, marker = _ours(tmp_path / "step"), tmp_path / "MARKER"
    point_at_object(folder, KEY, Payload(marker), as_bytes=True)
    refusal = (
        f"{folder}/__0_0.distcp ({KEY}): refused: .metadata marks it a pickled object "
        f"(BytesStorageMetadata), which this checkpoint's writer never stores there"
    )
    with pytest.raises(UserError) as refused:
        dcp_reader.load(folder, _tensors())
    assert str(refused.value).startswith(refusal)
    with pytest.raises(CheckpointException) as inside:
        dcp.load(_tensors(), storage_reader=dcp_reader.SafeReader(folder), no_dist=True)
    assert str(dcp_reader.first_failure(inside.value)).startswith(refusal)
    assert not marker.exists()
    dcp.load(_tensors(), storage_reader=FileSystemReader(folder), no_dist=True)
    assert marker.exists()


def test_a_payload_in_a_tensors_place_is_refused(tmp_path):
    folder, marker = _ours(tmp_path / "step"), tmp_path / "MARKER"
    point_at_object(folder, KEY, Payload(marker), as_bytes=False)
    with pytest.raises(UserError) as refused:
        dcp_reader.load(folder, _tensors())
    assert str(refused.value).startswith(
        f"{folder}/__0_0.distcp ({KEY}): refused to load: it holds pickled global(s) posix.system,"
    )
    assert not marker.exists()


def test_byte_items_only_where_allowed_and_through_the_allowlist(tmp_path):
    """A byte item the caller names reads through safe_load (plain data; a payload refused
    naming the global); the tensors beside it load."""
    state = {**_tensors(), "common_state": [{"iteration": 3, "args": None}]}
    folder = _ours(tmp_path / "step", state)
    loaded = dcp_reader.load(folder, {**_tensors(), "common_state": None}, objects=["common_state"])
    assert loaded["common_state"] == [{"iteration": 3, "args": None}]
    assert torch.equal(loaded[KEY], _tensors()[KEY])
    with pytest.raises(UserError, match=r"\(common_state\): refused: \.metadata marks it"):
        dcp_reader.load(folder, {"common_state": None})
    point_at_object(folder, "common_state", [Payload(tmp_path / "MARKER")], as_bytes=True)
    with pytest.raises(UserError, match=r"\(common_state\): refused to load: .*posix\.system"):
        dcp_reader.load(folder, {"common_state": None}, objects=["common_state"])
    assert not (tmp_path / "MARKER").exists()


def test_a_data_file_outside_the_folder_is_refused(tmp_path):
    folder = _ours(tmp_path / "step")
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UserError, match=r"is stored in '\.\./\.\./etc/passwd', not a file of this"):
        dcp_reader.load(folder, _tensors())


_READ_NAMES = {"load", "load_state_dict", "FileSystemReader", "DefaultLoadPlanner", "StorageReader"}


def _dcp_reads(path: Path) -> list[str]:
    """`line: name` of each DCP read API a module imports or uses (through any alias of
    torch.distributed.checkpoint)."""
    package, found, aliases = "torch.distributed.checkpoint", [], set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in _READ_NAMES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _READ_NAMES:
            if ast.unparse(node.value) in aliases:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_other_module_reads_a_dcp_folder(tmp_path):
    """DCP's load and its readers are used in dcp_reader.py only (the torch backend's dcp.py and
    the Megatron converter call `dcp_reader.load`); before, each had its own `_SafeReader`."""
    root = Path(__file__).resolve().parents[1]
    users = {
        str(path.relative_to(root)): reads
        for path in [*root.glob("pretrain/**/*.py"), *root.glob("tools/*.py")]
        if (reads := _dcp_reads(path))
    }
    assert list(users) == ["pretrain/checkpoint/dcp_reader.py"], users
    bad = tmp_path / "bad.py"  # the check sees both spellings
    bad.write_text(
        "import torch.distributed.checkpoint as d\n"
        "from torch.distributed.checkpoint import FileSystemReader\n"
        "d.load({}, storage_reader=FileSystemReader('x'))\n"
    )
    assert _dcp_reads(bad) == ["2: FileSystemReader", "3: d.load"]
