"""The functional FSDP training step: ``(shards, opt_state), batch -> (shards', opt_state'), metrics``;
how a unit is gathered on use: [Note: how a unit is gathered, used and released without module
hooks] in ``_intercept.py``.

[Note: data groups]
A *data axis* is a mesh axis, named by a string, whose ranks see different data (the FSDP
axis always is one; an EP axis usually is; see [Note: data axes] in
``ragged/parallel/_transforms.py``). ``rg.fsdp`` knows no mesh: it takes each extra data axis
as a :class:`DataGroup`, that axis's ``comm`` and which parameters are replicated over it
(``parallel.data_groups(mplan, mcomm, ("ep",))`` builds them from a mesh plan). After the
reduce-scatter over the shard group, the gradients of the replicated parameters are
all-reduced over each data group and every gradient is divided by its size.

[Note: parameters without a gradient]
``torch.optim`` skips a parameter whose ``.grad`` is ``None``: no update, no weight decay, no
moment decay. The step knows per leaf whether any rank produced a gradient (folded into its
end-of-call agreement, see ``_grad.py``). When some leaf got none, it saves that leaf's elements
of every optimizer-state subtree laid out like the shards (``{unit: DBuffer}``: Adam's moments,
momentum), runs the optimizer, writes the saved elements back and zeroes the leaf's update.
So the leaf and its state are left exactly as they were, whether the optimizer updates in place
or not. Two differences from ``torch.optim`` remain, stated here: step counters are per
optimizer, not per parameter (a leaf skipped in some steps gets the bias correction of the
optimizer's count when it is next used; exact whenever a leaf is used in every step or never),
and state not laid out like the shards (the 8-bit AdamW codes) still advances for such leaves.
``make_step(skip_unused=False)`` treats them as zero gradients instead.

[Note: the walk of one step]
``state, metrics = step(state, batch)`` top-down. ``state`` (the shards, the optimizer state and
what is made of them: gradients, updates) goes through four files of the step, ``_step.py`` ->
``_trainable.py`` -> ``_step.py`` -> ``_grad.py`` -> ``_runtime.py`` -> ``_grad.py`` -> ``_step.py`` ->
``_trainable.py`` -> ``_step.py`` (back to a file it had left five times):

1. ``Step.__call__`` (here) takes the trainable part of the shards, the one the optimizer
   updates, refusing a donated state, optimizer state over frozen leaves and a module whose
   ``requires_grad`` changed (``_trainable.trainable_part``), and the optimizer's settings
   (its fingerprint, learning rates checked): an error here joins the start-of-call agreement;
2. ``ValueAndGrad.compute`` (``_grad.py``): local checks, the start-of-call agreement
   (``check_plans``), then per attempt a :class:`~ragged.fsdp._runtime.Run` over the shards
   (3.); the end-of-call agreement (``_agree``) decides for every rank: raise, rerun with the
   learnt schedule, or return ``_result`` (the loss, ``{unit: DBuffer}`` over the trainable
   plans, the leaves no rank used, the run's counters);
3. ``Run`` (``_runtime.py``) runs the :class:`~ragged.fsdp._schedule.Program` of the agreed
   schedule: ``loss_fn`` under the interceptors (``_intercept.py``, ``_compiled.py``), which call
   the run's methods (``read`` gathers and frees units; markers and saved tensors prove backward
   events), and its :class:`~ragged.fsdp._reducing.Gradients` accumulate each trainable leaf's
   gradient and reduce-scatter each unit at the program's point;
4. back here: the reduction over data groups (:func:`reduce_over_data_groups`), the leaves no
   rank used kept as they were (:func:`freeze_unused`, :func:`restore_unused`), the optimizer,
   ``apply_updates``, and the new state (``_trainable.next_state``: the updated part put back into
   the shards, the old state marked donated).

``tests/fsdp/test_walk.py`` traces a step and checks this walk: the files ``state`` goes through
and how often it comes back to a file it had left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, leaf_positions
from ragged._divide import divisor
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged._pytree import pytree
from ragged.fsdp._chunks import check_chunked, chunked_micro_batches
from ragged.fsdp._grad import ValueAndGrad, value_and_grad
from ragged.fsdp._layout import MixedPrecision
from ragged.fsdp._units import Units, picked_leaves
from ragged.fsdp._trainable import TrainState, next_state, step_donation, trainable_part
from ragged.collectives._base import poison_on_error
from ragged.optim import apply_updates
from ragged.optim._base import settings_of
from ragged.transforms._check import joins_next_agreement
from ragged.transforms._reduce_scatter import all_reduce_leaves

__all__ = ["make_step", "Step", "DataGroup", "data_groups_option", "reduce_over_data_groups", "freeze_unused",
           "restore_unused"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """A training step built once; call it as ``state, metrics = step(state, batch)``.

    Built by :func:`make_step`; see there for the arguments (``units``, ``loss_fn``, ``comm``,
    ``policy`` ... are those of its :class:`~ragged.fsdp.ValueAndGrad`). Between calls it carries
    only caches that do not change results (up to the order of floating-point sums): the schedule
    every rank agreed on (see [Note: a collective order that does not depend on data]) and a local
    memory hint. With ``donate=True`` the input state is marked donated: passing it to a step or to
    ``rg.gather`` again raises.
    """

    value_and_grad: ValueAndGrad
    optimizer: Any
    donate: bool = False
    data_groups: tuple = ()
    skip_unused: bool = True

    units = property(lambda self: self.value_and_grad.units)
    loss_fn = property(lambda self: self.value_and_grad.loss_fn)
    comm = property(lambda self: self.value_and_grad.comm)
    micro_batches = property(lambda self: self.value_and_grad.micro_batches)
    chunks = property(lambda self: self.value_and_grad.chunks)
    policy = property(lambda self: self.value_and_grad.policy)
    module = property(lambda self: self.value_and_grad.module)

    def __call__(self, state: TrainState, batch):
        """See [Note: the walk of one step]."""
        params, settings, failure = None, (), None
        try:  # this rank's checks: an error joins the start-of-call agreement, raised on every rank
            params = trainable_part(self.units, state, self.module, "step(state, batch)")
            settings = settings_of(self.optimizer, state.opt_state, "optimizer")
        except Exception as e:  # noqa: BLE001
            failure = e
        result = self.value_and_grad.compute(getattr(state, "shards", None), batch, data_groups=self.data_groups,
                                             settings=settings, failure=failure)
        with poison_on_error(self.comm):  # past the agreements: a rank that fails here stops every rank
            grads = result.grads  # the trainable parts only (see [Note: frozen parameters] in _trainable.py)
            for name, g in grads.items():
                reduce_over_data_groups(self.units[name], g, self.data_groups)
            opt_state = state.opt_state
            frozen = (freeze_unused(self.units, result.unused, params, opt_state)
                      if self.skip_unused and result.unused else None)
            updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
            if frozen is not None:
                restore_unused(frozen, params, updates, new_opt_state)
            trained = apply_updates(params, updates, donate=self.donate)
            new_state = next_state(self.units, state, trained, new_opt_state, self.donate)
        return new_state, {"loss": result.loss, **result.metrics, "unused_leaves": sum(map(len, result.unused.values()))}

    def lower(self, state_shapes=None, batch_shapes=None, **options):
        """Memory and communication of this step per rank, without running it: see
        :func:`ragged.predict._lower.lower` (``options``: ``schedule``, ``activations``, ``max_ranks``, ``progress``)."""
        # the predictor sits above fsdp (it reads this step's schedule): imported when a step is
        # lowered, never when fsdp is
        from ragged.predict._lower import lower

        return lower(self, state_shapes, batch_shapes, **options)


@joins_next_agreement("fsdp.make_step")
def make_step(
    units: Units,
    loss_fn: Callable,
    optimizer,
    comm,
    *,
    micro_batches: int | None = None,
    policy: MixedPrecision | None = None,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
    max_inflight_reduce: int = 1,
    donate: bool | None = None,
    trace: bool = False,
    data_groups: Sequence[tuple[Any, Callable[[str], bool]]] = (),
    module: torch.nn.Module | None = None,
    skip_unused: bool = True,
    chunks: int | None = None,
) -> Step:
    """Builds the FSDP training step ``state, metrics = step(state, batch)``.

    The step is :func:`ragged.fsdp.value_and_grad`, the reduction over ``data_groups``,
    ``optimizer.update`` and :func:`ragged.optim.apply_updates`. See [Note: how a unit is
    gathered, used and released without module hooks].

    Args:
        units: from :func:`ragged.fsdp.make_units`.
        loss_fn: ``loss_fn(params, batch) -> scalar tensor``; ``params`` is the full parameter
            tree (``{name: tensor}`` for a module: use ``torch.func.functional_call``, or pass
            ``module=``). Its leaves are gathered on first use, so the loss must only read them
            inside torch calls. ``functional_call`` swaps tensors on the module object: on the
            simulated backend (ranks are threads of one process) give each rank its own module
            (``copy.deepcopy``).
        optimizer: a ``rg.optim`` GradientTransformation over ``{unit name: DBuffer}``.
        comm: the shard group's collectives (``rg.collectives.from_torch()`` or simulated).
        micro_batches: gradient accumulation: ``batch`` (this rank's) is split into this many
            equal micro-batches along dim 0; gradients are averaged (default 1; with ``chunks``,
            ``chunks / W``, and another value is refused).
        policy: a :class:`ragged.fsdp.MixedPrecision` (``compute_dtype``, ``reduce_dtype``).
            Default: gather in the plans' dtype; reduce-scatter in the plans' (master) dtype,
            e.g. fp32 reductions of bf16 gradients; the gradient shard is in the plan's dtype.
        prefetch: start the next unit's all-gather before the current unit computes.
        reshard_after_forward: free each unit's parameters after its forward (re-gather in
            backward); ``False`` keeps them from forward to backward (more memory, fewer gathers).
        max_inflight_reduce: reduce-scatters in flight before the oldest is waited (each
            holds its unit's flat gradient; 1 waits unit k's when unit k-1's starts).
        donate: like ``jax.jit(donate_argnums=...)``: the new shards are written into the
            input state's shard buffers (no allocation); the old state must not be used after
            the call (passing it to this step again raises). Decided by the optimizer
            (``rg.optim.adamw(..., donate=True)`` reuses the moments and the gradient buffers,
            which the step owns): ``None`` follows ``optimizer.donates``, a value that disagrees
            raises (see [Note: one donate decision per step] in ``_trainable.py``).
        trace: record ``(event, unit, phase)`` tuples in ``metrics["trace"]`` (see :func:`value_and_grad`).
        data_groups: the other data axes (e.g. expert parallelism), as :class:`DataGroup`
            ``(comm, is_replicated)`` pairs (see [Note: data groups]): after the reduce-scatter over
            ``comm`` (the FSDP axis), the gradients of the parameters with ``is_replicated(path)``
            (paths as in ``units``) are all-reduced over that group's ``comm``, and every gradient
            is divided by its size (the loss is a mean over all data-parallel ranks). See [Note:
            data axes] in ``ragged/parallel/_transforms.py``; ``rg.parallel.data_groups(mplan,
            mcomm, ("ep",))`` builds them from a mesh plan. Global-norm clipping must then see the
            whole mesh: ``rg.optim.clip_by_global_norm(max_norm, comm=comm, norm=lambda g:
            rg.global_norm(units, g, comm, data_groups=data_groups))`` (its default norm spans
            ``comm`` only, so EP ranks would clip by different factors).
        module: the model ``loss_fn`` runs: its parameter attributes are the step's leaves for
            the whole step (restored afterwards), so ``loss_fn`` may call ``module(...)`` and
            activation checkpointing inside the model recomputes with the step's parameters.
            Needed for ``torch.compile``: every compiled module in it (``block.compile()``,
            ``torch.compile(block)`` put back into the model, the whole model) is gathered at its
            boundary (see [Note: compiled regions] in ``_compiled.py``); compiled code the step
            cannot see raises. One module object per rank.
        skip_unused: ``torch.optim`` semantics for a parameter that got no gradient on any rank
            in a step: no update, no weight decay, no moment decay (see [Note: parameters without a
            gradient]). ``False``: it is updated as if its gradient were zero.
        chunks: ``C``: the global batch is ``C`` equal chunks, and the loss, gradients, optimizer
            state and parameters after every step are the same bits at every data-parallel world
            size ``W`` (FSDP ranks x HSDP replicas) that is a power of two dividing ``C``, or ``C``
            itself on one replica (see [Note: the chunked step] in ``_chunks.py`` and
            docs/invariance.md). Each rank runs ``C / W`` chunks as its micro-batches: feed it
            :func:`ragged.fsdp.local_chunks` of the global batch. Another ``W``, more than two
            HSDP replicas, ``data_groups`` (expert parallelism) and a quantized reduce-scatter into
            a dtype narrower than float32 are refused here, on every rank, naming ``C``, ``W`` and
            the fix.

    Returns:
        A :class:`Step`. Its metrics: ``loss`` (mean over micro-batches and ranks),
        ``peak_gathered_bytes`` (most bytes of gathered parameter buffers alive at once),
        ``peak_grad_bytes``, ``peak_shard_bytes`` (reduced gradient shards alive at once: each
        reduce-scatter's output and the sums over micro-batches), ``largest_unit_bytes``,
        ``model_bytes`` (all units gathered), ``num_gathers``, ``num_reduces``,
        ``schedule_reruns`` (calls rerun with a learnt schedule) and ``unused_leaves`` (leaves
        no rank produced a gradient for).

    Raises:
        RaggedValueError: ``loss_fn`` never read the parameters (on every rank, on the first
            step, before any parameter changes; see :data:`ragged.fsdp._grad.UNUSED_PARAMS_MSG`).
        PlanMismatchError: the ranks' collectives cannot follow one schedule; or the ranks' steps
            differ in an option or an optimizer setting (named, with each side's value), at the
            first call, on every rank.
        RaggedValueError: ``donate`` disagrees with ``optimizer.donates``; with ``chunks``, a
            world size or setting it cannot serve (see ``chunks``).
        RaggedError: on every other rank, at the first call, when this function refused a rank's
            options on that rank alone (e.g. a ``gather_format`` callable that returns a string on
            rank 1 only): that rank's error joins the call's agreement (see [Note: a rank's error
            joins the next agreement] in ``ragged/collectives/_agree.py``).

    Examples:
        >>> import copy, torch, ragged as rg
        >>> from ragged import fsdp
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> units = fsdp.make_units(model, world_size=2, groups=["0", "2"])
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> def run(comm):  # one module object per simulated rank (ranks are threads)
        ...     module = copy.deepcopy(model)
        ...     opt = rg.optim.sgd(0.1)
        ...     state = fsdp.init(units, model.state_dict(), opt, comm)  # a module would be released
        ...     loss_fn = lambda params, batch: ((module(batch[0]) - batch[1]) ** 2).mean()
        ...     step = fsdp.make_step(units, loss_fn, opt, comm, module=module)
        ...     rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        ...     state, metrics = step(state, (x[rows], y[rows]))
        ...     return metrics["loss"], rg.gather(units, state.shards, comm)["0.bias"]
        >>> (loss0, b0), (loss1, b1) = rg.collectives.simulate(2, run)
        >>> ref = torch.nn.functional.mse_loss(model(x), y)
        >>> ref.backward()
        >>> abs(loss0 - ref.item()) < 1e-6, torch.allclose(b0, model[0].bias - 0.1 * model[0].bias.grad)
        (True, True)
    """
    data_groups = data_groups_option(data_groups, "make_step")
    if chunks is not None:
        micro_batches = chunked_micro_batches(chunks, comm, micro_batches, "make_step")
        check_chunked((), data_groups, "make_step")
    # value_and_grad itself, without its own joining: an error here joins as make_step's
    grad = value_and_grad.__wrapped__(units, loss_fn, comm, micro_batches=micro_batches, policy=policy,
                                      prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                                      max_inflight_reduce=max_inflight_reduce, module=module, trace=trace,
                                      chunks=chunks)
    return Step(value_and_grad=grad, optimizer=optimizer, donate=step_donation(donate, optimizer), data_groups=data_groups,
                skip_unused=skip_unused)


# ---- data groups (see [Note: data groups]) ------------------------------------------------------------
class DataGroup(NamedTuple):
    """One extra data axis of a step: its ``comm`` and ``is_replicated(path) -> bool`` (the
    parameters that hold a copy on every rank of it, paths as in the units).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp, parallel, spec
        >>> mplan = spec.make_mesh_plan({"router": torch.empty(2, 4), "experts": torch.empty(2, 4, 4)},
        ...                             {"router": None, "experts": {"ep": spec.Shard(0)}}, mesh=spec.Mesh((1, 2), ("dp", "ep")))
        >>> def fn(mc):
        ...     (group,) = parallel.data_groups(mplan, mc, ("ep",))
        ...     return isinstance(group, fsdp.DataGroup), group.is_replicated("['router']"), group.is_replicated("['experts']")
        >>> parallel.simulate_mesh(mplan.mesh, fn)[0]
        (True, True, False)
    """

    comm: Any
    is_replicated: Callable[[str], bool]


def data_groups_option(data_groups: Sequence, where: str) -> tuple[DataGroup, ...]:
    """The ``data_groups=`` argument of ``where`` as DataGroups.

    Raises:
        RaggedTypeError: an entry that is not a ``(comm, is_replicated)`` pair.
    """
    out = []
    for entry in data_groups:
        try:
            comm, pred = entry
        except (TypeError, ValueError):
            raise RaggedTypeError(f"{where}: data_groups entries are (comm, is_replicated(path) -> bool) pairs, got "
                                  f"{type(entry).__name__}.") from None
        if not callable(pred) or not hasattr(comm, "all_reduce"):
            raise RaggedTypeError(f"{where}: data_groups entries are (comm, is_replicated(path) -> bool) pairs, got "
                                  f"({type(comm).__name__}, {type(pred).__name__}).")
        out.append(DataGroup(comm, pred))
    return tuple(out)


def reduce_over_data_groups(unit, grad, data_groups: Sequence[DataGroup]) -> None:
    """In place on ``unit``'s gradient shard ``grad`` (over its trainable plan, after its reduce-scatter): the replicated
    parameters' gradients summed over each data group, then everything divided by its size."""
    for group in data_groups:
        all_reduce_leaves(group.comm, grad.data, grad.replicated, grad.plan, grad.rank,
                          picked_leaves(unit, group.is_replicated))
        grad.data.div_(divisor(grad.data, group.comm.world_size))  # see [Note: a division every device rounds alike]
        grad.replicated.div_(divisor(grad.replicated, group.comm.world_size))


# ---- parameters without a gradient (see [Note: parameters without a gradient]) --------------------
def _subtrees(tree, shards):
    """The subtrees of ``tree`` laid out like ``shards`` (``{unit: DBuffer}`` with the same plans)."""
    def like(x):
        return (isinstance(x, dict) and x.keys() == shards.keys()
                and all(isinstance(v, DBuffer) and v.plan == shards[k].plan for k, v in x.items()))
    return [x for x in pytree.leaves(tree, is_leaf=like, none_is_leaf=True) if like(x)]


def freeze_unused(units, unused: dict, shards: dict, opt_state):
    """What :func:`restore_unused` writes back (see [Note: parameters without a gradient]);
    ``shards``: the trainable parts the optimizer updates (``_trainable.trainable_shards``)."""
    where = {}
    for u in units:
        if u.name in unused:
            d = shards[u.name]
            picked = frozenset(i for i, p in enumerate(u.trainable_paths) if p in unused[u.name])
            where[u.name] = leaf_positions(d.plan, d.rank, picked, d.data.device)
    saved = [{name: (t[name].data[pos[0]].clone(), t[name].replicated[pos[1]].clone()) for name, pos in where.items()}
             for t in _subtrees(opt_state, shards)]
    return where, saved


def restore_unused(frozen, shards: dict, updates: dict, opt_state):
    """Zeroes the unused leaves' updates and writes their saved state back (in place)."""
    where, saved = frozen
    subtrees = _subtrees(opt_state, shards)
    if len(subtrees) != len(saved):
        raise RaggedValueError("the optimizer changed the structure of its state; skip_unused=True needs it fixed.")
    with torch.no_grad():
        for name, (data_pos, rep_pos) in where.items():
            updates[name].data[data_pos] = 0
            updates[name].replicated[rep_pos] = 0
            for tree, values in zip(subtrees, saved):
                tree[name].data[data_pos] = values[name][0]
                tree[name].replicated[rep_pos] = values[name][1]
