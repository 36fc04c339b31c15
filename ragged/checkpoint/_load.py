"""`load` (into any world size / granularity) and `export` (one consolidated file)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch

from ragged._dbuffer import DBuffer
from ragged.checkpoint import _format as fmt
from ragged.checkpoint import _packed as pk
from ragged.checkpoint import _quant8 as q8
from ragged.checkpoint._dcp import Piece, SingleProcess, agree, dcp_load, everyone, read_metadata
from ragged.checkpoint._format import CheckpointCorruptError, CheckpointMismatchError, PerRank
from ragged.checkpoint._save import check_comm, describe, flatten_state
from ragged.spec._plan import LayoutPlan
from ragged._errors import RaggedKeyError

__all__ = ["load", "export", "read_manifest"]

_MAX_LISTED = 12


def read_manifest(path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (world size, entries with plans, files).

    Raises:
        CheckpointCorruptError: no published checkpoint at ``path``, or a damaged manifest.
    """
    return fmt.read_manifest(os.path.abspath(os.fspath(path)))


def _leaf_table(plan_desc: dict) -> dict[str, tuple[tuple[int, ...], int]]:
    """``leaf path -> (shape, numel)`` over sharded and replicated leaves of a described plan."""
    table = {}
    for leaf in plan_desc["leaves"] + plan_desc["replicated"]:
        table[leaf["path"]] = (tuple(leaf["shape"]), math.prod(leaf["shape"]))
    return table


def _compare_plans(where: str, saved: dict, like: dict, problems: list[str]) -> None:
    saved_t, like_t = _leaf_table(saved), _leaf_table(like)
    for p in sorted(set(saved_t) - set(like_t)):
        problems.append(f"{where}{p}: saved (shape {saved_t[p][0]}) but like_state's plan has no such leaf")
    for p in sorted(set(like_t) - set(saved_t)):
        problems.append(f"{where}{p}: like_state's plan has this leaf (shape {like_t[p][0]}) but the checkpoint does not")
    for p in sorted(set(saved_t) & set(like_t)):
        if saved_t[p][0] != like_t[p][0]:
            problems.append(f"{where}{p}: saved shape {saved_t[p][0]}, expected shape {like_t[p][0]}")


def _check(manifest: dict, paths, leaves, treedef, comm, *, strict: bool) -> list[str]:
    """Every difference between the checkpoint and ``like_state`` (empty list: it fits)."""
    problems: list[str] = []
    saved = manifest["entries"]
    like = {}
    for p, leaf in zip(paths, leaves):
        like[p] = describe(p, leaf, comm, argname="like_state")
    missing = [p for p in paths if p not in saved]
    for p in missing:
        problems.append(f"like_state{p}: not in the checkpoint")
    if strict:
        for p in sorted(set(saved) - set(like)):
            problems.append(f"like_state{p}: the checkpoint holds this entry but like_state does not (pass strict=False to skip it)")
        if not problems and manifest["treedef"] != str(treedef):
            problems.append(f"tree structure differs: saved {manifest['treedef']}, like_state {treedef}")
    for p in paths:
        if p not in saved:
            continue
        s, l = saved[p], like[p]
        where = f"like_state{p}"
        if s["kind"] != l["kind"]:
            problems.append(f"{where}: saved a {s['kind']}, like_state has a {l['kind']}")
            continue
        kind = s["kind"]
        if kind == "dbuffer":
            _compare_plans(where, s["plan"], l["plan"], problems)
            for key in ("dtype", "replicated_dtype"):
                if s[key] != l[key] and (key == "dtype" or l["plan"]["replicated"]):
                    problems.append(f"{where}: saved {key.replace('_', ' ')} {s[key]}, expected {l[key]}")
        elif kind == "tensor":
            if s["shape"] != l["shape"]:
                problems.append(f"{where}: saved shape {tuple(s['shape'])}, expected shape {tuple(l['shape'])}")
            if s["dtype"] != l["dtype"]:
                problems.append(f"{where}: saved dtype {s['dtype']}, expected dtype {l['dtype']}")
        elif kind == "per_rank":
            me, count = everyone(comm)
            if len(s["shapes"]) != count or manifest["world_size"] != comm.world_size:
                problems.append(
                    f"{where}: a PerRank value saved by {len(s['shapes'])} ranks cannot load on "
                    f"{count} ranks (leave it out of like_state with strict=False and make a fresh one)"
                )
                continue
            shape = tuple(s["shapes"][me])
            if shape != tuple(leaves[paths.index(p)].value.shape):
                problems.append(f"{where}: saved shape {shape} on rank {me}, expected {tuple(leaves[paths.index(p)].value.shape)}")
            if s["dtype"] != l["dtype"]:
                problems.append(f"{where}: saved dtype {s['dtype']}, expected dtype {l['dtype']}")
        elif kind == "quant8":
            _compare_plans(where, s["plan"], l["plan"], problems)
            q8.compare(where, s, l, problems)
        elif kind == "packed":
            _compare_plans(where, s["plan"], l["plan"], problems)
            if s["paths"] != l["paths"]:
                problems.append(f"{where}: saved a packed buffer of leaves {s['paths']}, like_state's holds {l['paths']} (other labels)")
            for key in ("dtype", "replicated_dtype"):
                if s[key] != l[key]:
                    problems.append(f"{where}: saved {key.replace('_', ' ')} {s[key]}, expected {l[key]}")
        elif kind == "plan":
            _compare_plans(where, s["plan"], l["plan"], problems)
        elif kind == "value":
            saved_type = "float" if s.get("nan") else type(s["value"]).__name__
            like_type = type(leaves[paths.index(p)]).__name__
            if saved_type != like_type and not (saved_type == "NoneType" or like_type == "NoneType"):
                problems.append(f"{where}: saved a {saved_type} ({s['value']!r}), like_state has a {like_type}")
    return problems


