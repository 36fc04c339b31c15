"""Thin adapters between torch and the step's runtime (``_runtime.Run``): the function mode
that sees every read of a unit, the markers, the saved-tensor hooks, backward under the mode,
and the binding of a module's parameter attributes to the step's leaves.

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

[Note: backward under the mode]
Python code that autograd runs in backward (recomputation, custom ``Function.backward``) must
gather what it reads, so the engine runs with the function mode active. The engine snapshots
the mode stack when it is called, and ``torch.autograd.backward`` / ``Tensor.backward``
dispatch to an active ``TorchFunctionMode``, which runs them with the mode popped (that code
would then read released storage: a segfault, seen with ``torch.utils.checkpoint``). Entering a
mode from a hook inside backward does not help either (measured: the snapshot wins). So the step
calls the engine through ``torch.autograd.graph._engine_run_backward`` (what
``torch.autograd.backward`` itself calls after that dispatch) under the mode, and the mode
handles a nested ``backward`` call (a reentrant checkpoint's) the same way. This private call
stays until torch offers a public way to run backward with a mode active.

[Note: binding a module]
With ``make_step(..., module=model)`` every parameter attribute of ``model`` (a tied parameter
under each of its names) is the step's leaf for the whole micro-batch, forward and backward, and
is restored afterwards (also on error). So ``loss_fn`` may call ``model(...)`` directly, and
recomputation inside the model (``torch.utils.checkpoint`` in a module's forward, Hugging Face
``gradient_checkpointing_enable()``), which runs after ``functional_call`` has returned, reads the
leaves too. Without it, backward reading a parameter (``nn.Parameter`` requiring grad) that is
not one of the step's leaves raises :class:`~ragged.RaggedValueError` naming that fix.

[Note: dynamo only once it is loaded]
``torch._dynamo`` takes seconds to import and ragged never imports it. What must be hidden from
dynamo's tracing (``torch.compiler.disable``: the refusal below, the saved-tensor hooks, a
region's boundary in ``_compiled.py``) is hidden once dynamo is loaded: nothing is compiled, so
nothing traced, before it is (``torch.compile`` and ``Module.compile`` import it). Each step call
checks when it starts (:func:`dynamo_loaded`), before any code it runs can be traced.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import sys
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

from ragged._errors import RaggedValueError

__all__ = ["UseMode", "Marker", "saved_tensor_hooks", "backward", "module_slots", "bind", "dynamo_loaded"]

_METADATA = frozenset(
    {"size", "dim", "stride", "storage_offset", "numel", "is_contiguous", "untyped_storage", "data_ptr", "__len__",
     "element_size", "__hash__", "__repr__", "__format__", "ndimension", "nelement", "requires_grad_",
     "register_hook", "register_post_accumulate_grad_hook"}
)
# properties that read metadata only (``.T``, ``.mT``, ``.data`` ... make views: they do gather)
_METADATA_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout", "is_cuda",
     "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "names", "_base", "_version", "output_nr",
     "itemsize", "nbytes", "_grad", "_grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks", "name"}
)
_BACKWARDS = (torch.autograd.backward, torch.Tensor.backward)

COMPILED_OUTSIDE_REGION_MSG = (
    "torch.compile traced a torch call ({func}) inside the step without ragged knowing where the compiled code "
    "starts: compiled code cannot gather a unit when it first reads it, so the step refuses (every rank raises "
    "this, before any parameter changes). Fix: pass the model to rg.fsdp.make_step(..., module=model) (or "
    "value_and_grad(..., module=model)) and compile modules of it (model.compile(), block.compile() for each "
    "block, or torch.compile(block) put back into the model): each compiled module is then a region whose units "
    "are gathered at its boundary. Compile the model or its blocks, not loss_fn, the step or another function "
    "that runs inside it; compiled autograd is not supported either."
)

FOREIGN_PARAMETER_MSG = (
    "backward read a parameter that is not one of the step's leaves ({shape}, an nn.Parameter requiring grad): "
    "recomputation inside the model (torch.utils.checkpoint in a module's forward, or Hugging Face "
    "gradient_checkpointing_enable()) runs after torch.func.functional_call has restored the module's own "
    "tensors, so it would recompute with them. Fix: rg.fsdp.make_step(..., module=model) binds the module's "
    "parameters to the step's leaves through backward."
)


def _reads_data(func) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) not in _METADATA_PROPERTIES
    return name not in _METADATA


def _in_place(func, kwargs) -> bool:
    name = getattr(func, "__name__", "") or ""
    return name.endswith("_") and not name.endswith("__") or name.startswith("__i") or "out" in kwargs


class Marker(torch.autograd.Function):
    """Identity on a leaf; its backward tells the runtime that entry ``entry`` is done (see
    [Note: markers and tags] in ``_runtime.py``)."""

    @staticmethod
    def forward(ctx, run, entry, leaf):
        ctx.run, ctx.entry, ctx.leaf_id = run, entry, id(leaf)
        return leaf.view_as(leaf)

    @staticmethod
    def backward(ctx, grad):
        ctx.run.marker_fired(ctx.entry, ctx.leaf_id)
        return None, None, grad


class UseMode(TorchFunctionMode):
    """Sends every torch call that reads a unit's storage to :meth:`Run.use`."""

    def __init__(self, run):
        super().__init__()
        self.run = run
        _hide_refusal_from_dynamo()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if torch.compiler.is_dynamo_compiling():  # see [Note: compiled regions] in _compiled.py
            return compiled_outside_region(func)
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            return backward(self.run, *_backward_args(func, args, kwargs))
        run = self.run
        if run.busy or not _reads_data(func):
            return func(*args, **kwargs)
        touched = None
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, torch.Tensor):
                i = run.unit_of(a)
                if i is not None:
                    touched = (touched or []) + [i]
                elif isinstance(a, torch.nn.Parameter) and a.requires_grad:
                    if run.phase == "backward":
                        raise RaggedValueError(FOREIGN_PARAMETER_MSG.format(shape=f"shape {tuple(a.shape)}"))
                    run.foreign_read(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        i = run.unit_of(b)
                        if i is not None:
                            touched = (touched or []) + [i]
        if touched is None:
            return func(*args, **kwargs)

        def call(mark: bool):
            a, k = _mark(run, args, kwargs) if mark and not _in_place(func, kwargs) else (args, kwargs)
            return func(*a, **k)

        return run.read(touched, call)


def dynamo_loaded() -> bool:
    """Whether ``torch._dynamo`` is imported (see [Note: dynamo only once it is loaded])."""
    return "torch._dynamo" in sys.modules


def _refuse_outside_region(func):
    raise RaggedValueError(COMPILED_OUTSIDE_REGION_MSG.format(func=getattr(func, "__name__", func)))


# the refusal; once dynamo is loaded, its disabled form (dynamo runs it instead of tracing it)
compiled_outside_region = _refuse_outside_region


def _hide_refusal_from_dynamo() -> None:
    global compiled_outside_region
    if compiled_outside_region is _refuse_outside_region and dynamo_loaded():
        compiled_outside_region = torch.compiler.disable(
            _refuse_outside_region, reason="ragged: a compiled module read the step's parameters outside a region "
                                           "(see the RaggedValueError this raises)")


def _mark(run, args, kwargs):
    """Wraps the first leaf argument of the call in a :class:`Marker` (none: the entry has none)."""
    entry = run.take_marker()
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor) and run.is_leaf(a):
            return args[:k] + (Marker.apply(run, entry, a),) + args[k + 1:], kwargs
    for name, a in kwargs.items():
        if isinstance(a, torch.Tensor) and run.is_leaf(a):
            return args, {**kwargs, name: Marker.apply(run, entry, a)}
    return args, kwargs


