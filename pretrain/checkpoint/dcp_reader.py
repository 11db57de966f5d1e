"""Read torch.distributed.checkpoint (DCP) folders without running code from them.

The one way this project reads a DCP folder: the torch backend's own checkpoints (`--load` of a
`--use-torch-fsdp2` step) and Megatron-LM's `--ckpt-format torch_dist` (`convert_from_megatron.py`).

torch's readers unpickle in two places: `FileSystemReader.read_metadata` reads `.metadata` with
plain `pickle.load`, and `DefaultLoadPlanner.load_bytes` reads every *byte item* (a state-dict
entry `.metadata` marks `BytesStorageMetadata`) with `torch.load(weights_only=False)`. A doctored
`.metadata` can mark any key a byte item and point it at a pickle appended to a `.distcp` file.
Here instead:

- `.metadata` is unpickled admitting exactly the classes DCP's index is made of (`METADATA_CLASSES`,
  torch dtypes); anything else is refused by name before its module is even imported.
- Byte items are read by `SafeReader` itself, never handed to torch's planner: only at the keys
  the caller names (where the writer puts one: none in the torch backend's checkpoints, Megatron's
  `common_state`), through `safe_load.load`'s allowlist; a byte item at any other key is refused
  naming the `.distcp` file and the key, unread.
- Tensor items are torch's read (`torch.load(weights_only=True)` of each tensor's bytes), one
  item at a time, so a refused global is one line naming the file, the key and the global.
- Every data file `.metadata` names is a file in the checkpoint's folder.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from pretrain.checkpoint import safe_load
from pretrain.errors import UserError

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint."
# (module, name) of every global a DCP index pickles: the torch backend's and Megatron-LM's
# torch_dist (whose index also keeps its save plans, `all_local_plans`), besides torch dtypes
METADATA_CLASSES = frozenset(
    [
        *((_DCP + "metadata", name) for name in ("Metadata", "StorageMeta", "MetadataIndex")),
        *((_DCP + "metadata", name) for name in ("TensorStorageMetadata", "BytesStorageMetadata")),
        *((_DCP + "metadata", name) for name in ("ChunkStorageMetadata", "TensorProperties")),
        (_DCP + "metadata", "_MEM_FORMAT_ENCODING"),
        (_DCP + "filesystem", "_StorageInfo"),
        *((_DCP + "planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType")),
        *((_DCP + "planner", name) for name in ("TensorWriteData", "BytesIOWriteData")),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # "torch.strided" -> the layout, nothing else
    ]
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles `.metadata` admitting only METADATA_CLASSES and torch's dtypes: torch's own
    reader uses plain `pickle.load`, which would run whatever a doctored `.metadata` names."""

    def find_class(self, module: str, name: str):  # noqa: D102 (pickle API)
        dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if dtype or (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(folder: str) -> Metadata:
    """`folder`'s `.metadata`, unpickled by `_MetadataUnpickler`; UserError (one line) naming a
    refused global, an unreadable file, or a data file outside `folder`."""
    path = os.path.join(folder, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise UserError(
            f"{path}: refused: it names {err}, which a checkpoint index never holds "
            f"(a doctored or foreign file; nothing was run)"
        ) from None
    except Exception as err:  # noqa: BLE001 - any unreadable index is the same user problem
        raise UserError(
            f"{path}: unreadable ({type(err).__name__}: {err}); copy it again"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UserError(f"{path}: holds a {type(metadata).__name__}, not a DCP checkpoint index")
    for index, place in metadata.storage_data.items():
        name = getattr(place, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", "..", "."):
            raise UserError(
                f"{path}: '{index.fqn}' is stored in {name!r}, not a file of this folder "
                f"(a doctored or foreign index; nothing was read)"
            )
    return metadata


def tensor_entries(folder: str) -> dict[str, TensorStorageMetadata]:
    """key -> (`.size`, `.properties.dtype`, `.chunks`) of every tensor `folder`'s index holds."""
    entries = read_metadata(folder).state_dict_metadata.items()
    return {key: entry for key, entry in entries if isinstance(entry, TensorStorageMetadata)}


class SafeReader(FileSystemReader):
    """torch's FileSystemReader with `read_metadata` above and byte items read here: those at
    `objects` through `safe_load.load` (`megatron`: its Megatron allowlist) into `self.objects`,
    any other refused; the rest of the plan (tensors) is torch's."""

    def __init__(self, path: str, *, objects: Collection[str] = (), megatron: bool = False):
        super().__init__(path)
        self.allowed, self.megatron = frozenset(objects), megatron
        self.objects: dict[str, Any] = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:  # noqa: D102 (torch API)
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> torch.futures.Future:  # noqa: D102 (torch API)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                self.objects[item.dest_index.fqn] = self._read_object(item.storage_index)
            else:
                self._read_tensor(plan, item, planner)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _where(self, index) -> str:
        """`FILE (key)`: where item `index` is stored."""
        return (
            f"{os.path.join(str(self.path), self.storage_data[index].relative_path)} ({index.fqn})"
        )

    def _read_tensor(self, plan, item, planner) -> None:
        """torch's read of one tensor item (`weights_only=True`), its refusal in one line."""
        try:
            super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
        except pickle.UnpicklingError as err:
            name = safe_load.refused_global(err)
            if name:
                raise safe_load.refused(self._where(item.storage_index), [name]) from None
            raise UserError(f"{self._where(item.storage_index)}: not a plain tensor") from None

    def _read_object(self, index) -> Any:
        """The object stored as byte item `index`, if its key is allowed, through safe_load."""
        place, where = self.storage_data[index], self._where(index)
        if index.fqn not in self.allowed:
            raise UserError(byte_item_refusal(where))
        if place.transform_descriptors:
            raise UserError(f"{where}: stored with transforms {place.transform_descriptors}")
        with open(os.path.join(str(self.path), place.relative_path), "rb") as f:
            f.seek(place.offset)
            data = f.read(place.length)
        return safe_load.load(where, megatron=self.megatron, data=data)


def byte_item_refusal(where: str) -> str:
    """The refusal of a byte item nobody writes at that key."""
    return (
        f"{where}: refused: .metadata marks it a pickled object (BytesStorageMetadata), which "
        f"this checkpoint's writer never stores there (a doctored or foreign file; nothing was run)"
    )


def _check_byte_items(folder: str, metadata: Metadata, keys, objects: frozenset) -> None:
    """Refuse, before DCP starts, a byte item at a key of `keys` outside `objects` (what
    `SafeReader` refuses too, here before any rank enters DCP's collectives)."""
    for key in keys:
        if key in objects or not isinstance(
            metadata.state_dict_metadata.get(key), BytesStorageMetadata
        ):
            continue
        files = sorted({p.relative_path for i, p in metadata.storage_data.items() if i.fqn == key})
        where = ", ".join(os.path.join(folder, f) for f in files) or folder
        raise UserError(byte_item_refusal(f"{where} ({key})"))


def load(
    folder: str,
    state_dict: dict[str, Any],
    *,
    objects: Collection[str] = (),
    megatron: bool = False,
    process_group: torch.distributed.ProcessGroup | None = None,
    no_dist: bool = False,
) -> dict[str, Any]:
    """DCP's load of `folder` into `state_dict` (tensors, in place) through `SafeReader`;
    the entries at `objects` (byte items; any value in `state_dict`) come back in the result.

    UserError (one line): a refused `.metadata`, a byte item at any other key (named with its
    file), or any other failure of the load (the first rank's exception, its first line).
    """
    metadata = read_metadata(folder)
    _check_byte_items(folder, metadata, state_dict, frozenset(objects))
    reader = SafeReader(folder, objects=objects, megatron=megatron)
    try:
        dcp.load(state_dict, storage_reader=reader, process_group=process_group, no_dist=no_dist)
    except CheckpointException as err:  # raised on every rank alike (a BaseException)
        if isinstance(first_failure(err), UserError):
            raise UserError(str(first_failure(err))) from None
        raise UserError(
            f"{folder}: cannot be loaded ({failure_reason(err)}); a shard is missing or damaged "
            f"(copy every __*.distcp file)"
        ) from None
    return {**state_dict, **reader.objects}


def first_failure(err: BaseException) -> BaseException:
    """The first rank's exception of a CheckpointException (which holds every rank's, with
    tracebacks), else `err`."""
    failures = getattr(err, "failures", None)
    return next(iter(failures.values()))[0] if failures else err


def failure_reason(err: BaseException) -> str:
    """One line for a failed DCP save or load: the first rank's exception type and first line."""
    err = first_failure(err)
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
