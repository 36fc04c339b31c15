"""`make_plan`: lay a parameter tree into one flat buffer.

Three strategies share one validated input:

* ``"exact"``: the minimum S for the given leaf order (see [Note: earliest placement is
  optimal for a fixed order and S] in ``_search.py``).
* ``"dp"`` (default): the exact optimum of several deterministic leaf orders (tree order,
  granule-descending, size-descending), keeping the best; never worse than ``"exact"`` on
  the tree order, hence never worse than the paper's heuristic on that order.
* ``"naive"``: concatenation with the end padded to a multiple of m, as DeepSpeed / FSDP1
  lay flat buffers; granules may be cut, and ``plan.split_blocks`` counts the cuts.

Speed: solves are cached by (sizes, granules, align, m, strategy), whole plans by
[Note: plan memo], and each further ``"dp"`` order is searched only below the best S so
far (``bench/plan.py`` times whole models, docs/performance.md).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import optree
import torch

from ragged._errors import NO_PARAMS_MSG, LayoutError, RaggedTypeError, RaggedValueError, check_int
from ragged._pytree import keystr
from ragged.spec import _buffers, _search
from ragged.spec._granularity import GRANULARITY_TYPES, Replicate, Rows, granule_of
from ragged.spec._spec_tree import broadcast_specs
from ragged.spec._plan import LayoutPlan, LeafLayout

__all__ = ["make_plan", "STRATEGIES", "ORDERS"]

STRATEGIES = ("dp", "exact", "naive")
ORDERS = ("tree", "granule", "size")
_DEFAULT = Rows(1)


def _leaf_shape_dtype(path: str, leaf):
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        raise RaggedTypeError(
            f"params{path} is a {type(leaf).__name__}, not a tensor. make_plan needs leaves with a "
            "`.shape` and a torch `.dtype` (torch tensors; meta tensors plan without memory). "
            "Fix: drop non-tensor leaves from the tree, or wrap shapes as torch.empty(shape, device='meta')."
        )
    return tuple(int(d) for d in shape), dtype


def _spec_leaves(specs, params, treedef, n: int) -> list:
    """One granularity per params leaf. Fast paths for the common cases (one spec for all
    leaves; a full spec tree); prefixes and every error go through :func:`broadcast_specs`."""
    if specs is None:
        return [_DEFAULT] * n
    if isinstance(specs, GRANULARITY_TYPES):
        return [specs] * n
    try:
        flat = treedef.flatten_up_to(specs)
    except ValueError:
        flat = None
    if flat is None or not all(s is None or isinstance(s, GRANULARITY_TYPES) for s in flat):
        flat = broadcast_specs(specs, params, treedef, check_leaf=_check_granularity, none_means="Rows(1)")
    return [_DEFAULT if s is None else s for s in flat]


def _check_granularity(path: str, s) -> None:
    if s is not None and not isinstance(s, GRANULARITY_TYPES):
        raise RaggedTypeError(
            f"specs{path} is {s!r} of type {type(s).__name__}, not a granularity. "
            "Each spec leaf must be spec.Elements(n), spec.Rows(n), spec.Blocks(r, c), "
            "spec.Replicate() or None (= Rows(1))."
        )


@functools.lru_cache(maxsize=256)
def _named_orders(items: tuple[tuple[int, int], ...]) -> dict[str, tuple[int, ...]]:
    """The named orders of leaves with these (numel, granule) pairs (cached: identical units
    sort once)."""
    by_tree = tuple(range(len(items)))
    by_granule = tuple(sorted(by_tree, key=lambda i: (-items[i][1], -items[i][0], i)))
    by_size = tuple(sorted(by_tree, key=lambda i: (-items[i][0], i)))
    return {"tree": by_tree, "granule": by_granule, "size": by_size}


def _order_indices(order, leaves: list[tuple]) -> list[tuple[int, ...]]:
    """Candidate orders (sequences of positions into ``leaves``) to evaluate."""
    if order is None:
        return [tuple(range(len(leaves)))]
    if isinstance(order, str):
        if order != "search" and order not in ORDERS:
            raise RaggedValueError(f"order must be one of {ORDERS + ('search',)} or a sequence of key paths, got {order!r}.")
        named = _named_orders(tuple((leaf[1], leaf[2]) for leaf in leaves))
        return list(dict.fromkeys(named[name] for name in ORDERS)) if order == "search" else [named[order]]
    paths = [leaf[0] for leaf in leaves]
    order = list(order)
    if sorted(order) != sorted(paths):
        missing, extra = sorted(set(paths) - set(order)), sorted(set(order) - set(paths))
        raise RaggedValueError(
            f"order must list every sharded leaf's key path exactly once; missing {missing}, "
            f"unknown {extra}. Paths are {paths}."
        )
    position = {p: i for i, p in enumerate(paths)}
    return [tuple(position[p] for p in order)]


@functools.lru_cache(maxsize=4096)
def _solve(sizes: tuple[int, ...], granules: tuple[int, ...], align: int, world_size: int, strategy: str,
           limit: int | None = None):
    """Returns (S, offsets, split_blocks) for leaves in the given order, or ``None`` when no
    S <= ``limit`` exists (cached: identical layers of a model plan once)."""
    if strategy == "naive":
        offsets, p = [], 0
        for e in sizes:
            offsets.append(p)
            p = -(-(p + e) // align) * align
        S = max(-(-(-(-sum(sizes) // world_size)) // align) * align, align)
        while world_size * S < p:
            S += align
        split = 0
        for off, e, g in zip(offsets, sizes, granules):
            first, last = off // S + 1, (off + e - 1) // S
            split += sum(1 for k in range(first, last + 1) if (k * S - off) % g)
        return S, tuple(offsets), split
    S = _search.min_shard_size(sizes, granules, align, world_size, limit=limit)
    if S is None:
        return None
    return S, tuple(_search.place(sizes, granules, align, S)), 0


_BUILTIN_NODES = (dict, list, tuple, type(None))


def _builtin_only(treedef) -> bool:
    if treedef.is_leaf():
        return True
    if treedef.type not in _BUILTIN_NODES:
        return False
    return all(_builtin_only(c) for c in treedef.children() if not c.is_leaf())


@functools.lru_cache(maxsize=1024)
def key_paths(treedef) -> tuple[str, ...]:
    """Key path strings of every leaf. Trees of plain dicts / lists / tuples format their
    raw paths directly (4x faster than building accessors, same text); others use accessors."""
    if _builtin_only(treedef):
        return tuple("".join(f"[{k!r}]" for k in path) or "<root>" for path in treedef.paths())
    return tuple(keystr(a) for a in treedef.accessors())


# [Note: plan memo]
# A plan depends only on the tree structure, each leaf's shape and dtype, the spec leaves and
# the options; the leaves' data never matter. make_plan memoises on exactly that key, so the
# 58 identical MoE layers of DeepSeek-V3 cost one plan plus 57 flattens. (Plans are frozen,
# so sharing one object is safe.) The solve itself is cached separately in `_solve`, keyed
# by sizes and granules, so units with other key names but equal shapes still share it.
_PLAN_MEMO: dict = {}
_PLAN_MEMO_MAX = 512


def make_plan(
    params,
    specs=None,
    *,
    world_size: int,
    align: int | None = None,
    strategy: str = "dp",
    order: str | Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    max_buffers: int | str = 1,
) -> LayoutPlan:
    """Plans where every leaf of ``params`` lives in flat buffers sharded over ``world_size``.

    Pure: touches no tensor data and communicates nothing, so meta tensors plan a 671B-parameter
    model with no memory.

    Args:
        params: any pytree of tensors (meta tensors included). Dict keys are flattened in
            sorted order, so the tree order of ``{"w", "b"}`` is ``b`` then ``w``.
        specs: a pytree, or a prefix of ``params``, of ``spec.Elements(n)``, ``spec.Rows(n)``,
            ``spec.Blocks(r, c)``, ``spec.Replicate()`` or ``None`` (= ``Rows(1)``). ``None``
            for the whole argument means ``Rows(1)`` everywhere.
        world_size: m, the number of ranks sharing the buffer.
        align: offset alignment in elements; default 16 bytes of the buffer dtype (4 for fp32,
            8 for bf16). S is a multiple of it too.
        strategy: ``"dp"`` (default), ``"exact"`` or ``"naive"`` (see module docstring).
        order: leaf order in the buffer: ``"tree"`` (key-sorted tree order), ``"granule"``,
            ``"size"``, ``"search"`` (try all three, keep the smallest S), or a sequence of
            key paths. Default: ``"search"`` for ``"dp"``, ``"tree"`` otherwise.
        dtype: the buffer dtype. Default: the leaves' dtype; leaves of different dtypes need an
            explicit ``dtype`` (one plan has one dtype; shard() casts into it).
        max_buffers: ``1`` (default): one buffer, today's plans bit for bit. An int ``K``: up
            to K buffers, the partition with the least padding (never more than one buffer,
            one buffer per granule, or one per leaf when within K). ``"auto"``: up to 8 buffers
            chosen by the cost model of [Note: the buffer cost model] (``_buffers.py``): an
            extra buffer must save 1 MiB of gathered padding, and padding never exceeds those
            baselines'. Every leaf lies in one buffer; see ``plan.buffers``.

    Returns:
        A frozen, hashable :class:`LayoutPlan`.

    Raises:
        TypeError: a leaf is not a tensor, or a spec is not a granularity.
        ValueError: the spec tree is not a prefix of ``params``; bad option values.
        LayoutError: a spec that cannot describe its leaf, or mixed dtypes without ``dtype``.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> params = {"w": torch.empty(10, 4, device="meta"), "b": torch.empty(4, device="meta")}
        >>> plan = rg.make_plan(params, {"w": spec.Rows(1), "b": None}, world_size=4)
        >>> plan.shard_size, plan.padding, [l.path for l in plan.leaves]
        (12, 4, ["['b']", "['w']"])
        >>> params = {"a": torch.empty(8, 3, device="meta"), "b": torch.empty(4, 5, device="meta")}
        >>> rg.make_plan(params, world_size=2, align=1).padding    # one buffer: S = 23
        2
        >>> two = rg.make_plan(params, world_size=2, align=1, max_buffers="auto")
        >>> two.buffers, two.shard_size, two.padding               # rows of 3 and rows of 5 apart
        (((0, 12), (24, 10)), 22, 0)
    """
    _check_options(world_size, align, strategy, max_buffers)
    max_buffers = _buffers.check_max_buffers(max_buffers)
    treedef, paths, shapes_dtypes, spec_leaves = _read_tree(params, specs)
    order_key = order if order is None or isinstance(order, str) else tuple(order)
    memo_key = (treedef, tuple(shapes_dtypes), tuple(spec_leaves), world_size, align, strategy, order_key, dtype,
                max_buffers)
    try:
        cached = _PLAN_MEMO.get(memo_key)
    except TypeError:  # an unhashable spec or order: plan without the memo
        memo_key, cached = None, None
    if cached is not None:
        return cached

    sharded, replicated = _granules(paths, shapes_dtypes, spec_leaves)
    buffer_dtype = _buffer_dtype(sharded + replicated, shapes_dtypes, dtype)
    itemsize = torch.empty((), dtype=buffer_dtype).element_size()
    align_elems = align if align is not None else max(1, 16 // itemsize)
    candidates = _order_indices("search" if order is None and strategy == "dp" else order, sharded)
    if max_buffers == 1 or len(sharded) < 2:
        S, offsets, split, chosen = _solve_one_buffer(sharded, candidates, align_elems, world_size, strategy)
        buffers = ()
    else:
        chosen, offsets, buffers = _solve_buffers(sharded, candidates, align_elems, world_size, max_buffers, itemsize)
        S, split = sum(b for _, b in buffers), 0

    def layout(entry, offset):
        path, numel, granule, index = entry
        shape, leaf_dtype = shapes_dtypes[index]
        return LeafLayout(path=path, index=index, shape=shape, dtype=leaf_dtype, offset=offset, numel=numel,
                          granule=granule, granularity=spec_leaves[index])

    rep_offsets = itertools.accumulate((-(-e[1] // align_elems) * align_elems for e in replicated), initial=0)
    plan = LayoutPlan(
        leaves=tuple(layout(sharded[i], off) for i, off in zip(chosen, offsets)),
        replicated=tuple(layout(entry, off) for entry, off in zip(replicated, rep_offsets)),
        world_size=world_size, shard_size=S, dtype=buffer_dtype, align=align_elems, strategy=strategy,
        split_blocks=split, treedef=treedef, buffers=buffers,
    )
    if memo_key is not None:
        if len(_PLAN_MEMO) >= _PLAN_MEMO_MAX:
            _PLAN_MEMO.pop(next(iter(_PLAN_MEMO)))
        _PLAN_MEMO[memo_key] = plan
    return plan


def _check_options(world_size, align, strategy, max_buffers) -> None:
    check_int("world_size", world_size)
    if strategy not in STRATEGIES:
        raise RaggedValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if align is not None:
        check_int("align", align)
    if strategy == "naive" and max_buffers != 1:
        raise RaggedValueError(
            f"strategy='naive' is plain concatenation into one buffer (a baseline); max_buffers={max_buffers!r} "
            "needs strategy='dp' or 'exact'."
        )


def _read_tree(params, specs):
    """(treedef, key paths, (shape, dtype) per leaf, granularity per leaf) of ``params``."""
    leaves, treedef = optree.tree_flatten(params, namespace="ragged")
    if not leaves:
        raise LayoutError(NO_PARAMS_MSG)
    paths = key_paths(treedef)
    seen = {}  # id(leaf) -> (shape, dtype): model trees often share one meta tensor per shape
    shapes_dtypes = []
    for p, leaf in zip(paths, leaves):
        sd = seen.get(id(leaf))
        if sd is None:
            sd = seen[id(leaf)] = _leaf_shape_dtype(p, leaf)
        shapes_dtypes.append(sd)
    return treedef, paths, shapes_dtypes, _spec_leaves(specs, params, treedef, len(leaves))


def _granules(paths, shapes_dtypes, spec_leaves) -> tuple[list, list]:
    """The sharded and the replicated leaves, each as (path, numel, granule, index)."""
    sharded, replicated = [], []
    granule_memo = {}
    for index, (path, (shape, _), s) in enumerate(zip(paths, shapes_dtypes, spec_leaves)):
        numel = math.prod(shape)
        if isinstance(s, Replicate):
            replicated.append((path, numel, 0, index))
        else:
            key = (s, shape)
            granule = granule_memo.get(key)
            if granule is None:
                granule = granule_memo[key] = granule_of(s, shape, path=path)
            sharded.append((path, numel, granule, index))
    return sharded, replicated


def _buffer_dtype(entries, shapes_dtypes, dtype) -> torch.dtype:
    """``dtype``, or the leaves' one dtype; mixed dtypes without ``dtype`` are refused."""
    dtypes = sorted({str(shapes_dtypes[i][1]) for _, _, _, i in entries})
    if dtype is None and len(dtypes) > 1:
        groups = {d: [p for p, _, _, i in entries if str(shapes_dtypes[i][1]) == d] for d in dtypes}
        listing = "; ".join(f"{d}: {', '.join(ps[:3])}{' ...' if len(ps) > 3 else ''}" for d, ps in groups.items())
        raise LayoutError(
            f"params mixes dtypes ({listing}), but one buffer has one dtype. Fix: pass "
            "make_plan(..., dtype=torch.float32) to keep an fp32 master buffer (shard() casts "
            "into it), or plan each dtype as its own unit."
        )
    return shapes_dtypes[0][1] if dtype is None else dtype