def _stored_fqns(manifest: dict, path: str, entry: dict, rank: int | None) -> dict[str, int]:
    """``fqn -> numel`` of the DCP tensors an entry was stored as (zero-size ones excluded)."""
    kind = entry["kind"]
    if kind == "dbuffer":
        return {
            fmt.leaf_fqn(path, leaf["path"]): math.prod(leaf["shape"])
            for leaf in entry["plan"]["leaves"] + entry["plan"]["replicated"]
            if math.prod(leaf["shape"])
        }
    if kind == "tensor":
        n = math.prod(entry["shape"])
        return {path: n} if n else {}
    if kind == "quant8":
        return {f: n for f, (n, _) in q8.stored(path, entry).items()}
    if kind == "packed":
        return pk.stored(path, entry)
    if kind == "per_rank":
        ranks = range(len(entry["shapes"])) if rank is None else [rank]
        return {
            fmt.per_rank_fqn(path, r): math.prod(entry["shapes"][r]) for r in ranks if math.prod(entry["shapes"][r])
        }
    return {}


def _open(path: str, rank: int, world_size: int, *, verify: bool, entries: list[str] | None = None):
    """Manifest + DCP metadata, with this rank's share of the checksums verified."""
    manifest = fmt.read_manifest(path)
    problems = []
    if ".metadata" not in manifest["files"]:
        problems.append("the manifest lists no .metadata file")
    else:
        # Every rank unpickles .metadata, so every rank checks it first. File sizes are always
        # checked (a stat); sha256 (the cost of reading every byte once more) with verify=True,
        # each rank hashing its share of the files.
        problems += fmt.verify_files(path, manifest, [".metadata"], digest=verify)
        others = [n for n in sorted(manifest["files"]) if n != ".metadata"]
        problems += fmt.verify_files(path, manifest, others, digest=False)
        if verify:
            problems += fmt.verify_files(path, manifest, others[rank::world_size])
    problems = list(dict.fromkeys(problems))
    if problems:
        raise CheckpointCorruptError(f"checkpoint {path!r} is damaged: " + "; ".join(problems[:_MAX_LISTED]))
    try:
        metadata = read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointCorruptError(f"checkpoint {path!r}: cannot read DCP metadata ({type(exc).__name__}: {exc}).") from None
    stored = metadata.state_dict_metadata
    for p, entry in manifest["entries"].items():
        if entries is not None and p not in entries:
            continue
        for fqn, numel in _stored_fqns(manifest, p, entry, None).items():
            md = stored.get(fqn)
            if md is None or tuple(getattr(md, "size", ())) != (numel,):
                raise CheckpointCorruptError(
                    f"checkpoint {path!r}: DCP metadata lacks {fqn!r} with {numel} elements that the manifest promises."
                )
    return manifest, metadata


