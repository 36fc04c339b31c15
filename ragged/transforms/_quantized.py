"""Quantized all-gather and reduce-scatter of a plan: codes and scales on block boundaries, one
collective of bytes per plan (see [Note: one chunk of bytes per rank] in
``ragged/quant/_wire.py``).

[Note: the quantized all-gather]
Each rank quantizes the blocks it owns from its master shard (no communication: it owns whole
blocks, see [Note: which granules hold whole blocks]), writes their codes and scales, and the
values of its unquantized pieces in the compute dtype, into its chunk; ONE all-gather of bytes
moves every chunk; each rank then dequantizes every chunk into the unit's flat compute buffer
(``m * S`` elements, padding zeroed), so the leaves stay zero-copy views of it and every
gathered weight is ``dequantize(*quantize(w, fmt), fmt)`` of the whole tensor, bit for bit, at
any world size. Backward is the plain reduce-scatter of the gradient with respect to those
weights (the straight-through rule: that gradient updates the master).

[Note: the quantized reduce-scatter]
Each rank quantizes its whole gradient (``m * S`` elements) block by block, and sends every
rank ``j`` the chunk of ``j``'s blocks (codes and scales; unquantized pieces as values): ONE
all-to-all of equal chunks. Rank ``j`` dequantizes the chunk from rank 0, then adds rank 1's,
..., rank ``m - 1``'s, in float32 (float64 for a float64 reduce dtype): rank order, whatever
order the bytes arrived in, so the result is deterministic and equal to the rank-order
reference bit for bit.
"""

from __future__ import annotations

import bisect
import hashlib

import torch

from ragged.collectives._base import completed
from ragged.collectives._scratch import SCRATCH
from ragged.collectives._tree import tree_sum
from ragged._dbuffer import local_gaps
from ragged.quant._codec import dequantize_run, e8m0_to_float, float_to_e8m0, quantize_run
from ragged.quant._wire import WireLayout, gaps, leaf_formats, wire_layout

__all__ = ["gather_start", "unit_gather_start", "unit_wire_bytes", "unit_scratch_buffers", "gather_launcher", "reduce_scatter_launch", "quantize_replicated", "formats_of", "format_key"]


class _Decoding:
    """A collective's handle whose ``wait()`` also runs ``finish`` once (the decode), then gives
    the scratch buffers back."""

    __slots__ = ("_handle", "_finish", "_buffers")

    def __init__(self, handle, finish, buffers):
        self._handle, self._finish, self._buffers = handle, finish, buffers

    def wait(self) -> None:
        if self._finish is None:
            return
        if self._handle is not None:
            self._handle.wait()
        finish, self._finish = self._finish, None
        with torch.no_grad():
            finish()
        for b in self._buffers:
            SCRATCH.give(b)

    def is_completed(self) -> bool:
        return self._finish is None or self._handle is None or completed(self._handle)


def _scale_bytes(chunk, seg, count):
    if seg.fmt.scale_nbytes == 4:
        return chunk[seg.scales : seg.scales + 4 * count].view(torch.float32)
    return chunk[seg.scales : seg.scales + count]


def encode(wire: WireLayout, rank: int, source: torch.Tensor, chunk: torch.Tensor, *, global_positions: bool) -> None:
    """``rank``'s pieces of ``source`` (its shard, or with ``global_positions`` a whole flat
    buffer) into ``chunk`` (uint8, ``B`` bytes): codes and scales, or values."""
    for seg in wire.segments(rank):
        pos = seg.global_offset if global_positions else seg.local_offset
        x = source[pos : pos + seg.numel]
        if seg.fmt is None:
            chunk[seg.data : seg.data + seg.numel * seg.dtype.itemsize].view(seg.dtype).copy_(x)
            continue
        codes = chunk[seg.data : seg.data + seg.numel].view(seg.fmt.code_dtype)
        _, scales = quantize_run(x, seg.cols, seg.fmt, codes=codes)
        out = _scale_bytes(chunk, seg, scales.numel())
        out.copy_(scales if seg.fmt.scale_nbytes == 4 else float_to_e8m0(scales))


