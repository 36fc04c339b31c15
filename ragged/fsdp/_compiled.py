"""``torch.compile`` under the FSDP step: every compiled module of the bound model is a region
whose units the runtime gathers at its boundary; dynamo never sees ragged's runtime.

[Note: compiled regions]
What dynamo does with ragged's function mode (torch 2.13, read in ``torch/_dynamo``): the mode
stack is part of a compiled frame's guards (the modes' types), and dynamo inlines an active
mode's ``__torch_function__`` into every torch call it traces
(``SymbolicTorchFunctionState.call_torch_function_mode``). Ragged's per-call logic (which unit
owns a tensor's storage, the schedule's cursor) is runtime state that dynamo can only guard on
or break at: each call's fresh :class:`~ragged.fsdp._runtime.Run` failed an identity guard (a
recompile per call until the limit), ``untyped_storage()._cdata`` broke the graph at every op.
And a compiled graph cannot gather a unit when it first reads it: its kernels read every input
as the graph runs, so a unit must be gathered before the graph that reads it starts.

So a compiled *module* is one opaque call from the runtime's point of view, like one torch call
that reads several units (FSDP2 gathers at module hooks that dynamo skips for the same reason):

* at its boundary (:class:`Region`, put in place of the module's compiled entry point for the
  step's call, like the parameters :func:`~ragged.fsdp._intercept.bind` puts in place) the
  runtime gathers the units of the module's parameters and of its tensor arguments, moving the
  schedule on exactly as a torch call reading them would (:meth:`Run.read`: nothing is freed
  before the module returns), and places the marker of the entry it entered on the module's
  first leaf for the duration of the call (swapped in the module's ``_parameters`` like a
  bound leaf), so backward observes the entry as in eager;
* the call runs with ragged's function mode off the stack: dynamo traces only the user's code
  (its mode-stack guard sees the same stack every call: no recompiles), and the compiled
  graph's own torch calls at run time do not reach the runtime either;
* what is not per call stays as in eager: saved tensors go through the saved-tensor hooks (the
  compiled function's ``save_for_backward`` runs eagerly, so parameters it saves are packed as
  unit references and gathered by the schedule in backward), gradients reach the leaves'
  accumulation hooks, the compiled backward runs in the engine under the mode (its reads of
  unpacked parameters are seen as in eager), and recomputation (``torch.utils.checkpoint``
  around a compiled block) enters the region again in backward.

A region that starts inside another region of the same call runs as it is: the outer one holds
every unit the inner one reads. Compiling a block (``block.compile()`` or ``torch.compile(block)``
for each block, as torchtitan does) makes every region one unit: the memory and the collective
order of eager. Compiling the whole model makes it one region that reads every unit: all of them
are gathered while it runs (the schedule learns that backward needs them together), which
trades the sharding of the parameters during the step for the larger graph.

What ragged cannot see it refuses: dynamo tracing a torch call under the function mode means
compiled code runs where ragged did not put a region (a compiled model called through
``torch.func.functional_call`` without ``module=``, a compiled free function, compiled
autograd); :func:`~ragged.fsdp._intercept.compiled_outside_region` is then the first thing the
compiled frame runs, before any op, and raises on that rank; the step's agreement makes every
rank raise before any parameter changes. A compiled module must read parameters through its own
attributes or its arguments (what the boundary sees), as modules do.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from ragged.fsdp._intercept import Marker, UseMode

__all__ = ["compiled_modules", "regions", "Region"]


def _optimized_module_type():
    """``torch.compile``'s wrapper type, once dynamo is loaded (before, no module can be one: see
    [Note: dynamo only once it is loaded] in ``_intercept.py``)."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())


