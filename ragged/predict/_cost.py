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

__all__ = ["Collective", "CostAnalysis", "cost_analysis", "unit_collectives", "around_program"]


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


def unit_collectives(lowered) -> list:
    """Per unit, ``(gather, reduction)``: what the runtime issues when the program gathers the unit,
    ``(kind, axis, bytes)`` (the gathered buffer in the compute dtype; quantized, its chunks of
    bytes), and when it reduces the unit's gradients in one micro-batch (none where nothing
    trains): the reduce-scatter in the reduce dtype (quantized: an all-to-all of the same volume
    per rank; a chunked step's from three ranks on: one all-to-all per buffer), the replicated
    gradients' all-reduce (a chunked step's, from three ranks on: an all-gather of every rank's
    copy), HSDP's all-reduces over the replica axis.
    Counted by :func:`cost_analysis`, timed by ``estimate_time``."""
    replicas, m, chunked = lowered.step.comm.num_replicas, lowered.step.comm.world_size, lowered.step.chunks is not None
    out = []
    for lay in lowered.layouts:
        qgather, qreduce = unit_wire_bytes(lowered.units[lay.name].plan, lay)
        gather = ("all_gather", "shard", lay.nbytes if qgather is None else qgather)
        reduction, gp = [], lay.grad_plan
        if gp is not None:
            rsize = (lay.reduce_dtype or gp.dtype).itemsize
            rep = gp.replicated_numel * rsize
            if qreduce is not None:
                reduction.append(("all_to_all", "shard", qreduce))
            elif not chunked or m <= 2:
                reduction.append(("reduce_scatter", "shard", gp.buffer_numel * rsize))
            else:  # the fixed tree's reduction: one all-to-all per buffer (ragged/transforms/_flat.py)
                reduction += [("all_to_all", "shard", m * size * rsize) for _, size in gp.buffers]
            if gp.replicated:
                reduction.append(("all_gather", "shard", m * rep) if chunked and m > 2 else ("all_reduce", "shard", rep))
            if replicas > 1:
                reduction.append(("all_reduce", "replica", gp.shard_size * rsize))
                if gp.replicated:
                    reduction.append(("all_reduce", "replica", rep))
        out.append((gather, reduction))
    return out


def around_program(lowered) -> tuple[list, list]:
    """The step's calls outside its program, as ``(kind, axis, calls, bytes)``: ``before`` it, the
    plan check; ``after`` it, the end-of-call agreement, each data group's agreement and
    all-reduce of the gradients replicated over it (axis ``"data<g>"``), and the calls the
    optimizer declares (see [Note: an optimizer's collectives are declared, not recorded] in
    ``ragged/optim/_base.py``)."""
    step = lowered.step
    comm = step.comm
    n = verdict_size(lowered.layouts, step.chunks)
    after = list(agree_collectives(comm, n))
    for g, group in enumerate(step.data_groups):  # the agreement spans each data axis; then its gradients
        axis = f"data{g}"
        after += [(kind, axis, calls, nbytes) for kind, _, calls, nbytes in agree_collectives(group.comm, n)]
        for lay in lowered.layouts:
            unit = lowered.units[lay.name]
            if lay.grad_plan is not None:
                for k in all_reduce_leaves_numels(unit.trainable_plan, comm.rank, picked_leaves(unit, group.is_replicated)):
                    after.append(("all_reduce", axis, 1, k * unit.trainable_plan.dtype.itemsize))
    if step.optimizer.collectives is not None:  # the update's own (Muon's exchanges, a global norm)
        after += step.optimizer.collectives(trainable_shards(lowered.units, meta_shards(lowered.units, comm.rank)))
    return list(agreement_collectives(comm)), after


def cost_analysis(lowered) -> CostAnalysis:
    """Collectives per step of the steady state of ``lowered`` (see [Note: lowering a step] in
    ``ragged/predict/_lower.py``); ``lowered.cost_analysis()`` calls this."""
    k = lowered.step.micro_batches
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
    for lay, n_g, ((kind, axis, gb), reduction) in zip(lowered.layouts, gathers, unit_collectives(lowered)):
        add(kind, axis, n_g, n_g * gb)
        for kind, axis, nbytes in reduction:
            add(kind, axis, k, k * nbytes)
        per_unit[lay.name] = {"gathers": n_g, "gather_bytes": n_g * gb, "reduces": k * (lay.grad_plan is not None),
                              "reduce_bytes": k * sum(b for _, axis, b in reduction if axis == "shard")}
    for record in (r for part in around_program(lowered) for r in part):
        add(*record)
    objects = 1 if lowered.schedule.learning else 0  # a learning call exchanges what every rank observed
    records = tuple(Collective(kd, ax, c, b) for (kd, ax), (c, b) in sorted(table.items()))
    return CostAnalysis(collectives=records, objects=objects, per_unit=per_unit, assumed=lowered._assumed())
