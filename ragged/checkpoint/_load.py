"""`load` (into any world size / granularity) and `consolidate` (one file of full tensors)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from ragged._errors import RaggedKeyError
from ragged._pytree import path_parts
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._dcp import SingleProcess, dcp_load, on_every_rank, reached
from ragged.collectives._agree import everyone
from ragged.checkpoint._entry import LoadSite
from ragged.checkpoint._format import CheckpointCorruptError, CheckpointMismatchError
from ragged.checkpoint._kinds import kind_named
from ragged.checkpoint._metadata import METADATA, check_metadata, read_metadata
from ragged.checkpoint._save import check_comm, describe_state, flatten_state

__all__ = ["load", "consolidate", "read_manifest", "LOAD_STEPS"]

#: The steps of the load protocol (see [Note: protocol steps] in ``_dcp.py``): the checkpoint
#: opened and checked on this rank, every rank agreed, this rank's data read.
LOAD_STEPS = ("opened", "agreed", "read")

_MAX_LISTED = 12
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def read_manifest(path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (world size, entries with plans, files).

    Raises:
        CheckpointCorruptError: no published checkpoint at ``path``, or a damaged manifest.

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(4, 2)}, world_size=1)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = rg.checkpoint.save(path, {"p": rg.shard(plan, {"w": torch.ones(4, 2)}, rank=0), "step": 7},
        ...                        rg.checkpoint.SingleProcess())
        >>> manifest = rg.checkpoint.read_manifest(path)
        >>> manifest["world_size"], sorted(manifest["entries"])
        (1, ["['p']", "['step']"])
    """
    return fmt.read_manifest(fmt.locate(os.path.abspath(os.fspath(path))))


def _check(manifest: dict, paths, leaves, kinds, like: dict, treedef, site: LoadSite, *, strict: bool) -> list[str]:
    """Every difference between the checkpoint and ``like_state`` (empty list: it fits)."""
    saved = manifest["entries"]
    problems = [f"like_state{p}: not in the checkpoint" for p in paths if p not in saved]
    if strict:
        problems += [f"like_state{p}: the checkpoint holds this entry but like_state does not (pass strict=False to skip it)"
                     for p in sorted(set(saved) - set(like))]
        if not problems and manifest["treedef"] != str(treedef):
            problems.append(f"tree structure differs: saved {manifest['treedef']}, like_state {treedef}")
    for p, leaf, kind in zip(paths, leaves, kinds):
        if p not in saved:
            continue
        s, where = saved[p], f"like_state{p}"
        if s["kind"] != kind.name:
            problems.append(f"{where}: saved a {s['kind']}, like_state has a {kind.name}")
            continue
        kind.compare(where, s, like[p], leaf, site, problems)
    return problems


def _open(path: str, rank: int, world_size: int, *, verify: bool, entries=None):
    """Manifest + DCP metadata of the checkpoint directory ``path``, with this rank's share of
    the checksums verified and the metadata checked against the manifest (see [Note: reading
    .metadata safely] in ``_metadata.py``)."""
    manifest = fmt.read_manifest(path)
    problems = []
    if METADATA not in manifest["files"]:
        problems.append(f"the manifest lists no {METADATA} file")
    else:
        # File sizes are always checked; sha256 (the cost of reading every byte once more) with
        # verify=True, each rank hashing its share of the files (.metadata: every rank reads it).
        problems += fmt.verify_files(path, manifest, [METADATA], digest=verify)
        others = [n for n in sorted(manifest["files"]) if n != METADATA]
        problems += fmt.verify_files(path, manifest, others, digest=False)
        if verify:
            problems += fmt.verify_files(path, manifest, others[rank::world_size])
    problems = list(dict.fromkeys(problems))
    if problems:
        raise CheckpointCorruptError(f"checkpoint {path!r} is damaged: " + "; ".join(problems[:_MAX_LISTED]))
    tensors = {}
    for p, entry in manifest["entries"].items():
        kind = kind_named(entry, p)
        try:
            stored = kind.stored(p, entry)
        except _MALFORMED as exc:
            raise CheckpointCorruptError(f"checkpoint {path!r}: the manifest's entry {p!r} is malformed ({exc!r}).") from None
        if entries is None or p in entries:
            tensors.update(stored)
    try:
        metadata = read_metadata(path)
        check_metadata(metadata, manifest["files"], tensors)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"checkpoint {path!r}: {exc}") from None
    return manifest, metadata


