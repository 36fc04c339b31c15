"""One verb per operation, whatever the layout: ``shard``, ``gather``, ``reduce_scatter`` and
``global_norm`` dispatch on the type of their first argument.

[Note: one verb, any layout]
A *layout* says where every parameter lives. ragged has three, and each verb takes any of them
first, as JAX's ``device_put`` / ``shard_map`` take any ``Sharding``:

=================================  ======================================  ==========================
layout                             sharded value (``shards``)              comm
=================================  ======================================  ==========================
:class:`~ragged.LayoutPlan`        a :class:`~ragged.DBuffer`              a ``Collectives``
:class:`~ragged.fsdp.Units`        ``{unit name: DBuffer}``                the shard group's
:class:`~ragged.spec.MeshPlan`     a ``DBuffer`` of ``mplan.plan``         a ``parallel.MeshComm``
=================================  ======================================  ==========================

``shard(layout, params, comm)``, ``gather(layout, shards, comm, *, dtype=None)``,
``reduce_scatter(layout, grads, comm, *, op="mean", dtype=None)`` and ``global_norm(layout,
grads, comm)``; a DBuffer carries its plan, so ``gather(dbuf, comm, *, dtype=None)`` (the
public contract's form) is the same as ``gather(dbuf.plan, dbuf, comm, dtype=...)``. Each verb
tells its call shape by the type of its first argument (``isinstance``), never by sniffing a
later one; options are keyword-only, and those only one layout has pass through (``out=`` for
a plan, ``data_axes=`` for a mesh plan, ``data_groups=`` for units).

The implementations for ``Units`` and ``MeshPlan`` live with their layouts (``ragged.fsdp``,
``ragged.parallel``, which import ``transforms``) and register here with
:func:`register_layout`, so ``transforms`` never imports upward; ``import ragged`` registers
both. The verbs have this one name (``rg.shard``, ...): ``fsdp`` and ``parallel`` hold no
second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, overload

import torch

from ragged._dbuffer import DBuffer, norm
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged.spec._plan import LayoutPlan
from ragged.transforms import _gather, _reduce_scatter, _shard

__all__ = ["LayoutOps", "register_layout", "layout_ops", "shard", "gather", "reduce_scatter", "global_norm"]


class LayoutOps(NamedTuple):
    """What a layout type implements (each takes the layout first, as the verbs do)."""

    shard: Callable  # (layout, params, comm) -> shards
    gather: Callable  # (layout, shards, comm, dtype) -> full tree
    reduce_scatter: Callable  # (layout, grads, comm, op, dtype, **options) -> shards
    global_norm: Callable  # (layout, grads, comm, **options) -> 0-d tensor


_LAYOUTS: dict[type, LayoutOps] = {}


def register_layout(cls: type, ops: LayoutOps) -> None:
    """Makes the verbs accept ``cls`` layouts (see [Note: one verb, any layout])."""
    _LAYOUTS[cls] = ops


def layout_ops(layout, verb: str) -> LayoutOps:
    for cls in type(layout).__mro__:
        ops = _LAYOUTS.get(cls)
        if ops is not None:
            return ops
    raise RaggedTypeError(
        f"{verb}: the layout must be a LayoutPlan (rg.make_plan), fsdp.Units (rg.fsdp.make_units) or "
        f"spec.MeshPlan (rg.spec.make_mesh_plan), got {type(layout).__name__}."
        + (f" A DBuffer carries its plan: {verb}(dbuf.plan, ...)." if isinstance(layout, DBuffer) else "")
    )


def shard(layout, params, comm=None, *, rank: int | None = None):
    """This rank's shards of ``params`` (the full tensors, equal on every rank) under ``layout``.

    See [Note: one verb, any layout]. For a plan, :func:`ragged.transforms._shard.shard`
    (``rank=`` instead of ``comm`` shards without communicating); for units, one DBuffer per
    unit; for a mesh plan, the FSDP shard of this rank's parts (see ``ragged.parallel``).

    Args:
        layout: a ``LayoutPlan``, ``fsdp.Units`` or ``spec.MeshPlan``.
        params: a pytree like the one the layout was planned from (for units also the module
            or its state dict).
        comm: the layout's comm (a ``Collectives``; a ``MeshComm`` for a mesh plan).
        rank: this rank's index, only for a ``LayoutPlan`` without ``comm``.

    Returns:
        A :class:`~ragged.DBuffer` (plan, mesh plan) or ``{unit name: DBuffer}`` (units).

    Raises:
        RaggedTypeError: ``layout`` is none of the three.
        LayoutError, RaggedTypeError: params do not match the layout (the message names the key path).
        PlanMismatchError: ranks hold different layouts.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp, spec
        >>> params = {"w": torch.arange(12.0).reshape(6, 2), "b": torch.ones(2)}
        >>> plan = rg.make_plan(params, world_size=2, align=1)
        >>> rg.shard(plan, params, rank=1).views()["w"].tolist()
        [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
        >>> units = fsdp.make_units(params, world_size=2, groups=lambda path: path)
        >>> sorted(rg.collectives.simulate(2, lambda comm: rg.shard(units, params, comm))[0])
        ["['b']", "['w']"]
        >>> mplan = spec.make_mesh_plan(params, {"w": spec.Shard(0), "b": None}, mesh=spec.Mesh((1, 2), ("dp", "tp")))
        >>> [d.views()["w"].shape for d in rg.parallel.simulate_mesh(mplan.mesh, lambda mc: rg.shard(mplan, params, mc))]
        [torch.Size([3, 2]), torch.Size([3, 2])]
    """
    if isinstance(layout, LayoutPlan):
        return _shard.shard(layout, params, comm, rank=rank)
    ops = layout_ops(layout, "shard")
    if rank is not None:
        raise RaggedTypeError(f"shard: rank= is for a LayoutPlan without a comm; a {type(layout).__name__} needs its comm.")
    return ops.shard(layout, params, comm)


@overload
def gather(dbuf: DBuffer, comm, /, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
           format=None): ...


@overload
def gather(layout, shards, comm, /, *, dtype: torch.dtype | None = None): ...


def gather(*args, dtype: torch.dtype | None = None, out: torch.Tensor | None = None, format=None):
    """The full parameters from this rank's shards: ``gather(dbuf, comm, *, dtype=None,
    out=None)`` (a :class:`~ragged.DBuffer` carries its plan: the public contract's form) or
    ``gather(layout, shards, comm, *, dtype=None)`` (any layout, see [Note: one verb, any
    layout]), the two call shapes told apart by the type of the first argument alone.

    For a plan: :func:`ragged.transforms._gather.gather` (differentiable, views into one
    gathered buffer; ``out=`` reuses that buffer). For units: the model's whole tree, not
    differentiable. For a mesh plan: this rank's parts, gathered over the plan's FSDP axis only
    (differentiable).

    Args:
        dbuf: this rank's shard of a plan (first form).
        layout: a ``LayoutPlan``, ``fsdp.Units`` or ``spec.MeshPlan`` (second form).
        shards: what :func:`shard` returned for ``layout``.
        comm: the layout's comm.
        dtype: compute dtype (the shard is cast, then gathered); keyword-only.
        out: a flat ``plan.buffer_numel`` buffer to gather into (the DBuffer form only).
        format: quantize on the wire (a plan's DBuffer only): a ``rg.quant`` format or a
            callable ``LeafLayout -> format | None``; see :func:`ragged.transforms._gather.gather`.

    Raises:
        RaggedTypeError: another number of positional arguments than the form takes (a
            dtype passed positionally, say), or a first argument that is neither a DBuffer
            nor a layout.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
        >>> plan = rg.make_plan(params, world_size=2)
        >>> def step(comm):
        ...     d = rg.shard(plan, params, comm)
        ...     a, b = rg.gather(d, comm), rg.gather(plan, d, comm, dtype=torch.float64)
        ...     return all(torch.equal(a[k], params[k]) and torch.equal(b[k], params[k].double()) for k in params)
        >>> rg.collectives.simulate(2, step)
        [True, True]
    """
    if args and isinstance(args[0], DBuffer):
        if len(args) != 2:
            raise RaggedTypeError(
                f"gather: the first argument is a DBuffer, so the call is gather(dbuf, comm, *, dtype=None, out=None) "
                f"(two positional arguments), got {len(args)}. With a layout first it is gather(layout, shards, comm); "
                "pass a dtype as dtype=."
            )
        dbuf, comm = args
        return _gather.gather(dbuf, comm, dtype=dtype, out=out, format=format)
    if len(args) != 3:
        raise RaggedTypeError(
            f"gather: the call is gather(layout, shards, comm, *, dtype=None) (three positional arguments) or "
            f"gather(dbuf, comm, *, dtype=None) with a DBuffer first; got {len(args)} positional argument(s)"
            + (f", the first a {type(args[0]).__name__}." if args else ".")
        )
    layout, shards, comm = args
    if isinstance(layout, LayoutPlan):
        if not isinstance(shards, DBuffer):
            raise RaggedTypeError(f"gather(plan, shards, comm): shards must be the plan's DBuffer, got {type(shards).__name__}.")
        if shards.plan != layout:
            raise RaggedValueError(
                f"gather: the DBuffer is of {shards.plan!r}, not of the plan given ({layout!r}). Fix: pass the plan "
                "the DBuffer was sharded with (or just gather(dbuf, comm))."
            )
        return _gather.gather(shards, comm, dtype=dtype, out=out, format=format)
    ops = layout_ops(layout, "gather")
    for name, value in (("out", out), ("format", format)):
        if value is not None:
            raise RaggedTypeError(f"gather: {name}= is for one DBuffer of a LayoutPlan, not for a {type(layout).__name__}.")
    return ops.gather(layout, shards, comm, dtype)


def reduce_scatter(layout, grads, comm, *, op: str = "mean", dtype: torch.dtype | None = None, **options):
    """This rank's shards of the reduction over every rank of every rank's ``grads``.

    For a plan: :func:`ragged.transforms._reduce_scatter.reduce_scatter` (options
    ``replicated=``, ``out=``); for units: ``{unit name: DBuffer}`` from the model's whole
    gradient tree; for a mesh plan: over the FSDP axis, then over ``data_axes=`` (see
    ``ragged.parallel``). One call shape: the layout first (a DBuffer is not a layout).

    Args:
        layout: a ``LayoutPlan``, ``fsdp.Units`` or ``spec.MeshPlan``.
        grads: full-shape gradients shaped like the params (for a plan also one flat tensor).
        comm: the layout's comm.
        op: ``"mean"`` or ``"sum"`` (keyword-only).
        dtype: reduce dtype; the result is in the plan's dtype (keyword-only).
        **options: the layout's own options.

    Raises:
        RaggedTypeError: ``layout`` is not a layout.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> params = {"a": torch.zeros(4, 2), "b": torch.zeros(2)}
        >>> units = fsdp.make_units(params, world_size=2, groups=lambda path: path)
        >>> def step(comm):
        ...     g = {k: torch.full(v.shape, comm.rank + 1.0) for k, v in params.items()}
        ...     return {u: d.data.tolist() for u, d in rg.reduce_scatter(units, g, comm, op="sum").items()}
        >>> rg.collectives.simulate(2, step)[0]
        {"['a']": [3.0, 3.0, 3.0, 3.0], "['b']": [3.0, 3.0, 0.0, 0.0]}
    """
    if isinstance(layout, LayoutPlan):
        return _reduce_scatter.reduce_scatter(layout, grads, comm, op=op, dtype=dtype, **options)
    return layout_ops(layout, "reduce_scatter").reduce_scatter(layout, grads, comm, op, dtype, **options)


def _plan_global_norm(plan: LayoutPlan, grads, comm) -> torch.Tensor:
    if not isinstance(grads, DBuffer) or grads.plan != plan:
        raise RaggedTypeError(
            f"global_norm(plan, grads, comm): grads must be a DBuffer of the plan, got {type(grads).__name__}"
            + (" of another plan." if isinstance(grads, DBuffer) else ".")
        )
    return norm([grads], comm)


def global_norm(layout, grads, comm, **options) -> torch.Tensor:
    """The L2 norm of the whole model that this rank's ``grads`` (shards under ``layout``) are
    part of, equal on every rank (float64).

    Each element counts once: padding is zero, replicated leaves are counted once, and copies
    over other axes are weighted out (units: ``data_groups=``, the step's; a mesh plan: every
    non-FSDP axis). For ``rg.optim.clip_by_global_norm(max_norm, comm=comm, norm=lambda g:
    rg.global_norm(layout, g, comm))``. (:func:`ragged.optim.tree_norm` is the layout-free
    norm of a tree over one comm.)

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(2, 2)}, world_size=2, align=1)
        >>> w = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
        >>> rg.collectives.simulate(2, lambda c: float(rg.global_norm(plan, rg.shard(plan, {"w": w}, c), c)))
        [5.0, 5.0]
    """
    if isinstance(layout, LayoutPlan):
        if options:
            raise RaggedTypeError(f"global_norm: a LayoutPlan takes no options, got {sorted(options)}.")
        return _plan_global_norm(layout, grads, comm)
    return layout_ops(layout, "global_norm").global_norm(layout, grads, comm, **options)
