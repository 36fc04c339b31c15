"""`save`: write a training state as a DCP checkpoint, each rank writing only its own pieces."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from typing import Any

import optree
import torch

from ragged._dbuffer import DBuffer
from ragged._pytree import keystr
from ragged.checkpoint import _format as fmt
from ragged.checkpoint import _packed as pk
from ragged.checkpoint import _quant8 as q8
from ragged.checkpoint._dcp import Piece, agree, dcp_save, everyone
from ragged.checkpoint._format import CheckpointError, PerRank
from ragged.spec._plan import LayoutPlan
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["save"]

_SUPPORTED = (
    "DBuffers, torch tensors, rg.checkpoint.PerRank(tensor), 8-bit Adam moments bound with "
    "rg.checkpoint.bind_quant8, packed states bound with rg.checkpoint.bind_packed / bind_muon, "
    "LayoutPlans, and Python scalars "
    "(bool, int, float, str, None)"
)


def is_entry(x) -> bool:
    return isinstance(x, (DBuffer, PerRank, q8.Quant8, pk.Packed))


def flatten_state(state):
    """``(paths, leaves, treedef)`` with DBuffers and PerRank values kept whole as leaves."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(state, namespace="ragged", is_leaf=is_entry)
    return [keystr(a) for a in accessors], leaves, treedef


def check_comm(comm, what: str) -> None:
    """Refuses values that are not a ragged Collectives (before any communication)."""
    for name in ("rank", "world_size", "all_gather_object"):
        if not hasattr(comm, name):
            raise RaggedTypeError(f"rg.checkpoint.{what}: comm is a {type(comm).__name__} without .{name}; pass a ragged Collectives.")


def describe(path: str, leaf, comm, *, argname: str) -> dict[str, Any]:
    """JSON description of one state leaf; raises TypeError/ValueError naming ``path``."""
    where = f"{argname}{path}"
    if isinstance(leaf, DBuffer):
        plan = leaf.plan
        if leaf.rank != comm.rank:
            raise RaggedValueError(
                f"{where} is a DBuffer of rank {leaf.rank}, but this process is rank {comm.rank} of the comm. "
                "Each rank saves its own shard: pass the DBuffer that rg.shard returned on this rank."
            )
        if plan.world_size != comm.world_size:
            raise RaggedValueError(
                f"{where} is a DBuffer planned for world_size={plan.world_size}, but the comm has "
                f"world_size={comm.world_size}. Save with the comm the state was sharded over."
            )
        if leaf.data.dim() != 1 or leaf.data.numel() != plan.shard_size:
            raise RaggedValueError(
                f"{where}.data has shape {tuple(leaf.data.shape)}; its plan needs a 1-D tensor of "
                f"shard_size={plan.shard_size} elements. If it is the packed state of a compact "
                "multi_transform label (e.g. rg.optim.muon's AdamW part), bind the optimizer state first: "
                "rg.checkpoint.bind_muon(opt_state) or rg.checkpoint.bind_packed(opt_state, labels, compact)."
            )
        rep_end = max((l.stop for l in plan.replicated), default=0)
        if leaf.replicated.dim() != 1 or leaf.replicated.numel() < rep_end:
            raise RaggedValueError(
                f"{where}.replicated has shape {tuple(leaf.replicated.shape)}; its plan needs a 1-D "
                f"tensor of at least {rep_end} elements."
            )
        return {
            "kind": "dbuffer",
            "dtype": fmt.dtype_name(leaf.data.dtype),
            "replicated_dtype": fmt.dtype_name(leaf.replicated.dtype),
            "plan": fmt.describe_plan(plan),
        }
    if isinstance(leaf, q8.Quant8):
        return q8.describe(where, leaf, comm)
    if isinstance(leaf, pk.Packed):
        return pk.describe(where, leaf, comm)
    if isinstance(leaf, PerRank):
        if not isinstance(leaf.value, torch.Tensor):
            raise RaggedTypeError(f"{where} is PerRank({type(leaf.value).__name__}); PerRank holds a torch tensor.")
        return {"kind": "per_rank", "dtype": fmt.dtype_name(leaf.value.dtype)}
    if isinstance(leaf, torch.Tensor):
        return {"kind": "tensor", "shape": list(leaf.shape), "dtype": fmt.dtype_name(leaf.dtype)}
    if isinstance(leaf, LayoutPlan):
        return {"kind": "plan", "plan": fmt.describe_plan(leaf)}
    if isinstance(leaf, fmt._JSON_SCALARS):
        if isinstance(leaf, float) and leaf != leaf:
            return {"kind": "value", "value": None, "nan": True}
        return {"kind": "value", "value": leaf}
    raise RaggedTypeError(
        f"{where} is a {type(leaf).__name__}, which a checkpoint cannot hold. Supported leaves: "
        f"{_SUPPORTED}. Fix: convert it (e.g. a torch.Generator's get_state()) or leave it out of the state."
    )


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def pieces_of(path: str, leaf, rank: int, *, index: int | None = None) -> list[Piece]:
    """This rank's pieces of one state leaf (1-D chunks; see [Note: checkpoint layout]).
    ``index`` names PerRank values (the process index, replicas included)."""
    out = []
    if isinstance(leaf, DBuffer):
        data, plan = leaf.data.detach(), leaf.plan
        for piece in plan.local_pieces(rank):
            view = data[piece.local_offset : piece.local_offset + piece.numel]
            out.append(Piece(fmt.leaf_fqn(path, piece.leaf.path), piece.start, piece.leaf.numel, view))
        for rleaf in plan.replicated:
            if rleaf.numel:
                view = leaf.replicated.detach()[rleaf.offset : rleaf.offset + rleaf.numel]
                out.append(Piece(fmt.leaf_fqn(path, rleaf.path), 0, rleaf.numel, view))
    elif isinstance(leaf, q8.Quant8):
        out += [Piece(f, s, n, t) for f, s, n, t in q8.pieces(path, leaf, rank)]
    elif isinstance(leaf, pk.Packed):
        out += [Piece(f, s, n, t.detach()) for f, s, n, t in pk.pieces(path, leaf, rank)]
    elif isinstance(leaf, PerRank):
        if leaf.value.numel():
            who = rank if index is None else index
            out.append(Piece(fmt.per_rank_fqn(path, who), 0, leaf.value.numel(), leaf.value.detach().reshape(-1)))
    elif isinstance(leaf, torch.Tensor):
        if leaf.numel():
            out.append(Piece(path, 0, leaf.numel(), leaf.detach().reshape(-1)))
    return out


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


