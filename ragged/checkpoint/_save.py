"""`save`: write a training state as a DCP checkpoint, each rank writing only its own pieces."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import sys
import uuid
from typing import Any

import optree
import torch

from ragged._errors import RaggedTypeError, RaggedValueError
from ragged._pytree import keystr
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._dcp import DcpWrite, on_every_rank, reached, written_names
from ragged.collectives._agree import everyone
from ragged.checkpoint import _background as background
from ragged.checkpoint._format import CheckpointError
from ragged.checkpoint._kinds import is_entry, kind_of

__all__ = ["save", "retire", "SAVE_STEPS"]

#: The steps of the save protocol, in order (see [Note: protocol steps] in ``_dcp.py``):
#: every rank: the state agreed, its data written, the checksums exchanged; rank 0: the manifest
#: written, the old checkpoint off the path (overwrite), the new one at the path, the old one's
#: manifest removed.
SAVE_STEPS = ("agreed", "written", "checksummed", "manifest", "swapped", "published", "retired")


def flatten_state(state):
    """``(paths, leaves, treedef)`` with DBuffers and the other whole entries kept as leaves."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(state, namespace="ragged", is_leaf=is_entry)
    return [keystr(a) for a in accessors], leaves, treedef


def check_comm(comm, what: str) -> None:
    """Refuses values that are not a ragged Collectives (before any communication)."""
    for name in ("rank", "world_size", "all_gather_object"):
        if not hasattr(comm, name):
            raise RaggedTypeError(f"rg.checkpoint.{what}: comm is a {type(comm).__name__} without .{name}; pass a ragged Collectives.")


def describe_state(paths, leaves, comm, argname: str):
    """``(kinds, entries)``: each leaf's kind and JSON description (raising before any communication)."""
    kinds = [kind_of(leaf, f"{argname}{p}") for p, leaf in zip(paths, leaves)]
    entries = {p: kind.describe(f"{argname}{p}", leaf, comm) for p, leaf, kind in zip(paths, leaves, kinds)}
    if len(entries) != len(paths):
        raise RaggedValueError(f"{argname} has repeated key paths {paths}; a checkpoint needs unique paths.")
    return kinds, entries


def _disagreement(descriptions: list[str]) -> str | None:
    first = json.loads(descriptions[0])
    for rank, text in enumerate(descriptions[1:], start=1):
        if text == descriptions[0]:
            continue
        other = json.loads(text)
        if first["treedef"] != other["treedef"] or first["entries"].keys() != other["entries"].keys():
            missing = sorted(set(first["entries"]) - set(other["entries"]))
            extra = sorted(set(other["entries"]) - set(first["entries"]))
            return (
                f"rank {rank}'s state has another tree than rank 0's (paths only on rank 0: {missing[:5]}, "
                f"only on rank {rank}: {extra[:5]}; trees {first['treedef']} vs {other['treedef']})."
            )
        for p, entry in first["entries"].items():
            if entry != other["entries"][p]:
                return f"state{p} differs between rank 0 ({_short(entry)}) and rank {rank} ({_short(other['entries'][p])})."
    return None


def _short(entry: dict) -> str:
    if entry["kind"] == "dbuffer":
        return f"DBuffer {entry['dtype']}, plan {entry['plan']['fingerprint'][:12]}"
    return json.dumps(entry)[:200]


def _occupied(path: str) -> bool:
    """Something is at ``path``, or the checkpoint an interrupted overwrite moved aside."""
    return os.path.lexists(path) or bool(fmt.old_siblings(path))


