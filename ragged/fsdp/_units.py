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
from ragged.spec._concat import concat_plans, leading_part
from ragged.spec._planning import key_paths
from ragged.spec._plan import LayoutPlan, LeafLayout
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
        plan: the unit's layout (its tree is ``{path: tensor}``): the trainable leaves' buffers
            first, then the frozen leaves' (see [Note: trainable buffers first] in
            ``ragged/spec/_concat.py``).
        frozen: the paths of the leaves that do not train (``requires_grad=False``): no gradient,
            no reduce-scatter, no optimizer state, no update.
        owners: for a module, the type of the module that holds each leaf (by ``paths``), for
            :meth:`Units.param_groups`; empty for a pytree.
    """

    name: str
    paths: tuple[str, ...]
    indices: tuple[int, ...]
    plan: LayoutPlan
    frozen: frozenset[str] = frozenset()
    owners: tuple[type, ...] = ()

    replace = dataclasses.replace

    @property
    def trainable_paths(self) -> tuple[str, ...]:
        """The paths of the leaves that train, in plan tree order."""
        return tuple(p for p in self.paths if p not in self.frozen)

    @property
    def trainable_plan(self) -> LayoutPlan | None:
        """The layout of this unit's gradients and optimizer state: ``plan`` itself when nothing is
        frozen, the plan of the trainable leaves (a prefix of ``plan``, see [Note: trainable buffers
        first] in ``ragged/spec/_concat.py``) when some are, ``None`` when none trains."""
        if not self.frozen:
            return self.plan
        paths = self.trainable_paths
        if not paths:
            return None
        keep = frozenset(l.path for l in self.plan.leaves + self.plan.replicated if self.paths[l.index] not in self.frozen)
        return leading_part(self.plan, keep, pytree.structure(dict.fromkeys(paths, 0)))


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

    def param_groups(self, rules: Mapping[Any, Any], *, default) -> Callable[[LeafLayout], Any]:
        """A label per leaf from the module that holds it, for ``rg.optim.multi_transform`` (what
        torch users write as ``param_groups``).

        Args:
            rules: ``{key: label}``, first match wins: a module type or a tuple of types matches
                every parameter held by an instance of one of them (subclasses included, e.g.
                ``torch.nn.LayerNorm``, ``torch.nn.Embedding``, Hugging Face's
                ``type(model.model.norm)``); a string matches the parameter's attribute name
                (``"bias"``).
            default: the label of every other parameter.

        Returns:
            ``label(leaf)`` for the leaves of any of the units' plans (``LeafLayout.path``).

        Raises:
            RaggedTypeError: the units were made from a pytree, or a key is neither a type nor a string.
            RaggedValueError: a rule matches no parameter, or only frozen ones (they get no update:
                drop the rule, or unfreeze them).

        Examples:
            >>> import torch, ragged as rg
            >>> from ragged import fsdp
            >>> model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 8))
            >>> units = fsdp.make_units(model, world_size=2)
            >>> group = units.param_groups({(torch.nn.Embedding, torch.nn.LayerNorm): "no_decay", "bias": "no_decay"},
            ...                            default="decay")
            >>> sorted((units[0].paths[l.index], group(l)) for l in units[0].plan.leaves)[:3]
            [('0.weight', 'no_decay'), ('1.bias', 'no_decay'), ('1.weight', 'no_decay')]
            >>> opt = rg.optim.multi_transform({"decay": rg.optim.adamw(1e-3, weight_decay=0.1),
            ...                                 "no_decay": rg.optim.adamw(1e-3)}, group)
        """
        if not self.is_module:
            raise RaggedTypeError("param_groups labels by module type: make the units from an nn.Module (for a pytree, "
                                  "pass multi_transform a function of leaf.path).")
        for key in rules:
            types = key if isinstance(key, tuple) else (key,)
            if not (isinstance(key, str) or types and all(isinstance(t, type) for t in types)):
                raise RaggedTypeError(f"param_groups: rule key {key!r} must be a module type, a tuple of types or a "
                                      "parameter attribute name (str).")

        def label_of(path: str, owner: type):
            for key, label in rules.items():
                if path.rpartition(".")[2] == key if isinstance(key, str) else issubclass(owner, key):
                    return key, label
            return None, default

        table, matched = {}, {key: [] for key in rules}
        for u in self.units:
            for leaf in u.plan.leaves + u.plan.replicated:
                path = u.paths[leaf.index]
                key, table[leaf.path] = label_of(path, u.owners[leaf.index])
                if key is not None:
                    matched[key].append(path not in u.frozen)
        for key, trains in matched.items():
            if not any(trains):
                what = "no parameter" if not trains else f"only frozen parameters ({len(trains)})"
                raise RaggedValueError(
                    f"param_groups: the rule {key!r} -> {rules[key]!r} matches {what} of the units: a group that never "
                    "gets a gradient is a mistake. Fix: drop the rule (or check its type / name), or unfreeze them."
                )

        def group(leaf):
            try:
                return table[leaf.path]
            except KeyError:
                raise RaggedKeyError(f"param_groups: {leaf.path} is not a parameter of these units.") from None
        return group

    def __rich__(self):
        # rich only when the units are drawn (as ragged/_viz.py)
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
    trainable: Callable[[str], bool] | None = None,
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
        trainable: for a pytree, a function ``key path -> bool``: which leaves train (default:
            all). A module's parameters train when they have ``requires_grad`` (set
            ``requires_grad_(False)`` to freeze one before ``make_units``). A unit's frozen
            leaves are planned in buffers after its trainable ones (see [Note: trainable buffers
            first] in ``ragged/spec/_concat.py``): gradients, reduce-scatters and optimizer state
            cover the trainable leaves only.

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
        >>> frozen = fsdp.make_units(tree, world_size=2, trainable=lambda path: "out" not in path)["rest"]
        >>> frozen.frozen, frozen.trainable_paths, frozen.plan.num_buffers
        (frozenset({"['out']"}), ("['layers'][0]['w']", "['layers'][1]['w']"), 2)
    """
    is_module = isinstance(model_or_params, torch.nn.Module)
    params = dict(model_or_params.named_parameters()) if is_module else model_or_params
    paths, leaves, treedef = flatten_with_keystr(params)
    if is_module:
        paths = sorted(params)  # optree flattens dicts in sorted key order
    if not leaves:
        raise RaggedValueError("make_units got no parameters. Pass an nn.Module with parameters or a pytree of tensors.")
    frozen = _frozen_paths(paths, params, is_module, trainable)

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
    name_of = dict(zip(paths, names))
    order = list(dict.fromkeys(name_of[p] for p in (params if is_module else paths)))
    unknown = [] if specs is None or callable(specs) else sorted(set(specs) - set(paths))
    if unknown:
        raise RaggedValueError(f"specs names {unknown[:3]} that are not parameters; names look like {paths[:3]}.")

    units = []
    for unit_name in order:
        idx = [i for i, n in enumerate(names) if n == unit_name]
        tree = {paths[i]: leaves[i] for i in idx}
        if specs is None:
            unit_specs = None
        elif callable(specs):
            unit_specs = {paths[i]: specs(paths[i], leaves[i]) for i in idx}
        else:
            unit_specs = {paths[i]: specs.get(paths[i]) for i in idx}
        options = dict(world_size=world_size, dtype=dtype, strategy=strategy, align=align, max_buffers=max_buffers)
        still = {p for p in tree if p in frozen}
        if still and len(still) < len(tree):
            plan = _plan_parts(tree, unit_specs, still, options)
        else:
            plan = make_plan(tree, unit_specs, **options)
        # plan tree order is key-sorted; keep paths/indices in that order
        sorted_idx = sorted(idx, key=lambda i: paths[i])
        owners = tuple(type(_owner(model_or_params, paths[i])) for i in sorted_idx) if is_module else ()
        units.append(Unit(name=unit_name, paths=tuple(paths[i] for i in sorted_idx),
                          indices=tuple(sorted_idx), plan=plan, frozen=frozenset(still), owners=owners))
    if not any(u.trainable_plan is not None for u in units):
        raise RaggedValueError(NOTHING_TRAINS_MSG)
    return Units(units=tuple(units), treedef=treedef, is_module=is_module)