def load(path, like_state, comm, *, strict: bool = True, verify: bool = True):
    """Loads a checkpoint into the layout of ``like_state``: any world size, any plan.

    ``like_state`` gives the structure and, for each DBuffer, the target plan (another world
    size, another granularity or leaf order: any plan of the same leaves). Each rank reads only
    the chunks that overlap its own pieces. Nothing in ``like_state`` is modified: the result
    is new tensors; the checkpoint is checked (manifest, checksums, every path, shape and
    dtype) on every rank before any data is read, and a problem raises on every rank.

    Args:
        path: a directory written by :func:`save` (if an overwrite of it was interrupted
            between its two renames, the previous checkpoint it moved aside is loaded, with a
            RuntimeWarning).
        like_state: a state of the same tree as the saved one (values are ignored; DBuffers
            supply plan, rank, dtype and device; tensors shape, dtype and device).
        comm: the ranks' ``Collectives`` (its world size may differ from the saver's).
        strict: when False, entries of the checkpoint that ``like_state`` lacks are skipped.
        verify: check every file's sha256 against the manifest (each rank hashes a share of
            the files); sizes are checked either way.

    Returns:
        A new state like ``like_state`` holding the checkpoint's values (padding zero).

    Raises:
        CheckpointCorruptError: no published checkpoint (or a file at ``path``), missing /
            truncated / altered files, an edited manifest, or a crafted one (a file name outside
            the directory, a symlink, metadata that is not DCP's): see docs/checkpointing.md.
        CheckpointMismatchError: the checkpoint does not fit ``like_state``; the message lists
            every differing key path with saved and expected shape / dtype / kind.

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> params = {"w": torch.arange(12.0).view(6, 2)}
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> plan2 = rg.make_plan(params, world_size=2)
        >>> _ = rg.collectives.simulate(2, lambda c: rg.checkpoint.save(path, {"p": rg.shard(plan2, params, c)}, c))
        >>> plan3 = rg.make_plan(params, world_size=3)                 # resume on 3 ranks
        >>> def resume(comm):
        ...     state = rg.checkpoint.load(path, {"p": rg.shard(plan3, {"w": torch.zeros(6, 2)}, comm)}, comm)
        ...     return torch.equal(rg.gather(state["p"], comm)["w"], params["w"])
        >>> rg.collectives.simulate(3, resume)
        [True, True, True]
    """
    check_comm(comm, "load")
    path = os.path.abspath(os.fspath(path))
    try:  # an error here joins the first round (raised on every rank), as check()'s do
        paths, leaves, treedef, failure = *flatten_state(like_state), None
    except Exception as e:  # noqa: BLE001
        paths, leaves, treedef, failure = [], [], None, e
    me, count = everyone(comm)
    call = f"load({path!r})"

    def check():
        where = fmt.locate(path)
        manifest, metadata = _open(where, me, count, verify=verify, entries=set(paths))
        kinds, like = describe_state(paths, leaves, comm, "like_state")
        site = LoadSite(me, count, comm.world_size, manifest["world_size"])
        try:
            problems = _check(manifest, paths, leaves, kinds, like, treedef, site, strict=strict)
        except _MALFORMED as exc:
            raise CheckpointCorruptError(f"checkpoint {where!r}: the manifest is malformed ({exc!r}).") from None
        if problems:
            listed = "\n  ".join(problems[:_MAX_LISTED])
            more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
            raise CheckpointMismatchError(
                f"checkpoint {path!r} (saved by {manifest['world_size']} ranks) does not fit like_state:\n  {listed}{more}"
            )
        opened.update(manifest=manifest, metadata=metadata, where=where, kinds=kinds)
        reached("opened")
        like_digest = hashlib.sha256(json.dumps(like, sort_keys=True).encode()).hexdigest()
        return like_digest, where, fmt.manifest_checksum(manifest)

    opened: dict[str, Any] = {}
    gathered = on_every_rank(comm, call, "checking the checkpoint", check, failure=failure)
    for rank, (desc, where, checksum) in enumerate(gathered):
        if desc != gathered[0][0]:
            raise CheckpointMismatchError(
                f"ranks passed different like_state trees to load (rank 0 and rank {rank} differ in "
                "paths, plans, shapes or dtypes); every rank must pass its part of the same state."
            )
        if (where, checksum) != gathered[0][1:]:
            raise CheckpointCorruptError(
                f"ranks see different checkpoints at {path!r} (rank 0 reads {gathered[0][1]!r}, rank {rank} "
                f"{where!r}): the directory changed during the load, or the ranks do not share one filesystem."
            )
    reached("agreed")
    manifest, metadata, kinds = opened["manifest"], opened["metadata"], opened["kinds"]

    new_leaves = []

    def allocate():  # in the reading round: a rank that cannot allocate raises on every rank
        pieces = []
        for p, leaf, kind in zip(paths, leaves, kinds):
            new = kind.allocate(leaf, manifest["entries"][p])
            pieces += kind.pieces(p, new, comm.rank, me)
            new_leaves.append(new)
        return pieces

    dcp_load(opened["where"], allocate, metadata, comm, call)
    return treedef.unflatten(new_leaves)


