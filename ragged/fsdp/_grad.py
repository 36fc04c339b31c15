"""``rg.fsdp.value_and_grad``: the loss and the sharded gradients of every unit, gathering each
unit on use and reduce-scattering it as backward finishes with it.

[Note: one agreement at the start of a call, one at the end]
At the start the ranks agree, in one small all-reduce (``check_plans(..., every_call=True)``),
on the units' plans, the options (each by name: ``reduce_dtype``, ``micro_batches``, the
``gather_format`` of each unit, ...), the learnt schedule's fingerprint and, in a step, the
optimizer's settings (see [Note: the optimizer's settings join the step's agreement] in
``ragged/optim/_base.py``), and, on a deferred comm, the ledger's digest of the collectives
since the last agreement, so a rank that diverged in the previous call is reported here on
every rank (see [Note: what each agreement catches] in ``ragged/transforms/_check.py``). A
difference raises :class:`~ragged.PlanMismatchError` on every rank naming the option and its
value on each side; a rank whose own checks failed (the state, the batch, a learning rate; or
``make_step`` itself) joins this round with its error instead (see [Note: a rank's error joins
the next agreement] in ``ragged/collectives/_agree.py``). At the end, one
:func:`~ragged.collectives._agree.agree` of a small float64 vector (see
[Note: one way to agree]) carries the loss, whether any rank
failed (``loss_fn`` raised, or returned no scalar that needs grad) or deviated from the schedule,
which units got late gradients and, per leaf, whether any rank produced a gradient. Every rank
then takes the same branch: a failure raises everywhere (the failing rank re-raises its own
error); a deviation reruns the call with the schedule every rank learnt (see [Note: a
collective order that does not depend on data] in ``_schedule.py``) from the same RNG state, at
most ``MAX_ATTEMPTS`` times, then raises :class:`~ragged.PlanMismatchError` naming the unit and
position; a loss that reached no parameter raises :data:`UNUSED_PARAMS_MSG`, one that also (or
only) reached others :data:`FOREIGN_GRADS_MSG`. A rank that fails
mid-call still issues the rest of the schedule's collectives (on zeros), so no peer is left
waiting in one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import PlanMismatchError, RaggedError, RaggedTypeError, RaggedValueError, check_int
from ragged._pytree import flatten_with_keystr, pytree
from ragged.collectives._agree import agree, on_device
from ragged.collectives._tree import tree_sum
from ragged.fsdp._chunks import LATE_CHUNKS_MSG, check_chunked, chunk_losses, chunked_micro_batches
from ragged.fsdp._compiled import regions
from ragged.fsdp._intercept import UseMode, backward, bind, module_slots, saved_tensor_hooks
from ragged.fsdp._layout import MixedPrecision, unit_layouts
from ragged.fsdp._runtime import Run
from ragged.fsdp._schedule import CollectiveSchedule, program
from ragged.fsdp._trainable import check_shards
from ragged.fsdp._units import Units
from ragged.transforms._check import check_plans, joins_next_agreement

__all__ = ["value_and_grad", "ValueAndGrad", "GradResult", "UNUSED_PARAMS_MSG", "FOREIGN_GRADS_MSG", "MAX_ATTEMPTS"]

MAX_ATTEMPTS = 3
UNUSED_PARAMS_MSG = (
    "loss_fn never read the parameters the step passes: no gradient reached any of them on any rank (every "
    "rank raises this, before any parameter changes). loss_fn(params, batch) must compute with `params`, e.g. "
    "torch.func.functional_call(model, params, (x,)); calling model(x) uses the module's own tensors. Fix: "
    "use functional_call, or rg.fsdp.make_step(..., module=model) (or value_and_grad(..., module=model)) so "
    "that model(...) reads the step's parameters."
)

FOREIGN_GRADS_MSG = (
    "loss_fn computed gradients for parameters that are not the step's ({where}: an nn.Parameter requiring grad "
    "that the loss read directly, e.g. model.head.weight, or model(x) outside torch.func.functional_call): the "
    "step never updates them, and their part of the loss is missing from the step's gradients (every rank raises "
    "this, before any parameter changes). Fix: read parameters from `params`, or rg.fsdp.make_step(..., "
    "module=model); a parameter that must not train needs requires_grad=False."
)


class GradResult(NamedTuple):
    """What :meth:`ValueAndGrad.compute` returns."""

    loss: float  # mean over micro-batches and every data-parallel rank
    grads: dict[str, DBuffer]  # mean over the shard group (and replicas)
    unused: dict[str, frozenset[str]]  # per unit, leaves no rank produced a gradient for (when any)
    metrics: dict[str, Any]


def split_batch(batch, k: int):
    if k == 1:
        return [batch]
    paths, leaves, treedef = flatten_with_keystr(batch)
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % k:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise RaggedValueError(
                f"batch{p} has shape {shape}; with micro_batches={k} every batch leaf needs a leading "
                f"dimension divisible by {k}. Fix: pick a per-rank batch size that is a multiple of micro_batches."
            )
    chunks = [x.chunk(k) for x in leaves]
    return [pytree.unflatten(treedef, [c[j] for c in chunks]) for j in range(k)]


class _Memo:
    """What a :class:`ValueAndGrad` carries between calls: the agreed collective schedule and a
    local memory hint (which units keep leaf gradients). A cache: with any value of it the results
    are the same, up to the order of floating-point sums (a gradient that arrives late is
    reduce-scattered on its own and added); ranks agree on the schedule every call."""

    def __init__(self, num_units: int):
        self.schedule, self.lazy = CollectiveSchedule.initial(num_units), frozenset()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ValueAndGrad:
    """``loss, grads = f(shards, batch)``: built by :func:`value_and_grad` (see there)."""

    units: Units
    loss_fn: Callable
    comm: Any
    micro_batches: int = 1
    policy: MixedPrecision = MixedPrecision()
    prefetch: bool = True
    reshard_after_forward: bool = True
    max_inflight_reduce: int = 1
    module: Any = None
    trace: Any = False  # True: a list in the metrics; a callable: called per event (see value_and_grad)
    chunks: int | None = None  # see [Note: the chunked step] in _chunks.py
    layouts: tuple = dataclasses.field(default=(), repr=False, compare=False)
    options: tuple = dataclasses.field(default=(), repr=False, compare=False)  # (name, value) the ranks agree on
    slots: tuple = dataclasses.field(default=(), repr=False, compare=False)
    memo: _Memo = dataclasses.field(default=None, repr=False, compare=False)

    def __call__(self, shards: dict[str, DBuffer], batch):
        result = self.compute(shards, batch)
        return result.loss, result.grads

    def compute(self, shards: dict[str, DBuffer], batch, *, data_groups=(), settings=(),
                failure: BaseException | None = None) -> GradResult:
        """Loss, gradients and what the step needs besides (see [Note: one agreement at the start
        of a call, one at the end]); ``data_groups`` as in :func:`make_step` (only the loss and the
        agreement span them here; the step reduces the gradients over them); ``settings``: more
        ``(name, value)`` pairs the ranks must share (the step's optimizer's); ``failure``: this
        rank's error in the caller's own checks, which joins the start-of-call agreement as this
        call's local checks' do (see [Note: a rank's error joins the next agreement] in
        ``ragged/collectives/_agree.py``)."""
        micro, memo = None, self.memo
        if failure is None:
            try:  # local checks first, then the cross-rank one
                check_shards(self.units, shards)
                for u in self.units:
                    if shards[u.name].plan != u.plan:
                        raise RaggedValueError(f"state.shards[{u.name!r}] was sharded with another plan than "
                                               f"units[{u.name!r}].")
                micro = split_batch(batch, self.micro_batches)
            except Exception as e:  # noqa: BLE001 - raised on every rank by the agreement
                failure = e
        options = (*self.options, ("data_groups", str([c.world_size for c, _ in data_groups])),
                   ("the learnt collective schedule", memo.schedule.fingerprint()), *settings)
        check_plans([u.plan for u in self.units], self.comm, "rg.fsdp step", every_call=True, options=options,
                    failure=failure, where="rg.fsdp step")
        rng = _rng_state(self.comm.device)
        for attempt in range(MAX_ATTEMPTS):
            run, losses, failure = self._attempt(shards, micro)
            memo.lazy = frozenset(run.gradients.lazy)
            try:
                verdict = _agree(run, losses, failure, self.comm, data_groups, self.chunks)
                seen = []
                if verdict["exchange"]:
                    seen = agree(self.comm, explain=lambda _: (run.seen.observation(), run.seen.deviations[:1],
                                                               _describe(failure), run.seen.foreign_grads()[:1])).details
                    memo.schedule = memo.schedule.observe([s[0] for s in seen])
                # a chunked step also reruns a call with late gradients: their separate reduce-scatter
                # would add them outside the tree (see [Note: the chunked step] in _chunks.py)
                late = bool(self.chunks and verdict["late"] and not verdict["failed"])
                if verdict["deviated"] or late:  # before failures: computing on zeros may have caused them
                    if attempt + 1 < MAX_ATTEMPTS:
                        _set_rng_state(self.comm.device, rng)
                        continue
                    if not verdict["deviated"]:
                        raise RaggedError(LATE_CHUNKS_MSG.format(attempts=MAX_ATTEMPTS))
                    what = [f"rank {r}: {s[1][0]}" for r, s in enumerate(seen) if s[1]]
                    raise PlanMismatchError(
                        "the ranks' collective sequences would diverge: " + "; ".join(what or ["another group"])
                        + f" (still after {MAX_ATTEMPTS} attempts with the learnt schedule: the units this model "
                        "reads, or when, depend on the data in a way one schedule cannot cover). Fix: make such "
                        "parts one unit (make_units(groups=...)), e.g. all experts of a layer."
                    )
                if verdict["failed"]:
                    if failure is not None:
                        raise failure
                    ranks = [f"rank {r}: {s[2]}" for r, s in enumerate(seen) if s[2]]
                    raise RaggedError("loss_fn failed on another rank (every rank stops before any parameter "
                                      "changes): " + "; ".join(ranks or ["a rank of another data-parallel group"]))
                if not any(verdict["used"]):
                    raise RaggedValueError(UNUSED_PARAMS_MSG)
                if verdict["foreign"]:
                    shapes = [f"rank {r}: shape {s[3][0]}" for r, s in enumerate(seen) if s[3]]
                    raise RaggedValueError(FOREIGN_GRADS_MSG.format(where="; ".join(shapes or ["another group"])))
                run.gradients.reduce_late(verdict["late"])
                return self._result(run, verdict, shards, attempt)
            finally:
                run.close()
        raise AssertionError("unreachable")

    def _attempt(self, shards, micro):
        memo = self.memo
        frozen = frozenset(lay.index for lay in self.layouts if lay.grad_plan is None)
        prog = program(memo.schedule, reshard=self.reshard_after_forward, prefetch=self.prefetch, frozen=frozen)
        run = Run(self.layouts, self.units, shards, self.comm, schedule=memo.schedule, program=prog, lazy=memo.lazy,
                  max_inflight_reduce=self.max_inflight_reduce, trace=self.trace, chunks=self.chunks)
        scale = 1.0 if self.chunks else 1.0 / len(micro)  # chunked: each chunk unscaled, the sum divided by C
        losses, failure = [], None
        try:
            leaves = {p: t for u in run.units for p, t in u.leaves.items()}
            with bind(self.module, self.slots, leaves), regions(self.module, run):
                for mb in micro:
                    run.reset()
                    loss = None
                    if failure is None:
                        try:
                            with UseMode(run), saved_tensor_hooks(run):
                                loss = self.loss_fn(run.params_tree, mb)
                            _check_loss(loss)
                        except Exception as e:  # noqa: BLE001 - every rank raises it after the agreement
                            failure = e
                    run.end_forward()
                    run.begin_backward()
                    if failure is None:
                        try:
                            with saved_tensor_hooks(run):
                                backward(run, (loss.float() * scale,))
                            losses.append(loss.detach())
                        except Exception as e:  # noqa: BLE001
                            failure = e
                    run.end_backward()
            run.gradients.finish()
        except BaseException as e:
            poison = getattr(self.comm, "poison", None)
            if poison is not None:  # peers may be in a collective this rank will not issue
                poison(f"rg.fsdp step failed on rank {self.comm.rank}: {type(e).__name__}: {e}")
            run.close()
            raise
        return run, losses, failure

    def _result(self, run, verdict, shards, attempt) -> GradResult:
        grads, unused, k = {}, {}, 0
        for u, rec in zip(self.units, self.layouts):
            if rec.grad_plan is None:
                continue
            grads[u.name] = DBuffer(data=run.gradients.reduced[u.name], replicated=run.gradients.reduced_rep[u.name],
                                    plan=rec.grad_plan,
                                    rank=shards[u.name].rank)
            paths = rec.trained
            got = verdict["used"][k : k + len(paths)]
            k += len(paths)
            if not all(got):
                unused[u.name] = frozenset(p for p, g in zip(paths, got) if not g)
        metrics = {
            **run.counts.metrics(),
            "largest_unit_bytes": max(lay.nbytes for lay in self.layouts),
            "model_bytes": sum(lay.nbytes for lay in self.layouts),
            "micro_batches": self.micro_batches,
            "schedule_reruns": attempt,
        }
        if isinstance(run.trace, list):
            metrics["trace"] = run.trace
        return GradResult(verdict["loss"], grads, unused, metrics)


def _check_loss(loss):
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise RaggedTypeError(
            "loss_fn(params, batch) must return a scalar tensor that depends on the params; got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
        )


def _describe(failure) -> str:
    return "" if failure is None else f"{type(failure).__name__}: {failure}"


_HEAD = ("loss", "failed", "deviated", "foreign", "exchange")  # summed over the mesh; the first four over data axes too


def verdict_size(layouts, chunks: int | None = None) -> int:
    """The numbers each rank brings to the end-of-call agreement: :data:`_HEAD`, a late flag per
    unit, a used flag per trainable leaf and, in a chunked step, a loss per chunk (``_agree``
    builds it; the predictor counts it)."""
    return len(_HEAD) + len(layouts) + sum(len(lay.trained) for lay in layouts) + (chunks or 0)


def _agree(run, losses, failure, comm, data_groups, chunks=None) -> dict:
    """The end-of-call all-reduce (see [Note: one agreement at the start of a call, one at the end]);
    a chunked step's loss is the fixed tree over the chunk losses (see [Note: the chunked step])."""
    obs = run.seen.observation()
    used = [float(x) for u in run.gradients.units for x in u.used]
    late = [0.0] * len(run.units)
    for i, _ in obs.late:
        late[i] = 1.0
    failed, foreign = failure is not None, bool(run.seen.foreign_grads())
    exchange = failed or obs.deviated or foreign or bool(obs.late) or run.ctx.schedule.learning
    flags = [float(failed), float(obs.deviated), float(foreign), float(exchange)] + late + used
    assert 1 + len(flags) + (chunks or 0) == verdict_size(run.ctx.layouts, chunks)
    # the loss stays on the device until the round's one host read: a steady step waits for the
    # device at its two agreements only (docs/gpu.md, 'Two host syncs per step')
    loss = torch.stack([l.double() for l in losses]).mean() if losses else torch.zeros((), dtype=torch.float64,
                                                                                          device=comm.device)
    slots = [chunk_losses(losses, comm, chunks)] if chunks else []
    verdict = torch.cat([loss.reshape(1), on_device(flags, comm.device), *slots])
    v = agree(comm, verdict, op="sum", label="fsdp step: end of call").values
    count, h, nl = comm.world_size * comm.num_replicas, len(_HEAD), len(late)
    if data_groups:
        paths = [p for lay in run.ctx.layouts for p in lay.trained]
        for axis_comm, is_replicated in data_groups:
            w = agree(axis_comm, v, op="sum", label="fsdp step: end of call").values
            v[: h - 1] = w[: h - 1]
            for k, p in enumerate(paths):
                if is_replicated(p):
                    v[h + nl + k] = w[h + nl + k]
            count *= axis_comm.world_size
    out = dict(zip(_HEAD, (x > 0 for x in v[:h])))
    n = len(v) - (chunks or 0)
    loss = tree_sum(v[n:]) / chunks if chunks else v[0] / count
    out.update(loss=loss, late=[i for i in range(nl) if v[h + i] > 0], used=[x > 0 for x in v[h + nl : n]])
    return out


def _rng_state(device):
    cuda = device.type == "cuda"
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if cuda else None)


