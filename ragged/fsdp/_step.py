"""The functional FSDP training step: ``(shards, opt_state), batch -> (shards', opt_state'), metrics``.

[Note: how a unit is gathered, used and released without module hooks]
For every unit the step allocates one flat buffer of ``m * S`` elements (compute dtype) and
makes every parameter a *leaf tensor that is a view of it* (zero-copy: the all-gather writes
straight into the storage the parameters read). The buffer's storage is released
(``untyped_storage().resize_(0)``, as FSDP2 does) and brought back only when the schedule says:

* forward: the loss runs under a ``TorchFunctionMode`` that looks at the storage of every
  tensor argument of every torch call. A call that reads a unit's storage moves the schedule on
  to that unit's next entry: the entries passed free what is no longer needed (reshard after
  forward), gather the unit and start the next entry's all-gather (prefetch).
* saved tensors: under ``torch.autograd.graph.saved_tensors_hooks``, a tensor saved for
  backward that lives in a unit's storage is packed as ``(unit, offset, size, stride)``, not
  kept alive; its unpack in backward reads the unit the schedule has gathered by then.
* gradients: each parameter leaf has a ``register_post_accumulate_grad_hook`` that copies its
  gradient into the unit's flat gradient buffer (laid out like the plan, padding zero) and
  drops it: one copy per gradient, as FSDP2's copy-in. A unit's reduce-scatter
  (``rg.reduce_scatter_start`` on the flat buffer) starts at a point of backward every rank
  reaches in the same order, once backward is provably done with it; leaves without a gradient
  on this rank contribute zeros. At most ``max_inflight_reduce`` reduce-scatters are in flight.

Which collectives run, in which order, is decided by a schedule every rank agrees on, never by
what this rank's data touched: see [Note: a collective order that does not depend on data] in
``_schedule.py`` (the pure part), [Note: markers and tags] in ``_runtime.py`` (how backward
progress is observed) and [Note: one agreement at the start of a call, one at the end] in
``_grad.py`` (deviations, failures, reruns).

``spec.Replicate()`` leaves of a unit are views of a copy of the shard's replicated buffer (in
the compute dtype) made once per call: never gathered, never freed. Their gradients go to a small
per-unit buffer that rides along the unit's reduce-scatter as its all-reduced part.

Per-leaf leaves (rather than one flat leaf with views) matter: autograd runs a leaf's
``AccumulateGrad`` as soon as its gradient is ready, whereas views of one flat leaf created
before the forward would funnel every gradient through nodes that autograd schedules last.

[Note: the walk of one step]
``state, metrics = step(state, batch)`` top-down, each file entered once:

1. ``Step.__call__`` (here): refuses a donated state, optimizer state over frozen leaves and a
   module whose ``requires_grad`` changed (``_trainable.py``), before any communication.
2. ``ValueAndGrad.compute`` (``_grad.py``): local checks, the start-of-call agreement
   (``check_plans``), then per attempt ``_attempt``: a :class:`~ragged.fsdp._runtime.Run` of the
   :class:`~ragged.fsdp._schedule.Program` (``_schedule.py``, pure) is made; ``loss_fn`` runs
   under the interceptors (``_intercept.py``, ``_compiled.py``), which call the run's methods
   (``_runtime.py``: ``read`` gathers and frees units, markers and saved tensors prove backward
   events); its :class:`~ragged.fsdp._reducing.Gradients` (``_reducing.py``) accumulate each
   trainable leaf's gradient and reduce-scatter each unit at the program's point. The
   end-of-call agreement ``_agree`` decides for every rank: raise, rerun with the learnt
   schedule, or return ``_result`` (the loss, ``{unit: DBuffer}`` over the trainable plans, the
   leaves no rank used, the run's :class:`~ragged.fsdp._observed.Counters`).
3. Back here: the reduction over data groups (``_data.py``), the optimizer over the trainable
   parts (``_trainable.trainable_shards``; unused leaves kept as they were, ``_unused.py``),
   ``apply_updates``, the updated parts put back into the shards (``with_trainable``), donation
   (``_donate.py``).

[Note: limits of gathering on use]
* The loss must read parameters through torch calls (any op, method or view property; only
  metadata such as ``.shape`` does not gather). Python code that autograd runs in backward
  (custom ``Function.backward``, recomputation) gathers too: tensors saved with
  ``ctx.save_for_backward`` through the saved-tensor hooks, parameters (or views of them) kept
  as plain ``ctx`` attributes on their first use in a torch call (tested).
* Recomputation inside the model (``torch.utils.checkpoint`` in a module's forward, Hugging
  Face ``gradient_checkpointing_enable()``) needs ``make_step(..., module=model)``; without it,
  backward reading the module's own parameters raises (see [Note: binding a module] in
  ``_intercept.py``).
* ``torch.compile``: a compiled module of ``make_step(..., module=model)`` is one opaque call
  that reads its parameters' units, gathered at its boundary; a compiled block is one unit, as
  in eager, a compiled whole model keeps every unit gathered while it runs. Compiled code the
  step cannot see is refused (see [Note: compiled regions] in ``_compiled.py``).
* A unit read where the schedule has it freed is served zeros on that rank and the call is rerun
  with the learnt schedule; the first call learns the usual patterns (a tied or reused unit, a
  checkpointed layer). What depends on the data in a way one schedule cannot cover raises
  :class:`~ragged.PlanMismatchError` on every rank, never a collective mismatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ragged.fsdp._grad import ValueAndGrad, value_and_grad
from ragged.fsdp._layout import MixedPrecision
from ragged.fsdp._state import TrainState
from ragged.fsdp._data import data_groups_option, reduce_over_data_groups
from ragged.fsdp._units import Units
from ragged.fsdp._donate import check_not_donated, donate, step_donation
from ragged.fsdp._trainable import check_opt_state, check_trainable, trainable_shards, with_trainable
from ragged.fsdp._unused import freeze_unused, restore_unused
from ragged.optim import apply_updates

__all__ = ["make_step", "Step"]


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
    policy = property(lambda self: self.value_and_grad.policy)
    module = property(lambda self: self.value_and_grad.module)

    def __call__(self, state: TrainState, batch):
        shards, opt_state = state
        check_not_donated(state, "step(state, batch)")
        check_opt_state(self.units, opt_state)
        if self.module is not None:
            check_trainable(self.units, self.module.named_parameters(), "step(state, batch)")
        result = self.value_and_grad.compute(shards, batch, data_groups=self.data_groups)
        grads = result.grads  # the trainable parts only (see [Note: frozen parameters] in _trainable.py)
        for name, g in grads.items():
            reduce_over_data_groups(self.units[name], g, self.data_groups)
        params = trainable_shards(self.units, shards)
        frozen = freeze_unused(self.units, result.unused, params, opt_state) if self.skip_unused and result.unused else None
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        if frozen is not None:
            restore_unused(frozen, params, updates, new_opt_state)
        trained = apply_updates(params, updates, donate=self.donate)
        new_state = TrainState(with_trainable(self.units, shards, trained), new_opt_state)
        if self.donate:
            new_state = donate(state, new_state)
        return new_state, {"loss": result.loss, **result.metrics, "unused_leaves": sum(map(len, result.unused.values()))}

    def lower(self, state_shapes=None, batch_shapes=None, **options):
        """Memory and communication of this step per rank, without running it: see
        :func:`ragged.predict._lower.lower` (``options``: ``schedule``, ``activations``, ``max_ranks``)."""
        # the predictor sits above fsdp (it reads this step's schedule): imported when a step is
        # lowered, never when fsdp is
        from ragged.predict._lower import lower

        return lower(self, state_shapes, batch_shapes, **options)


def make_step(
    units: Units,
    loss_fn: Callable,
    optimizer,
    comm,
    *,
    micro_batches: int = 1,
    policy: MixedPrecision | None = None,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
    max_inflight_reduce: int = 1,
    donate: bool | None = None,
    trace: bool = False,
    data_groups: Sequence[tuple[Any, Callable[[str], bool]]] = (),
    module: torch.nn.Module | None = None,
    skip_unused: bool = True,
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
            equal micro-batches along dim 0; gradients are averaged.
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
            raises (see [Note: one donate decision per step] in ``_donate.py``).
        trace: record ``(event, unit, phase)`` tuples in ``metrics["trace"]`` (see :func:`value_and_grad`).
        data_groups: the other data axes (e.g. expert parallelism), as :class:`DataGroup`
            ``(comm, is_replicated)`` pairs (see ``_data.py``): after the reduce-scatter over
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
            gradient] in ``_unused.py``). ``False``: it is updated as if its gradient were zero.

    Returns:
        A :class:`Step`. Its metrics: ``loss`` (mean over micro-batches and ranks),
        ``peak_gathered_bytes`` (most bytes of gathered parameter buffers alive at once),
        ``peak_grad_bytes``, ``largest_unit_bytes``, ``model_bytes`` (all units gathered),
        ``num_gathers``, ``num_reduces``, ``schedule_reruns`` (calls rerun with a learnt
        schedule) and ``unused_leaves`` (leaves no rank produced a gradient for).

    Raises:
        RaggedValueError: ``loss_fn`` never read the parameters (on every rank, on the first
            step, before any parameter changes; see :data:`ragged.fsdp._grad.UNUSED_PARAMS_MSG`).
        PlanMismatchError: the ranks' collectives cannot follow one schedule.
        RaggedValueError: ``donate`` disagrees with ``optimizer.donates``.

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
    grad = value_and_grad(units, loss_fn, comm, micro_batches=micro_batches, policy=policy, prefetch=prefetch,
                          reshard_after_forward=reshard_after_forward, max_inflight_reduce=max_inflight_reduce,
                          module=module, trace=trace)
    return Step(value_and_grad=grad, optimizer=optimizer, donate=step_donation(donate, optimizer), data_groups=data_groups,
                skip_unused=skip_unused)