def save(path, state, comm, *, overwrite: bool = False, blocking: bool = True) -> dict[str, Any] | background.SaveHandle:
    """Saves a training state as a sharded checkpoint: every rank writes only its own pieces.

    Call it on every rank of ``comm`` with that rank's state (for an HSDP comm: on every
    process of every replica; replica 0 writes the shards). The checkpoint appears at
    ``path`` complete or not at all: files go to a hidden sibling directory that rank 0
    renames to ``path`` after all ranks finished and the manifest (sizes and sha256 of every
    file) is on disk.

    Args:
        path: directory of the checkpoint (must not exist unless ``overwrite``; all ranks must
            see the same filesystem).
        state: a pytree (``ragged.pytree``: dicts, lists, tuples, NamedTuples, None) whose
            leaves are DBuffers (each rank's shard; saved as the plan's leaves, padding
            excluded), torch tensors (same value on every rank; written once),
            :class:`PerRank` tensors (one value per rank), LayoutPlans (their description) and
            Python scalars (kept in the manifest).
        comm: the ranks' ``Collectives`` (the one the DBuffers were sharded over).
        overwrite: replace an existing checkpoint at ``path``: at every instant the path holds
            the old checkpoint or the new one, both complete (see [Note: publish by rename]).
        blocking: ``False`` returns a :class:`SaveHandle` once this rank's pieces are copied
            (staged), and writes, hashes and publishes in the background (see [Note: a save
            in the background] in ``_background.py``): ``handle.result()`` waits and returns
            the manifest. One save is in flight at a time: the next save, ``result()`` and
            the interpreter's exit finish it, and raise its error on every rank.

    Returns:
        The manifest written (a dict; ``manifest["files"]`` lists the files with checksums),
        or with ``blocking=False`` a :class:`SaveHandle`.

    Raises:
        TypeError: a leaf of an unsupported type (its key path is named), before anything is
            written: on the rank that holds it, after the first round, which it joins with this
            error so that every other rank raises a CheckpointError naming it.
        ValueError: a DBuffer of another rank or world size (the same way).
        CheckpointError: ranks passed different states (other trees, shapes, or plain tensors
            with different values) or other paths, the path exists, writing failed, or a rank
            died or left the call; raised on every rank.

    Examples:
        >>> import tempfile, os, torch, ragged as rg
        >>> comm = rg.checkpoint.SingleProcess()
        >>> plan = rg.make_plan({"w": torch.empty(3, 2)}, world_size=1)
        >>> dbuf = rg.DBuffer(data=torch.arange(plan.shard_size, dtype=torch.float32),
        ...                   replicated=torch.empty(0), plan=plan, rank=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> manifest = rg.checkpoint.save(path, {"params": dbuf, "step": 7}, comm)
        >>> sorted(os.listdir(path))
        ['.metadata', '__0_0.distcp', 'manifest.json']
        >>> rg.checkpoint.load(path, {"params": dbuf, "step": 0}, comm)["step"]
        7
        >>> handle = rg.checkpoint.save(path + "-8", {"params": dbuf, "step": 8}, comm, blocking=False)
        >>> handle.result()["entries"]["['step']"]["value"]   # waits, publishes: the manifest
        8
    """
    check_comm(comm, "save")
    if not isinstance(blocking, bool):
        raise RaggedTypeError(f"rg.checkpoint.save: blocking must be True or False, got {blocking!r}.")
    path = os.path.abspath(os.fspath(path))
    background.settle()  # the save in flight first: its rounds come before this one's, on every rank
    call = f"save({path!r})"
    try:  # local validation first: a bad leaf's error joins the first round, raised on every rank
        paths, leaves, treedef = flatten_state(state)
        kinds, entries, failure = *describe_state(paths, leaves, comm, "state"), None
    except Exception as e:  # noqa: BLE001
        paths, leaves, treedef, kinds, entries, failure = [], [], None, (), {}, e
    token = _agreed_token(path, comm, call, paths, leaves, kinds, entries, treedef, overwrite, failure)
    reached("agreed")
    # [Note: HSDP] Replicas hold identical shards: replica 0 writes them, the others write
    # only their PerRank values; every process takes part in the protocol (and in loading).
    me, replica = everyone(comm)[0], getattr(comm, "replica_rank", 0)

    def pieces():  # made in dcp_save's first round: an error there raises on every rank
        return [pc for p, leaf, kind in zip(paths, leaves, kinds) if replica == 0 or kind.per_process
                for pc in kind.pieces(p, leaf, comm.rank, me)]

    manifest = {"format": fmt.FORMAT, "version": fmt.VERSION, "world_size": comm.world_size,
                "replicas": getattr(comm, "num_replicas", 1), "treedef": str(treedef), "entries": entries,
                "torch": torch.__version__}
    if blocking:
        return _Save(path, token, pieces, manifest, comm, call, overwrite).run()
    staging = {}

    def staged():  # the copies, made in the first round of the write, as the pieces are
        staging["pieces"], staging["bytes"], staging["ready"] = background.stage(pieces())
        return staging["pieces"]

    job = _Save(path, token, staged, manifest, comm, call, overwrite)
    return background.start(job, staging["bytes"], staging["ready"])