def saved_tensor_hooks(run):
    """``saved_tensors_hooks`` packing tensors as :meth:`Run.saved` says (see the runtime's notes).

    Autograd calls them from eager code inside a compiled region too (a graph break): dynamo must
    not trace them (see [Note: compiled regions] in ``_compiled.py``)."""
    if not dynamo_loaded():  # see [Note: dynamo only once it is loaded]
        return torch.autograd.graph.saved_tensors_hooks(run.saved, run.restored)
    return torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(run.saved),
                                                    torch.compiler.disable(run.restored))


_BACKWARD_SIGNATURE = inspect.signature(torch.autograd.backward)


def _backward_args(func, args, kwargs):
    if func is torch.Tensor.backward:
        bound = inspect.signature(torch.Tensor.backward).bind(*args, **kwargs)
        p = bound.arguments
        return (p["self"],), (p.get("gradient"),), p.get("retain_graph"), p.get("create_graph", False), p.get("inputs")
    p = _BACKWARD_SIGNATURE.bind(*args, **kwargs).arguments
    tensors = p["tensors"]
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = p.get("grad_tensors")
    grads = (grads,) if grads is None or isinstance(grads, torch.Tensor) else tuple(grads)
    return tensors, grads, p.get("retain_graph"), p.get("create_graph", False), p.get("inputs")


