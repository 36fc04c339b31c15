"""``step.lower(...)``: what a step costs per rank (memory, collectives), without running it.

[Note: lowering a step]
Like ``jax.jit(f).lower(...)``, a :class:`~ragged.fsdp.Step` lowers on abstract inputs: no process,
no memory (meta tensors), any world size (``rg.collectives.abstract(world_size=10_240)``).
Everything comes from values the step already holds and that decide what a real call does:

* persistent bytes: the ``TrainState`` the step threads, built on ``meta`` by the same code as
  :func:`ragged.fsdp.init` (each unit's ``S``-element shard in the plan's dtype, its replicated
  buffer, and ``optimizer.init`` over :func:`~ragged.fsdp._trainable.trainable_shards`: a partly
  frozen unit's state covers its ``trainable_plan`` only, a unit where nothing trains has none).
  Optimizer leaves are grouped by their field in the state (``mu``, ``nu``, ``count``,
  ``mu_codes``, ``mu_scales`` ...). The state may depend on the rank (8-bit codes cover only the
  elements a rank holds): every rank is evaluated up to ``max_ranks``, else an even sample of them
  (named in ``ranks``);
* collectives: the :func:`~ragged.fsdp._schedule.program` of the step's collective schedule (the
  learnt one once the step has run, else an assumed one, see :func:`lower`), per micro-batch,
  counted at the ``Collectives`` boundary the way the runtime issues them: one all-gather call per
  unit gather (coalesced over a multi-buffer plan: one call, its bytes the sum of the outputs),
  one reduce-scatter call per trainable unit per micro-batch over its ``trainable_plan`` in the
  reduce dtype (bytes: the input, ``m * S``), one all-reduce of the replicated gradients when the
  unit has any, the HSDP all-reduces over the replica axis, the end-of-call agreement (a float64
  all-reduce of ``5 + units + trained leaves`` elements) and the plan check (an all-reduce of two
  int64, four on a deferred-handshake comm), each data group's agreement and all-reduce of the
  leaves replicated over it, and what the optimizer declares it issues (see [Note: an optimizer's
  collectives are declared, not recorded] in ``ragged/optim/_base.py``); a learning call's
  exchange of observations is an ``all_gather_object``, counted in ``objects`` (its pickled size
  is not predicted);
* peak: the program's gathers, frees and reduce-scatters walked in the runtime's order
  (``_timeline.walk``), with the flat gradient buffer of a unit alive from its first
  gradient's segment until its reduce-scatter is waited (at the latest: ``max_inflight_reduce``
  later; the runtime may finish one earlier), a quantized collective's scratch while it is in
  flight and the free buffers the scratch pool keeps for the next one (see [Note: the wire scratch
  in the timeline]), and the model's own bytes at each point
  (``activations``: saved tensors, temporaries, leaf gradients), which do not depend on the world
  size but not on shapes alone either: measured once on one device by
  :func:`~ragged.predict.profile_activations` (see [Note: measuring activations on one device]);
  0 is assumed without them, and the analysis says so.

What is assumed is listed in ``assumed`` of every analysis. Not modelled: the collectives of a
``clip_by_global_norm(norm=...)`` function and of the loss, a first call's schedule exchange and reruns (``lower(schedule=CollectiveSchedule.initial(n))`` shows a first
call), the optimizer update's temporaries and the allocator's fragmentation.
"""

from __future__ import annotations

import dataclasses

import torch

from ragged._errors import RaggedTypeError, RaggedValueError, check_int
from ragged._pytree import flatten_with_keystr
from ragged.fsdp._schedule import CollectiveSchedule, program
from ragged.predict._activations import Activations
from ragged.predict._cost import CostAnalysis, cost_analysis
from ragged.predict._persistent import given_state_bytes, sample_ranks, state_bytes
from ragged.predict._time import TimeEstimate, estimate_time
from ragged.predict._timeline import timeline

