"""Why a unit pads, and which changes would fix it, with numbers (``python -m ragged plan``'s
warnings; every suggested fix is planned, see [Note: only verified fixes]).
"""

from __future__ import annotations

import math

from ragged.spec import Rows, _search, make_plan
from ragged.spec._granularity import GRANULARITY_TYPES

__all__ = ["forcing_leaves", "explain_padding"]


def _ideal(plan, numel: int) -> int:
    """``ceil(numel / m)`` rounded up to ``plan.align``: the shard size without padding."""
    return -(-(-(-numel // plan.world_size)) // plan.align) * plan.align


def forcing_leaves(plan, leaves=None):
    """Leaves (of ``leaves``, default all: one buffer) too long to cross only one rank boundary
    at their buffer's ideal shard size ``ceil(numel / m)``: each forces S to a multiple of its
    granule (see ``_search`` note).

    Returns:
        ``(leaves, step)``: the forcing leaves and the lcm of ``align`` and their granules.
    """
    leaves = plan.leaves if leaves is None else leaves
    S = max(_ideal(plan, sum(l.numel for l in leaves)), 1)
    forced, step = [], plan.align
    for leaf in leaves:
        L = math.lcm(leaf.granule, plan.align)
        if leaf.numel > leaf.granule and leaf.numel > S + (S // L) * L:
            forced.append(leaf)
            step = math.lcm(step, leaf.granule)
    return forced, step


def _merged(params, k: int):
    return {f"layer{i}": params for i in range(k)}


def explain_padding(unit, plan, specs, *, granularity, strategy, align, repeated: int, threshold: float,
                    max_buffers=1):
    """Why a unit's padding is large and what would fix it, with numbers.

    Every suggestion is planned, not guessed (see [Note: only verified fixes]).

    Args:
        repeated: how many identical units of this kind the model has (merging up to that
            many layers per unit is offered as a fix).
        threshold: padding percentage at or below which a change counts as a fix.

    Returns:
        ``(why_lines, fixes, reductions)``: fixes bring the padding to ``threshold`` or below,
        reductions lower it without getting there; both are ``"change: padding"`` strings.
    """
    m = plan.world_size
    lines = []
    forced, step = forcing_leaves(plan) if plan.num_buffers == 1 else ((), plan.align)
    for b, (_, size) in enumerate(plan.buffers if plan.num_buffers > 1 else ()):
        members = [l for l in plan.leaves if plan.buffer_index(l.offset) == b]
        in_b, step_b = forcing_leaves(plan, members)
        lines.append(f"buffer {b} ({len(members)} leaves, S_b={size}): "
                     + (f"{len(in_b)} leaves longer than 2*S_b force S_b to a multiple of {step_b}" if in_b
                        else "no leaf forces S_b"))
    ideal = _ideal(plan, plan.numel)
    if forced:  # (one buffer only)
        shown = sorted(forced, key=lambda l: (-l.granule, l.path))[:4]
        listing = ", ".join(f"{l.path} {l.shape} granule {l.granule}" for l in shown)
        more = f", +{len(forced) - len(shown)} more" if len(forced) > len(shown) else ""
        lines.append(
            f"{len(forced)} leaves are longer than 2*S (S~{ideal}), so S must be a multiple of the lcm of their "
            f"granules = {step} elements ({listing}{more}); S={plan.shard_size} is {plan.shard_size / ideal:.2f}x "
            "the ideal."
        )
        lb = _search.order_free_lower_bound([l.numel for l in plan.leaves], [l.granule for l in plan.leaves],
                                            plan.align, m)
        if plan.shard_size == lb:
            lines.append("this S is the order-free lower bound: no leaf order and no planner pads less here.")
    elif plan.num_buffers == 1:  # (several buffers: one line each above)
        lines.append(f"no leaf forces S (S={plan.shard_size}, ideal {ideal}); large granules relative to S cost the rest.")

    def overhead(params, unit_specs, world_size):
        return make_plan(params, unit_specs, world_size=world_size, strategy=strategy, align=align,
                         max_buffers=max_buffers).overhead

    # Each family of changes, mildest first: (label, padding) until one reaches the threshold.
    families = []
    hsdp, d = [], 2
    while m % d == 0:  # HSDP: m = replicas x shard group
        hsdp.append((f"shard group {m // d} ({d} replicas)", overhead(unit.params, specs, m // d)))
        if hsdp[-1][1] * 100 <= threshold:
            break
        d *= 2
    families.append(hsdp)
    merged = []
    for k in (k for k in (2, 4, 8, 16) if k <= repeated):
        merged_specs = specs if _is_leaf_spec(specs) else _merged(specs, k)
        merged.append((f"{k} layers per unit", overhead(_merged(unit.params, k), merged_specs, m)))
        if merged[-1][1] * 100 <= threshold:
            break
    families.append(merged)
    if isinstance(granularity, Rows) and granularity.n > 1:
        families.append([("granularity rows:1", overhead(unit.params, Rows(1), m))])
    fixes, reductions = [], []
    for family in families:
        fixing = [c for c in family if c[1] * 100 <= threshold]
        if fixing:
            fixes.append(f"{fixing[0][0]}: {fixing[0][1]:.2%}")
        elif family:
            label, best = min(family, key=lambda c: c[1])
            if best < _HELPS * plan.overhead:
                reductions.append(f"{label}: {best:.2%}")
    return lines, fixes, reductions


# [Note: only verified fixes]
# The CLI suggests a change only after planning the unit with it: "would fix it" lists changes
# whose padding is at or below --warn-above, "would reduce it" those that cut the padding to
# less than _HELPS of what it is (the best of each family), and nothing else. A change that
# plans to the same padding (2 layers per unit when both layers force the same multiple) is
# not a fix and is not shown.
_HELPS = 0.9


def _is_leaf_spec(specs) -> bool:
    return isinstance(specs, GRANULARITY_TYPES)
