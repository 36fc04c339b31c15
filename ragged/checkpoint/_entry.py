"""The protocol every kind of checkpoint entry implements, and helpers the kinds share.

[Note: entry kinds]
A state leaf becomes one *entry* of the manifest. What an entry is (a DBuffer, a plain tensor,
a per-rank tensor, a Python value, a plan, a packed DBuffer, 8-bit Adam moments) decides five
things, each a method of one :class:`EntryKind` subclass:

* ``describe``: the entry's JSON description (the manifest's ``entries[path]``), after checking
  the live leaf (raising before any communication, naming the key path);
* ``pieces``: this rank's chunks of the 1-D DCP tensors the entry is stored as (see
  [Note: checkpoint layout] in ``_format.py``), as views of the leaf;
* ``allocate``: a fresh leaf shaped like ``like_state``'s, to load into (its ``pieces`` are the
  destinations);
* ``compare``: every difference between a saved entry and the one ``like_state`` would write;
* ``consolidate``: full tensors of the entry's leaves for a single-process read.

``save``, ``load`` and ``consolidate`` iterate over :data:`ragged.checkpoint._kinds.KINDS` and call
these methods; none of them knows a kind. A new kind is a class and one line in the registry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import torch

from ragged._errors import is_sizes
from ragged._pytree import path_parts
from ragged.checkpoint._dcp import Piece
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._format import CheckpointCorruptError

__all__ = [
    "EntryKind",
    "Consolidated",
    "LoadSite",
    "compare_plans",
    "compare_dtypes",
    "numel_of",
    "full_tensor",
    "plan_leaf_tensors",
    "consolidate_plan_leaves",
]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSite:
    """Where a load runs: this process's ``index`` of ``count`` (replicas included, see
    ``_dcp.everyone``), the shard group's ``world_size``, and the saver's world size."""

    index: int
    count: int
    world_size: int
    saved_world_size: int


class Consolidated(NamedTuple):
    """One value of :func:`ragged.checkpoint.consolidate`: key-path ``parts`` below the entry,
    a ``suffix`` for the dotted name, the ``value`` (a tensor filled by ``pieces``, or a Python
    value) and the DCP pieces that fill it."""

    parts: list[str]
    suffix: str
    value: Any
    pieces: list[Piece]


class EntryKind:
    """One kind of checkpoint entry: see [Note: entry kinds]. The defaults suit an entry
    stored in the manifest only (no DCP tensors)."""

    name: ClassVar[str]
    #: the type (or types) of the leaves this kind stores
    holds: ClassVar[type | tuple[type, ...]]
    #: consolidate names its values by the plan's own leaf paths (``leaf_names=True`` keeps only those)
    holds_leaves: ClassVar[bool] = False
    #: written by every process of an HSDP mesh (default: by replica 0 only, the replicas agree)
    per_process: ClassVar[bool] = False
    #: kept whole when the state is flattened (a value ``ragged.pytree`` would otherwise descend into
    #: or that must not be split); the others are pytree leaves already
    whole: ClassVar[bool] = False

    def claims(self, leaf) -> bool:
        return isinstance(leaf, self.holds)

    def describe(self, where: str, leaf, comm) -> dict[str, Any]:
        """The entry's JSON description; raises RaggedTypeError / RaggedValueError naming ``where``."""
        raise NotImplementedError

    def agreement(self, leaf) -> Any:
        """A small value every process sends when saving (see :meth:`settle`); ``None``: nothing."""
        return None

    def settle(self, where: str, entry: dict, values: list) -> str | None:
        """Checks (or records into ``entry``) the processes' :meth:`agreement` values; returns a
        problem (the values must agree and do not) or None."""
        return None

    def pieces(self, path: str, leaf, rank: int, index: int) -> list[Piece]:
        """This rank's chunks of the entry (``index``: the process index, replicas included)."""
        return []

    def stored(self, path: str, entry: dict) -> dict[str, tuple[int, str]]:
        """``fqn -> (numel, dtype name)`` of every non-empty DCP tensor the entry was stored as."""
        return {}

    def compare(self, where: str, saved: dict, like: dict, leaf, site: LoadSite, problems: list[str]) -> None:
        """Appends to ``problems`` every way the saved entry does not fit ``like`` (same kind)."""

    def allocate(self, leaf, entry: dict):
        """A new leaf like ``leaf`` to load the entry into (nothing shared with ``leaf``)."""
        return leaf

    def consolidate(self, path: str, entry: dict) -> list[Consolidated]:
        return []