def _solve_one_buffer(sharded, candidates, align: int, world_size: int, strategy: str):
    """(S, offsets, split_blocks, chosen order) of the best candidate order in one buffer."""
    best = None
    for candidate in candidates:
        sizes = tuple(sharded[i][1] for i in candidate)
        granules = tuple(sharded[i][2] for i in candidate)
        # Later orders only need to beat the best S so far (strictly, so ties keep the first).
        limit = None if best is None or strategy == "naive" else best[0] - align
        if limit is not None and limit < align:
            break
        solved = _solve(sizes, granules, align, world_size, strategy, limit)
        if solved is not None and (best is None or solved[0] < best[0]):
            best = (*solved, candidate)
    return (align, (), 0, []) if best is None else best  # None: only replicated leaves


def _solve_buffers(sharded, candidates, align: int, world_size: int, max_buffers, itemsize: int):
    """(chosen order, offsets, buffers) of the best partition into at most ``max_buffers`` buffers."""
    parts = _buffers.partition([(e, g) for _, e, g, _ in sharded], world_size=world_size, align=align,
                               max_buffers=max_buffers, itemsize=itemsize, orders=candidates)
    chosen, offsets, start, buffers = [], [], 0, []
    for S_b, members, local in parts:
        chosen.extend(members)
        offsets.extend(start + o for o in local)
        buffers.append((start, S_b))
        start += world_size * S_b
    return chosen, offsets, tuple(buffers)