def load(path, like_state, comm, *, strict: bool = True, verify: bool = True):
    """Loads a checkpoint into the layout of ``like_state``: any world size, any plan.

    ``like_state`` gives the structure and, for each DBuffer, the target plan (another world
    size, another granularity or leaf order: any plan of the same leaves). Each rank reads only
    the chunks that overlap its own pieces. Nothing in ``like_state`` is modified: the result
    is new tensors; the checkpoint is checked (manifest, checksums, every path, shape and
    dtype) on every rank before any data is read, and a problem raises on every rank.

    Args:
        path: a directory written by :func:`save`.
        like_state: a state of the same tree as the saved one (values are ignored; DBuffers
            supply plan, rank, dtype and device; tensors shape, dtype and device).
        comm: the ranks' ``Collectives`` (its world size may differ from the saver's).
        strict: when False, entries of the checkpoint that ``like_state`` lacks are skipped.
        verify: check every file's sha256 against the manifest (each rank hashes a share of
            the files); sizes are checked either way.

    Returns:
        A new state like ``like_state`` holding the checkpoint's values (padding zero).

    Raises:
        CheckpointCorruptError: no published checkpoint, or missing / truncated / altered files.
        CheckpointMismatchError: the checkpoint does not fit ``like_state``; the message lists
            every differing key path with saved and expected shape / dtype / kind.
    """
    check_comm(comm, "load")
    path = os.path.abspath(os.fspath(path))
    paths, leaves, treedef = flatten_state(like_state)

    me, count = everyone(comm)

    def check():
        manifest, metadata = _open(path, me, count, verify=verify, entries=set(paths))
        problems = _check(manifest, paths, leaves, treedef, comm, strict=strict)
        if problems:
            listed = "\n  ".join(problems[:_MAX_LISTED])
            more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
            raise CheckpointMismatchError(
                f"checkpoint {path!r} (saved by {manifest['world_size']} ranks) does not fit like_state:\n  {listed}{more}"
            )
        opened["manifest"], opened["metadata"] = manifest, metadata
        like_desc = json.dumps({p: describe(p, leaf, comm, argname="like_state") for p, leaf in zip(paths, leaves)}, sort_keys=True)
        return hashlib.sha256(like_desc.encode()).hexdigest()

    opened: dict[str, Any] = {}
    gathered = agree(comm, f"checkpoint load from {path!r}", check)
    for rank, desc in enumerate(gathered):
        if desc != gathered[0]:
            raise CheckpointMismatchError(
                f"ranks passed different like_state trees to load (rank 0 and rank {rank} differ in "
                "paths, plans, shapes or dtypes); every rank must pass its part of the same state."
            )
    manifest, metadata = opened["manifest"], opened["metadata"]

    new_leaves, pieces = [], []
    for p, leaf in zip(paths, leaves):
        entry = manifest["entries"][p]
        if isinstance(leaf, DBuffer):
            plan = leaf.plan
            data = torch.zeros(plan.shard_size, dtype=leaf.data.dtype, device=leaf.data.device)
            rep = torch.zeros_like(leaf.replicated)
            for piece in plan.local_pieces(comm.rank):
                view = data[piece.local_offset : piece.local_offset + piece.numel]
                pieces.append(Piece(fmt.leaf_fqn(p, piece.leaf.path), piece.start, piece.leaf.numel, view))
            for rleaf in plan.replicated:
                if rleaf.numel:
                    pieces.append(Piece(fmt.leaf_fqn(p, rleaf.path), 0, rleaf.numel, rep[rleaf.offset : rleaf.stop]))
            new_leaves.append(leaf.replace(data=data, replicated=rep))
        elif isinstance(leaf, pk.Packed):
            new = pk.allocate(leaf)
            pieces += [Piece(f, s, n, t) for f, s, n, t in pk.pieces(p, new, comm.rank)]
            new_leaves.append(new)
        elif isinstance(leaf, q8.Quant8):
            new = q8.allocate(leaf)
            pieces += [Piece(f, s, n, t) for f, s, n, t in q8.pieces(p, new, comm.rank)]
            new_leaves.append(new)
        elif isinstance(leaf, PerRank):
            value = torch.empty_like(leaf.value)
            if value.numel():
                pieces.append(Piece(fmt.per_rank_fqn(p, me), 0, value.numel(), value.view(-1)))
            new_leaves.append(PerRank(value))
        elif isinstance(leaf, torch.Tensor):
            value = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
            if value.numel():
                pieces.append(Piece(p, 0, value.numel(), value.view(-1)))
            new_leaves.append(value)
        elif isinstance(leaf, LayoutPlan):
            new_leaves.append(leaf)
        else:
            new_leaves.append(float("nan") if entry.get("nan") else entry["value"])
    dcp_load(path, pieces, metadata, comm)
    return treedef.unflatten(new_leaves)


