"""Input validation and the cross-rank plan check shared by the transforms.

[Note: plan check before collectives]
Ranks holding different plans would exchange differently sized buffers: at best a hang, at
worst silently wrong numbers. Before the first large collective on a plan, every rank of the
mesh all-gathers a small summary of its plan (``fingerprint()`` plus the fields needed to say
what differs) and raises :class:`~ragged.PlanMismatchError` on every rank if any differ. The
fingerprint is then remembered on the comm (``comm.checked_plans``), so the check costs one
small ``all_gather_object`` per plan, not per step.
Limitation (the price of not checking every step): the check is a collective, so it only
helps if every rank *runs* it, i.e. if the mismatching plan is new on every rank of this comm.
That holds for the common failure (ranks built different models or options from the start).
A rank that later switches to a plan the others never use, while they keep a plan they
already checked, cannot be detected without per-step communication; gloo's process-group
timeout then turns the mismatch into an error. Pass a fresh comm (``from_torch()``) to force
the check again.
"""

from __future__ import annotations

import torch

from ragged._errors import LayoutError, PlanMismatchError
from ragged._pytree import flatten_with_keystr
from ragged.spec._plan import LayoutPlan

__all__ = ["check_plan", "check_comm", "flatten_like_plan", "check_plan_type"]


def check_plan_type(plan, where: str) -> LayoutPlan:
    if not isinstance(plan, LayoutPlan):
        raise TypeError(f"{where}: plan must be a ragged LayoutPlan (from rg.make_plan), got {type(plan).__name__}.")
    return plan


def check_comm(plan: LayoutPlan, comm, where: str) -> None:
    """A plan may shard over fewer ranks than the comm has (the rest hold empty shards, see
    ``redistribute``), never over more."""
    if comm.world_size < plan.world_size:
        raise ValueError(
            f"{where}: the plan shards over world_size={plan.world_size} ranks but the comm's shard group has "
            f"{comm.world_size}. Fix: plan with rg.make_plan(..., world_size=comm.world_size)."
        )


def _summary(plan: LayoutPlan):
    return (
        plan.fingerprint(),
        plan.world_size,
        plan.shard_size,
        str(plan.dtype),
        tuple((l.path, l.shape, str(l.dtype), l.offset, l.granule) for l in plan.leaves),
        tuple((l.path, l.shape, str(l.dtype)) for l in plan.replicated),
    )


def _describe(mine, other) -> str:
    """The most basic difference first: world size, dtype, leaf set/shapes, then layout."""
    diffs = []
    if mine[1] != other[1]:
        diffs.append(f"world_size {mine[1]} vs {other[1]}")
    if mine[3] != other[3]:
        diffs.append(f"dtype {mine[3]} vs {other[3]}")
    fields = ("path", "shape", "dtype", "offset", "granule")
    for kind, la, lb in (("sharded", mine[4], other[4]), ("replicated", mine[5], other[5])):
        pa, pb = {x[0]: x for x in la}, {x[0]: x for x in lb}
        if set(pa) != set(pb):
            diffs.append(
                f"{kind} leaves: only on the first {sorted(set(pa) - set(pb))}, only on the second {sorted(set(pb) - set(pa))}"
            )
        for path in sorted(set(pa) & set(pb)):
            d = [f"{f} {x} vs {y}" for f, x, y in zip(fields[1:3], pa[path][1:3], pb[path][1:3]) if x != y]
            if d:
                diffs.append(f"leaf {path}: " + ", ".join(d))
    if not diffs and mine[2] != other[2]:
        diffs.append(f"shard_size {mine[2]} vs {other[2]}")
    if not diffs:
        for kind, la, lb in (("sharded", mine[4], other[4]),):
            pa, pb = {x[0]: x for x in la}, {x[0]: x for x in lb}
            for path in sorted(set(pa) & set(pb)):
                d = [f"{f} {x} vs {y}" for f, x, y in zip(fields[3:], pa[path][3:], pb[path][3:]) if x != y]
                if d:
                    diffs.append(f"leaf {path}: " + ", ".join(d))
    if not diffs:
        diffs.append("leaf order, tree structure or planning options (align/strategy/specs)")
    return "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")


