"""`gather` / `gather_start` / `gather_wait`: DBuffer -> pytree of full tensors.

[Note: gather is one collective and zero per-leaf work]
The S-element shard (cast once to the compute dtype if asked: an S-element cast, never a full
fp32 copy) is all-gathered into ONE flat buffer of m*S elements; every leaf of the result is a
view of that buffer (``ragged.unflatten``). There is no copy-in (the shard already is the
buffer's rank-k chunk, or for several buffers its chunks back to back) and no copy-out (leaves
are contiguous ranges of the buffer). Several buffers move in one coalesced launch
(:func:`all_gather_flat`, see [Note: one launch per unit, whatever its buffers]).

[Note: gather's backward]
All-gather transposes to reduce-scatter(sum): ``_GatherStart`` is a new-style
``autograd.Function`` (``setup_context``) whose backward reduce-scatters the m*S gradient into
the S-element shard with :func:`reduce_scatter_flat` (all_to_all + local sum on gloo, which,
unlike gloo's ``reduce_scatter_single``, also works under ``torch.func.grad``). Replicated
leaves are returned as views of ``dbuf.replicated``; their backward all-reduces (sums) the
gradient over the shard group, the transpose of replication.

[Note: reusing gather buffers]
Each gather allocates its m*S output. On CPU, glibc serves allocations above its mmap
threshold (dynamic, at most 32 MiB by default) with fresh pages, and the first write to a fresh
page costs a page fault: filling fresh memory runs ~5x slower than warm memory (torch-notes),
which for a 50 MB unit is a large share of a gloo all-gather. ``out=`` lets a caller that
gathers the same unit every step (e.g. a training step) keep one buffer per unit; the
returned leaves then view that buffer, so it must not be reused while an earlier result (or
an autograd graph through it) is still needed. ``bench/collectives.py`` shows both.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, unflatten
from ragged.spec._plan import LayoutPlan
from ragged.transforms._check import check_plan, poisons
from ragged.transforms._flat import _all_gather_flat_start, reduce_scatter_flat
from ragged.transforms._quantized import format_key, formats_of, gather_launcher, quantize_replicated
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["gather", "gather_start", "gather_wait", "GatherPending"]


class GatherPending(NamedTuple):
    """An all-gather in flight (from :func:`gather_start`).

    Attributes:
        buffer: the flat ``m * S`` output tensor (filled once ``handle`` completes).
        replicated: the replicated buffer (views of ``dbuf.replicated`` when no cast).
        handle: the collective's handle.
        plan: the layout.
        source: the S-element tensor being sent (kept alive until the op completes).

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(2, 3)}, world_size=2)
        >>> def fn(comm):
        ...     pending = rg.gather_start(rg.shard(plan, {"w": torch.ones(2, 3)}, comm), comm)
        ...     return pending.buffer.shape == (plan.buffer_numel,), pending.plan == plan
        >>> rg.collectives.simulate(2, fn)[0]
        (True, True)
    """

    buffer: torch.Tensor
    replicated: torch.Tensor
    handle: Any
    plan: LayoutPlan
    source: torch.Tensor


class _Box:
    """Carries the handle out of ``_GatherStart.forward`` (a plain object: torch.func maps over
    list arguments, so a list would be copied)."""

    __slots__ = ("handle",)

    def __init__(self):
        self.handle = None


class _GatherStart(torch.autograd.Function):
    """``launch(plan, out, src, comm)`` fills ``out`` (of ``dtype``) from every rank's ``src``:
    the plain all-gather, or the quantized one (see [Note: the quantized all-gather] in
    ``_quantized.py``, whose ``src`` is the master shard); backward is the same either way."""

    @staticmethod
    def forward(src, comm, box, out, plan, launch=_all_gather_flat_start, dtype=None):
        if out is None:
            out = torch.empty(comm.world_size * src.numel(), dtype=dtype or src.dtype, device=src.device)
        box.handle = launch(plan, out, src, comm)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.plan, ctx.src_dtype = inputs[1], inputs[4], inputs[0].dtype

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        grad = grad.contiguous()
        out = torch.empty(grad.numel() // comm.world_size, dtype=grad.dtype, device=grad.device)
        reduce_scatter_flat(ctx.plan, out, grad, comm, op="sum")
        return out.to(ctx.src_dtype), None, None, None, None, None, None


class AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient is summed over ``comm`` backward (replicated leaves
    here, Megatron's ``f`` in ``ragged.parallel``)."""

    @staticmethod
    def forward(x, comm):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        ctx.comm.all_reduce(out.view(-1), op="sum")
        return out, None


