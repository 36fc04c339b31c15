"""FSDP units: a model's parameters split into groups, one :class:`~ragged.LayoutPlan` each.

A unit is what one all-gather brings in and one reduce-scatter sends out (FSDP2's
``fully_shard`` module, veScale's DBuffer). :func:`make_units` splits an ``nn.Module`` (every
element of every ``nn.ModuleList`` is a unit, the remaining parameters form the unit
``"rest"``) or a plain parameter pytree with a user-given grouping.

[Note: unit parameter trees]
Each unit plans a flat dict ``{path: tensor}`` whose keys are the parameter names
(``"blocks.0.attn.wq.weight"`` for a module, the key path ``"['layers'][0]['w']"`` for a
pytree). :meth:`Units.merge` puts unit trees back into the model's full tree, which is what
``torch.func.functional_call`` (or the user's loss) receives.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ragged._pytree import flatten_with_keystr, pytree
from ragged.spec import make_plan
from ragged.spec._plan import LayoutPlan
from ragged._errors import RaggedKeyError, RaggedTypeError, RaggedValueError

__all__ = ["Unit", "Units", "make_units", "picked_leaves", "REST"]

REST = "rest"
"""Name of the unit that holds every parameter no other unit claims."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """One FSDP unit.

    Attributes:
        name: e.g. ``"blocks.3"`` or ``"rest"``.
        paths: parameter names (module) or key paths (pytree) of its leaves, in plan tree order.
        indices: positions of those leaves in the full tree's flattened leaves.
        plan: the unit's layout (its tree is ``{path: tensor}``).
    """

    name: str
    paths: tuple[str, ...]
    indices: tuple[int, ...]
    plan: LayoutPlan

    replace = dataclasses.replace


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Units:
    """A model split into FSDP units (frozen, hashable: plans and structure only, no tensors).

    Attributes:
        units: the units, in the order their parameters first appear in the model.
        treedef: structure of the full parameter tree.
        is_module: whether the tree is ``dict(model.named_parameters())``.
    """

    units: tuple[Unit, ...]
    treedef: Any = dataclasses.field(repr=False)
    is_module: bool = False

    replace = dataclasses.replace

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    @property
    def world_size(self) -> int:
        return self.units[0].plan.world_size

    @property
    def num_leaves(self) -> int:
        return sum(len(u.paths) for u in self.units)

    def __len__(self) -> int:
        return len(self.units)

    def __iter__(self):
        return iter(self.units)

    def __getitem__(self, key: int | str) -> Unit:
        if isinstance(key, str):
            for u in self.units:
                if u.name == key:
                    return u
            raise RaggedKeyError(f"no unit named {key!r}; units are {list(self.names)}")
        return self.units[key]

    def split(self, params) -> dict[str, dict[str, Any]]:
        """The full tree (or a module) -> ``{unit name: {path: leaf}}``.

        Raises:
            ValueError: ``params`` does not have the structure the units were made for.
        """
        if isinstance(params, torch.nn.Module):
            params = dict(params.named_parameters())
        leaves, treedef = pytree.flatten(params)
        if treedef != self.treedef:
            raise RaggedValueError(
                f"params has structure {treedef}, but the units were made for {self.treedef}. "
                "Fix: pass the same model / parameter tree make_units was given."
            )
        return {u.name: {p: leaves[i] for p, i in zip(u.paths, u.indices)} for u in self.units}

    def merge(self, unit_trees: Mapping[str, Mapping[str, Any]]):
        """Inverse of :meth:`split`: ``{unit name: {path: leaf}}`` -> the full tree."""
        leaves = [None] * self.num_leaves
        for u in self.units:
            tree = unit_trees[u.name]
            for p, i in zip(u.paths, u.indices):
                leaves[i] = tree[p]
        return pytree.unflatten(self.treedef, leaves)

    def __rich__(self):
        from rich.table import Table

        table = Table(title=f"{len(self.units)} FSDP units over {self.world_size} ranks")
        for col in ("unit", "leaves", "params", "shard S", "buffers", "padding", "overhead", "dtype"):
            table.add_column(col, justify="left" if col == "unit" else "right")
        for u in self.units:
            p = u.plan
            table.add_row(u.name, str(len(u.paths)), f"{p.numel:,}", f"{p.shard_size:,}", str(p.num_buffers),
                          f"{p.padding:,}", f"{p.overhead:.2%}", str(p.dtype).replace("torch.", ""))
        total = sum(u.plan.numel for u in self.units)
        pad = sum(u.plan.padding for u in self.units)
        table.add_row("total", str(self.num_leaves), f"{total:,}",
                      f"{sum(u.plan.shard_size for u in self.units):,}",
                      str(sum(u.plan.num_buffers for u in self.units)), f"{pad:,}", f"{pad / total:.2%}", "")
        return table


def _module_groups(model: torch.nn.Module) -> list[str]:
    prefixes = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            prefixes.extend(f"{name}.{child}" if name else child for child, _ in module.named_children())
    return prefixes


def _assign_by_prefix(names: Sequence[str], prefixes: Sequence[str]) -> list[str]:
    for i, p in enumerate(prefixes):
        if not isinstance(p, str) or not p or p == REST:
            raise RaggedValueError(f"groups[{i}] is {p!r}; each group must be a non-empty module name other than {REST!r}.")
        if not any(n.startswith(p + ".") for n in names):
            raise RaggedValueError(
                f"groups[{i}] = {p!r} matches no parameter (a group is a module name: its parameters "
                f"are '{p}.<...>'). Parameter names start with {sorted({n.split('.')[0] for n in names})}."
            )
    ordered = sorted(prefixes, key=len, reverse=True)
    return [next((p for p in ordered if n.startswith(p + ".")), REST) for n in names]


def make_units(
    model_or_params,
    *,
    world_size: int,
    groups: Sequence[str] | Callable[[str], str] | None = None,
    specs: Mapping[str, Any] | Callable[[str, torch.Tensor], Any] | None = None,
    dtype: torch.dtype | None = None,
    strategy: str = "dp",
    align: int | None = None,
    max_buffers: int | str = 1,
) -> Units:
    """Splits a model into FSDP units and plans each one.

    Args:
        model_or_params: an ``nn.Module`` (its ``named_parameters()``; meta modules are fine),
            or any pytree of tensors.
        world_size: ranks in the shard group.
        groups: for a module, module names that become units (default: every element of every
            ``nn.ModuleList``); a parameter goes to the longest matching name, else to
            ``"rest"``. For a pytree, a function ``key path -> unit name`` (default: one unit
            ``"rest"``). Either way a function of the name works.
        specs: granularities, as a dict ``{name: spec}`` (missing names: ``Rows(1)``) or a
            function ``(name, tensor) -> spec``.
        dtype: master buffer dtype of every unit (default: the parameters' dtype).
        strategy, align, max_buffers: passed to :func:`ragged.make_plan` (``max_buffers``: a
            unit may be planned into several buffers, all gathered in one coalesced launch).

    Returns:
        :class:`Units`, in the order each unit's first parameter appears.

    Examples:
        >>> import torch
        >>> from ragged import fsdp
        >>> from ragged.examples.gpt import GPT, GPTConfig
        >>> model = GPT(GPTConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=48), device="meta")
        >>> units = fsdp.make_units(model, world_size=4)
        >>> units.names
        ('rest', 'blocks.0', 'blocks.1')
        >>> units["blocks.1"].paths[:2]
        ('blocks.1.attn.wk.weight', 'blocks.1.attn.wo.weight')
        >>> tree = {"layers": [{"w": torch.empty(4, 3)}, {"w": torch.empty(4, 3)}], "out": torch.empty(3)}
        >>> fsdp.make_units(tree, world_size=2, groups=lambda path: path[:13] if "layers" in path else "rest").names
        ("['layers'][0]", "['layers'][1]", 'rest')
    """
    is_module = isinstance(model_or_params, torch.nn.Module)
    params = dict(model_or_params.named_parameters()) if is_module else model_or_params
    paths, leaves, treedef = flatten_with_keystr(params)
    if is_module:
        paths = sorted(params)  # optree flattens dicts in sorted key order
    if not leaves:
        raise RaggedValueError("make_units got no parameters. Pass an nn.Module with parameters or a pytree of tensors.")

    if callable(groups):
        names = []
        for p in paths:
            name = groups(p)
            if not isinstance(name, str) or not name:
                raise RaggedTypeError(f"groups({p!r}) returned {name!r}; it must return a non-empty unit name (str).")
            names.append(name)
    elif is_module:
        names = _assign_by_prefix(paths, _module_groups(model_or_params) if groups is None else list(groups))
    elif groups is None:
        names = [REST] * len(paths)
    else:
        raise RaggedTypeError(f"groups for a pytree must be a function key path -> unit name, got {type(groups).__name__}.")

    # units in the order their first parameter appears in the model (registration order for modules)
    first_seen = list(params) if is_module else paths
    order: list[str] = []
    name_of = dict(zip(paths, names))
    for p in first_seen:
        if name_of[p] not in order:
            order.append(name_of[p])

    units = []
    for unit_name in order:
        idx = [i for i, n in enumerate(names) if n == unit_name]
        tree = {paths[i]: leaves[i] for i in idx}
        if specs is None:
            unit_specs = None
        elif callable(specs):
            unit_specs = {paths[i]: specs(paths[i], leaves[i]) for i in idx}
        else:
            unknown = sorted(set(specs) - set(paths))
            if unknown:
                raise RaggedValueError(f"specs names {unknown[:3]} that are not parameters; names look like {paths[:3]}.")
            unit_specs = {paths[i]: specs.get(paths[i]) for i in idx}
        plan = make_plan(tree, unit_specs, world_size=world_size, dtype=dtype, strategy=strategy, align=align,
                         max_buffers=max_buffers)
        # plan tree order is key-sorted; keep paths/indices in that order
        sorted_idx = sorted(idx, key=lambda i: paths[i])
        units.append(Unit(name=unit_name, paths=tuple(paths[i] for i in sorted_idx),
                          indices=tuple(sorted_idx), plan=plan))
    return Units(units=tuple(units), treedef=treedef, is_module=is_module)


@functools.lru_cache(maxsize=1024)
def picked_leaves(unit: Unit, is_replicated) -> frozenset:
    """Indices of ``unit``'s leaves whose path ``is_replicated`` picks."""
    return frozenset(l.index for l in unit.plan.leaves + unit.plan.replicated if is_replicated(unit.paths[l.index]))