def export(
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
        prefix: export only the entries under this dotted prefix, named relative to it (e.g.
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
        >>> rg.checkpoint.export(path)
        {'params.w': tensor([[0., 1.],
                [2., 3.]]), 'step': 3}
        >>> rg.checkpoint.export(path, prefix="params")
        {'w': tensor([[0., 1.],
                [2., 3.]])}
    """
    path = os.path.abspath(os.fspath(path))
    manifest, metadata = _open(path, 0, 1, verify=verify)
    head = None if prefix is None else prefix.strip(".")
    out: dict[str, Any] = {}
    pieces = []

    for p, entry in manifest["entries"].items():
        parts = fmt.path_parts(p)
        base = ".".join(parts)
        if head is None:
            rel = parts
        elif base == head:
            rel = []
        elif base.startswith(head + "."):
            rel = [base[len(head) + 1 :]]
        else:
            continue
        kind = entry["kind"]
        own = leaf_names and kind in ("dbuffer", "packed", "quant8")

        def put(leaf_parts: list[str], value, suffix: str = "") -> None:
            name = ".".join(leaf_parts if own else rel + leaf_parts) or (parts[-1] if parts else "state")
            name += suffix
            if name in out:
                raise CheckpointMismatchError(f"two entries of {path!r} export under the same name {name!r}.")
            out[name] = value

        def read(fqn: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            flat = torch.zeros(numel, dtype=dtype)
            if numel:
                pieces.append(Piece(fqn, 0, numel, flat))
            return flat

        if kind in ("dbuffer", "packed"):
            plan = entry["plan"]
            keep = set(entry["paths"]) if kind == "packed" else None
            for leaf, dtype in [(l, entry["dtype"]) for l in plan["leaves"]] + [
                (l, entry["replicated_dtype"]) for l in plan["replicated"]
            ]:
                if keep is not None and leaf["path"] not in keep:
                    continue
                shape = tuple(leaf["shape"])
                flat = read(fmt.leaf_fqn(p, leaf["path"]), math.prod(shape), fmt.dtype_from_name(dtype))
                put(fmt.path_parts(leaf["path"]), flat.view(shape))
        elif kind == "tensor":
            shape = tuple(entry["shape"])
            put([], read(p, math.prod(shape), fmt.dtype_from_name(entry["dtype"])).view(shape))
        elif kind == "per_rank":
            for r, shape in enumerate(entry["shapes"]):
                flat = read(fmt.per_rank_fqn(p, r), math.prod(shape), fmt.dtype_from_name(entry["dtype"]))
                put([], flat.view(tuple(shape)), f"@rank{r}")
        elif kind == "quant8":
            for leaf_parts, view, f, flat in q8.export(p, entry):
                if flat.numel():
                    pieces.append(Piece(f, 0, flat.numel(), flat))
                put(leaf_parts, view)
        elif kind == "value":
            put([], float("nan") if entry.get("nan") else entry["value"])
        # kind == "plan": metadata only, nothing to export
    if head is not None and not out:
        raise RaggedKeyError(f"checkpoint {path!r} has no entry under {prefix!r}; entries are {list(manifest['entries'])}.")
    dcp_load(path, pieces, metadata, SingleProcess())
    if out_file is not None:
        out_file = os.fspath(out_file)
        tmp = out_file + ".tmp"
        torch.save(out, tmp)
        os.replace(tmp, out_file)
    return out