def _check_dbuf(dbuf, comm, where):
    if not isinstance(dbuf, DBuffer):
        raise RaggedTypeError(f"{where} takes a DBuffer (from rg.shard / rg.reduce_scatter), got {type(dbuf).__name__}.")
    plan = dbuf.plan
    if plan.world_size != comm.world_size:
        raise RaggedValueError(
            f"{where}: the DBuffer's plan shards over world_size={plan.world_size} but the comm's shard group "
            f"has {comm.world_size} ranks. Fix: use the comm the plan was made for, or rg.redistribute first."
        )
    if dbuf.rank != comm.rank:
        raise RaggedValueError(f"{where}: the DBuffer belongs to rank {dbuf.rank} but comm.rank is {comm.rank}.")
    if dbuf.data.numel() != plan.shard_size or dbuf.data.dim() != 1:
        raise RaggedValueError(
            f"{where}: dbuf.data has shape {tuple(dbuf.data.shape)} but the plan's shard is ({plan.shard_size},)."
        )


def _check_out(out, numel, dtype, device):
    if out is None:
        return None
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.numel() != numel or not out.is_contiguous():
        raise RaggedValueError(
            f"gather: out= must be a contiguous 1-D tensor of plan.buffer_numel = {numel} elements, got "
            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}."
        )
    if out.dtype != dtype or out.device != device:
        raise RaggedValueError(f"gather: out= is {out.dtype} on {out.device}; the gather produces {dtype} on {device}.")
    if out.requires_grad:
        raise RaggedValueError("gather: out= must not require grad (it is overwritten).")
    return out


def _check_cast(have: torch.dtype, dtype) -> None:
    """Refuses a cast that drops information silently: floating to integer or bool, complex to real."""
    if dtype is None or dtype == have:
        return
    if not isinstance(dtype, torch.dtype):
        raise RaggedTypeError(f"gather: dtype must be a torch.dtype, got {type(dtype).__name__}.")
    lossy = (have.is_floating_point and not (dtype.is_floating_point or dtype.is_complex)) or (have.is_complex and not dtype.is_complex)
    if lossy:
        raise RaggedValueError(
            f"gather: dtype={dtype} would cast the {have} shard to {dtype}, dropping every fraction (silently "
            f"wrong values). Fix: gather in a floating dtype (e.g. torch.bfloat16); to gather {dtype} on purpose, "
            f"cast the shard first: rg.gather(dbuf.replace(data=dbuf.data.to({dtype}), "
            f"replicated=dbuf.replicated.to({dtype})), comm)."
        )


