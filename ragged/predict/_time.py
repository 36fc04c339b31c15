"""``lowered.estimate_time(network, ...)``: a step's time from an alpha-beta network and per-unit compute.

[Note: the step-time model]
Two queues, walked in the order the runtime issues its work (the lowered step's
:func:`~ragged.fsdp._schedule.program`, per micro-batch):

* compute: forward entry ``c`` runs unit ``forward[c]``'s forward (``compute[unit]`` seconds) once
  its all-gather is done; backward segment ``s`` runs ``backward_factor`` times that (default 2, the
  usual 2x of backward over forward; an assumption the caller may change);
* network: every collective of the mesh axis in turn (one link per axis, collectives on it in issue
  order, the reduce-scatters sharing it with the all-gathers), each ``alpha + (W - 1) / W * bytes /
  bandwidth`` (an all-reduce twice that: reduce-scatter + all-gather), issued when the compute queue
  reaches the point that issues it. The collectives are the ones ``cost_analysis`` counts
  (``unit_collectives`` and ``around_program`` in ``_cost.py``): the plan check first, the end-of-call
  agreement and the optimizer's own after the program; those of a data group's axis are not timed. So a prefetched gather overlaps the previous entry's compute,
  a reduce-scatter the next segment's; ``max_inflight_reduce`` makes compute wait for the oldest.

``overlap`` is the fraction of each collective's time that runs beside compute: ``True`` (1, the
default: a GPU's collectives run on their own engines), ``False`` (0: every collective also holds
the compute queue from its issue to its end), or a number in between: the collective holds the
compute queue for ``1 - overlap`` of its time from its start. That is the transport whose work runs
on the cores the compute uses: gloo on a CPU with one core per rank or fewer (its copies, its sums
and the kernel's socket copies take the core the next unit would compute on); the share of a
collective's wall time it spends on the CPU is a machine constant, measured beside alpha and beta
(``bench/predict.py --time`` takes its CPU seconds per call).

``alpha`` is the per-call latency and ``bandwidth`` the bus bandwidth of one axis: calibrate them
from ``bench/collectives.py`` on the machine (two sizes give both), or pass a vendor's figures,
labelled as assumed. The result's ``parts`` say where the time goes: ``compute``, ``comm`` (the
network busy time per kind), ``exposed_comm`` (the step minus compute: what overlap did not hide).
"""

from __future__ import annotations

import dataclasses

from ragged._errors import RaggedValueError
from ragged.predict._cost import around_program, unit_collectives
from ragged.predict._timeline import walk

