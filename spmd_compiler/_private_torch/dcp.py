"""torch.distributed.checkpoint (DCP) internals that an all-or-nothing load needs.

Touches ``torch.distributed.checkpoint._nested_dict.flatten_state_dict`` (the keys DCP
stores a nested state dict under) and the file system storage's per-item record
(``Metadata.storage_data``: ``MetadataIndex -> _StorageInfo(relative_path, offset,
length)``). Checked against torch 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["StoredItem", "read_checkpoint_metadata", "stored_items", "flatten_state", "item_is_readable"]


@dataclass(frozen=True)
class StoredItem:
    """One item of a checkpoint on disk: the state dict key it belongs to, its file
    (relative to the checkpoint folder), and its byte range there."""

    key: str
    file: str
    offset: int
    length: int
    tensor: bool


def read_checkpoint_metadata(path: str) -> Metadata:
    """The checkpoint's ``.metadata`` (raises what the reader raises)."""
    return FileSystemReader(path).read_metadata()


def stored_items(metadata: Metadata) -> list[StoredItem]:
    """Every stored item of the checkpoint, with its file and byte range."""
    out = []
    for index, info in (metadata.storage_data or {}).items():
        md = metadata.state_dict_metadata.get(index.fqn)
        out.append(StoredItem(index.fqn, info.relative_path, int(info.offset), int(info.length), isinstance(md, TensorStorageMetadata)))
    return out


def flatten_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` flattened under the keys DCP stores it by (``model.l1.weight``)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state_dict)[0]


def item_is_readable(path: str, item: StoredItem) -> bool:
    """Whether ``item``'s bytes are all in its file and (a tensor) load."""
    name = os.path.join(path, item.file)
    try:
        if os.path.getsize(name) < item.offset + item.length:
            return False
        if not item.tensor:
            return True
        with open(name, "rb") as f:
            f.seek(item.offset)
            data = f.read(item.length)
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return True
    except Exception:  # a missing or unreadable file, a damaged zip record
        return False
