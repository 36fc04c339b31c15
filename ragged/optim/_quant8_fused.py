"""The fused 8-bit AdamW update of one chunk of whole blocks, in place in a few scratch tensors.

[Note: one chunk, no allocation]
One step of a chunk (a run of whole blocks of one quantized piece, see ``chunks`` in
``_quant8_state.py``) decodes both moments, runs Adam in float32, writes the update, takes each
block's new absmax and encodes both moments (the formula: [Note: one update] in
``_quant8.py``). It is about 35 passes of torch ops over the chunk (and a few ops per block),
each writing into a scratch tensor of the step's
:class:`~ragged.optim._quant8_codec.Workspace` or into the result itself (``out=`` and in-place
ops): no allocation per op, so nothing is paged in per step and a chunk's temporaries stay in
the cache while the next op reads them. The scale of each block is broadcast, not expanded
(``mul_blocks``); a moment decodes with one table lookup and encodes with one lookup and a few
integer ops on the float's bits ([Note: the nearest code from the float's bits]).

Every op rounds once, in float32, in the formula's order, so the state never depends on where
an element sits in the buffer or on the world size. Never ``lerp``, ``addcmul`` or
``add(alpha=)``: their vectorised and scalar-tail paths may differ by an FMA. ``x + s * t`` is
one ``addcdiv(x, t, 1, value=s)`` on the CPU (``x + (s * t) / 1``: a division and an addition
never fuse) and a product then a sum elsewhere (CUDA's ``addcdiv`` is one FMA). The square root
is correctly rounded (:func:`sqrt_into`; the form per device: :func:`root_form`).
``tests/optim/test_quant8.py`` checks every code, scale and parameter against the formula
written out leaf by leaf.
ragged calls no compiler of its own.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ragged.optim._quant8_codec import Codec, Workspace, abs_blocks, absmax_into, blocks_of, inverse, mul_blocks

__all__ = ["Scalars", "adam_into", "add_scaled", "root_form", "sqrt_into", "chunk_update"]

# hp: the step's scalars (Scalars; see [Note: one update] in _quant8.py); its indexes
B1, OMB1, B2, OMB2, EPS, SCALE, DECAY, LR = range(8)


_ONE = torch.ones(())


def adam_into(mb, vb, g, p, hp, u, tmp, *, decay: bool, lr: bool, zero_eps: bool) -> torch.Tensor:
    """The formula of [Note: one update] on fp32 tensors of one shape, from ``mb = m * b1`` and
    ``vb = v * b2`` (updated in place into the new moments); the update is written into ``u``
    (which may be ``g``'s memory: ``g`` is read before ``u`` is written); ``tmp`` is scratch;
    ``p`` is read when ``decay``. ``hp``: the step's scalars (:class:`Scalars`)."""
    m = add_scaled(mb, g, hp, OMB1, tmp)
    v = add_scaled(vb, torch.mul(g, g, out=tmp), hp, OMB2, tmp)
    torch.div(m, sqrt_into(v, u).add_(hp[EPS]), out=u)
    if zero_eps:  # 0 / 0 where v and m are 0
        u.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
    u.mul_(hp[SCALE])
    if decay:
        add_scaled(u, p, hp, DECAY, tmp)
    if lr:
        u.mul_(hp[LR])
    return u


class Scalars(tuple):
    """The step's scalars, indexed by ``B1`` ... ``LR``, each a float32 value: a Python float
    (exactly a float32) where the host knows it (the hyperparameters; the learning rate when it is
    a number), a 0-d float32 tensor on the device where it comes from the step count (``EPS``,
    ``SCALE``; a scheduled ``LR``). Either multiplies alike, in one float32 rounding, on every
    device, and neither costs a host-device copy or a sync (see [Note: one update] in
    ``_quant8.py``).

    Examples:
        >>> import torch
        >>> hp = Scalars.of(0.9, 0.999, 0.1, 1e-3, eps=torch.tensor(1e-8), scale=torch.tensor(3.0))
        >>> hp[B1], hp[OMB1], hp[DECAY], hp[SCALE].dtype
        (0.8999999761581421, 0.10000000149011612, 0.10000000149011612, torch.float32)
    """

    @classmethod
    def of(cls, b1: float, b2: float, decay: float, lr, *, eps: torch.Tensor, scale: torch.Tensor) -> "Scalars":
        """From the float64 values (``lr``: a number or a 0-d tensor), each rounded once to float32."""
        f32 = lambda x: x.to(torch.float32) if isinstance(x, torch.Tensor) else float(np.float32(x))  # noqa: E731
        return cls(f32(x) for x in (b1, 1.0 - b1, b2, 1.0 - b2, eps, scale, decay, lr))

    def to(self, device) -> "Scalars":
        """The device values on ``device``."""
        return Scalars(x.to(device) if isinstance(x, torch.Tensor) else x for x in self)


def _cpu_kernels(t: torch.Tensor) -> bool:
    """Whether ``t``'s ops take the CPU's forms (numpy's root, ``addcdiv``); the other forms give
    the same bits (``tests/optim/test_quant8.py`` runs both on the CPU)."""
    return t.device.type == "cpu"


def add_scaled(x: torch.Tensor, t: torch.Tensor, hp: Scalars, k: int, tmp: torch.Tensor) -> torch.Tensor:
    """``x += t * hp[k]``, rounded twice (see [Note: one chunk, no allocation]); ``hp[k]`` a
    number on the CPU (``OMB1``, ``OMB2``, ``DECAY`` are)."""
    if _cpu_kernels(x):
        return x.addcdiv_(t, _ONE, value=hp[k])
    return x.add_(torch.mul(t, hp[k], out=tmp))


def root_form(t: torch.Tensor) -> str:
    """Which correctly rounded float32 square root :func:`sqrt_into` takes for ``t``: ``"numpy"``
    on the CPU (torch's own float32 root there is MKL's, within an ulp: off by one in ~15% of the
    values; numpy's is the processor's instruction), ``"float32"`` on CUDA (its float32 ``sqrt``
    is IEEE's, correctly rounded: torch is not built with fast math), ``"float64"`` on any other
    device or in a graph being compiled (the float64 root rounded to float32: the same value, as
    the float64 root is within an ulp of float64 and no float32 root lies that close to a float32
    rounding boundary; 16 more bytes per element of the chunk, for the moment).

    Examples:
        >>> import torch
        >>> root_form(torch.ones(2)), root_form(torch.ones(2, device="meta"))
        ('numpy', 'float64')
    """
    if torch.compiler.is_compiling():
        return "float64"
    if _cpu_kernels(t):
        return "numpy"
    return "float32" if t.device.type == "cuda" else "float64"


def sqrt_into(v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = the correctly rounded float32 square root of ``v`` (contiguous fp32; the form:
    :func:`root_form`)."""
    form = root_form(v)
    if form == "numpy":
        np.sqrt(v.numpy(), out=out.numpy())
        return out
    if form == "float32":
        return torch.sqrt(v, out=out)
    return out.copy_(torch.sqrt(v.double()))


def chunk_update(c, g, p, out, codes, decayed, new_codes, new_scales, hp, cm: Codec, cv: Codec, ws: Workspace, *,
                 decay: bool, lr: bool, zero_eps: bool) -> None:
    """One chunk's step (see [Note: one chunk, no allocation]).

    Args:
        c: the chunk (a ``QPiece``: offsets into the shard and the compact arrays, rows, cols, block).
        g, p, out: the whole shard's fp32 gradient, params (read when ``decay``) and update (written).
        codes: ``(mu, nu)`` uint8 codes, compact (read).
        decayed: ``(mu, nu)`` absmax per block times ``b1`` / ``b2``, compact (read).
        new_codes, new_scales: codes and absmax per block, written (``new_codes`` may be
            ``codes``: each chunk's are read before they are written).
        hp: the step's scalars (see :func:`adam_into`).
        cm, cv: the codecs of the two moments.
        ws: scratch for at least ``c.numel`` elements.
    """
    n, grid = c.numel, (c.bands, c.tiles)
    at, codes_at = slice(c.local_offset, c.local_offset + n), slice(c.code_offset, c.code_offset + n)
    scales_at = slice(c.scale_offset, c.scale_offset + c.num_blocks)
    w = _views(ws, c)
    for k, (x, xb, cd) in enumerate(((w.m, w.m_blocks, cm), (w.v, w.v_blocks, cv))):  # m * b1, v * b2
        cd.decode_into(codes[k][codes_at], x, w.idx)
        mul_blocks(xb, decayed[k][scales_at].view(grid), xb)
    adam_into(w.m, w.v, g[at], None if p is None else p[at], hp, out[at], w.normed, decay=decay, lr=lr,
              zero_eps=zero_eps)
    ms, vs = new_scales[0][scales_at].view(grid), new_scales[1][scales_at].view(grid)
    mul_blocks(w.m_blocks, inverse(absmax_into(abs_blocks(w.m_blocks, w.normed_blocks), ms)), w.normed_blocks)
    cm.encode_into(w.bits, new_codes[0][codes_at], w.idx, w.acc)
    mul_blocks(w.v_blocks, inverse(absmax_into(w.v_blocks, vs)), w.normed_blocks)  # v >= 0: no abs
    cv.encode_into(w.bits, new_codes[1][codes_at], w.idx, w.acc)


class _Views(NamedTuple):
    m: torch.Tensor
    v: torch.Tensor
    normed: torch.Tensor
    bits: torch.Tensor  # normed's int32 patterns
    idx: torch.Tensor
    acc: torch.Tensor
    m_blocks: list
    v_blocks: list
    normed_blocks: list


def _views(ws: Workspace, c) -> _Views:
    """The workspace's tensors cut to chunk ``c``'s size and viewed in its blocks (made once per
    chunk shape in a step: most chunks of a buffer share a few shapes)."""
    key = (c.rows, c.cols, c.br, c.bc)
    hit = ws.views.get(key)
    if hit is None:
        n, shape, block = c.numel, (c.rows, c.cols), (c.br, c.bc)
        m, v, normed = ws.a[:n], ws.b[:n], ws.c[:n]
        blocks = [blocks_of(t.view(shape), block) for t in (m, v, normed)]
        hit = ws.views[key] = _Views(m, v, normed, normed.view(torch.int32), ws.idx[:n], ws.acc[:n], *blocks)
    return hit