def save(path, state, comm, *, overwrite: bool = False) -> dict[str, Any]:
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
        overwrite: replace an existing checkpoint at ``path`` (it stays intact until the new
            one is complete).

    Returns:
        The manifest written (a dict; ``manifest["files"]`` lists the files with checksums).

    Raises:
        TypeError: a leaf of an unsupported type (its key path is named), before any
            communication.
        ValueError: a DBuffer of another rank or world size, before any communication.
        CheckpointError: ranks passed different states (other trees, shapes, or plain tensors
            with different values), the path exists, or writing failed; raised on every rank.

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
    """
    check_comm(comm, "save")
    path = os.path.abspath(os.fspath(path))
    paths, leaves, treedef = flatten_state(state)
    # Local validation first: a bad leaf raises here, before any communication.
    entries = {p: describe(p, leaf, comm, argname="state") for p, leaf in zip(paths, leaves)}
    if len(entries) != len(paths):
        raise RaggedValueError(f"state has repeated key paths {paths}; a checkpoint needs unique paths.")

    description = json.dumps({"treedef": str(treedef), "entries": entries}, sort_keys=True)

    def prepare():
        # Only a digest of the description travels (all_gather_object pads every rank's object
        # to the largest, so full descriptions would cost world_size x their size per rank).
        digests = {
            p: tensor_digest(leaf) for p, leaf in zip(paths, leaves)
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DBuffer)
        }
        replicated = {
            p: tensor_digest(leaf.replicated) for p, leaf in zip(paths, leaves) if isinstance(leaf, DBuffer)
        }
        shapes = {p: list(leaf.value.shape) for p, leaf in zip(paths, leaves) if isinstance(leaf, PerRank)}
        digest = hashlib.sha256(description.encode()).hexdigest()
        return digest, digests, replicated, shapes, os.path.exists(path), uuid.uuid4().hex[:12]

    gathered = agree(comm, "checkpoint save (checking the state on every rank)", prepare)
    problem = None
    if len({g[0] for g in gathered}) > 1:  # every rank sees this: all take the second round
        problem = _disagreement(agree(comm, "checkpoint save (comparing states)", lambda: description))
    else:
        for rank, g in enumerate(gathered[1:], start=1):
            for key, (which, fix) in ((1, ("tensor", "wrap it in rg.checkpoint.PerRank")), (2, ("replicated leaves of DBuffer", "all-reduce it"))):
                for p, digest in g[key].items():
                    if digest != gathered[0][key][p]:
                        problem = (
                            f"state{p} ({which}) holds different values on rank 0 and rank {rank}; a plain "
                            f"tensor is saved once, so it must be the same on every rank. Fix: {fix}, or "
                            "store per-rank data as a DBuffer."
                        )
                        break
                if problem:
                    break
            if problem:
                break
    if problem is not None:
        raise CheckpointError(f"cannot save to {path!r}: {problem}")
    exists, token = gathered[0][4], gathered[0][5]
    if exists and not overwrite:
        raise CheckpointError(f"cannot save: {path!r} already exists. Pass overwrite=True to replace it, or pick a new path.")
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, f".{name}.tmp-{token}")
    for p, entry in entries.items():
        if entry["kind"] == "per_rank":
            entry["shapes"] = [g[3][p] for g in gathered]

    # [Note: HSDP] Replicas hold identical shards: replica 0 writes them, the others write
    # only their PerRank values; every process takes part in the protocol (and in loading).
    me, _ = everyone(comm)
    replica = getattr(comm, "replica_rank", 0)
    pieces = [
        pc for p, leaf in zip(paths, leaves)
        for pc in pieces_of(p, leaf, comm.rank, index=me)
        if replica == 0 or isinstance(leaf, PerRank)
    ]
    try:
        written = dcp_save(tmp, pieces, comm)
        digests = agree(
            comm,
            "checkpoint save (checksums)",
            lambda: {name_: fmt.file_digest(os.path.join(tmp, name_)) for name_ in written},
        )

        files = {}
        for d in digests:
            files.update(d)
        base = {
            "format": fmt.FORMAT,
            "version": fmt.VERSION,
            "world_size": comm.world_size,
            "replicas": getattr(comm, "num_replicas", 1),
            "treedef": str(treedef),
            "entries": entries,
            "torch": torch.__version__,
        }

        def publish():
            if me != 0:
                return None
            extra = {}
            for name_ in os.listdir(tmp):  # e.g. the empty file of a rank with nothing to write
                if name_ not in files and name_ != fmt.MANIFEST:
                    extra[name_] = fmt.file_digest(os.path.join(tmp, name_))
            manifest = dict(base, files=dict(files, **extra))
            fmt.write_json_atomic(os.path.join(tmp, fmt.MANIFEST), manifest)
            fmt.fsync_dir(tmp)
            _publish(tmp, path, token, overwrite)
            return extra  # small: every rank rebuilds the manifest from what it has

        extra = agree(comm, "checkpoint save (publishing)", publish)[0]
        return dict(base, files=dict(files, **extra))
    except BaseException:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: str, path: str, token: str, overwrite: bool) -> None:
    """[Note: publish by rename]
    ``rename`` of a directory is atomic on POSIX filesystems: readers see either no
    checkpoint or a complete one (manifest included). Overwriting moves the old checkpoint
    aside first, renames the new one in, then deletes the old one; a crash in between leaves
    the old checkpoint intact under ``.<name>.old-<token>`` (never a half-written one at
    ``path``). Only directories that are ragged checkpoints (or empty) are ever replaced.
    """
    parent, name = os.path.split(path)
    if os.path.exists(path):
        if not overwrite:
            raise CheckpointError(f"{path!r} appeared while saving; refusing to replace it (overwrite=False).")
        if not os.path.isdir(path) or (os.listdir(path) and not os.path.isfile(os.path.join(path, fmt.MANIFEST))):
            raise CheckpointError(
                f"refusing to overwrite {path!r}: it is not a ragged checkpoint (no {fmt.MANIFEST}). Remove it yourself."
            )
        old = os.path.join(parent, f".{name}.old-{token}")
        os.rename(path, old)
        os.rename(tmp, path)
        fmt.fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
        fmt.fsync_dir(parent)