def _agreed_token(path: str, comm, call: str, paths, leaves, kinds, entries: dict, treedef, overwrite: bool,
                  failure: Exception | None) -> str:
    """Every rank's state agreed (one digest round; a second round names what differs) and the
    path free (or ``overwrite``): the token naming this save's temporary directory. ``failure``:
    this rank's error in describing its state, which joins the first round."""
    description = json.dumps({"treedef": str(treedef), "entries": entries}, sort_keys=True)

    def prepare():
        # Only a digest of the description travels (every rank receives every rank's object,
        # so full descriptions would cost world_size x their size per rank).
        agreements = {p: kind.agreement(leaf) for p, leaf, kind in zip(paths, leaves, kinds)}
        agreements = {p: v for p, v in agreements.items() if v is not None}
        digest = hashlib.sha256(description.encode()).hexdigest()
        return digest, agreements, _occupied(path), uuid.uuid4().hex[:12]

    gathered = on_every_rank(comm, call, "checking the state", prepare, failure=failure)
    problem = None
    if len({g[0] for g in gathered}) > 1:  # every rank sees this: all take the second round
        problem = _disagreement(on_every_rank(comm, call, "comparing states", lambda: description))
    else:
        for p, kind in zip(paths, kinds):
            if p in gathered[0][1]:
                problem = kind.settle(f"state{p}", entries[p], [g[1][p] for g in gathered])
                if problem:
                    break
    if problem is not None:
        raise CheckpointError(f"cannot save to {path!r}: {problem}")
    exists, token = gathered[0][2], gathered[0][3]
    if exists and not overwrite:
        raise CheckpointError(f"cannot save: {path!r} already exists. Pass overwrite=True to replace it, or pick a new path.")
    return token


