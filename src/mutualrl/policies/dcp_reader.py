"""Reading a sharded checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint``'s ``FileSystemReader`` reads the checkpoint's ``.metadata`` with
a plain ``pickle.load``, which runs whatever a rewritten file asks for; the shards themselves are
raw tensor bytes and ``torch.load(weights_only=True)``. Run folders are shared, so
``SafeFileSystemReader`` reads the metadata with an unpickler that builds only the classes a
checkpoint's metadata is made of (DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts,
a path) and refuses any other, naming it. Imported only where a sharded checkpoint is read.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

METADATA = ".metadata"


def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) -> the object the metadata may name: nothing that acts when called."""
    names = {
        (dcp_md.__name__, n): getattr(dcp_md, n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    }
    names[(dcp_fs.__name__, "_StorageInfo")] = dcp_fs._StorageInfo
    names[("torch", "Size")] = torch.Size
    names[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    names.update(
        {
            ("pathlib", n): getattr(__import__("pathlib"), n)
            for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
        }
    )
    names.update(
        {
            ("torch", n): getattr(torch, n)
            for n in dir(torch)
            if isinstance(getattr(torch, n, None), torch.dtype)
        }
    )
    return names


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.allowed, self.where = _allowed(), where

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"{self.where}: names {module}.{name}, which checkpoint "
                "metadata does not hold; not read"
            )
        return found


def read_metadata(path: str | Path) -> dcp_md.Metadata:
    """A sharded checkpoint's metadata file, read as data (see the module docstring)."""
    data = Path(path).read_bytes()
    metadata = _MetadataUnpickler(io.BytesIO(data), str(path)).load()
    if not isinstance(metadata, dcp_md.Metadata):
        raise pickle.UnpicklingError(
            f"{path}: holds a {type(metadata).__name__}, expected checkpoint metadata"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by ``read_metadata``, not by ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        metadata = read_metadata(Path(self.path) / name)
        storage: dcp_md.StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage is None:
            storage = metadata.storage_meta = dcp_md.StorageMeta()
        storage.load_id = self.load_id
        return metadata
