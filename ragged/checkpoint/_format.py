"""What a ragged checkpoint is on disk: the manifest, entry descriptions, errors, checksums.

[Note: checkpoint layout]
A checkpoint is a directory::

    path/
      .metadata            DCP's global metadata (pickled torch.distributed.checkpoint Metadata)
      __0_0.distcp ...     DCP data files, one per rank that wrote something
      manifest.json        written last, by rank 0: format version, world size, one entry per
                           state leaf (kind, shapes, dtypes, the plan of each DBuffer) and the
                           size + sha256 of every other file in the directory

Every sharded leaf of every DBuffer is stored in DCP as a 1-D tensor of ``numel`` elements
(its flattened global value, padding excluded); each rank writes one contiguous chunk
``[start, stop)`` per leaf piece it holds, so no rank ever holds another rank's data. The
leaf's true shape is in the manifest. Plain tensors are stored the same way (1-D, one chunk
covering everything, written once). Python scalars (``step``) live in the manifest only.

A directory without ``manifest.json`` is not a checkpoint: :func:`ragged.checkpoint.save`
writes into a hidden sibling directory and renames it into place only after every file and
the manifest are on disk (see [Note: publish by rename] in ``_save.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import re
from typing import Any

import torch

from ragged._errors import RaggedError, RaggedValueError

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "PerRank",
    "MANIFEST",
    "FORMAT",
    "VERSION",
]

MANIFEST = "manifest.json"
FORMAT = "ragged-checkpoint"
VERSION = 1
_JSON_SCALARS = (bool, int, float, str, type(None))


class CheckpointError(RaggedError):
    """A checkpoint could not be written or read (raised on every rank alike)."""


class CheckpointCorruptError(CheckpointError):
    """The files on disk are not a complete, intact ragged checkpoint (missing, truncated,
    or altered files; an unpublished directory)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is intact but does not fit the state it is loaded into (other tree,
    other shapes, other dtypes, other kinds of leaves)."""


_ERROR_TYPES = {cls.__name__: cls for cls in (CheckpointError, CheckpointCorruptError, CheckpointMismatchError)}


def error_type(name: str) -> type[CheckpointError]:
    return _ERROR_TYPES.get(name, CheckpointError)


@dataclasses.dataclass(frozen=True, slots=True)
class PerRank:
    """A tensor whose value differs per rank (e.g. a per-rank RNG state).

    Saved once per rank; loads back on the same rank, and only at the same world size (a
    per-rank value has no meaning on another number of ranks: give ``load`` a state without
    it, with ``strict=False``, and make a fresh one).

    Examples:
        >>> import torch
        >>> PerRank(torch.get_rng_state()).value.dtype
        torch.uint8
    """

    value: torch.Tensor


# ---- dtypes and descriptions ------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"the manifest names an unknown dtype {name!r}.")
    return dtype


def describe_plan(plan) -> dict[str, Any]:
    """JSON description of a LayoutPlan (what loading and export need, plus provenance)."""
    return {
        "world_size": plan.world_size,
        "shard_size": plan.shard_size,
        "dtype": dtype_name(plan.dtype),
        "strategy": plan.strategy,
        "fingerprint": plan.fingerprint(),
        "leaves": [
            {
                "path": leaf.path,
                "shape": list(leaf.shape),
                "dtype": dtype_name(leaf.dtype),
                "offset": leaf.offset,
                "numel": leaf.numel,
                "granule": leaf.granule,
                "spec": repr(leaf.spec),
            }
            for leaf in plan.leaves
        ],
        "replicated": [
            {"path": leaf.path, "shape": list(leaf.shape), "dtype": dtype_name(leaf.dtype), "numel": leaf.numel}
            for leaf in plan.replicated
        ],
    }


def leaf_fqn(entry_path: str, leaf_path: str) -> str:
    """The DCP key of one leaf of a DBuffer stored at ``entry_path`` of the state."""
    return entry_path + leaf_path


def per_rank_fqn(entry_path: str, rank: int) -> str:
    return f"{entry_path}@rank{rank}"


# ---- key paths -> dotted names (for export) ---------------------------------------------------
_TOKEN = re.compile(r"\[((?:'(?:[^'\\]|\\.)*')|(?:\"(?:[^\"\\]|\\.)*\")|[^\]]*)\]|\.([A-Za-z_]\w*)")


def path_parts(path: str) -> list[str]:
    """Splits a key path such as ``['layers'][0].mu['w']`` into ``['layers', '0', 'mu', 'w']``.

    A string key that is itself a key path (FSDP units plan ``{key path: tensor}`` trees) is
    split too.

    Examples:
        >>> path_parts("['layers'][0].mu['w']")
        ['layers', '0', 'mu', 'w']
        >>> path_parts('''["['layers'][0]"]["['layers'][0]['w']"]''')
        ['layers', '0', 'layers', '0', 'w']
    """
    if path == "<root>":
        return []
    parts, pos = [], 0
    while pos < len(path):
        match = _TOKEN.match(path, pos)
        if match is None:
            raise RaggedValueError(f"cannot parse key path {path!r} at position {pos}.")
        bracket, attr = match.groups()
        if attr is not None:
            parts.append(attr)
        else:
            try:
                value = ast.literal_eval(bracket)
            except (ValueError, SyntaxError):
                value = bracket
            if isinstance(value, str) and value.startswith("["):
                try:  # a key that is itself a key path (plans over {path: tensor} trees)
                    parts.extend(path_parts(value))
                    pos = match.end()
                    continue
                except ValueError:
                    pass
            parts.append(str(value))
        pos = match.end()
    return parts


# ---- manifest ---------------------------------------------------------------------------------
def file_digest(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": os.path.getsize(path), "sha256": digest}


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(path: str) -> dict[str, Any]:
    """Reads and checks the manifest of the checkpoint at ``path``.

    Raises:
        CheckpointCorruptError: no checkpoint there, or an unreadable manifest.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointCorruptError(
            f"no checkpoint at {path!r}: the directory does not exist. (A save that did not "
            "finish leaves only a hidden '.<name>.tmp-*' sibling, which is never loaded.)"
        )
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointCorruptError(
            f"{path!r} is not a published ragged checkpoint: it has no {MANIFEST}. The manifest "
            "is written last, so the save that produced this directory did not finish."
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{manifest_path!r} is unreadable ({exc}); the checkpoint is damaged.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{manifest_path!r} is not a {FORMAT} manifest.")
    if manifest.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{manifest_path!r} has format version {manifest.get('version')!r}; this ragged reads version {VERSION}."
        )
    for key in ("world_size", "entries", "files", "treedef"):
        if key not in manifest:
            raise CheckpointCorruptError(f"{manifest_path!r} lacks the field {key!r}; the checkpoint is damaged.")
    return manifest


def verify_files(path: str, manifest: dict[str, Any], names: list[str] | None = None, *, digest: bool = True) -> list[str]:
    """Checks sizes and (``digest=True``) sha256 of the manifest's files (or of ``names``).

    Returns a list of problems (empty when every checked file is intact).
    """
    problems = []
    files = manifest["files"]
    for name in sorted(files) if names is None else names:
        want = files[name]
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            problems.append(f"file {name!r} is missing")
            continue
        size = os.path.getsize(full)
        if size != want["size"]:
            problems.append(f"file {name!r} has {size} bytes, the manifest says {want['size']} (truncated or extended)")
            continue
        if digest and file_digest(full)["sha256"] != want["sha256"]:
            problems.append(f"file {name!r} has a different sha256 than the manifest records (altered bytes)")
    return problems