def _decoded(wire: WireLayout, seg, chunk: torch.Tensor, out=None):
    """A segment's values from ``chunk`` (float32 products for quantized pieces, into ``out``
    when given)."""
    if seg.fmt is None:
        values = chunk[seg.data : seg.data + seg.numel * seg.dtype.itemsize].view(seg.dtype)
        return values if out is None else out.copy_(values)
    codes = chunk[seg.data : seg.data + seg.numel].view(seg.fmt.code_dtype)
    scales = _scale_bytes(chunk, seg, seg.numel // seg.fmt.block_numel)
    if seg.fmt.scale_nbytes == 1:
        scales = e8m0_to_float(scales)
    return dequantize_run(codes, scales, seg.cols, seg.fmt, out=out)


def _chunks(wire: WireLayout, buffer: torch.Tensor):
    B = wire.chunk_nbytes
    return [buffer[k * B : (k + 1) * B] for k in range(wire.plan.world_size)]


def decode_gathered(wire: WireLayout, gathered: torch.Tensor, outputs) -> None:
    """Every rank's chunk of ``gathered`` dequantized into the flat compute buffer; padding
    zeroed. ``outputs``: ``((offset, tensor), ...)`` by offset, global element ``g`` lands in
    ``tensor[g - offset]`` of the last one with ``offset <= g`` (a unit's trainable part and
    its frozen part in another dtype: two typed views of one storage)."""
    starts = [o for o, _ in outputs]

    def target(lo, hi):
        k = bisect.bisect_right(starts, lo) - 1
        offset, out = outputs[k]
        return out[lo - offset : hi - offset]

    for rank, chunk in enumerate(_chunks(wire, gathered)):
        for seg in wire.segments(rank):
            _decoded(wire, seg, chunk, target(seg.global_offset, seg.global_offset + seg.numel))
    for lo, hi in gaps(wire.plan):
        for k, (offset, out) in enumerate(outputs):  # a gap may span the parts' boundary
            end = outputs[k + 1][0] if k + 1 < len(outputs) else hi
            a, b = max(lo, offset), min(hi, end)
            if a < b:
                out[a - offset : b - offset].zero_()


def decode_sum(wire: WireLayout, rank: int, received: torch.Tensor, out: torch.Tensor, *, tree: bool = False) -> None:
    """``out`` (this rank's shard) <- the sum, in rank order, of every rank's chunk for it;
    ``tree=True``: over the chunked step's fixed tree of the ranks instead (see [Note: one tree
    over the chunks] in ``ragged/collectives/_tree.py``), each segment's partial sums held at once."""
    acc_dtype = torch.promote_types(out.dtype, torch.float32)
    acc = out if out.dtype == acc_dtype else torch.empty(out.shape, dtype=acc_dtype, device=out.device)
    segs, chunks = wire.segments(rank), _chunks(wire, received)
    if tree:
        for seg in segs:
            acc[seg.local_offset : seg.local_offset + seg.numel].copy_(
                tree_sum(_decoded(wire, seg, chunk).to(acc_dtype) for chunk in chunks))
        for lo, hi in local_gaps(wire.plan, rank):
            acc[lo:hi].zero_()
    else:
        acc.zero_()
        for chunk in chunks:  # rank 0 first: the order is fixed, not the arrival's
            for seg in segs:
                acc[seg.local_offset : seg.local_offset + seg.numel].add_(_decoded(wire, seg, chunk))
    if acc is not out:
        out.copy_(acc)


def gather_scratch(wire: WireLayout) -> tuple[int, int]:
    """The scratch buffers (bytes) a quantized all-gather holds until its handle is waited: its
    own chunk (``B``) and every rank's (``m * B``)."""
    return wire.chunk_nbytes, wire.nbytes


def reduce_scatter_scratch(wire: WireLayout) -> tuple[int, int]:
    """The scratch buffers (bytes) a quantized reduce-scatter holds until its handle is waited: the
    chunks it sends and the chunks it receives (``m * B`` each)."""
    return wire.nbytes, wire.nbytes


def gather_start(wire: WireLayout, outputs, master: torch.Tensor, comm, *, label=None):
    """Starts the quantized all-gather (see [Note: the quantized all-gather]): encodes this
    rank's chunk from its ``master`` shard, all-gathers the bytes; the returned handle's
    ``wait()`` decodes into ``outputs`` (see :func:`decode_gathered`)."""
    device = master.device
    send, gathered = (SCRATCH.take(n, torch.uint8, device) for n in gather_scratch(wire))
    with torch.no_grad():
        encode(wire, comm.rank, master.detach(), send, global_positions=False)
    kw = {} if label is None else {"label": label}
    handle = comm.all_gather_into(gathered, send, async_op=True, **kw)
    return _Decoding(handle, lambda: decode_gathered(wire, gathered, outputs), (send, gathered))


def gather_launcher(dbuf, comm, formats: tuple, dtype: torch.dtype):
    """``launch(plan, out, master, comm) -> handle`` for ``_GatherStart``: :func:`gather_start`
    into the one flat output ``out``."""
    wire = wire_layout(dbuf.plan, formats, dtype)
    return lambda plan, out, master, comm: gather_start(wire, ((0, out),), master, comm)


def reduce_scatter_launch(plan, flat: torch.Tensor, out: torch.Tensor, comm, formats: tuple, *, label=None,
                          tree: bool = False):
    """Starts the quantized reduce-scatter of the flat gradient ``flat`` (``m * S`` elements, the
    reduce dtype) into ``out`` (``S``); returns a handle whose ``wait()`` sums in rank order (over
    the fixed tree with ``tree=True``, see :func:`decode_sum`)."""
    wire = wire_layout(plan, formats, flat.dtype)
    B, m, device = wire.chunk_nbytes, plan.world_size, flat.device
    send, received = (SCRATCH.take(n, torch.uint8, device) for n in reduce_scatter_scratch(wire))
    with torch.no_grad():
        for dest, chunk in enumerate(_chunks(wire, send)):
            encode(wire, dest, flat, chunk, global_positions=True)
    kw = {} if label is None else {"label": label}
    handle = comm.all_to_all(received, send, [B] * m, [B] * m, async_op=True, **kw)
    return _Decoding(handle, lambda: decode_sum(wire, comm.rank, received, out, tree=tree), (send, received))


def quantize_replicated(plan, formats: tuple, replicated: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``replicated`` (the compute copy of the replicated buffer) with every quantized leaf
    replaced by ``dequantize(quantize(leaf))`` of the ``master`` buffer (no communication; a
    fresh tensor, so gradients pass straight through the copy)."""
    picked = [leaf for leaf in plan.replicated if formats[leaf.index] is not None]
    if not picked:
        return replicated
    out = replicated.clone()
    with torch.no_grad():
        for leaf in picked:
            fmt, cols = formats[leaf.index], leaf.shape[-1] if leaf.shape else 1
            part = master.detach()[leaf.offset : leaf.stop]
            codes, scales = quantize_run(part, cols, fmt)
            dequantize_run(codes, scales, cols, fmt, out=out[leaf.offset : leaf.stop])
    return out


def formats_of(plan, choose, where: str, *, replicated: bool = True) -> tuple | None:
    """:func:`ragged.quant._wire.leaf_formats` (the plan's check before any communication);
    ``None`` when no leaf is quantized: the plain collective then moves the same values, without
    the encode, the decode and the wire scratch (``B + m * B`` for a gather: a second copy of
    what it gathers when every value travels as bytes)."""
    formats = leaf_formats(plan, choose, where=where, replicated=replicated)
    return formats if any(f is not None for f in formats) else None


def format_key(formats: tuple) -> str:
    """A short digest of every leaf's format: part of what the ranks agree on before the
    collective (ranks quantizing differently would move chunks of different layouts)."""
    return hashlib.sha256(repr(formats).encode()).hexdigest()[:12]


def unit_gather_start(layout, record, shard, comm, label):
    """The step's quantized all-gather of one unit (``layout``: its ``UnitLayout``; ``record``:
    its ``UnitRecord``): every leaf in its compute dtype, the trainable part into
    ``record.flat`` and the frozen part into ``record.frozen_flat``."""
    wire = wire_layout(shard.plan, layout.gather_formats, layout.gather_dtypes)
    outputs = ((0, record.flat),) if layout.frozen_plan is None else \
        ((0, record.flat), (layout.grad_numel, record.frozen_flat))
    return gather_start(wire, outputs, shard.data, comm, label=label)


def unit_wires(plan, layout) -> tuple[WireLayout | None, WireLayout | None]:
    """The wire layouts of one unit's quantized all-gather and reduce-scatter (``None`` where that
    collective is not quantized), as the step builds them. ``plan``: the unit's plan; ``layout``:
    its ``UnitLayout``."""
    gather = reduce = None
    if layout.gather_formats is not None:
        gather = wire_layout(plan, layout.gather_formats, layout.gather_dtypes)
    if layout.reduce_formats is not None:
        reduce = wire_layout(layout.grad_plan, layout.reduce_formats, layout.reduce_dtype or layout.grad_plan.dtype)
    return gather, reduce


def unit_wire_bytes(plan, layout) -> tuple[int | None, int | None]:
    """``(all-gather bytes, all-to-all bytes)`` of one unit's quantized collectives (``m * B``
    each, ``None`` where that collective is not quantized): what ``step.lower`` counts."""
    return tuple(None if w is None else w.nbytes for w in unit_wires(plan, layout))


def unit_scratch_buffers(plan, layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The scratch buffers (bytes each) one unit's quantized all-gather and reduce-scatter take
    from the pool while in flight (none where not quantized): what ``step.lower``'s memory
    timeline walks."""
    gather, reduce = unit_wires(plan, layout)
    return (() if gather is None else gather_scratch(gather), () if reduce is None else reduce_scatter_scratch(reduce))