def _owner(model: torch.nn.Module, path: str) -> torch.nn.Module:
    prefix = path.rpartition(".")[0]
    return model.get_submodule(prefix) if prefix else model


NOTHING_TRAINS_MSG = (
    "make_units: no parameter trains (every one has requires_grad=False, or trainable= returned False for every "
    "path), so a step would have nothing to update. Fix: leave requires_grad=True on the parameters to train."
)


def _frozen_paths(paths, params, is_module: bool, trainable) -> frozenset:
    if is_module:
        if trainable is not None:
            raise RaggedTypeError(
                "make_units(trainable=...) is for pytrees; a module's parameters train when they have requires_grad. "
                "Fix: call requires_grad_(False) on the parameters to freeze, and drop trainable=."
            )
        return frozenset(p for p in paths if not params[p].requires_grad)
    if trainable is None:
        return frozenset()
    if not callable(trainable):
        raise RaggedTypeError(f"trainable must be a function key path -> bool, got {type(trainable).__name__}.")
    flags = {p: trainable(p) for p in paths}
    bad = [p for p, f in flags.items() if not isinstance(f, bool)]
    if bad:
        raise RaggedTypeError(f"trainable({bad[0]!r}) returned {flags[bad[0]]!r}; it must return True or False.")
    return frozenset(p for p, f in flags.items() if not f)


def _plan_parts(tree: dict, specs, frozen: set, options: dict) -> LayoutPlan:
    """A unit's plan with its trainable leaves' buffers first (see [Note: trainable buffers
    first] in ``ragged/spec/_concat.py``); both parts in one dtype."""
    if options["dtype"] is None:  # one dtype for both parts, or make_plan's own error for the whole unit
        dtypes = {t.dtype for t in tree.values()}
        if len(dtypes) > 1:
            make_plan(tree, specs, **options)
        options = {**options, "dtype": next(iter(dtypes))}
    parts = []
    for keep in (lambda p: p not in frozen, lambda p: p in frozen):
        sub = {p: t for p, t in tree.items() if keep(p)}
        parts.append(make_plan(sub, None if specs is None else {p: specs[p] for p in sub}, **options))
    treedef = pytree.structure(tree)
    return concat_plans(*parts, treedef, key_paths(treedef))


@functools.lru_cache(maxsize=1024)
def picked_leaves(unit: Unit, is_replicated) -> frozenset:
    """Indices in ``unit.trainable_plan`` (the layout of its gradients) of the leaves whose path
    ``is_replicated`` picks."""
    plan, paths = unit.trainable_plan, unit.trainable_paths
    return frozenset(l.index for l in plan.leaves + plan.replicated if is_replicated(paths[l.index]))