__all__ = ["Lowered", "MemoryAnalysis", "lower", "assumed_schedule"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryAnalysis:
    """Bytes per rank (see [Note: lowering a step]).

    Attributes:
        persistent_bytes: the largest evaluated rank's ``TrainState`` storage.
        by_category: that rank's persistent bytes by category (``param_shards``, ``replicated``,
            ``optimizer.<field>``).
        per_rank: ``{rank: persistent bytes}`` of the evaluated ranks; ``max_rank`` / ``min_rank``
            and ``min_bytes`` summarise it.
        peak_bytes: persistent bytes plus the most transient bytes alive at one point of the step,
            reduce-scatters waited as late as ``max_inflight_reduce`` lets the runtime wait them.
        peak_bytes_low: the same with every reduce-scatter done by the next point (a network that
            keeps up, like torch's fake process group, whose collectives return at once).
        peak_at: ``(unit, phase)`` where the peak is reached.
        peak_parts: the transient bytes at the peak by kind (``gathered``, ``grad_buffers``,
            ``reduce_copies``, ``grad_shards``, ``wire_scratch``, ``activations``).
        peak_gathered_bytes, peak_grad_bytes: the step's metrics of those names, predicted
            (``peak_grad_bytes``: reduce-scatters waited as late as the runtime may; ``peak_grad_bytes_low``:
            each done by the next point, the least it can reach: the metric lies between them).
        peak_scratch_bytes, peak_scratch_bytes_low: the most scratch the quantized collectives in
            flight hold at once (``wire_scratch``: each all-gather's ``B + m * B`` bytes, each
            reduce-scatter's ``2 * m * B``, see [Note: the wire scratch in the timeline]), with
            reduce-scatters waited late and early as above; 0 without quantized collectives (a
            chunked step's reductions hold their rows there too, see ``transforms/_flat.py``).
        retained_scratch_bytes: the free scratch buffers the pool keeps from one step to the next
            (up to two per size, and on CUDA per stream: [Note: one scratch pool]); ``peak_parts``
            counts those free at the peak as ``scratch_pool``.
        peak_shard_bytes, peak_shard_bytes_low: the step's ``peak_shard_bytes`` metric, predicted
            (``grad_shards``: the reduced gradient shards alive at once, each reduce-scatter's
            output from its start and every unit's sums of micro-batches: one in the plan's dtype,
            or a chunked step's fixed tree, one per set bit of the micro-batches so far, in the
            reduce dtype), reduce-scatters waited late and early as above.
        assumed: which numbers are assumed, not derived.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> units = fsdp.make_units(model, world_size=64, groups=["0", "1"])
        >>> lowered = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(64)).lower()
        >>> mem = lowered.memory_analysis()
        >>> mem.persistent_bytes == sum(mem.by_category.values()), mem.peak_bytes >= mem.persistent_bytes
        (True, True)
    """

    persistent_bytes: int
    by_category: dict
    per_rank: dict
    max_rank: int
    min_rank: int
    min_bytes: int
    peak_bytes: int
    peak_bytes_low: int
    peak_at: tuple[str, str]
    peak_parts: dict
    peak_gathered_bytes: int
    peak_grad_bytes: int
    peak_grad_bytes_low: int
    peak_scratch_bytes: int = 0
    peak_scratch_bytes_low: int = 0
    retained_scratch_bytes: int = 0
    peak_shard_bytes: int = 0
    peak_shard_bytes_low: int = 0
    assumed: tuple[str, ...] = ()


def assumed_schedule(units) -> CollectiveSchedule:
    """The schedule assumed for a step that has not run: every unit read once in unit order, its
    backward reading it again (a learnt schedule replaces it: a unit read at both ends, like a
    ``rest`` unit holding the embedding and the head, appears twice there)."""
    n = len(units)
    order = tuple(range(n))
    return CollectiveSchedule(forward=order, needs=tuple(frozenset({u}) for u in order), reduce_at=order,
                              learning=False)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Lowered:
    """A lowered step: see [Note: lowering a step]. Built by :func:`lower` (``step.lower(...)``).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> units = fsdp.make_units(model, world_size=64, groups=["0", "1"])
        >>> lowered = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(64)).lower()
        >>> isinstance(lowered, rg.predict.Lowered), lowered.memory_analysis().persistent_bytes > 0
        (True, True)
    """

    step: object = dataclasses.field(repr=False)
    schedule: CollectiveSchedule
    state_bytes: dict  # {rank: {category: bytes}}
    activations: Activations | None = None
    schedule_assumed: bool = False

    @property
    def units(self):
        return self.step.units

    @property
    def layouts(self):
        return self.step.value_and_grad.layouts

    @property
    def program(self):
        frozen = frozenset(lay.index for lay in self.layouts if lay.grad_plan is None)
        return program(self.schedule, reshard=self.step.value_and_grad.reshard_after_forward,
                       prefetch=self.step.value_and_grad.prefetch, frozen=frozen)

    def _assumed(self) -> tuple[str, ...]:
        out = []
        if self.schedule_assumed:
            out.append("schedule: each unit read once, in unit order (the step has not run; pass schedule= the learnt "
                       "step.value_and_grad.memo.schedule of a small run)")
        out.append("optimizer: the collectives its transformations declare (GradientTransformation.collectives); "
                   "those of a clip_by_global_norm(norm=...) function are not counted")
        out.append("the loss issues no collectives of its own (an MoE dispatch's or tensor parallelism's are not counted)")
        return tuple(out)

    def cost_analysis(self) -> CostAnalysis:
        """Collectives per step of the steady state: see :func:`ragged.predict._cost.cost_analysis`."""
        return cost_analysis(self)

    def timeline(self, *, early: bool = False):
        """The step's transient memory, point by point: see :func:`ragged.predict._timeline.timeline`."""
        return timeline(self, early=early)

    def memory_analysis(self, *, workspace_bytes: int = 0) -> MemoryAnalysis:
        """Persistent and peak bytes per rank (see [Note: lowering a step]).

        Args:
            workspace_bytes: bytes no profile on this machine sees, alive at the peak: what kernels
                allocate and free inside themselves (a GPU's GEMM or fused-attention workspace), the
                optimizer update's temporaries. Ragged cannot know them: 0 unless given, and named in
                ``assumed`` either way; added to both peaks as the part ``"workspace"``.

        Examples:
            >>> import torch, ragged as rg
            >>> from ragged import fsdp
            >>> units = fsdp.make_units(torch.nn.Linear(4, 8), world_size=8)
            >>> lowered = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(8)).lower()
            >>> a, b = lowered.memory_analysis(), lowered.memory_analysis(workspace_bytes=2**20)
            >>> b.peak_bytes - a.peak_bytes, b.peak_parts["workspace"]
            (1048576, 1048576)
            >>> print(b.assumed[-1])
            kernels' workspace and the update's temporaries: 1048576 B (workspace_bytes=)
        """
        check_int("memory_analysis: workspace_bytes", workspace_bytes, low=0)
        totals = {r: sum(v.values()) for r, v in self.state_bytes.items()}
        top = max(totals, key=lambda r: (totals[r], -r))
        low = min(totals, key=lambda r: (totals[r], r))
        persistent = totals[top]
        points, peaks = self.timeline()
        unit, phase, parts = max(points, key=lambda p: sum(p[2].values()))
        early_points, early = self.timeline(early=True)
        least = max(sum(p[2].values()) for p in early_points)
        parts = {key: int(round(v)) for key, v in parts.items()}
        assumed = list(self._assumed())
        if self.activations is None:
            assumed.append("activations: 0 bytes (not derivable from shapes; pass activations=rg.predict.profile_activations("
                           "...) of the same step on one device)")
        else:
            assumed.append("activations: as given per point (rg.predict.Activations; rg.predict.profile_activations measures them "
                           "on one device)")
        assumed.append("gradient buffers: waited at the latest point max_inflight_reduce allows (peak_bytes; "
                       "peak_bytes_low: done by the next point)")
        if len(totals) < self.units.world_size:
            assumed.append(f"per rank: {len(totals)} of {self.units.world_size} ranks evaluated ({sorted(totals)})")
        assumed.append(f"kernels' workspace and the update's temporaries: {workspace_bytes} B (workspace_bytes=)")
        if workspace_bytes:
            parts["workspace"] = workspace_bytes
        return MemoryAnalysis(persistent_bytes=persistent, by_category=dict(self.state_bytes[top]), per_rank=totals,
                              max_rank=top, min_rank=low, min_bytes=totals[low], peak_bytes=persistent + sum(parts.values()),
                              peak_bytes_low=persistent + int(round(least)) + workspace_bytes, peak_at=(unit, phase), peak_parts=parts,
                              peak_gathered_bytes=peaks["gathered"], peak_grad_bytes=peaks["grad_buffers"],
                              peak_grad_bytes_low=early["grad_buffers"], peak_scratch_bytes=peaks["wire_scratch"],
                              peak_scratch_bytes_low=early["wire_scratch"], retained_scratch_bytes=peaks["retained_scratch"],
                              peak_shard_bytes=peaks["grad_shards"], peak_shard_bytes_low=early["grad_shards"],
                              assumed=tuple(assumed))

    def estimate_time(self, network, **kwargs) -> TimeEstimate:
        """Step time from an alpha-beta ``network``: see :func:`ragged.predict._time.estimate_time`."""
        return estimate_time(self, network, **kwargs)


def lower(step, state_shapes=None, batch_shapes=None, *, schedule: CollectiveSchedule | None = None,
          activations: Activations | None = None, max_ranks: int = 8, progress=None) -> Lowered:
    """Lowers ``step`` (see [Note: lowering a step]); ``step.lower(...)`` calls this.

    Args:
        step: a :class:`~ragged.fsdp.Step` (its comm may be ``rg.collectives.abstract(...)``).
        state_shapes: ``None`` (build the state on meta: every rank's), or a ``TrainState`` (real or
            meta) whose tensors are counted as this comm's rank's.
        batch_shapes: this rank's batch (tensors or meta tensors): checked against
            ``micro_batches``; the data itself is never read.
        schedule: the collective schedule (default: the one ``activations`` were measured with, else the
            step's learnt one when it has run, else :func:`assumed_schedule`).
        activations: the model's own bytes per point, from :func:`~ragged.predict.profile_activations`
            of this step built on one device (default: unknown, 0 assumed).
        max_ranks: evaluate every rank up to this many, else this many evenly spread ranks.
        progress: ``progress(line)`` is called as each evaluated rank's state is built (the slow
            part: a Muon step at 10K ranks takes seconds per rank), e.g. to show it on stderr.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> units = fsdp.make_units(model, world_size=1024, groups=["0", "1"])
        >>> step = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(1024))
        >>> lowered = step.lower()
        >>> mem = lowered.memory_analysis()
        >>> mem.persistent_bytes, sorted(mem.by_category.items())
        (152, [('optimizer.count', 8), ('optimizer.mu', 48), ('optimizer.nu', 48), ('param_shards', 48), ('replicated', 0)])
        >>> [(c.kind, c.calls, c.bytes) for c in lowered.cost_analysis().collectives]
        [('all_gather', 3, 65536), ('all_reduce', 2, 104), ('reduce_scatter', 2, 49152)]
    """
    if max_ranks < 2:
        raise RaggedValueError(f"step.lower: max_ranks must be >= 2, got {max_ranks!r}.")
    units = step.units
    if batch_shapes is not None and step.micro_batches > 1:
        for path, leaf in zip(*flatten_with_keystr(batch_shapes)[:2]):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] % step.micro_batches:
                raise RaggedValueError(f"step.lower: batch{path} has shape {tuple(getattr(leaf, 'shape', ()))}; "
                                       f"micro_batches={step.micro_batches} needs a divisible leading dimension.")
    if state_shapes is None:
        ranks, by_rank = sample_ranks(units.world_size, max_ranks), {}
        for i, r in enumerate(ranks):
            if progress is not None:
                progress(f"rank {r}'s state ({i + 1} of {len(ranks)} evaluated ranks)")
            by_rank[r] = state_bytes(units, step.optimizer, r)
    elif isinstance(state_shapes, tuple) and len(state_shapes) == 2 and isinstance(state_shapes[0], dict):
        by_rank = {step.comm.rank: given_state_bytes(state_shapes)}
    else:
        raise RaggedTypeError(f"step.lower: state_shapes must be None or a TrainState, got {type(state_shapes).__name__}.")
    memo = step.value_and_grad.memo
    assumed = False
    if schedule is None and isinstance(activations, Activations):
        schedule = activations.schedule
    if schedule is None:
        if memo.schedule.learning:
            schedule, assumed = assumed_schedule(units), True
        else:
            schedule = memo.schedule
    if not isinstance(schedule, CollectiveSchedule) or len(schedule.reduce_at) != len(units):
        raise RaggedValueError(f"step.lower: schedule must be a CollectiveSchedule over the step's {len(units)} units.")
    if activations is not None and (not isinstance(activations, Activations) or activations.schedule != schedule):
        raise RaggedValueError("step.lower: activations must be rg.predict.profile_activations(...) of a step with this "
                               f"schedule, got {type(activations).__name__}" + (" measured with another schedule" if
                                                                                 isinstance(activations, Activations) else "")
                               + ". Fix: profile the same step on one device (or lower with schedule=activations.schedule).")
    return Lowered(step=step, schedule=schedule, state_bytes=by_rank, activations=activations,
                   schedule_assumed=assumed)
