"""What a ragged checkpoint is on disk: the manifest, entry descriptions, errors, checksums.

[Note: checkpoint layout]
A checkpoint is a directory::

    path/
      .metadata            DCP's global metadata (pickled torch.distributed.checkpoint Metadata)
      __0_0.distcp ...     DCP data files, one per rank that wrote something
      manifest.json        written last, by rank 0: format version, world size, one entry per
                           state leaf (kind, shapes, dtypes, the plan of each DBuffer), the
                           size + sha256 of every other file in the directory, and the sha256
                           of its own content (``checksum``; absent in checkpoints written
                           before ragged recorded it, which still load)

Every sharded leaf of every DBuffer is stored in DCP as a 1-D tensor of ``numel`` elements
(its flattened global value, padding excluded); each rank writes one contiguous chunk
``[start, stop)`` per leaf piece it holds, so no rank ever holds another rank's data. The
leaf's true shape is in the manifest. Plain tensors are stored the same way (1-D, one chunk
covering everything, written once). Python scalars (``step``) live in the manifest only.

A directory without ``manifest.json`` is not a checkpoint: :func:`ragged.checkpoint.save`
writes into a hidden sibling directory and renames it into place only after every file and
the manifest are on disk (see [Note: publish by rename] in ``_save.py``).

[Note: what a checkpoint may name]
Every file name in the manifest, and every storage path in DCP's ``.metadata``, must be a plain
name (no separator, not ``.`` / ``..``, not absolute) of a regular file directly inside the
checkpoint directory (no symlink, no device, no FIFO): names are checked as strings before any
file is touched, and files are opened with ``O_NOFOLLOW`` and checked with ``fstat`` on the
open descriptor. So a checkpoint can only make ragged read its own files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import stat
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ragged._errors import RaggedError

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "require_path",
    "PerRank",
    "MANIFEST",
    "FORMAT",
    "VERSION",
]

MANIFEST = "manifest.json"
FORMAT = "ragged-checkpoint"
VERSION = 1


class CheckpointError(RaggedError):
    """A checkpoint could not be written or read (raised on every rank alike).

    Examples:
        >>> import os, tempfile, ragged as rg
        >>> try:
        ...     rg.checkpoint.read_manifest(os.path.join(tempfile.mkdtemp(), "nothing-here"))
        ... except rg.checkpoint.CheckpointError as err:           # the base of the kinds below
        ...     print(type(err).__name__)
        CheckpointNotFoundError
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing exists at the path given (a typo, not a damaged checkpoint); also a
    ``FileNotFoundError``. The message names the path.

    Examples:
        >>> import ragged as rg
        >>> try:
        ...     rg.checkpoint.pretrained("/no/such/dir")
        ... except FileNotFoundError as err:
        ...     print(type(err).__name__, err)
        CheckpointNotFoundError '/no/such/dir' does not exist (rg.checkpoint.pretrained reads a Hugging Face model directory).
    """


def require_path(path, reader: str) -> str:
    """``path`` as a string; :class:`CheckpointNotFoundError` naming it when nothing is there
    (``reader``: what reads it, for the message)."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"{path!r} does not exist ({reader}).")
    return path


class CheckpointCorruptError(CheckpointError):
    """The files on disk are not a complete, intact ragged checkpoint (missing, truncated,
    or altered files; an unpublished directory).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = rg.checkpoint.save(path, {"x": torch.arange(4.0)}, rg.checkpoint.SingleProcess())
        >>> data = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
        >>> with open(data[0], "r+b") as f:
        ...     _ = f.write(b"garbage")                            # alter a data file
        >>> rg.checkpoint.consolidate(path)
        Traceback (most recent call last):
        ...
        ragged.checkpoint._format.CheckpointCorruptError: ...
    """


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is intact but does not fit the state it is loaded into (other tree,
    other shapes, other dtypes, other kinds of leaves).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> comm = rg.checkpoint.SingleProcess()
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = rg.checkpoint.save(path, {"x": torch.zeros(4)}, comm)
        >>> try:
        ...     rg.checkpoint.load(path, {"x": torch.zeros(5)}, comm)
        ... except rg.checkpoint.CheckpointMismatchError as err:
        ...     print(isinstance(err, ValueError), "['x']" in str(err))
        True True
    """


_ERROR_TYPES = {cls.__name__: cls for cls in (CheckpointError, CheckpointCorruptError, CheckpointMismatchError,
                                                 CheckpointNotFoundError)}


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


class RefMapping(Mapping):
    """A read-only ``{name: reference}`` over ``self._refs``: the lazy views of a directory."""

    _refs: dict

    def __getitem__(self, name: str):
        return self._refs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)


# ---- dtypes and descriptions ------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def dtype_from_name(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
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
                "spec": repr(leaf.granularity),
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


# ---- names and files (see [Note: what a checkpoint may name]) --------------------------------
def check_name(name, what: str) -> str:
    """``name`` if it is a plain file name inside a directory; otherwise CheckpointCorruptError."""
    plain = (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in ("/", "\\", "\x00"))
             and os.path.basename(name) == name and not os.path.isabs(name))
    if not plain:
        raise CheckpointCorruptError(
            f"{what} names the file {name!r}, which is not a plain file name inside the checkpoint "
            "directory; a checkpoint may only refer to its own files, so it is refused."
        )
    return name


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def open_regular(path: str):
    """Opens ``path`` for reading if it is a regular file and not a symlink (a binary file object).

    Raises:
        CheckpointCorruptError: a symlink, a directory, a FIFO or device, or a missing file.
    """
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):  # pragma: no cover - no O_NOFOLLOW (Windows)
        raise CheckpointCorruptError(f"{path!r} is a symlink; a checkpoint's files must be regular files.")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"file {os.path.basename(path)!r} is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointCorruptError(
                f"file {os.path.basename(path)!r} is a symlink; a checkpoint's files must be regular files "
                "inside its directory."
            ) from None
        raise CheckpointCorruptError(f"file {os.path.basename(path)!r} cannot be opened ({exc.strerror}).") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"file {os.path.basename(path)!r} is not a regular file.")
    return os.fdopen(fd, "rb")


def _digest_open(f) -> dict[str, Any]:
    return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def file_digest(path: str) -> dict[str, Any]:
    """``{"size", "sha256"}`` of a regular file (never through a symlink)."""
    with open_regular(path) as f:
        return _digest_open(f)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


# ---- manifest ---------------------------------------------------------------------------------
def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its ``checksum`` field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def with_checksum(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` as it reads back from JSON, with its ``checksum``."""
    plain = json.loads(json.dumps({k: v for k, v in manifest.items() if k != "checksum"}))
    return dict(plain, checksum=manifest_checksum(plain))


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def old_siblings(path: str) -> list[str]:
    """Hidden ``.<name>.old-*`` siblings of ``path`` (previous checkpoints an overwrite moved
    aside; see [Note: publish by rename] in ``_save.py``), newest manifest first, only those
    with a manifest."""
    parent, name = os.path.split(path)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = []
    for entry in names:
        if entry.startswith(f".{name}.old-"):
            full = os.path.join(parent, entry)
            try:
                st = os.lstat(os.path.join(full, MANIFEST))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime_ns, entry, full))
    return [full for _, _, full in sorted(found, reverse=True)]


