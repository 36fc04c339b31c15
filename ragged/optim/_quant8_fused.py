"""The fused 8-bit AdamW update of one chunk of whole blocks, in place in a few scratch tensors.

[Note: one chunk, no allocation]
One step of a chunk (a run of whole blocks of one quantized piece, see ``chunks`` in
``_quant8_state.py``) decodes both moments, runs Adam in float32, writes the update, takes each
block's new absmax and encodes both moments (the formula: [Note: one update] in
``_quant8.py``). It is about 35 torch ops over the chunk, every one writing into a scratch tensor
of the step's :class:`~ragged.optim._quant8_codec.Workspace` or into the result itself (``out=``
and in-place ops): no allocation per op, so nothing is paged in per step and a chunk's
temporaries stay in the cache while the next op reads them. The scale of each block is
broadcast, not expanded (``mul_blocks``); a moment decodes with one table lookup and encodes with
one lookup and a few integer ops on the float's bits ([Note: the nearest code from the float's
bits]).

Every op rounds once, in float32, in the formula's order, so the state never depends on where
an element sits in the buffer or on the world size. Never ``lerp``, ``addcmul`` or
``add(alpha=)``: their vectorised and scalar-tail paths may differ by an FMA. ``x + s * t`` is
one ``addcdiv(x, t, 1, value=s)`` on the CPU (``x + (s * t) / 1``: a division and an addition
never fuse) and a product then a sum elsewhere (CUDA's ``addcdiv`` is one FMA). The square root
is correctly rounded (:func:`sqrt_into`). ``tests/optim/test_quant8.py`` checks every code,
scale and parameter against the formula written out leaf by leaf.
ragged calls no compiler of its own.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ragged.optim._quant8_codec import Codec, Workspace, absmax_into, inverse, mul_blocks

__all__ = ["Scalars", "adam_into", "add_scaled", "sqrt_into", "chunk_update"]

# hp: the step's scalars, one float32 tensor (rounded as torch rounds Python scalars); its indexes
B1, OMB1, B2, OMB2, EPS, BC1, BC2, DECAY, LR = range(9)


_ONE = torch.ones(())


def adam_into(m, v, g, p, hp, u, tmp, *, decay: bool, lr: bool, zero_eps: bool) -> torch.Tensor:
    """The formula of [Note: one update] on fp32 tensors of one shape: ``m`` and ``v`` are
    updated in place, the update is written into ``u`` (which may be ``g``'s memory: ``g`` is
    read before ``u`` is written); ``tmp`` is scratch; ``p`` is read when ``decay``. ``hp``:
    the step's scalars (:class:`Scalars`)."""
    add_scaled(m.mul_(hp[B1]), g, hp, OMB1, tmp)
    add_scaled(v.mul_(hp[B2]), torch.mul(g, g, out=tmp), hp, OMB2, tmp)
    torch.addcdiv(hp[EPS], sqrt_into(v, u), hp[BC2], out=u)  # eps + sqrt(v) / bc2: 1 * q is exact
    torch.div(m, u, out=u).div_(hp[BC1])
    if zero_eps:  # 0 / 0 where v and m are 0
        u.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
    if decay:
        add_scaled(u, p, hp, DECAY, tmp)
    if lr:
        u.mul_(hp[LR])
    return u


class Scalars(tuple):
    """The step's scalars as 0-dim float32 tensors (indexed by ``B1`` ... ``LR``), and the same
    values as Python floats (``.floats``)."""

    def __new__(cls, hp: torch.Tensor):
        out = super().__new__(cls, hp.unbind(0))
        out.floats = tuple(hp.tolist())
        return out


def add_scaled(x: torch.Tensor, t: torch.Tensor, hp: Scalars, k: int, tmp: torch.Tensor) -> torch.Tensor:
    """``x += t * hp[k]``, rounded twice (see [Note: one chunk, no allocation])."""
    if x.device.type == "cpu":
        return x.addcdiv_(t, _ONE, value=hp.floats[k])
    return x.add_(torch.mul(t, hp[k], out=tmp))


def sqrt_into(v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = the correctly rounded float32 square root of ``v`` (contiguous fp32). torch's
    own float32 root on the CPU is MKL's, within an ulp (off by one in ~15% of the values), so
    the CPU takes numpy's (the processor's instruction, correctly rounded) and every other
    device, or a graph being compiled, the float64 root rounded to float32 (the same value:
    the float64 root is within an ulp of float64, and no float32 root lies that close to a
    float32 rounding boundary)."""
    if v.device.type == "cpu" and not torch.compiler.is_compiling():
        np.sqrt(v.numpy(), out=out.numpy())
        return out
    return out.copy_(torch.sqrt(v.double()))


def chunk_update(c, g, p, out, codes, scales, new_codes, new_scales, hp, cm: Codec, cv: Codec, ws: Workspace, *,
                 decay: bool, lr: bool, zero_eps: bool) -> None:
    """One chunk's step (see [Note: one chunk, no allocation]).

    Args:
        c: the chunk (a ``QPiece``: offsets into the shard and the compact arrays, rows, cols, block).
        g, p, out: the whole shard's fp32 gradient, params (read when ``decay``) and update (written).
        codes, scales: ``(mu, nu)`` uint8 codes and fp32 absmax per block, compact (read).
        new_codes, new_scales: the same, written (may be ``codes`` / ``scales``: each chunk's are
            read before they are written).
        hp: the step's scalars (see :func:`adam_into`).
        cm, cv: the codecs of the two moments.
        ws: scratch for at least ``c.numel`` elements.
    """
    n, shape, block = c.numel, (c.rows, c.cols), (c.br, c.bc)
    grid = (c.bands, c.tiles)
    w = ws.take(n)
    el = lambda t: t[c.local_offset : c.local_offset + n].view(shape)  # noqa: E731
    code = lambda t: t[c.code_offset : c.code_offset + n]  # noqa: E731
    scale = lambda t: t[c.scale_offset : c.scale_offset + c.num_blocks].view(grid)  # noqa: E731
    m, v = w.a.view(shape), w.b.view(shape)
    for x, cd, k in ((m, cm, 0), (v, cv, 1)):
        cd.decode_into(code(codes[k]), x.view(-1), w.idx)
        mul_blocks(x, scale(scales[k]), block, out=x)
    adam_into(m, v, el(g), None if p is None else el(p), hp, el(out), w.c.view(shape), decay=decay, lr=lr,
              zero_eps=zero_eps)
    normed = w.c.view(shape)
    absmax_into(torch.abs(m, out=normed), scale(new_scales[0]), block)
    cm.encode_into(mul_blocks(m, inverse(scale(new_scales[0])), block, out=normed).view(-1), code(new_codes[0]), w)
    absmax_into(v, scale(new_scales[1]), block)  # v >= 0
    cv.encode_into(mul_blocks(v, inverse(scale(new_scales[1])), block, out=normed).view(-1), code(new_codes[1]), w)
