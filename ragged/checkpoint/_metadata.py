"""Reading DCP's ``.metadata`` without running code, and checking it against the manifest.

[Note: reading .metadata safely]
DCP pickles its ``Metadata``, and ``pickle.load`` calls whatever the file names (``os.system``,
``builtins.eval``, ...). ragged reads it with an unpickler whose ``find_class`` returns only
what DCP's metadata is built from -- its dataclasses, ``torch.Size``, dtypes, the layout and
memory-format decoders, ``pathlib`` paths -- and refuses every other global. Pickle can only
call (``REDUCE``, ``NEWOBJ``) or set the state of (``BUILD``) objects that ``find_class``
returned, so nothing outside that list runs. (Tensor data is read by DCP with
``torch.load(weights_only=True)``, torch's own allow-listed unpickler.)

The object is then checked field by field against the manifest before any data file is opened:
every stored tensor a :class:`TensorStorageMetadata` of the size and dtype the manifest
promises, its chunks inside it, every storage entry a plain name of a file the manifest lists
(see [Note: what a checkpoint may name] in ``_format.py``) with its byte range inside that
file, no storage transforms, no byte entries (ragged never writes them).

A DCP directory another writer made (FSDP2, torchtitan: no ragged manifest) is checked by
:func:`check_foreign` against the directory itself: N-D tensors with their chunks inside them,
byte entries allowed (an optimizer's param groups; their values are read with
``torch.load(weights_only=True)``), every storage entry a regular file of the directory with
its byte range inside it, no transforms.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import stat
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from ragged._errors import is_sizes
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._format import CheckpointCorruptError

__all__ = ["read_metadata", "check_metadata", "check_foreign", "reader"]

METADATA = ".metadata"

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
for _cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
    _ALLOWED[("pathlib", _cls.__name__)] = _cls
_ALLOWED.update({("torch", name): dtype for name, dtype in fmt._DTYPES.items()})


class _MetadataUnpickler(pickle.Unpickler):
    """See [Note: reading .metadata safely]."""

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None:
            raise CheckpointCorruptError(
                f"{METADATA} asks to load {module}.{name}, which is not part of DCP's metadata; ragged never "
                "unpickles anything else (a crafted or foreign file), so the checkpoint is refused."
            )
        return found

    def persistent_load(self, pid):
        raise CheckpointCorruptError(f"{METADATA} holds a persistent reference, which DCP's metadata never has.")


def read_metadata(path: str) -> dcp_md.Metadata:
    """Unpickles ``path/.metadata`` with the allow-listed unpickler (never through a symlink)."""
    with fmt.open_regular(os.path.join(path, METADATA)) as f:
        data = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointCorruptError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointCorruptError(f"cannot read DCP metadata ({type(exc).__name__}: {exc}).") from None
    if not isinstance(metadata, dcp_md.Metadata):
        raise CheckpointCorruptError(f"{METADATA} holds a {type(metadata).__name__}, not DCP Metadata.")
    return metadata


def _is_size(x, dims: int | None = 1) -> bool:
    return isinstance(x, torch.Size) and (dims is None or len(x) == dims) and is_sizes(x)


def _check_tensor(fqn: str, md, dims: int | None) -> None:
    """A tensor entry of ``dims`` dimensions (any if None) whose chunks lie inside it."""
    if not isinstance(md, dcp_md.TensorStorageMetadata) or not _is_size(md.size, dims):
        what = "a tensor" if dims is None else "a 1-D tensor (ragged stores only those)"
        raise CheckpointCorruptError(f"{METADATA}: entry {fqn!r} is not {what}.")
    if not isinstance(md.chunks, list) or not isinstance(md.properties, dcp_md.TensorProperties):
        raise CheckpointCorruptError(f"{METADATA}: entry {fqn!r} has no chunk list.")
    n = len(md.size)
    for chunk in md.chunks:
        ok = isinstance(chunk, dcp_md.ChunkStorageMetadata) and _is_size(chunk.offsets, n) and _is_size(chunk.sizes, n)
        if not ok or any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size)):
            raise CheckpointCorruptError(f"{METADATA}: entry {fqn!r} has a chunk outside the tensor.")


def _check_storage(storage: dict, files: dict[str, int], listing: str) -> None:
    """Every storage entry a plain name of one of ``files`` (``{name: size}``, what ``listing``
    lists), its byte range inside that file, no transforms."""
    for index, info in storage.items():
        if not isinstance(index, dcp_md.MetadataIndex) or not isinstance(info, dcp_fs._StorageInfo):
            raise CheckpointCorruptError(f"{METADATA}: its storage table holds a {type(info).__name__}.")
        name = fmt.check_name(info.relative_path, f"{METADATA}")
        if name not in files or name == METADATA:
            raise CheckpointCorruptError(f"{METADATA} stores {index.fqn!r} in {name!r}, a file {listing} does not list.")
        if not is_sizes((info.offset, info.length)) or info.offset + info.length > files[name]:
            raise CheckpointCorruptError(f"{METADATA} stores {index.fqn!r} outside the bytes of {name!r}.")
        if info.transform_descriptors:
            raise CheckpointCorruptError(f"{METADATA} stores {index.fqn!r} through transforms {info.transform_descriptors!r}.")


def check_metadata(metadata: dcp_md.Metadata, files: dict, tensors: dict[str, tuple[int, str]]) -> None:
    """Checks ``metadata`` against the manifest's ``files`` and the ``fqn -> (numel, dtype)``
    the manifest promises (see [Note: reading .metadata safely]); raises CheckpointCorruptError."""
    stored, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(stored, dict) or not isinstance(storage, dict):
        raise CheckpointCorruptError(f"{METADATA} lacks its tensor table or its storage table.")
    for fqn, md in stored.items():
        _check_tensor(fqn, md, 1)
    _check_storage(storage, {name: f["size"] for name, f in files.items()}, "the manifest")
    for fqn, (numel, dtype) in tensors.items():
        md = stored.get(fqn)
        if md is None or tuple(md.size) != (numel,):
            raise CheckpointCorruptError(f"DCP metadata lacks {fqn!r} with {numel} elements that the manifest promises.")
        if md.properties.dtype != fmt.dtype_from_name(dtype):
            raise CheckpointCorruptError(f"DCP metadata stores {fqn!r} as {md.properties.dtype}; the manifest says {dtype}.")


def check_foreign(metadata: dcp_md.Metadata, path: str) -> None:
    """Checks the metadata of a DCP directory ``path`` that another writer made (see [Note:
    reading .metadata safely]); raises CheckpointCorruptError."""
    stored, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(stored, dict) or not isinstance(storage, dict):
        raise CheckpointCorruptError(f"{METADATA} lacks its tensor table or its storage table.")
    for fqn, md in stored.items():
        if not isinstance(fqn, str):
            raise CheckpointCorruptError(f"{METADATA}: an entry is named {fqn!r}, not by a string.")
        if not isinstance(md, dcp_md.BytesStorageMetadata):
            _check_tensor(fqn, md, None)
    files = {}
    for name in os.listdir(path):
        st = os.lstat(os.path.join(path, name))
        if stat.S_ISREG(st.st_mode):
            files[name] = st.st_size
    _check_storage(storage, files, f"the directory {path!r}")


class _NoFollowFileSystem(dcp_fs.FileSystem):
    """DCP's local filesystem, reading only regular files and never through a symlink."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise CheckpointCorruptError(f"a checkpoint is read only; DCP asked to open {os.fspath(path)!r} as {mode!r}.")
        with fmt.open_regular(os.fspath(path)) as stream:
            yield stream


def reader(path: str) -> FileSystemReader:
    """A DCP reader of the checkpoint directory ``path`` that opens files as :func:`fmt.open_regular`."""
    r = FileSystemReader(path)
    r.fs = _NoFollowFileSystem()
    return r
