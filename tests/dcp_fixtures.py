"""Doctoring a torch.distributed.checkpoint folder as an attacker would: an object torch.saved at
the end of a `.distcp` file, an entry of `.metadata` pointing at it."""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex


class Payload:
    """Unpickling this runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def point_at_object(folder: str, key: str, obj, *, as_bytes: bool) -> None:
    """`obj` torch.saved at the end of `__0_0.distcp`, every chunk of `key` pointing at it
    (`as_bytes`: the entry marked a byte item instead, as DCP marks non-tensors)."""
    blob = io.BytesIO()
    torch.save(obj, blob)
    shard = os.path.join(folder, "__0_0.distcp")
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # our own test folder
    chunks = [i for i in metadata.storage_data if i.fqn == key]
    assert chunks, key
    if as_bytes:
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        for index in chunks:
            del metadata.storage_data[index]
        chunks = [MetadataIndex(key)]
    for index in chunks:
        metadata.storage_data[index] = _StorageInfo("__0_0.distcp", offset, len(blob.getvalue()))
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