__all__ = ["Link", "Network", "TimeEstimate", "estimate_time"]


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One mesh axis: ``alpha`` seconds per call, ``bandwidth`` bytes per second.

    Examples:
        >>> import ragged as rg
        >>> round(rg.predict.Link(alpha=1e-5, bandwidth=1e10).seconds("all_gather", 10**9, 2), 6)   # alpha + (W-1)/W * bytes / bw
        0.05001
    """

    alpha: float
    bandwidth: float

    def seconds(self, kind: str, nbytes: int, world: int) -> float:
        if world <= 1:
            return 0.0
        one = self.alpha + (world - 1) / world * nbytes / self.bandwidth
        return 2 * one if kind == "all_reduce" else one


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Network:
    """Links per mesh axis (``shard``: the FSDP group; ``replica``: HSDP's replica group).

    Examples:
        >>> import ragged as rg
        >>> rg.predict.Network(shard=rg.predict.Link(alpha=1e-5, bandwidth=1e10)).replica is None
        True
    """

    shard: Link
    replica: Link | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TimeEstimate:
    """``seconds`` of one step and its ``parts`` (see [Note: the step-time model]).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> units = fsdp.make_units(model, world_size=64, groups=["0", "1"])
        >>> lowered = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(64)).lower()
        >>> link = rg.predict.Link(alpha=1e-5, bandwidth=1e10)
        >>> t = lowered.estimate_time(rg.predict.Network(shard=link))
        >>> isinstance(t, rg.predict.TimeEstimate), t.seconds >= 0
        (True, True)
    """

    seconds: float
    parts: dict
    assumed: tuple[str, ...] = ()


def estimate_time(lowered, network: Network, *, compute=None, backward_factor: float = 2.0,
                  optimizer_seconds: float = 0.0, overlap: bool | float = True) -> TimeEstimate:
    """The step time of ``lowered`` on ``network`` (see [Note: the step-time model]).

    Args:
        lowered: from ``step.lower(...)``.
        network: a :class:`Network` (a :class:`Link` is taken as the shard axis).
        compute: ``{unit name: forward seconds of one of its entries, per micro-batch}`` (missing: 0), or one number
            for every unit; measure it at W=1 or derive it as flops / throughput.
        backward_factor: backward seconds of a unit over its forward seconds.
        optimizer_seconds: the optimizer update (not overlapped).
        overlap: the fraction of each collective's time that runs beside compute: ``True`` (1,
            default), ``False`` (0: each holds the compute queue too), or a number in between (a
            CPU transport sharing the compute's cores; see [Note: the step-time model]).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        >>> units = fsdp.make_units(model, world_size=8, groups=["0", "1"])
        >>> step = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(8))
        >>> t = step.lower().estimate_time(rg.predict.Link(alpha=1e-5, bandwidth=1e9), compute=1e-3)
        >>> round(t.parts["compute"], 6), t.seconds > t.parts["compute"]
        (0.006, True)
        >>> serial = step.lower().estimate_time(rg.predict.Link(alpha=1e-5, bandwidth=1e9), compute=1e-3, overlap=False)
        >>> serial.seconds > t.seconds, round(serial.seconds - serial.parts["compute"] - sum(serial.parts["comm"].values()), 9)
        (True, 0.0)
    """
    if not isinstance(overlap, bool) and not (isinstance(overlap, (int, float)) and 0 <= overlap <= 1):
        raise RaggedValueError(f"estimate_time: overlap must be True, False or a number in [0, 1], got {overlap!r}.")
    hold = 1.0 - float(overlap)
    if isinstance(network, Link):
        network = Network(shard=network)
    if not isinstance(network, Network):
        raise RaggedValueError(f"estimate_time: network must be a Network or a Link, got {type(network).__name__}.")
    step, sched, lays = lowered.step, lowered.schedule, lowered.layouts
    comm = step.comm
    W, R = comm.world_size, comm.num_replicas
    if R > 1 and network.replica is None:
        raise RaggedValueError("estimate_time: the step has replica groups (HSDP); pass Network(shard=..., replica=...).")
    fwd = _forward_seconds(compute, lays)
    clock = {"compute": 0.0, "net": 0.0}
    busy: dict[str, float] = {}
    done: dict[int, float] = {}
    pending: list[float] = []
    inflight = step.value_and_grad.max_inflight_reduce

    links = {"shard": (network.shard, W), "replica": (network.replica, R)}  # a data axis has no link here

    def issue(kind, axis, nbytes, calls=1):
        link, world = links[axis]
        t = calls * link.seconds(kind, nbytes / calls, world)
        start = max(clock["net"], clock["compute"])
        clock["net"] = start + t
        if hold:
            clock["compute"] = max(clock["compute"], start + hold * t)
        busy[kind] = busy.get(kind, 0.0) + t
        return clock["net"]

    of_unit = unit_collectives(lowered)
    before, after = around_program(lowered)

    def reduce(i):
        for kind, axis, nbytes in of_unit[i][1]:
            end = issue(kind, axis, nbytes)
        pending.append(end)
        while len(pending) > inflight:
            clock["compute"] = max(clock["compute"], pending.pop(0))

    def run(units, seconds):
        ready = max([done.get(i, 0.0) for i in units], default=0.0)
        clock["compute"] = max(clock["compute"], ready) + seconds

    for kind, axis, calls, nbytes in before:  # the plan check, before anything
        issue(kind, axis, nbytes, calls)
    for action, *args in walk(lowered):  # the program in issue order (shared with the memory timeline)
        if action == "gather":
            kind, axis, nbytes = of_unit[args[0]][0]
            done[args[0]] = issue(kind, axis, nbytes)
        elif action == "reduce":
            reduce(args[0])
        elif action == "forward":
            run([sched.forward[args[0]]], fwd[sched.forward[args[0]]])
        elif action == "backward":
            s = args[0]
            run(set(sched.needs[s]) | {sched.forward[s]}, backward_factor * fwd[sched.forward[s]])
    clock["compute"] = max([clock["compute"], clock["net"]] + pending)
    clock["net"] = clock["compute"]
    for kind, axis, calls, nbytes in after:  # the agreement, the data groups' and the update's
        if axis in links:
            issue(kind, axis, nbytes, calls)
    clock["compute"] = clock["net"] + optimizer_seconds
    total = clock["compute"]
    compute_total = step.micro_batches * (1 + backward_factor) * sum(fwd[u] for u in sched.forward) + optimizer_seconds
    parts = {"compute": compute_total, "comm": dict(busy), "exposed_comm": total - compute_total}
    assumed = [f"backward = {backward_factor:g} x forward per unit", "one link per mesh axis, collectives in issue order"]
    if hold == 1:
        assumed.append("overlap=False: collectives hold the compute queue (no overlap)")
    elif hold:
        assumed.append(f"overlap={overlap:g}: each collective holds the compute queue for {hold:g} of its time")
    if compute is None:
        assumed.append("compute: 0 (pass compute= per unit: measured at W=1, or flops / throughput)")
    return TimeEstimate(seconds=total, parts=parts, assumed=tuple(assumed) + tuple(lowered._assumed()))


def _forward_seconds(compute, lays) -> list[float]:
    """Each unit's forward seconds from ``estimate_time``'s ``compute`` (None, one number, or by unit name)."""
    if compute is None:
        return [0.0] * len(lays)
    if isinstance(compute, (int, float)):
        return [float(compute)] * len(lays)
    unknown = set(compute) - {lay.name for lay in lays}
    if unknown:
        raise RaggedValueError(f"estimate_time: compute names units {sorted(unknown)} the step does not have.")
    return [float(compute.get(lay.name, 0.0)) for lay in lays]