def numel_of(shape) -> int:
    """Elements of a shape read from a manifest (refuses what is not a list of sizes)."""
    if not isinstance(shape, list) or not is_sizes(shape):
        raise CheckpointCorruptError(f"the manifest holds a malformed shape {shape!r}.")
    return math.prod(shape)


def _leaf_table(plan_desc: dict) -> dict[str, tuple[int, ...]]:
    """``leaf path -> shape`` over sharded and replicated leaves of a described plan."""
    return {leaf["path"]: tuple(leaf["shape"]) for leaf in plan_desc["leaves"] + plan_desc["replicated"]}


def compare_plans(where: str, saved: dict, like: dict, problems: list[str]) -> None:
    """Differences in leaves and shapes between two described plans (layouts may differ)."""
    saved_t, like_t = _leaf_table(saved), _leaf_table(like)
    for p in sorted(set(saved_t) - set(like_t)):
        problems.append(f"{where}{p}: saved (shape {saved_t[p]}) but like_state's plan has no such leaf")
    for p in sorted(set(like_t) - set(saved_t)):
        problems.append(f"{where}{p}: like_state's plan has this leaf (shape {like_t[p]}) but the checkpoint does not")
    for p in sorted(set(saved_t) & set(like_t)):
        if saved_t[p] != like_t[p]:
            problems.append(f"{where}{p}: saved shape {saved_t[p]}, expected shape {like_t[p]}")


def full_tensor(fqn: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[Piece]]:
    """A zero 1-D tensor of ``numel`` elements and the piece that reads all of DCP tensor ``fqn``."""
    flat = torch.zeros(numel, dtype=dtype)
    return flat, ([Piece(fqn, 0, numel, flat)] if numel else [])


def compare_dtypes(where: str, saved: dict, like: dict, problems: list[str], *, replicated_matters: bool) -> None:
    for key in ("dtype", "replicated_dtype"):
        if saved[key] != like[key] and (key == "dtype" or replicated_matters):
            problems.append(f"{where}: saved {key.replace('_', ' ')} {saved[key]}, expected {like[key]}")


def plan_leaf_tensors(path: str, entry: dict, keep=None) -> dict[str, tuple[int, str]]:
    """``fqn -> (numel, dtype)`` of the leaves of a DBuffer-like entry (only ``keep`` paths if given)."""
    plan = entry["plan"]
    out = {}
    for leaves, dtype in ((plan["leaves"], entry["dtype"]), (plan["replicated"], entry["replicated_dtype"])):
        for leaf in leaves:
            n = numel_of(leaf["shape"])
            if n and (keep is None or leaf["path"] in keep):
                out[fmt.leaf_fqn(path, leaf["path"])] = (n, dtype)
    return out


def consolidate_plan_leaves(path: str, entry: dict, keep=None) -> list[Consolidated]:
    """Full tensors (true shapes) of every leaf of a DBuffer-like entry."""
    plan, out = entry["plan"], []
    for leaves, dtype in ((plan["leaves"], entry["dtype"]), (plan["replicated"], entry["replicated_dtype"])):
        for leaf in leaves:
            if keep is not None and leaf["path"] not in keep:
                continue
            flat, pieces = full_tensor(fmt.leaf_fqn(path, leaf["path"]), numel_of(leaf["shape"]), fmt.dtype_from_name(dtype))
            out.append(Consolidated(path_parts(leaf["path"]), "", flat.view(tuple(leaf["shape"])), pieces))
    return out
