"""The same configuration under FSDP2's and ZeRO-3's layout rules, next to ragged's lowering.

[Note: peer rules of a lowered step]
:func:`compare` takes a :class:`~ragged.predict._lower.Lowered` step and lays the *same units, dtypes,
optimizer kind and schedule* (every unit gathered as often as ragged's program gathers it) out by
each system's rule, per rank (``W`` = the shard group):

* ``ragged``: the lowering itself (``S`` per unit, rows / blocks never split).
* ``fsdp2`` (``fully_shard``, ``Shard(0)`` per parameter): each parameter holds
  ``ceil(d0 / W) * prod(d[1:])`` elements (``spec.peer_shard_numel(..., "fsdp2")``); the optimizer
  state is ``torch.optim.AdamW``'s (``mu``, ``nu`` in the parameter's dtype, a 0-d float32 ``step``
  per parameter). A gather moves ``W`` times the padded shard; while a unit is gathered FSDP2 also
  holds its copy-in buffer (the shard in the compute dtype) and its copy-out (the unsharded
  parameters, ``numel`` elements), so a gathered unit costs ``(W * P + P + numel)`` elements.
* ``zero3`` (DeepSpeed ZeRO-3): each parameter partitioned element-wise, ``ceil(n / W)``
  (``spec.peer_shard_numel(..., "zero3")``); persistent: the partition in the master dtype, a
  compute-dtype copy when it differs, Adam ``mu`` / ``nu`` (master dtype) and the gradient
  partition ZeRO-3 keeps between steps (master dtype). A gathered unit is ``W * P`` elements.

With ``adamw_8bit`` the peers are given bitsandbytes' rule (blockwise 8-bit: one byte per element per
moment plus one fp32 absmax per 2048 elements, tensors under 4096 elements kept in fp32), the
nearest thing either system runs. Reduce-scatters cover the trainable parameters in each rule.
These are rules applied to shapes, not measurements of the other systems.
"""

from __future__ import annotations

import dataclasses

from ragged.spec._peers import peer_shard_numel

__all__ = ["PeerRow", "compare"]

_BNB_BLOCK, _BNB_MIN = 2048, 4096


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerRow:
    """One system's per-rank bytes for the configuration (see [Note: peer rules of a lowered step]).

    Attributes:
        system: ``"ragged"``, ``"fsdp2"`` or ``"zero3"``.
        persistent_bytes: parameter shards, optimizer state (and what else the rule keeps).
        by_category: those bytes by category.
        gather_bytes, reduce_bytes: all-gather output and reduce-scatter input bytes per step (ragged's
            replicated leaves' all-reduces and the step's small agreements are left out: the peers
            shard those leaves).
        largest_gathered_bytes: the largest unit's transient bytes while gathered.
    """

    system: str
    persistent_bytes: int
    by_category: dict
    gather_bytes: int
    reduce_bytes: int
    largest_gathered_bytes: int


def _moments(numels, master: int, eight_bit: bool) -> dict[str, int]:
    if not eight_bit:
        return {"optimizer.mu": sum(numels) * master, "optimizer.nu": sum(numels) * master}
    q = [n for n in numels if n >= _BNB_MIN]
    small = sum(n for n in numels if n < _BNB_MIN)
    blocks = sum(-(-n // _BNB_BLOCK) for n in q)
    return {"optimizer.codes": 2 * sum(q), "optimizer.scales": 2 * 4 * blocks, "optimizer.fp32": 2 * 4 * small}


def compare(lowered, *, eight_bit: bool | None = None) -> tuple[PeerRow, ...]:
    """``ragged``, ``fsdp2`` and ``zero3`` rows for ``lowered``'s configuration.

    Args:
        lowered: from ``step.lower(...)``.
        eight_bit: whether the optimizer is 8-bit AdamW (default: whether ragged's state has codes).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Linear(100, 3))
        >>> units = fsdp.make_units(model, world_size=64, groups=["0", "1"])
        >>> step = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(64))
        >>> [(r.system, r.by_category["param_shards"]) for r in compare(step.lower())]
        [('ragged', 912), ('fsdp2', 924), ('zero3', 432)]
    """
    mem, cost = lowered.memory_analysis(), lowered.cost_analysis()
    if eight_bit is None:
        eight_bit = any(k.endswith("_codes") for k in mem.by_category)
    step = lowered.step
    W, k = step.comm.world_size, step.micro_batches
    rows = [PeerRow(system="ragged", persistent_bytes=mem.persistent_bytes, by_category=dict(mem.by_category),
                    gather_bytes=cost.get("all_gather").bytes,
                    reduce_bytes=cost.get("reduce_scatter").bytes,
                    largest_gathered_bytes=max(lay.nbytes for lay in lowered.layouts))]
    for system in ("fsdp2", "zero3"):
        cat: dict[str, int] = {}
        gather = reduce = largest = 0
        for u, lay in zip(lowered.units, lowered.layouts):
            leaves = u.plan.leaves + u.plan.replicated
            master, compute = u.plan.dtype.itemsize, lay.dtype.itemsize
            rsize = (lay.reduce_dtype or u.plan.dtype).itemsize
            per = [peer_shard_numel({"x": _Shape(l.shape)}, W, system) for l in leaves]
            trains = [p for p, l in zip(per, leaves) if u.paths[l.index] not in u.frozen]
            P, numel = sum(per), sum(l.numel for l in leaves)
            cat["param_shards"] = cat.get("param_shards", 0) + P * master
            for key, v in _moments(trains, master, eight_bit).items():
                cat[key] = cat.get(key, 0) + v
            if system == "fsdp2":
                cat["optimizer.step"] = cat.get("optimizer.step", 0) + 4 * len(trains)
                unit_gathered = (W * P + P + numel) * compute
            else:
                if compute != master:
                    cat["compute_copy"] = cat.get("compute_copy", 0) + P * compute
                cat["grad_partition"] = cat.get("grad_partition", 0) + sum(trains) * master
                unit_gathered = W * P * compute
            gathers = cost.per_unit[u.name]["gathers"]
            gather += gathers * W * P * compute
            if trains:
                reduce += k * W * sum(trains) * rsize
            largest = max(largest, unit_gathered)
        rows.append(PeerRow(system=system, persistent_bytes=sum(cat.values()), by_category=cat, gather_bytes=gather,
                            reduce_bytes=reduce, largest_gathered_bytes=largest))
    return tuple(rows)


class _Shape:
    """A shape-only leaf for ``peer_shard_numel`` (no tensor needed)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape):
        self.shape, self.dtype = tuple(shape), None