def with_buffers(plan: LayoutPlan, groups: Sequence[Sequence[str]] | None = None) -> LayoutPlan:
    """``plan``'s leaves laid out in the given buffers (one per group of key paths, in order;
    inside a buffer, the leaves keep ``plan``'s order and take the exact least S for it).

    For tests of code that consumes plans: a multi-buffer plan whatever the padding says
    (``make_plan`` only splits when that pads less). Default ``groups``: one buffer per granule.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged.spec._planning import with_buffers
        >>> plan = rg.make_plan({"a": torch.empty(4, 2), "b": torch.empty(3, 3)}, world_size=2, align=1)
        >>> with_buffers(plan).buffers
        ((0, 4), (8, 6))
    """
    by_path = {leaf.path: leaf for leaf in plan.leaves}
    if groups is None:
        by_granule: dict[int, list[str]] = {}
        for leaf in plan.leaves:
            by_granule.setdefault(leaf.granule, []).append(leaf.path)
        groups = list(by_granule.values())
    listed = [p for g in groups for p in g]
    if sorted(listed) != sorted(by_path) or any(not g for g in groups):
        raise RaggedValueError(
            f"with_buffers: groups must be non-empty and list every sharded leaf exactly once; got {groups}, "
            f"leaves are {list(by_path)}."
        )
    position = {leaf.path: i for i, leaf in enumerate(plan.leaves)}
    leaves, buffers, start, m, align = [], [], 0, plan.world_size, plan.align
    for group in groups:
        members = sorted(group, key=position.get)
        sizes = tuple(by_path[p].numel for p in members)
        granules = tuple(by_path[p].granule for p in members)
        S = _search.min_shard_size(sizes, granules, align, m)
        for p, off in zip(members, _search.place(sizes, granules, align, S)):
            leaves.append(by_path[p].replace(offset=start + off))
        buffers.append((start, S))
        start += m * S
    return plan.replace(leaves=tuple(leaves), shard_size=sum(s for _, s in buffers), buffers=tuple(buffers),
                        split_blocks=0)