def consolidate(
    path, out_file=None, *, prefix: str | None = None, leaf_names: bool = False, verify: bool = True
) -> dict[str, Any]:
    """Consolidates a checkpoint into one flat state dict of full tensors (single process).

    Keys are dotted names (``params.layers.0.w``: a DBuffer's leaves continue its own path),
    values are full tensors of their true shapes in the saved dtype, Python scalars as saved,
    per-rank values as ``name@rank<r>``, 8-bit Adam moments as ``<leaf>.mu_codes`` (uint8, leaf
    shape), ``<leaf>.mu_scales`` (fp32, one per block), ``<leaf>.mu`` (fp32). No padding.

    Args:
        path: a checkpoint written by :func:`save` (any world size).
        out_file: if given, the dict is also written there with ``torch.save`` (atomically).
        prefix: only the entries under this dotted prefix, named relative to it (e.g.
            ``prefix="params"`` gives keys that ``nn.Module.load_state_dict`` accepts).
        leaf_names: name each DBuffer leaf by its own path in the DBuffer's plan only (the
            DBuffer's place in the state dropped). For FSDP unit shards
            (``{unit name: DBuffer}``, whose plans carry full parameter names), ``prefix=
            "<path to the shards>", leaf_names=True`` gives the module's state dict.
        verify: check every file's sha256 first (sizes are checked either way).

    Returns:
        The consolidated dict.

    Raises:
        CheckpointCorruptError: missing or damaged files.
        KeyError: nothing under ``prefix``.
        CheckpointMismatchError: two entries would get the same name.

    Examples:
        >>> import tempfile, os, torch, ragged as rg
        >>> comm = rg.checkpoint.SingleProcess()
        >>> plan = rg.make_plan({"w": torch.empty(2, 2)}, world_size=1)
        >>> dbuf = rg.DBuffer(data=torch.arange(plan.shard_size, dtype=torch.float32),
        ...                   replicated=torch.empty(0), plan=plan, rank=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = rg.checkpoint.save(path, {"params": dbuf, "step": 3}, comm)
        >>> rg.checkpoint.consolidate(path)
        {'params.w': tensor([[0., 1.],
                [2., 3.]]), 'step': 3}
        >>> rg.checkpoint.consolidate(path, prefix="params")
        {'w': tensor([[0., 1.],
                [2., 3.]])}
    """
    path = os.path.abspath(os.fspath(path))
    where = fmt.locate(path)
    manifest, metadata = _open(where, 0, 1, verify=verify)
    head = None if prefix is None else prefix.strip(".")
    out: dict[str, Any] = {}
    pieces = []
    try:
        for p, entry in manifest["entries"].items():
            parts = path_parts(p)
            base = ".".join(parts)
            if head is None:
                rel = parts
            elif base == head:
                rel = []
            elif base.startswith(head + "."):
                rel = [base[len(head) + 1 :]]
            else:
                continue
            kind = kind_named(entry, p)
            own = leaf_names and kind.holds_leaves
            for item in kind.consolidate(p, entry):
                name = ".".join(item.parts if own else rel + item.parts) or (parts[-1] if parts else "state")
                name += item.suffix
                if name in out:
                    raise CheckpointMismatchError(f"two entries of {path!r} consolidate under the same name {name!r}.")
                out[name] = item.value
                pieces += item.pieces
    except _MALFORMED as exc:
        raise CheckpointCorruptError(f"checkpoint {where!r}: the manifest is malformed ({exc!r}).") from None
    if head is not None and not out:
        raise RaggedKeyError(f"checkpoint {path!r} has no entry under {prefix!r}; entries are {list(manifest['entries'])}.")
    dcp_load(where, pieces, metadata, SingleProcess(), f"consolidate({path!r})")
    if out_file is not None:
        out_file = os.fspath(out_file)
        tmp = out_file + ".tmp"
        torch.save(out, tmp)
        os.replace(tmp, out_file)
    return out
