"""One plan made of two: the buffers of the first, then those of the second.

[Note: trainable buffers first]
A unit whose leaves are partly frozen is planned as two plans, its trainable leaves and its
frozen ones, joined by :func:`concat_plans`: the trainable buffers come first. So the trainable
plan is a *prefix* of the unit's plan: the same leaf offsets, its buffers are the first buffers,
its replicated leaves the first replicated elements, and a rank's trainable elements are the
first ``trainable.shard_size`` of its shard. Gradients, reduce-scatters and optimizer state use
the trainable plan over that prefix (views, nothing copied); the all-gather moves the whole plan
in one launch. Each part is planned on its own, so no granule of either crosses a rank boundary
of its buffers.
"""

from __future__ import annotations

import functools
from typing import Any

from ragged._errors import RaggedValueError
from ragged.spec._plan import LayoutPlan

__all__ = ["concat_plans", "leading_part", "replicated_size"]


def replicated_size(plan: LayoutPlan) -> int:
    """Elements of the replicated buffer (offsets are aligned; the end is aligned too)."""
    if not plan.replicated:
        return 0
    end = max(l.stop for l in plan.replicated)
    return -(-end // plan.align) * plan.align


def concat_plans(first: LayoutPlan, second: LayoutPlan, treedef: Any, paths: tuple[str, ...]) -> LayoutPlan:
    """The plan of both plans' leaves: ``first``'s buffers, then ``second``'s (see [Note: trainable
    buffers first]).

    Args:
        first, second: plans of disjoint subtrees of one flat dict, with equal world size, dtype
            and alignment.
        treedef: the structure of the joined tree.
        paths: the joined tree's leaf key paths in flattened order (``LeafLayout.path``).

    Examples:
        >>> import optree, torch, ragged as rg
        >>> tree = {"a": torch.empty(6), "b": torch.empty(4, 2)}
        >>> a = rg.make_plan({"a": tree["a"]}, world_size=2, align=1)
        >>> b = rg.make_plan({"b": tree["b"]}, world_size=2, align=1)
        >>> both = concat_plans(a, b, optree.tree_structure(tree, namespace="ragged"), ("['a']", "['b']"))
        >>> both.buffers, [(l.path, l.index, l.offset) for l in both.leaves]
        (((0, 3), (6, 4)), [("['a']", 0, 0), ("['b']", 1, 6)])
    """
    for field in ("world_size", "dtype", "align", "strategy"):
        if getattr(first, field) != getattr(second, field):
            raise RaggedValueError(f"concat_plans: the plans differ in {field} ({getattr(first, field)} vs "
                                   f"{getattr(second, field)}).")
    index = {p: i for i, p in enumerate(paths)}
    shift, rshift = first.buffer_numel, replicated_size(first)

    def moved(leaves, by):
        return tuple(l.replace(index=index[l.path], offset=l.offset + by) for l in leaves)

    return LayoutPlan(
        leaves=moved(first.leaves, 0) + moved(second.leaves, shift),
        replicated=moved(first.replicated, 0) + moved(second.replicated, rshift),
        world_size=first.world_size,
        shard_size=first.shard_size + second.shard_size,
        dtype=first.dtype,
        align=first.align,
        strategy=first.strategy,
        split_blocks=first.split_blocks + second.split_blocks,
        treedef=treedef,
        buffers=first.buffers + tuple((o + shift, s) for o, s in second.buffers),
    )


@functools.lru_cache(maxsize=1024)
def leading_part(plan: LayoutPlan, keep: frozenset[str], treedef: Any) -> LayoutPlan:
    """The plan of the leaves of ``plan`` whose key paths are in ``keep``, which must fill its
    leading buffers and the start of its replicated buffer (as :func:`concat_plans` lays them):
    the same offsets, ``plan``'s first buffers (see [Note: trainable buffers first]).

    Args:
        plan: a plan of a flat dict.
        keep: ``LeafLayout.path`` of the leaves to keep.
        treedef: the structure of the dict of the kept leaves.

    Raises:
        RaggedValueError: a kept leaf lies after a leaf that is not kept.

    Examples:
        >>> import optree, torch, ragged as rg
        >>> a = rg.make_plan({"a": torch.empty(6)}, world_size=2, align=1)
        >>> b = rg.make_plan({"b": torch.empty(4, 2)}, world_size=2, align=1)
        >>> both = concat_plans(a, b, optree.tree_structure({"a": 0, "b": 0}, namespace="ragged"), ("['a']", "['b']"))
        >>> leading_part(both, frozenset({"['a']"}), optree.tree_structure({"a": 0}, namespace="ragged")) == a
        True
    """
    kept = [l for l in plan.leaves if l.path in keep]
    rest = [l for l in plan.leaves if l.path not in keep]
    k = min((plan.buffer_index(l.offset) for l in rest), default=plan.num_buffers)
    rkept = [l for l in plan.replicated if l.path in keep]
    rend = -(-max((l.stop for l in rkept), default=0) // plan.align) * plan.align
    late = [l.path for l in kept if plan.buffer_index(l.offset) >= k]
    late += [l.path for l in plan.replicated if l.path not in keep and l.offset < rend]
    if late or k == 0:
        raise RaggedValueError(
            f"the plan does not hold the leaves {sorted(keep)[:3]} in its leading buffers ({late[:3]} lie after others); "
            "plan a unit's trainable and frozen leaves apart and join them with concat_plans."
        )
    order = sorted(l.index for l in kept + rkept)
    index = {i: n for n, i in enumerate(order)}
    buffers = plan.buffers[:k]
    return LayoutPlan(
        leaves=tuple(l.replace(index=index[l.index]) for l in kept),
        replicated=tuple(l.replace(index=index[l.index]) for l in rkept),
        world_size=plan.world_size,
        shard_size=sum(s for _, s in buffers),
        dtype=plan.dtype,
        align=plan.align,
        strategy=plan.strategy,
        split_blocks=plan.split_blocks if not rest else 0,
        treedef=treedef,
        buffers=buffers,
    )