def locate(path: str) -> str:
    """The directory holding the checkpoint published at ``path``: ``path`` itself, or, when an
    overwrite was interrupted between its two renames, the previous checkpoint it moved aside.

    Raises:
        CheckpointNotFoundError: nothing there.
        CheckpointCorruptError: ``path`` is a file.
    """
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise CheckpointCorruptError(
                f"{path!r} is a file, not a checkpoint directory: rg.checkpoint.save writes a directory "
                "(rg.checkpoint.consolidate writes single files, which torch.load(..., weights_only=True) reads)."
            )
        return path
    for old in old_siblings(path):
        warnings.warn(
            f"no checkpoint at {path!r}, but an overwrite of it did not finish: loading the previous "
            f"checkpoint it had moved aside, {os.path.basename(old)!r}.",
            RuntimeWarning,
            stacklevel=3,
        )
        return old
    raise CheckpointNotFoundError(
        f"no checkpoint at {path!r}: the directory does not exist. (A save that did not "
        "finish leaves only a hidden '.<name>.tmp-*' sibling, which is never loaded.)"
    )


def read_manifest(path: str) -> dict[str, Any]:
    """Reads and checks the manifest of the checkpoint directory ``path`` (see :func:`locate`).

    Raises:
        CheckpointCorruptError: no checkpoint there, or a damaged or edited manifest.
    """
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.lexists(manifest_path):
        raise CheckpointCorruptError(
            f"{path!r} is not a published ragged checkpoint: it has no {MANIFEST}. The manifest "
            "is written last, so the save that produced this directory did not finish."
        )
    try:
        with open_regular(manifest_path) as f:
            manifest = json.load(f)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"checkpoint {path!r}: {exc}") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{manifest_path!r} is unreadable ({exc}); the checkpoint is damaged.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{manifest_path!r} is not a {FORMAT} manifest.")
    if manifest.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{manifest_path!r} has format version {manifest.get('version')!r}; this ragged reads version {VERSION}."
        )
    if "checksum" in manifest and manifest["checksum"] != manifest_checksum(manifest):
        raise CheckpointCorruptError(
            f"{manifest_path!r} was altered after it was written: its content does not match its own checksum "
            "(a damaged disk, or an edit by hand). Restore the file or save the checkpoint again."
        )
    for key, types in (("world_size", int), ("entries", dict), ("files", dict), ("treedef", str)):
        if not isinstance(manifest.get(key), types):
            raise CheckpointCorruptError(f"{manifest_path!r} lacks the field {key!r}; the checkpoint is damaged.")
    for name, want in manifest["files"].items():
        check_name(name, f"the manifest of {path!r}")
        if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("sha256"), str)):
            raise CheckpointCorruptError(f"{manifest_path!r} describes the file {name!r} without a size and sha256.")
    if MANIFEST in manifest["files"]:
        raise CheckpointCorruptError(f"{manifest_path!r} lists itself among the files it checks.")
    return manifest


def verify_files(path: str, manifest: dict[str, Any], names: list[str] | None = None, *, digest: bool = True) -> list[str]:
    """Checks sizes and (``digest=True``) sha256 of the manifest's files (or of ``names``).

    Every name was checked by :func:`read_manifest`; files are opened without following links.
    Returns a list of problems (empty when every checked file is intact).
    """
    problems = []
    files = manifest["files"]
    for name in sorted(files) if names is None else names:
        want = files[name]
        try:
            f = open_regular(os.path.join(path, name))
        except CheckpointCorruptError as exc:
            problems.append(str(exc))
            continue
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != want["size"]:
                problems.append(f"file {name!r} has {size} bytes, the manifest says {want['size']} (truncated or extended)")
                continue
            if digest and _digest_open(f)["sha256"] != want["sha256"]:
                problems.append(f"file {name!r} has a different sha256 than the manifest records (altered bytes)")
    return problems