def check_plan(plan: LayoutPlan, comm) -> None:
    """Compares ``plan`` across every rank of ``comm`` once (see [Note: plan check before
    collectives]); raises :class:`PlanMismatchError` on every rank if they differ."""
    checked = getattr(comm, "checked_plans", None)
    if checked is not None and id(plan) in checked:  # fast path: this very plan object
        return
    fp = plan.fingerprint()
    if checked is not None and fp in checked:
        checked[id(plan)] = plan
        return
    summaries = comm.all_gather_object(_summary(plan))
    distinct = []
    for s in summaries:
        if s[0] not in [d[0] for d in distinct]:
            distinct.append(s)
    if len(distinct) > 1:
        groups = {d[0]: [i for i, s in enumerate(summaries) if s[0] == d[0]] for d in distinct}
        a, b = distinct[0], distinct[1]
        raise PlanMismatchError(
            f"ranks hold different plans: ranks {groups[a[0]]} vs ranks {groups[b[0]]} differ in "
            f"{_describe(a, b)}. Every rank must build the plan from the same shapes, specs, world_size "
            f"and options (check that all ranks build the same model and call make_plan the same way)."
        )
    if checked is not None:
        checked[fp] = plan
        checked[id(plan)] = plan  # the value keeps the plan alive, so its id is not reused


def flatten_like_plan(plan: LayoutPlan, tree, what: str, *, device=None, allow_dtypes=None):
    """Leaves of ``tree`` in plan leaf-index order, validated against ``plan``.

    Raises (before any communication) TypeError / LayoutError naming the key path, the shape
    and the fix.
    """
    paths, leaves, treedef = flatten_with_keystr(tree)
    if treedef != plan.treedef:
        expected = [l.path for l in sorted(plan.leaves + plan.replicated, key=lambda l: l.index)]
        missing, extra = sorted(set(expected) - set(paths)), sorted(set(paths) - set(expected))
        raise LayoutError(
            f"{what} does not have the plan's tree structure: missing {missing}, unexpected {extra}"
            + ("" if missing or extra else f" (structure {treedef} vs plan {plan.treedef})")
            + f". Fix: pass a tree shaped like the params the plan was made from."
        )
    for layout in plan.leaves + plan.replicated:
        leaf = leaves[layout.index]
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what}{layout.path} is a {type(leaf).__name__}, not a torch.Tensor.")
        if tuple(leaf.shape) != layout.shape:
            raise LayoutError(
                f"{what}{layout.path} has shape {tuple(leaf.shape)} but the plan expects {layout.shape}. "
                "Fix: pass the tensors the plan was made from (or re-plan).",
                path=layout.path,
                shape=leaf.shape,
            )
        if leaf.is_meta:
            raise LayoutError(
                f"{what}{layout.path} is a meta tensor (shape {layout.shape}); it has no data to move. "
                "Fix: materialise the parameters (e.g. module.to_empty(device=...) then init) first.",
                path=layout.path,
                shape=leaf.shape,
            )
        if device is not None and leaf.device.type != torch.device(device).type:
            raise LayoutError(
                f"{what}{layout.path} is on {leaf.device} but the comm works on {device}. "
                f"Fix: move it with .to({str(device)!r}).",
                path=layout.path,
                shape=leaf.shape,
            )
        if not (leaf.is_floating_point() or leaf.is_complex()) and plan.dtype.is_floating_point:
            raise LayoutError(
                f"{what}{layout.path} has dtype {leaf.dtype} but the plan's buffer is {plan.dtype}: an integer "
                "or bool tensor cannot be cast into a floating buffer safely. Fix: plan integer buffers "
                "separately, or keep them out of the sharded tree.",
                path=layout.path,
                shape=leaf.shape,
            )
    return leaves