def backward(run, tensors, grads=(None,), retain_graph=None, create_graph=False, inputs=None):
    """``torch.autograd.backward(tensors, grads, ...)`` with the engine running under the mode
    (see [Note: backward under the mode])."""
    if len(grads) != len(tensors):
        grads = tuple(grads) + (None,) * (len(tensors) - len(grads))
    made = []
    for t, g in zip(tensors, grads):
        if g is None:
            if t.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(t, memory_format=torch.preserve_format)
        made.append(g)
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    with UseMode(run):
        torch.autograd.graph._engine_run_backward(
            tuple(tensors), tuple(made), create_graph if retain_graph is None else retain_graph, create_graph, inputs,
            allow_unreachable=True, accumulate_grad=True,
        )


# ---- module binding -----------------------------------------------------------------------------

_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BOUND_LOCK = threading.Lock()


def module_slots(module: torch.nn.Module, units) -> tuple:
    """``(submodule, attribute, path)`` for every parameter attribute of ``module``, a tied
    parameter under each of its names (``path``: the name ``make_units`` gave it)."""
    if not isinstance(module, torch.nn.Module):
        raise RaggedValueError(f"make_step(module=...) must be an nn.Module, got {type(module).__name__}.")
    known = {p for u in units for p in u.paths}
    inner = getattr(module, "_orig_mod", None)  # torch.compile(model) of the model make_units was given
    if isinstance(inner, torch.nn.Module) and not known & {name for name, _ in module.named_parameters()}:
        module = inner
    path_of = {id(p): name for name, p in module.named_parameters()}
    slots = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            path = path_of.get(id(p))
            if path not in known:
                full = f"{prefix}.{attr}" if prefix else attr
                raise RaggedValueError(
                    f"make_step(module=...): the module's parameter {full!r} (shape {tuple(p.shape)}) is not in the "
                    f"units (their parameters are {sorted(known)[:3]}...). Fix: pass the module make_units was given."
                )
            slots.append((sub, attr, path))
    missing = known - {path for _, _, path in slots}
    if missing:
        raise RaggedValueError(f"make_step(module=...): the units have parameters the module lacks: {sorted(missing)[:3]}.")
    return tuple(slots)


@contextlib.contextmanager
def bind(module, slots, leaves: dict):
    """Every slot's attribute is its leaf in ``leaves`` ({path: tensor}) inside the block."""
    if module is None:
        yield
        return
    with _BOUND_LOCK:
        if module in _BOUND:
            raise RaggedValueError(
                "make_step(module=...): this module is bound by another step call right now (simulated ranks are "
                "threads of one process). Fix: give every rank its own copy of the module (copy.deepcopy)."
            )
        _BOUND[module] = True
    saved = [(sub, attr, sub._parameters[attr]) for sub, attr, _ in slots]
    try:
        for sub, attr, path in slots:
            sub._parameters[attr] = leaves[path]
        yield
    finally:
        for sub, attr, p in saved:
            sub._parameters[attr] = p
        with _BOUND_LOCK:
            _BOUND.pop(module, None)