def _set_rng_state(device, state):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@joins_next_agreement("fsdp.value_and_grad")
def value_and_grad(
    units: Units,
    loss_fn: Callable,
    comm,
    *,
    micro_batches: int | None = None,
    policy: MixedPrecision | None = None,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
    max_inflight_reduce: int = 1,
    module: torch.nn.Module | None = None,
    trace: bool = False,
    chunks: int | None = None,
) -> ValueAndGrad:
    """``loss, grads = value_and_grad(units, loss_fn, comm)(shards, batch)``: FSDP's ``jax.value_and_grad``.

    Gathers each unit when ``loss_fn`` first reads it, frees it after use, re-gathers it for
    backward and reduce-scatters its gradient as backward finishes with it, every rank in the
    same order (see [Note: a collective order that does not depend on data] in ``_schedule.py``).

    Args:
        units: from :func:`ragged.fsdp.make_units`.
        loss_fn: ``loss_fn(params, batch) -> scalar tensor``; ``params`` is the full parameter
            tree (``{name: tensor}`` for a module: use ``torch.func.functional_call``, or pass
            ``module=``). It must read parameters through torch calls (any op, view or method;
            ``.shape`` and other metadata do not gather).
        comm: the shard group's collectives.
        micro_batches: ``batch`` (this rank's) is split into this many equal parts along dim 0;
            the loss and gradients are their mean (default 1; with ``chunks``, ``chunks / W``).
        policy: a :class:`MixedPrecision` (default: gather and reduce in the plans' dtype).
        prefetch: start the next unit's all-gather before the current one computes.
        reshard_after_forward: free each unit after its forward use (re-gather for backward).
        max_inflight_reduce: reduce-scatters in flight before the oldest is waited.
        module: bind this module's parameter attributes to the step's leaves through forward and
            backward (see [Note: binding a module] in ``_intercept.py``): ``loss_fn`` may then call
            ``module(...)``, and recomputation inside it works; its compiled modules are gathered
            at their boundary (see [Note: compiled regions] in ``_compiled.py``). One module
            object per rank.
        trace: record ``(event, unit, phase)`` tuples in the step's metrics (events: ``enter`` a forward
            entry, ``event`` a backward event, ``gather_start`` / ``gather_done`` / ``free``, ``compute``,
            ``grad_buffer``, ``reduce_start`` / ``reduce_done``); a callable is called as
            ``trace(event, unit, cursor)`` instead (``fsdp.profile_activations``).
        chunks: the same loss and gradients, to the bit, at every data-parallel world size that
            serves it: see :func:`ragged.fsdp.make_step`.

    Returns:
        A :class:`ValueAndGrad`; calling it on ``(shards, batch)`` gives ``(loss, grads)``: the
        loss (a float, mean over micro-batches and ranks) and ``{unit name: DBuffer}``, this
        rank's shard of the gradient of that mean loss (the mean over ranks of each rank's
        gradient).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> params = {"w": torch.arange(6.0).view(3, 2), "b": torch.ones(3)}
        >>> units = fsdp.make_units(params, world_size=2, groups=lambda path: path)
        >>> x = torch.arange(8.0).view(4, 2)
        >>> loss_fn = lambda p, x: ((x @ p["w"].T + p["b"]) ** 2).mean()
        >>> def run(comm):
        ...     loss, grads = fsdp.value_and_grad(units, loss_fn, comm)(rg.shard(units, params, comm), x[2 * comm.rank:][:2])
        ...     return loss, rg.gather(units, grads, comm)
        >>> (loss, g), _ = rg.collectives.simulate(2, run)
        >>> want = torch.func.grad(loss_fn)(params, x)
        >>> round(loss, 4) == round(loss_fn(params, x).item(), 4), torch.allclose(g["w"], want["w"])
        (True, True)
    """
    if chunks is not None:
        micro_batches = chunked_micro_batches(chunks, comm, micro_batches, "value_and_grad")
    micro_batches = check_int("micro_batches", 1 if micro_batches is None else micro_batches)
    check_int("max_inflight_reduce", max_inflight_reduce)
    if units.world_size != comm.world_size:
        raise RaggedValueError(
            f"the units were planned for world_size={units.world_size} but comm has {comm.world_size} ranks. "
            "Fix: make_units(model, world_size=comm.world_size)."
        )
    policy = MixedPrecision() if policy is None else policy
    if not isinstance(policy, MixedPrecision):
        raise RaggedTypeError(f"policy must be a rg.fsdp.MixedPrecision, got {type(policy).__name__}.")
    slots = () if module is None else module_slots(module, units)
    layouts = unit_layouts(units, policy)
    if chunks is not None:
        check_chunked(layouts, (), "value_and_grad")
    frozen = hashlib.blake2b(repr([sorted(u.frozen) for u in units]).encode(), digest_size=8).hexdigest()
    options = (("compute_dtype", str(policy.compute_dtype)), ("reduce_dtype", str(policy.reduce_dtype)),
               ("frozen_dtype", str(policy.frozen_dtype)), ("micro_batches", str(micro_batches)),
               ("reshard_after_forward", str(reshard_after_forward)), ("prefetch", str(prefetch)),
               ("frozen leaves", frozen),  # a fully frozen unit has the plan a trainable one would have
               ("chunks", str(chunks)),
               *((f"{kind} of unit {lay.name!r}", _formats_text(formats, plan)) for u, lay in zip(units, layouts)
                 for kind, formats, plan in (("gather_format", lay.gather_formats, u.plan),
                                             ("reduce_format", lay.reduce_formats, lay.grad_plan))))
    return ValueAndGrad(units=units, loss_fn=loss_fn, comm=comm, micro_batches=micro_batches, policy=policy,
                        prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                        max_inflight_reduce=max_inflight_reduce, module=module, trace=trace, chunks=chunks, layouts=layouts,
                        options=options, slots=slots, memo=_Memo(len(units)))


def _formats_text(formats, plan) -> str:
    """A unit's gather or reduce formats (by leaf index in ``plan``) as the ranks compare them: one
    format for every leaf, or which leaf gets which."""
    if formats is None or len(set(formats)) == 1:
        return repr(None if formats is None else formats[0])
    paths = {leaf.index: leaf.path for leaf in plan.leaves + plan.replicated}
    return "{" + ", ".join(f"{paths[i]}: {f!r}" for i, f in enumerate(formats) if f is not None) + "}"
