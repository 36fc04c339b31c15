"""The kinds of checkpoint entries and their registry (see [Note: entry kinds] in ``_entry.py``)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._dcp import Piece
from ragged.checkpoint._entry import (
    EntryKind,
    Consolidated,
    LoadSite,
    compare_dtypes,
    compare_plans,
    consolidate_plan_leaves,
    full_tensor,
    numel_of,
    plan_leaf_tensors,
)
from ragged.checkpoint._format import CheckpointCorruptError, PerRank
from ragged.checkpoint._blocks import BlockFactorsKind
from ragged.checkpoint._packed import PackedKind
from ragged.checkpoint._quant8 import Quant8Kind
from ragged.spec._plan import LayoutPlan

__all__ = ["KINDS", "kind_of", "kind_named", "is_entry", "tensor_digest"]

_SUPPORTED = (
    "DBuffers, torch tensors, rg.checkpoint.PerRank(tensor), 8-bit Adam moments bound with "
    "rg.checkpoint.bind_quant8, packed states bound with rg.checkpoint.bind_packed / bind_muon, SOAP / "
    "Shampoo block matrices (rg.optim.SoapFactors / ShampooFactors), "
    "LayoutPlans, and Python scalars "
    "(bool, int, float, str, None)"
)
_JSON_SCALARS = (bool, int, float, str, type(None))


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def _same_everywhere(where: str, values: list, which: str, fix: str) -> str | None:
    for rank, value in enumerate(values[1:], start=1):
        if value != values[0]:
            return (
                f"{where} ({which}) holds different values on rank 0 and rank {rank}; a plain "
                f"tensor is saved once, so it must be the same on every rank. Fix: {fix}, or "
                "store per-rank data as a DBuffer."
            )
    return None


class DBufferKind(EntryKind):
    """A DBuffer: each leaf of its plan is a 1-D DCP tensor of ``numel`` elements, one chunk
    per piece (padding excluded); loads into any plan of the same leaves."""

    name = "dbuffer"
    holds = DBuffer
    holds_leaves = True
    whole = True

    def describe(self, where, leaf, comm):
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
            "kind": self.name,
            "dtype": fmt.dtype_name(leaf.data.dtype),
            "replicated_dtype": fmt.dtype_name(leaf.replicated.dtype),
            "plan": fmt.describe_plan(plan),
        }

    def agreement(self, leaf):
        return tensor_digest(leaf.replicated)

    def settle(self, where, entry, values):
        return _same_everywhere(where, values, "replicated leaves of DBuffer", "all-reduce it")

    def pieces(self, path, leaf, rank, index):
        data, plan, out = leaf.data.detach(), leaf.plan, []
        for piece in plan.local_pieces(rank):
            view = data[piece.local_offset : piece.local_offset + piece.numel]
            out.append(Piece(fmt.leaf_fqn(path, piece.leaf.path), piece.start, piece.leaf.numel, view))
        for rleaf in plan.replicated:
            if rleaf.numel:
                view = leaf.replicated.detach()[rleaf.offset : rleaf.stop]
                out.append(Piece(fmt.leaf_fqn(path, rleaf.path), 0, rleaf.numel, view))
        return out

    def stored(self, path, entry):
        return plan_leaf_tensors(path, entry)

    def compare(self, where, saved, like, leaf, site, problems):
        compare_plans(where, saved["plan"], like["plan"], problems)
        compare_dtypes(where, saved, like, problems, replicated_matters=bool(like["plan"]["replicated"]))

    def allocate(self, leaf, entry):
        data = torch.zeros(leaf.plan.shard_size, dtype=leaf.data.dtype, device=leaf.data.device)
        return leaf.replace(data=data, replicated=torch.zeros_like(leaf.replicated))

    def consolidate(self, path, entry):
        return consolidate_plan_leaves(path, entry)


class TensorKind(EntryKind):
    """A plain tensor, the same on every rank: one chunk, written once."""

    name = "tensor"
    holds = torch.Tensor

    def describe(self, where, leaf, comm):
        return {"kind": self.name, "shape": list(leaf.shape), "dtype": fmt.dtype_name(leaf.dtype)}

    def agreement(self, leaf):
        return tensor_digest(leaf)

    def settle(self, where, entry, values):
        return _same_everywhere(where, values, "tensor", "wrap it in rg.checkpoint.PerRank")

    def pieces(self, path, leaf, rank, index):
        return [Piece(path, 0, leaf.numel(), leaf.detach().reshape(-1))] if leaf.numel() else []

    def stored(self, path, entry):
        n = numel_of(entry["shape"])
        return {path: (n, entry["dtype"])} if n else {}

    def compare(self, where, saved, like, leaf, site, problems):
        if saved["shape"] != like["shape"]:
            problems.append(f"{where}: saved shape {tuple(saved['shape'])}, expected shape {tuple(like['shape'])}")
        if saved["dtype"] != like["dtype"]:
            problems.append(f"{where}: saved dtype {saved['dtype']}, expected dtype {like['dtype']}")

    def allocate(self, leaf, entry):
        return torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)

    def consolidate(self, path, entry):
        flat, pieces = full_tensor(path, numel_of(entry["shape"]), fmt.dtype_from_name(entry["dtype"]))
        return [Consolidated([], "", flat.view(tuple(entry["shape"])), pieces)]


class PerRankKind(EntryKind):
    """:class:`PerRank`: one tensor per process, loaded back by the same process index."""

    name = "per_rank"
    holds = PerRank
    per_process = True
    whole = True

    def describe(self, where, leaf, comm):
        if not isinstance(leaf.value, torch.Tensor):
            raise RaggedTypeError(f"{where} is PerRank({type(leaf.value).__name__}); PerRank holds a torch tensor.")
        return {"kind": self.name, "dtype": fmt.dtype_name(leaf.value.dtype)}

    def agreement(self, leaf):
        return list(leaf.value.shape)

    def settle(self, where, entry, values):
        entry["shapes"] = values
        return None

    def pieces(self, path, leaf, rank, index):
        n = leaf.value.numel()
        return [Piece(fmt.per_rank_fqn(path, index), 0, n, leaf.value.detach().reshape(-1))] if n else []

    def stored(self, path, entry):
        shapes = entry["shapes"]
        return {fmt.per_rank_fqn(path, r): (numel_of(s), entry["dtype"]) for r, s in enumerate(shapes) if numel_of(s)}

    def compare(self, where, saved, like, leaf, site: LoadSite, problems):
        if len(saved["shapes"]) != site.count or site.saved_world_size != site.world_size:
            problems.append(
                f"{where}: a PerRank value saved by {len(saved['shapes'])} ranks cannot load on "
                f"{site.count} ranks (leave it out of like_state with strict=False and make a fresh one)"
            )
            return
        shape = tuple(saved["shapes"][site.index])
        if shape != tuple(leaf.value.shape):
            problems.append(f"{where}: saved shape {shape} on rank {site.index}, expected {tuple(leaf.value.shape)}")
        if saved["dtype"] != like["dtype"]:
            problems.append(f"{where}: saved dtype {saved['dtype']}, expected dtype {like['dtype']}")

    def allocate(self, leaf, entry):
        return PerRank(torch.empty_like(leaf.value))

    def consolidate(self, path, entry):
        out = []
        for r, shape in enumerate(entry["shapes"]):
            flat, pieces = full_tensor(fmt.per_rank_fqn(path, r), numel_of(shape), fmt.dtype_from_name(entry["dtype"]))
            out.append(Consolidated([], f"@rank{r}", flat.view(tuple(shape)), pieces))
        return out


class PlanKind(EntryKind):
    """A LayoutPlan: its description only (loading returns ``like_state``'s plan)."""

    name = "plan"
    holds = LayoutPlan

    def describe(self, where, leaf, comm):
        return {"kind": self.name, "plan": fmt.describe_plan(leaf)}

    def compare(self, where, saved, like, leaf, site, problems):
        compare_plans(where, saved["plan"], like["plan"], problems)


class ValueKind(EntryKind):
    """A Python scalar, kept in the manifest (NaN as ``"nan": true``: JSON has no NaN)."""

    name = "value"
    holds = _JSON_SCALARS

    def describe(self, where, leaf, comm):
        if isinstance(leaf, float) and leaf != leaf:
            return {"kind": self.name, "value": None, "nan": True}
        return {"kind": self.name, "value": leaf}

    def compare(self, where, saved, like, leaf, site, problems):
        saved_type = "float" if saved.get("nan") else type(saved["value"]).__name__
        like_type = type(leaf).__name__
        if saved_type != like_type and not (saved_type == "NoneType" or like_type == "NoneType"):
            problems.append(f"{where}: saved a {saved_type} ({saved['value']!r}), like_state has a {like_type}")

    def allocate(self, leaf, entry):
        return self._value(entry)

    def consolidate(self, path, entry):
        return [Consolidated([], "", self._value(entry), [])]

    @staticmethod
    def _value(entry):
        if entry.get("nan"):
            return float("nan")
        value = entry["value"]
        if not isinstance(value, _JSON_SCALARS):
            raise CheckpointCorruptError(f"the manifest holds a value entry of type {type(value).__name__}.")
        return value


#: Every kind, in the order leaves are matched (the first that claims a leaf describes it).
KINDS: tuple[EntryKind, ...] = (DBufferKind(), Quant8Kind(), PackedKind(), BlockFactorsKind(), PerRankKind(), TensorKind(),
                                 PlanKind(), ValueKind())
_BY_NAME = {k.name: k for k in KINDS}


def is_entry(x) -> bool:
    """Whether ``x`` is kept whole as one entry when a state is flattened (not a pytree node)."""
    return any(k.whole and k.claims(x) for k in KINDS)


def kind_of(leaf, where: str) -> EntryKind:
    for kind in KINDS:
        if kind.claims(leaf):
            return kind
    raise RaggedTypeError(
        f"{where} is a {type(leaf).__name__}, which a checkpoint cannot hold. Supported leaves: "
        f"{_SUPPORTED}. Fix: convert it (e.g. a torch.Generator's get_state()) or leave it out of the state."
    )


def kind_named(entry: Any, path: str) -> EntryKind:
    name = entry.get("kind") if isinstance(entry, dict) else None
    kind = _BY_NAME.get(name) if isinstance(name, str) else None
    if kind is None:
        raise CheckpointCorruptError(f"the manifest's entry {path!r} has an unknown kind {name!r}.")
    return kind