def compiled_modules(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """``(submodule, attribute)`` of every compiled module in ``module`` (itself included): the
    instance attribute holding its compiled entry point (``forward`` of a ``torch.compile(m)``
    wrapper, ``_compiled_call_impl`` after ``m.compile()``)."""
    optimized, out = _optimized_module_type(), []
    for sub in module.modules():
        if optimized and isinstance(sub, optimized) and "forward" in sub.__dict__:
            out.append((sub, "forward"))
        elif sub.__dict__.get("_compiled_call_impl") is not None:
            out.append((sub, "_compiled_call_impl"))
    return out


class _Call:
    """Regions of one call of the step: the run and how deep in regions the code is."""

    __slots__ = ("run", "depth")

    def __init__(self, run):
        self.run, self.depth = run, 0


class Region:
    """The compiled entry point of ``module`` as a region of the step's call (see [Note:
    compiled regions])."""

    __slots__ = ("call", "module", "entry", "units")

    def __init__(self, call: _Call, module: torch.nn.Module, entry):
        self.call, self.module, self.entry, self.units = call, module, entry, None

    def __call__(self, *args, **kwargs):
        call, run = self.call, self.call.run
        if call.depth or run.busy:
            return self.entry(*args, **kwargs)
        if self.units is None:  # the module's parameters are the step's leaves for the whole call
            self.units = _units_of(run, self.module.parameters())
        touched = self.units + [i for i in _units_of(run, _tensors(args, kwargs)) if i not in self.units]
        call.depth += 1
        try:
            with _without_mode(run):
                if not touched:
                    return self.entry(*args, **kwargs)
                return run.read(touched, lambda mark: self._run(mark, args, kwargs))
        finally:
            call.depth -= 1

    def _run(self, mark: bool, args, kwargs):
        run = self.call.run
        slot = _first_leaf_slot(self.module, run) if mark else None
        if slot is None:
            return self.entry(*args, **kwargs)
        owner, attr, leaf = slot
        owner._parameters[attr] = Marker.apply(run, run.take_marker(), leaf)
        try:
            return self.entry(*args, **kwargs)
        finally:
            owner._parameters[attr] = leaf


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a


def _units_of(run, tensors) -> list[int]:
    out = []
    for t in tensors:
        i = run.unit_of(t)
        if i is not None and i not in out:
            out.append(i)
    return out


def _first_leaf_slot(module, run):
    for owner in module.modules():
        for attr, p in owner._parameters.items():
            if p is not None and run.is_leaf(p):
                return owner, attr, p
    return None


@contextlib.contextmanager
def _without_mode(run):
    """The function mode stack without ``run``'s :class:`UseMode` (forward's or backward's)."""
    stack = [torch._C._get_function_stack_at(k) for k in range(torch._C._len_torch_function_stack())]
    keep = [m for m in stack if not (isinstance(m, UseMode) and m.run is run)]
    if len(keep) == len(stack):
        yield
        return
    _set_stack(keep)
    try:
        yield
    finally:
        _set_stack(stack)


def _set_stack(modes) -> None:
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for m in modes:
        torch._C._push_on_torch_function_stack(m)


@contextlib.contextmanager
def regions(module, run):
    """Inside the block every compiled module of ``module`` (``None``: none) is a region of ``run``."""
    if module is None:
        yield
        return
    call, swapped = _Call(run), []
    try:
        for sub, attr in compiled_modules(module):
            entry = sub.__dict__[attr]
            sub.__dict__[attr] = _hidden_region()(call, sub, entry)
            swapped.append((sub, attr, entry))
        yield
    finally:
        for sub, attr, entry in reversed(swapped):
            sub.__dict__[attr] = entry


@functools.cache
def _hidden_region():
    """:class:`Region` with its boundary hidden from dynamo: made when a compiled module is first
    found, dynamo being loaded by then (see [Note: dynamo only once it is loaded] in ``_intercept.py``)."""
    hidden = torch.compiler.disable(Region.__call__, reason="ragged: a compiled module's boundary (gathers its "
                                                            "units, see [Note: compiled regions] in "
                                                            "ragged/fsdp/_compiled.py)")
    return type("Region", (Region,), {"__slots__": (), "__call__": hidden})