@poisons("comm")
def gather_start(dbuf: DBuffer, comm, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                 format=None) -> GatherPending:
    """Starts the all-gather of ``dbuf`` (for prefetch/overlap); finish with :func:`gather_wait`.

    Args:
        dbuf: this rank's shard.
        comm: the shard group's collectives.
        dtype: compute dtype of the result (e.g. ``torch.bfloat16`` from an fp32 master shard:
            only the S-element shard is cast). Default: ``dbuf.data.dtype``.
        out: optional flat ``m * S`` buffer to gather into (reused across steps it saves the
            allocation and first touch of fresh memory, see [Note: reusing gather buffers]).
        format: quantize on the wire (see :func:`gather`).

    Returns:
        A :class:`GatherPending`; ``pending.buffer`` is the flat ``m * S`` output.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.arange(6.0).view(3, 2)}
        >>> plan = rg.make_plan(params, world_size=2)
        >>> def fn(comm):
        ...     pending = rg.gather_start(rg.shard(plan, params, comm), comm, dtype=torch.float64)
        ...     # ... compute that overlaps the all-gather ...
        ...     return rg.gather_wait(pending)["w"].dtype
        >>> rg.collectives.simulate(2, fn)
        [torch.float64, torch.float64]
    """
    _check_dbuf(dbuf, comm, "gather")
    _check_cast(dbuf.data.dtype, dtype)
    dtype = dtype or dbuf.data.dtype
    out = _check_out(out, dbuf.plan.buffer_numel, dtype, dbuf.data.device)  # before any collective
    formats = formats_of(dbuf.plan, format, "gather: format") if format is not None else None
    check_plan(dbuf.plan, comm, f"gather:{dtype}" + ("" if formats is None else f":{format_key(formats)}"))
    rep = dbuf.replicated if dtype == dbuf.replicated.dtype else dbuf.replicated.to(dtype)
    if formats is None:
        src, launch = (dbuf.data if dtype == dbuf.data.dtype else dbuf.data.to(dtype)), _all_gather_flat_start
    else:  # the master shard is quantized; unquantized pieces are cast as they are written
        src, launch = dbuf.data, gather_launcher(dbuf, comm, formats, dtype)
        rep = quantize_replicated(dbuf.plan, formats, rep, dbuf.replicated)
    box = _Box()
    if torch.is_grad_enabled() and (src.requires_grad or rep.requires_grad):
        buffer = _GatherStart.apply(src, comm, box, out, dbuf.plan, launch, dtype)
        if rep.numel():
            rep = AllReduceGrad.apply(rep, comm)
    else:  # nothing to differentiate: skip autograd.Function's per-call overhead (~0.1 ms)
        buffer = _GatherStart.forward(src, comm, box, out, dbuf.plan, launch, dtype)
    return GatherPending(buffer=buffer, replicated=rep, handle=box.handle, plan=dbuf.plan, source=src)


def gather_wait(pending: GatherPending):
    """Completes :func:`gather_start`; returns the same tree as :func:`gather`.

    Args:
        pending: what :func:`gather_start` returned (wait on it once).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(4, 2), "b": torch.randn(2)}
        >>> plan = rg.make_plan(params, world_size=2)
        >>> def fn(comm):
        ...     full = rg.gather_wait(rg.gather_start(rg.shard(plan, params, comm), comm))
        ...     return all(torch.equal(full[k], params[k]) for k in params)
        >>> rg.collectives.simulate(2, fn)
        [True, True]
    """
    pending.handle.wait()
    return unflatten(pending.plan, pending.buffer, pending.replicated if pending.plan.replicated else None)


@poisons("comm")
def gather(dbuf: DBuffer, comm, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None, format=None):
    """The full parameters: a pytree of views into ONE gathered flat buffer.

    See [Note: gather is one collective and zero per-leaf work] and [Note: gather's backward]:
    differentiable w.r.t. ``dbuf.data`` under ``.backward()`` and ``torch.func.grad``. On an
    HSDP mesh that backward sums within the shard group only; reduce the result across
    replicas with ``comm.all_reduce_replicas`` (or use :func:`reduce_scatter` on the full
    gradients, which does both).

    Args:
        dbuf: this rank's shard.
        comm: the shard group's collectives (for HSDP: gathers within the shard group).
        dtype: compute dtype (cast the S-element shard, then gather). Default: the shard's.
        out: optional flat ``m * S`` buffer to gather into (see [Note: reusing gather buffers]).
        format: quantize on the wire: a ``rg.quant`` format (every leaf of two or more
            dimensions), or a callable ``LeafLayout -> format | None`` (per leaf). Each rank
            quantizes the blocks it owns from its shard, codes and scales move in one
            all-gather of bytes, and every gathered leaf it applies to is
            ``rg.quant.dequantize(*rg.quant.quantize(w, fmt), fmt, dtype)`` of the whole tensor,
            at any world size (see [Note: the quantized all-gather] in ``_quantized.py``).
            Backward passes the gradient straight through to the shard. A leaf whose granule
            does not hold whole blocks is refused before any communication.

    Returns:
        A pytree like the params the plan was made from.

    Raises:
        PlanMismatchError: ranks hold different plans (raised on every rank, before gathering).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
        >>> plan = rg.make_plan(params, world_size=2)
        >>> def step(comm):
        ...     full = rg.gather(rg.shard(plan, params, comm), comm)
        ...     return all(torch.equal(full[k], params[k]) for k in params)
        >>> rg.collectives.simulate(2, step)
        [True, True]
    """
    return gather_wait(gather_start(dbuf, comm, dtype=dtype, out=out, format=format))
