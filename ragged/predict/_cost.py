"""``lowered.cost_analysis()``: a lowered step's collectives per step, counted at the
``Collectives`` boundary the way the runtime issues them (see [Note: lowering a step] in
``ragged/predict/_lower.py``)."""

from __future__ import annotations

import dataclasses

from ragged.fsdp._trainable import trainable_shards
from ragged.fsdp._units import picked_leaves
from ragged.predict._persistent import meta_shards
from ragged.predict._timeline import walk
from ragged.collectives._agree import agree_collectives
from ragged.fsdp._grad import verdict_size
from ragged.transforms._check import agreement_collectives
from ragged.transforms._quantized import unit_wire_bytes
from ragged.transforms._reduce_scatter import all_reduce_leaves_numels

__all__ = ["Collective", "CostAnalysis", "cost_analysis"]


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One collective kind on one mesh axis, per step: ``calls`` and ``bytes`` (sent per rank, as
    the full buffer: all-gather output, reduce-scatter input, all-reduce tensor). ``axis``:
    ``"shard"`` (the FSDP group), ``"replica"`` (HSDP), ``"data0"``, ``"data1"``, ... (the step's
    ``data_groups`` in order, e.g. expert parallelism's EP axis). Collectives inside the loss
    (an MoE dispatch's all-to-all, tensor parallelism's) are the model's and not counted.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> units = fsdp.make_units(model, world_size=64, groups=["0", "1"])
        >>> lowered = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(64)).lower()
        >>> c = lowered.cost_analysis().get("reduce_scatter")
        >>> c.kind, c.axis, c.calls > 0, c.bytes > 0
        ('reduce_scatter', 'shard', True, True)
    """

    kind: str
    axis: str
    calls: int
    bytes: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CostAnalysis:
    """Collectives per step (see [Note: lowering a step]).

    Attributes:
        collectives: one :class:`Collective` per (kind, axis), sorted.
        objects: ``all_gather_object`` calls per step (host objects; sizes not predicted).
        per_unit: ``{unit: {"gathers": calls, "gather_bytes": .., "reduces": .., "reduce_bytes": ..}}``.
        assumed: what the counts rest on.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> units = fsdp.make_units(model, world_size=64, groups=["0", "1"])
        >>> lowered = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(64)).lower()
        >>> {"all_gather", "reduce_scatter"} <= {c.kind for c in lowered.cost_analysis().collectives}
        True
    """

    collectives: tuple[Collective, ...]
    objects: int
    per_unit: dict
    assumed: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    def get(self, kind: str, axis: str = "shard") -> Collective:
        """The record of ``kind`` on ``axis`` (zero calls when the step issues none)."""
        return next((c for c in self.collectives if (c.kind, c.axis) == (kind, axis)), Collective(kind, axis, 0, 0))


def cost_analysis(lowered) -> CostAnalysis:
    """Collectives per step of the steady state of ``lowered`` (see [Note: lowering a step] in
    ``ragged/predict/_lower.py``); ``lowered.cost_analysis()`` calls this."""
    step = lowered.step
    comm, k = step.comm, step.micro_batches
    replicas = comm.num_replicas
    gathers = [0] * len(lowered.layouts)  # every micro-batch's
    for action, *args in walk(lowered):
        if action == "gather":
            gathers[args[0]] += 1
    table: dict[tuple[str, str], list[int]] = {}

    def add(kind, axis, calls, nbytes):
        if calls:
            row = table.setdefault((kind, axis), [0, 0])
            row[0] += calls
            row[1] += nbytes

    per_unit = {}
    for lay, n_g in zip(lowered.layouts, gathers):
        qgather, qreduce = unit_wire_bytes(lowered.units[lay.name].plan, lay)  # quantized: chunks of bytes
        gb = lay.nbytes if qgather is None else qgather  # the gathered buffer in the compute dtype
        add("all_gather", "shard", n_g, n_g * gb)
        unit = {"gathers": n_g, "gather_bytes": n_g * gb, "reduces": 0, "reduce_bytes": 0}
        gp = lay.grad_plan
        if gp is not None:
            rsize = (lay.reduce_dtype or gp.dtype).itemsize
            moved = gp.buffer_numel * rsize if qreduce is None else qreduce
            add("reduce_scatter" if qreduce is None else "all_to_all", "shard", k, k * moved)
            rep = gp.replicated_numel * rsize
            if gp.replicated:
                add("all_reduce", "shard", k, k * rep)
            if replicas > 1:
                add("all_reduce", "replica", k * (1 + bool(gp.replicated)), k * (gp.shard_size * rsize + rep))
            unit.update(reduces=k, reduce_bytes=k * (moved + (rep if gp.replicated else 0)))
        per_unit[lay.name] = unit
    for record in agreement_collectives(comm):  # the plan check, every step
        add(*record)
    n = verdict_size(lowered.layouts)  # the end-of-call agreement
    for record in agree_collectives(comm, n):
        add(*record)
    for g, group in enumerate(step.data_groups):  # the agreement spans each data axis; then its gradients
        axis = f"data{g}"
        for kind, _, calls, nbytes in agree_collectives(group.comm, n):
            add(kind, axis, calls, nbytes)
        for lay in lowered.layouts:
            unit = lowered.units[lay.name]
            if lay.grad_plan is not None:
                for n in all_reduce_leaves_numels(unit.trainable_plan, comm.rank, picked_leaves(unit, group.is_replicated)):
                    add("all_reduce", axis, 1, n * unit.trainable_plan.dtype.itemsize)
    if step.optimizer.collectives is not None:  # the update's own (Muon's exchanges, a global norm)
        for record in step.optimizer.collectives(trainable_shards(lowered.units, meta_shards(lowered.units, comm.rank))):
            add(*record)
    objects = 1 if lowered.schedule.learning else 0  # a learning call exchanges what every rank observed
    records = tuple(Collective(kd, ax, c, b) for (kd, ax), (c, b) in sorted(table.items()))
    return CostAnalysis(collectives=records, objects=objects, per_unit=per_unit, assumed=lowered._assumed())