class _Save:
    """One save after the state was agreed: every rank writes its ``pieces`` (or what a function
    of none makes, in the first round) into a hidden
    sibling of ``path`` (:meth:`write`: no collective), then the files are checksummed on every
    rank and rank 0 writes the metadata and the manifest and publishes the directory at
    ``path`` (:meth:`publish`, two rounds)."""

    def __init__(self, path: str, token: str, pieces, manifest: dict, comm, call: str, overwrite: bool):
        parent, name = os.path.split(path)
        self.path, self.tmp, self.token = path, os.path.join(parent, f".{name}.tmp-{token}"), token
        self.manifest, self.comm, self.call, self.overwrite = manifest, comm, call, overwrite
        self.me = everyone(comm)[0]
        self.dcp = DcpWrite(self.tmp, pieces, comm, call)
        with self.cleanup():
            self.dcp.plan()

    @contextlib.contextmanager
    def cleanup(self):
        try:
            yield
        except BaseException:
            if self.me == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def run(self) -> dict[str, Any]:
        return self.publish(self.write)

    def write(self):
        """This rank's files and their checksums: ``(write results, {name: digest})``."""
        results = self.dcp.write()
        return results, {n: fmt.file_digest(os.path.join(self.tmp, n)) for n in written_names(results)}

    def publish(self, written) -> dict[str, Any]:
        """``written()`` returns :meth:`write`'s outcome or raises its error; every rank calls this."""
        with self.cleanup():
            gathered = on_every_rank(self.comm, self.call, "checksums", written)
            reached("checksummed")
            files = {n: digest for _, d in gathered for n, digest in d.items()}

            def publish():
                if self.me != 0:
                    return None
                self.dcp.finish([results for results, _ in gathered])
                extra = {n: fmt.file_digest(os.path.join(self.tmp, n)) for n in os.listdir(self.tmp)
                         if n not in files and n != fmt.MANIFEST}  # .metadata, the empty file of a rank with nothing to write
                fmt.write_json_atomic(os.path.join(self.tmp, fmt.MANIFEST),
                                      fmt.with_checksum(dict(self.manifest, files=dict(files, **extra))))
                fmt.fsync_dir(self.tmp)
                reached("manifest")
                _publish(self.tmp, self.path, self.token, self.overwrite)
                return extra  # small: every rank rebuilds the manifest from what it has

            extra = on_every_rank(self.comm, self.call, "publishing", publish)[0]
            return fmt.with_checksum(dict(self.manifest, files=dict(files, **extra)))


def _exchange_dirs(a: str, b: str) -> bool:
    """Atomically swaps two directories (Linux ``renameat2(RENAME_EXCHANGE)``); False when the
    system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def retire(old: str) -> None:
    """Deletes a replaced checkpoint: its manifest first, so that a crash mid-way never leaves
    a half-deleted directory that looks like a checkpoint."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(old, fmt.MANIFEST))
    fmt.fsync_dir(old)
    reached("retired")
    shutil.rmtree(old, ignore_errors=True)


def _publish(tmp: str, path: str, token: str, overwrite: bool) -> None:
    """[Note: publish by rename]
    ``rename`` of a directory is atomic on POSIX filesystems: readers see either no
    checkpoint or a complete one (manifest included). Overwriting swaps the new directory with
    the old one in one ``renameat2(RENAME_EXCHANGE)`` where Linux offers it, so the path holds a
    complete checkpoint at every instant; then the old one is retired (manifest first). Elsewhere
    the old checkpoint is renamed to ``.<name>.old-<token>`` and the new one into place: between
    the two renames the path is empty, and ``load`` / ``export`` find the old checkpoint there by
    themselves (``_format.locate``), so a crash at any instant leaves a complete checkpoint that
    loads from ``path``. The next save at ``path`` retires such leftovers. Only directories that
    are ragged checkpoints (or empty) are ever replaced.
    """
    parent, name = os.path.split(path)
    if os.path.lexists(path):
        if not overwrite:
            raise CheckpointError(f"{path!r} appeared while saving; refusing to replace it (overwrite=False).")
        if not os.path.isdir(path) or os.path.islink(path) or (
            os.listdir(path) and not os.path.isfile(os.path.join(path, fmt.MANIFEST))
        ):
            raise CheckpointError(
                f"refusing to overwrite {path!r}: it is not a ragged checkpoint (no {fmt.MANIFEST}). Remove it yourself."
            )
        if _exchange_dirs(tmp, path):
            fmt.fsync_dir(parent)
            reached("swapped")
            reached("published")
            retire(tmp)
        else:
            old = os.path.join(parent, f".{name}.old-{token}")
            os.rename(path, old)
            fmt.fsync_dir(parent)
            reached("swapped")
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            fmt.fsync_dir(parent)
            reached("published")
            retire(old)
    else:
        os.rename(tmp, path)
        fmt.fsync_dir(parent)
        reached("published")
    for stale in fmt.old_siblings(path):  # left by an overwrite that crashed between its renames
        retire(stale)
