"""Block-wise 8-bit Adam over the plan's own blocks.

[Note: blocks are the plan's blocks]
Each quantization block is one block of the layout: an ``r x c`` tile of a leaf planned with
``spec.Blocks(r, c)`` (tiles over the last two dims; the last tile of a row band is narrower
when ``c`` does not divide the row, the last band of a 2-D leaf shorter when ``r`` does not
divide the rows), or a run of ``n`` elements of a leaf planned with ``spec.Elements(n)`` (the
last run of a leaf may be shorter). The planner never lets a rank boundary cut a block, so each
rank quantizes whole blocks of its own shard: no communication, and every block sees exactly the
same values whatever the world size. All arithmetic is element-wise or an exact max, so the
state is bit-identical on every world size for the same gradients.

Which leaves are quantized: floating leaves of at least ``min_size`` elements (default 4096)
planned with ``Blocks(r, c)`` (``r * c >= 32``) or ``Elements(n)`` (``n >= 32``). Every other
leaf -- small ones, ``Rows(n)`` leaves, tiny blocks, and ``Replicate()`` leaves -- keeps fp32
moments (in one compact tensor per buffer). Plans from ``strategy="naive"`` that cut blocks are
rejected.

[Note: dynamic quantization maps]
Both moments are stored as 8-bit codes into a 256-entry (255 used for the signed map) table of
values in [-1, 1], times one fp32 absmax per block, as in dynamic tree quantization (Dettmers,
"8-bit approximations for parallelism in deep learning", 2016; "8-bit optimizers via block-wise
quantization", 2022). A code is read as: (sign bit,) then ``e`` zero bits, a 1 bit, and the
remaining ``f`` bits a linear fraction; it stands for ``10^-e * (0.1 + 0.9 * (k + 1) / 2^f)``.
So large exponents trade fraction bits for range: values from 1e-6 (signed) or 1e-7 (unsigned)
up to exactly 1.0 (the absmax element of a block is represented exactly). The all-zero code is
0. The first moment uses the signed map (7 non-sign bits), the second moment, which is never
negative, the unsigned one (all 8 bits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ragged._dbuffer import DBuffer
from ragged._errors import LayoutError, RaggedTypeError, RaggedValueError
from ragged._pytree import pytree
from ragged.optim._base import GradientTransformation, Schedule, zero_count
from ragged.optim._combine import chain
from ragged.optim._transform import _check_beta, _check_nonneg, add_decayed_weights, scale_by_learning_rate
from ragged.spec import Blocks, Elements, LayoutPlan

__all__ = [
    "dynamic_map",
    "Quant8Moments",
    "ScaleByAdam8bitState",
    "scale_by_adam_8bit",
    "adamw_8bit",
    "adam8bit_leaf_state",
    "state_nbytes",
]

MIN_BLOCK = 32


def dynamic_map(signed: bool) -> torch.Tensor:
    """The sorted table of values of the dynamic tree quantization map (see [Note: dynamic
    quantization maps]); 255 values for ``signed=True``, 256 otherwise.

    Examples:
        >>> from ragged.optim import dynamic_map
        >>> m = dynamic_map(signed=True)
        >>> len(m), m.min().item(), m.max().item(), (m == 0).sum().item()
        (255, -1.0, 1.0, 1)
        >>> u = dynamic_map(signed=False)
        >>> len(u), u.min().item(), u.max().item(), f"{u[1].item():.0e}"
        (256, 0.0, 1.0, '1e-07')
    """
    bits = 7 if signed else 8
    values = [0.0]
    for e in range(bits):  # e leading zeros, then the indicator bit, then f fraction bits
        f = bits - 1 - e
        for k in range(2**f):
            v = 10.0 ** (-e) * (0.1 + 0.9 * (k + 1) / 2**f)
            values.append(v)
            if signed:
                values.append(-v)
    table = torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)
    return table


class Quant8Moments(NamedTuple):
    """8-bit Adam moments of one DBuffer.

    Attributes:
        mu_codes: uint8 codes of the first moment of every quantized element (compact, in
            buffer order).
        nu_codes: uint8 codes of the second moment.
        mu_scales: fp32 absmax per quantized block (buffer order; tiles band-major).
        nu_scales: same for the second moment.
        mu_fp32: fp32 first moment of the other (non-quantized, non-padding) elements.
        nu_fp32: fp32 second moment of those.
        mu_rep: fp32 first moment of the replicated buffer.
        nu_rep: fp32 second moment of the replicated buffer.
    """

    mu_codes: torch.Tensor
    nu_codes: torch.Tensor
    mu_scales: torch.Tensor
    nu_scales: torch.Tensor
    mu_fp32: torch.Tensor
    nu_fp32: torch.Tensor
    mu_rep: torch.Tensor
    nu_rep: torch.Tensor


class ScaleByAdam8bitState(NamedTuple):
    """State of :func:`scale_by_adam_8bit`: step count and one :class:`Quant8Moments` per
    DBuffer of the params tree (same tree structure, DBuffers replaced)."""

    count: torch.Tensor
    moments: Any


@dataclasses.dataclass(frozen=True, slots=True)
class _QPiece:
    path: str
    local_offset: int
    numel: int
    rows: int  # the piece viewed as (rows, cols)
    cols: int
    br: int  # block rows / cols
    bc: int
    code_offset: int
    scale_offset: int

    @property
    def bands(self) -> int:
        return -(-self.rows // self.br)

    @property
    def tiles(self) -> int:
        return -(-self.cols // self.bc)

    @property
    def num_blocks(self) -> int:
        return self.bands * self.tiles


@dataclasses.dataclass(frozen=True, slots=True)
class _Layout:
    qpieces: tuple[_QPiece, ...]
    fp32_pieces: tuple[tuple[str, int, int, int], ...]  # (path, local_offset, numel, compact offset)
    fp32_mask: torch.Tensor  # bool [S]
    num_codes: int
    num_blocks: int
    num_fp32: int


def _block_shape(leaf) -> tuple[int, int] | None:
    """(block rows, block cols) if ``leaf`` is quantized, else None."""
    s = leaf.spec
    if isinstance(s, Elements) and s.n >= MIN_BLOCK:
        return (1, s.n)
    if isinstance(s, Blocks) and len(leaf.shape) >= 2 and s.r * s.c >= MIN_BLOCK:
        return (s.r, s.c)
    return None


def _build_layout(plan: LayoutPlan, rank: int, device, min_size: int) -> _Layout:
    if plan.split_blocks:
        raise LayoutError(
            f"adamw_8bit needs whole blocks on every rank, but this plan (strategy={plan.strategy!r}) "
            f"cuts {plan.split_blocks} block(s) at rank boundaries. Fix: plan with strategy='dp' "
            "or 'exact' (the default), which never cuts a block."
        )
    qpieces, fp32_pieces = [], []
    mask = torch.zeros(plan.shard_size, dtype=torch.bool)
    codes = blocks = nfp = 0
    for piece in plan.local_pieces(rank):
        leaf = piece.leaf
        block = _block_shape(leaf) if leaf.numel >= min_size and leaf.dtype.is_floating_point else None
        if block is None:
            fp32_pieces.append((leaf.path, piece.local_offset, piece.numel, nfp))
            mask[piece.local_offset : piece.local_offset + piece.numel] = True
            nfp += piece.numel
            continue
        br, bc = block
        if br == 1:  # Elements(n): one row of n-element blocks
            if piece.start % bc:
                raise LayoutError(f"params{leaf.path}: piece starts at {piece.start}, inside a block of {bc}.")
            rows, cols = 1, piece.numel
        else:
            C = leaf.shape[-1]
            if piece.start % (br * C):
                raise LayoutError(
                    f"params{leaf.path} (shape {leaf.shape}): rank {rank}'s piece starts at row "
                    f"{piece.start // C}, inside a band of {br} rows."
                )
            rows, cols = piece.numel // C, C
        q = _QPiece(leaf.path, piece.local_offset, piece.numel, rows, cols, br, bc, codes, blocks)
        qpieces.append(q)
        codes += piece.numel
        blocks += q.num_blocks
    return _Layout(tuple(qpieces), tuple(fp32_pieces), mask.to(device), codes, blocks, nfp)


_LAYOUTS: dict = {}
_CODECS: dict = {}  # (signed, device) -> _Codec (its lookup tables are built once per process)


def _layout(dbuf: DBuffer, min_size: int) -> _Layout:
    key = (dbuf.plan, dbuf.rank, dbuf.data.device, min_size)
    hit = _LAYOUTS.get(key)
    if hit is None:
        if len(_LAYOUTS) > 64:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = _build_layout(dbuf.plan, dbuf.rank, dbuf.data.device, min_size)
    return hit


_KEY_SHIFT = 13  # keep 8 exponent + 10 mantissa bits of |x| as the lookup key


class _Codec:
    """Quantize / dequantize (rows, cols) pieces with per-block absmax.

    [Note: exact nearest-code lookup without a search]
    The code of a normalised value ``x`` is ``z + sign(x) * n(|x|)``, where ``z`` is the code
    of 0 and ``n(a)`` counts the positive midpoints between neighbouring table values that are
    below ``a`` (the map is symmetric, so this is the nearest value). ``n`` is read from two
    small tables indexed by the top bits of ``a``'s float32 pattern (monotone in ``a``): the
    count of midpoints below the key's interval, and the one midpoint inside it (the table is
    built so that no interval holds two; checked here). That is a handful of element-wise
    integer ops instead of a binary search per element, and, like everything here, exact and
    independent of where an element sits in the buffer.
    """

    def __init__(self, signed: bool, device):
        table = dynamic_map(signed)
        self.table = table.to(device)
        self.zero = int((table == 0).nonzero()[0, 0])
        pos = table[self.zero :].double()  # 0, then the positive values ascending
        mids = ((pos[:-1] + pos[1:]) / 2).to(torch.float32)  # positive midpoints
        nkeys = (int(torch.tensor(1.0).view(torch.int32)) >> _KEY_SHIFT) + 1
        keys = torch.arange(nkeys, dtype=torch.int64)
        lo = (keys << _KEY_SHIFT).to(torch.int32).view(torch.float32)
        hi = (((keys + 1) << _KEY_SHIFT) - 1).to(torch.int32).view(torch.float32)
        base = torch.searchsorted(mids, lo, right=False)  # midpoints < lo
        inside = torch.searchsorted(mids, hi, right=True) - base  # midpoints in [lo, hi]
        if int(inside.max()) > 1:
            raise AssertionError("quantization map too fine for the lookup key; lower _KEY_SHIFT")
        thr = torch.where(inside > 0, mids[base.clamp(max=len(mids) - 1)], torch.tensor(float("inf")))
        self.max_key = nkeys - 1
        self.base = base.to(torch.int32).to(device)
        self.thr = thr.to(device)

    @staticmethod
    def _pad(x: torch.Tensor, q: _QPiece) -> torch.Tensor:
        pr, pc = q.bands * q.br - q.rows, q.tiles * q.bc - q.cols
        return F.pad(x, (0, pc, 0, pr)) if pr or pc else x

    def _codes(self, normed: torch.Tensor) -> torch.Tensor:
        a = normed.abs()
        key = (a.view(torch.int32) >> _KEY_SHIFT).clamp_(max=self.max_key).reshape(-1)
        n = self.base.index_select(0, key).view(a.shape)
        n += a > self.thr.index_select(0, key).view(a.shape)
        if self.zero:
            n = torch.where(normed < 0, self.zero - n, n + self.zero)
        return n.to(torch.uint8)

    def encode(self, x: torch.Tensor, q: _QPiece) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (rows, cols) fp32 -> (uint8 codes (rows*cols,), fp32 absmax (num_blocks,))."""
        xp = self._pad(x, q).view(q.bands, q.br, q.tiles, q.bc)
        absmax = xp.abs().amax(dim=(1, 3))
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        codes = self._codes(xp / safe[:, None, :, None])
        if xp.data_ptr() != x.data_ptr():  # padded: cut back to the piece
            codes = codes.view(q.bands * q.br, q.tiles * q.bc)[: q.rows, : q.cols]
        return codes.reshape(-1), absmax.reshape(-1)

    def decode(self, codes: torch.Tensor, absmax: torch.Tensor, q: _QPiece) -> torch.Tensor:
        values = self.table.index_select(0, codes.to(torch.int32)).view(q.rows, q.cols)
        if q.rows % q.br == 0 and q.cols % q.bc == 0:
            values.view(q.bands, q.br, q.tiles, q.bc).mul_(absmax.view(q.bands, 1, q.tiles, 1))
            return values
        scale = absmax.view(q.bands, 1, q.tiles, 1).expand(q.bands, q.br, q.tiles, q.bc)
        scale = scale.reshape(q.bands * q.br, q.tiles * q.bc)[: q.rows, : q.cols]
        return values.mul_(scale)


_CHUNK = 1 << 18  # elements quantized at a time: bounds the fp32 / int temporaries of one update


def _chunks(q: _QPiece, limit: int = _CHUNK):
    """``q`` cut into sub-pieces of whole blocks, about ``limit`` elements each.

    Every block is quantized on its own, so the cut changes no code and no scale; it only
    bounds the temporaries (decoded moments, lookup keys) to one chunk instead of one leaf.
    """
    if q.numel <= limit:
        yield q
        return
    if q.rows == 1:  # Elements(n): one row of n-element blocks
        step = max(1, limit // q.bc)
        for t0 in range(0, q.tiles, step):
            c0, c1 = t0 * q.bc, min(q.cols, (t0 + step) * q.bc)
            yield dataclasses.replace(q, local_offset=q.local_offset + c0, numel=c1 - c0, cols=c1 - c0,
                                      code_offset=q.code_offset + c0, scale_offset=q.scale_offset + t0)
        return
    step = max(1, limit // (q.br * q.cols))
    for b0 in range(0, q.bands, step):
        r0, r1 = b0 * q.br, min(q.rows, (b0 + step) * q.br)
        n0, n = r0 * q.cols, (r1 - r0) * q.cols
        yield dataclasses.replace(q, local_offset=q.local_offset + n0, numel=n, rows=r1 - r0,
                                  code_offset=q.code_offset + n0, scale_offset=q.scale_offset + b0 * q.tiles)


def _zero_padding(data: torch.Tensor, dbuf: DBuffer) -> None:
    """Zeroes the elements of this rank's shard that belong to no leaf (the padding)."""
    pos = 0
    for piece in dbuf.plan.local_pieces(dbuf.rank):
        if piece.local_offset > pos:
            data[pos : piece.local_offset].zero_()
        pos = piece.local_offset + piece.numel
    if pos < data.numel():
        data[pos:].zero_()


def _moments_init(dbuf: DBuffer, min_size: int) -> Quant8Moments:
    lay = _layout(dbuf, min_size)
    dev = dbuf.data.device
    f32 = dict(dtype=torch.float32, device=dev)
    zero_rep = torch.zeros(dbuf.replicated.shape, **f32)
    return Quant8Moments(
        mu_codes=torch.full((lay.num_codes,), _ZERO_SIGNED, dtype=torch.uint8, device=dev),
        nu_codes=torch.zeros(lay.num_codes, dtype=torch.uint8, device=dev),
        mu_scales=torch.zeros(lay.num_blocks, **f32),
        nu_scales=torch.zeros(lay.num_blocks, **f32),
        mu_fp32=torch.zeros(lay.num_fp32, **f32),
        nu_fp32=torch.zeros(lay.num_fp32, **f32),
        mu_rep=zero_rep,
        nu_rep=zero_rep.clone(),
    )


_ZERO_SIGNED = int((dynamic_map(True) == 0).nonzero()[0, 0])


def _is_dbuffer(x) -> bool:
    return isinstance(x, DBuffer)


def _is_moments(x) -> bool:
    return isinstance(x, Quant8Moments)


def scale_by_adam_8bit(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, min_size: int = 4096, donate: bool = False
) -> GradientTransformation:
    """Adam's rescaling with block-wise 8-bit moments (see [Note: blocks are the plan's blocks]).

    Each step dequantizes a block's moments, updates them in fp32 exactly as
    :func:`ragged.optim.scale_by_adam` does, computes the update from the fp32 values, then
    re-quantizes them with the block's new absmax.

    Args:
        b1, b2, eps: Adam's hyperparameters.
        min_size: leaves with fewer elements keep fp32 moments.
        donate: reuse the state's buffers (codes, scales, fp32 moments) and write the update
            into the fp32 gradient buffer passed to ``update`` (as
            :func:`ragged.optim.scale_by_adam` does): no shard-sized allocation per step, but
            the caller must not read the old state or the gradients afterwards. Results are
            bit-identical to ``donate=False``.

    The params must be a DBuffer or a pytree of DBuffers.
    """
    _check_beta("b1", b1)
    _check_beta("b2", b2)
    _check_nonneg("eps", eps)
    def codec(signed, device):
        key = (signed, device)
        if key not in _CODECS:
            _CODECS[key] = _Codec(signed, device)
        return _CODECS[key]

    def check(tree, what):
        for leaf in pytree.leaves(tree, is_leaf=_is_dbuffer):
            if not isinstance(leaf, DBuffer):
                raise RaggedTypeError(
                    f"adamw_8bit works on DBuffers (rg.shard output); {what} has a "
                    f"{type(leaf).__name__} leaf. Fix: pass the DBuffer(s), or use rg.optim.adamw."
                )

    def init(params):
        check(params, "params")
        moments = pytree.map(lambda d: _moments_init(d, min_size), params, is_leaf=_is_dbuffer)
        return ScaleByAdam8bitState(count=zero_count(params), moments=moments)

    def update(updates, state, params=None):
        del params
        check(updates, "updates")
        count = state.count + 1
        t = count.to(torch.float64)
        bc1 = (1.0 - b1**t).to(torch.float32)
        bc2_sqrt = torch.sqrt(1.0 - b2**t).to(torch.float32)

        def adam(m, v, g, *, fresh=False):
            # [Note: no fused ops here] only single-rounding ops (mul, add, sqrt, div), never
            # lerp / addcmul / add(alpha=): their vectorised and scalar-tail paths may differ by
            # an FMA, and the state must not depend on where an element sits in the buffer.
            # ``fresh``: m and v are temporaries (dequantized), so update them in place.
            m = m.mul_(b1) if fresh else m * b1
            m.add_(g * (1.0 - b1))
            v = v.mul_(b2) if fresh else v * b2
            gg = g * g
            v.add_(gg.mul_(1.0 - b2))
            u = torch.sqrt(v, out=gg).div_(bc2_sqrt).add_(eps)
            torch.div(m, u, out=u).div_(bc1)
            if eps == 0:
                u.nan_to_num_(nan=0.0)
            return m, v, u

        def one(g: DBuffer, mom: Quant8Moments):
            lay = _layout(g, min_size)
            dev = g.data.device
            cm, cv = codec(True, dev), codec(False, dev)
            gdata = g.data.to(torch.float32)
            in_place = donate and gdata is g.data and not gdata.requires_grad
            if in_place:  # the update overwrites the gradient piece by piece, after reading it
                out = gdata
                _zero_padding(out, g)
                mu_codes, nu_codes, mu_scales, nu_scales = mom.mu_codes, mom.nu_codes, mom.mu_scales, mom.nu_scales
            else:
                out = torch.zeros(g.data.shape, dtype=torch.float32, device=dev)
                mu_codes, nu_codes = torch.empty_like(mom.mu_codes), torch.empty_like(mom.nu_codes)
                mu_scales, nu_scales = torch.empty_like(mom.mu_scales), torch.empty_like(mom.nu_scales)
            for q in (sub for piece in lay.qpieces for sub in _chunks(piece)):
                cs, ce = q.code_offset, q.code_offset + q.numel
                ss, se = q.scale_offset, q.scale_offset + q.num_blocks
                gq = gdata[q.local_offset : q.local_offset + q.numel].view(q.rows, q.cols)
                m = cm.decode(mom.mu_codes[cs:ce], mom.mu_scales[ss:se], q)
                v = cv.decode(mom.nu_codes[cs:ce], mom.nu_scales[ss:se], q)
                m, v, u = adam(m, v, gq, fresh=True)
                out[q.local_offset : q.local_offset + q.numel] = u.reshape(-1)
                mu_codes[cs:ce], mu_scales[ss:se] = cm.encode(m, q)
                nu_codes[cs:ce], nu_scales[ss:se] = cv.encode(v, q)
            mu_fp32, nu_fp32 = mom.mu_fp32, mom.nu_fp32
            if lay.num_fp32:
                mu_fp32, nu_fp32, u = adam(mom.mu_fp32, mom.nu_fp32, gdata[lay.fp32_mask], fresh=in_place)
                out.masked_scatter_(lay.fp32_mask, u)
            mu_rep, nu_rep, u_rep = adam(mom.mu_rep, mom.nu_rep, g.replicated.to(torch.float32), fresh=in_place)
            new = Quant8Moments(mu_codes, nu_codes, mu_scales, nu_scales, mu_fp32, nu_fp32, mu_rep, nu_rep)
            wide = lambda t: torch.promote_types(t.dtype, torch.float32)  # noqa: E731  (bf16 grads: fp32 updates)
            return g.replace(data=out.to(wide(g.data)), replicated=u_rep.to(wide(g.replicated))), new

        flat_g, treedef = pytree.flatten(updates, is_leaf=_is_dbuffer)
        flat_m = pytree.leaves(state.moments, is_leaf=_is_moments)
        for g, m in zip(flat_g, flat_m):
            lay = _layout(g, min_size)
            if m.mu_codes.numel() != lay.num_codes or m.mu_fp32.numel() != lay.num_fp32:
                raise RaggedValueError(
                    f"adamw_8bit: the updates (DBuffer of rank {g.rank}, {g.plan!r}) do not match the 8-bit "
                    f"state ({m.mu_codes.numel()} codes / {m.mu_fp32.numel()} fp32 moments, expected "
                    f"{lay.num_codes} / {lay.num_fp32}). Fix: call opt.init on the DBuffer(s) whose "
                    "gradients you pass to opt.update."
                )
        if len(flat_m) != len(flat_g):
            raise RaggedValueError(f"the 8-bit Adam state holds {len(flat_m)} buffers but the updates hold {len(flat_g)}.")
        results = [one(g, m) for g, m in zip(flat_g, flat_m)]
        new_updates = pytree.unflatten(treedef, [r[0] for r in results])
        moments = pytree.unflatten(pytree.structure(state.moments, is_leaf=_is_moments), [r[1] for r in results])
        return new_updates, ScaleByAdam8bitState(count=count, moments=moments)

    return GradientTransformation(init, update)


def adamw_8bit(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    min_size: int = 4096,
    donate: bool = False,
) -> GradientTransformation:
    """AdamW with block-wise 8-bit moments over the plan's blocks (same contract as
    :func:`ragged.optim.adamw`).

    ``donate=True`` updates the state in place and writes the update into the gradient buffer
    (see :func:`scale_by_adam_8bit`); results are bit-identical.

    About 2 bytes of state per parameter plus 8 bytes per block (e.g. +0.008 B/param for
    ``Blocks(32, 32)``), and fp32 moments for small or non-block leaves (see
    [Note: blocks are the plan's blocks]). The state is bit-identical on every world size.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> from ragged._dbuffer import DBuffer
        >>> params = {"w": torch.randn(64, 128), "b": torch.randn(64)}
        >>> plan = rg.make_plan(params, {"w": spec.Blocks(32, 32), "b": spec.Elements(1)}, world_size=1)
        >>> flat = torch.cat([params[l.path[2]].reshape(-1) for l in plan.leaves])  # b, w (key order)
        >>> local = DBuffer(data=flat, replicated=torch.zeros(0), plan=plan, rank=0)
        >>> opt = rg.optim.adamw_8bit(1e-3, min_size=1024)
        >>> state = opt.init(local)
        >>> updates, state = opt.update(local, state, local)
        >>> state[0].moments.mu_codes.dtype, state[0].moments.mu_scales.numel()  # 2 x 4 tiles
        (torch.uint8, 8)
    """
    return chain(
        scale_by_adam_8bit(b1=b1, b2=b2, eps=eps, min_size=min_size, donate=donate),
        add_decayed_weights(weight_decay, donate=donate),
        scale_by_learning_rate(learning_rate, donate=donate),
    )


def adam8bit_leaf_state(moments: Quant8Moments, dbuf: DBuffer, *, min_size: int = 4096) -> dict[str, dict]:
    """This rank's part of the 8-bit Adam state, per leaf path.

    Returns ``{path: {"mu_codes", "nu_codes", "mu_scales", "nu_scales"}}`` for quantized leaves
    and ``{path: {"mu", "nu"}}`` for fp32 ones. Concatenating one leaf's entries over ranks in
    rank order gives the whole leaf's state (codes in element order, scales band-major), which
    is what the world-size-independence tests compare.
    """
    lay = _layout(dbuf, min_size)
    out: dict[str, dict] = {}
    for q in lay.qpieces:
        cs, ss = q.code_offset, q.scale_offset
        out[q.path] = {
            "mu_codes": moments.mu_codes[cs : cs + q.numel],
            "nu_codes": moments.nu_codes[cs : cs + q.numel],
            "mu_scales": moments.mu_scales[ss : ss + q.num_blocks],
            "nu_scales": moments.nu_scales[ss : ss + q.num_blocks],
        }
    for path, _, n, c in lay.fp32_pieces:
        out[path] = {"mu": moments.mu_fp32[c : c + n], "nu": moments.nu_fp32[c : c + n]}
    for leaf in dbuf.plan.replicated:
        out[leaf.path] = {
            "mu": moments.mu_rep[leaf.offset : leaf.stop],
            "nu": moments.nu_rep[leaf.offset : leaf.stop],
        }
    return out


def state_nbytes(state) -> int:
    """Bytes of every tensor in an optimizer state (step counters included)."""
    return sum(t.numel() * t.element_size() for t in pytree.leaves(state) if isinstance(t, torch.Tensor))
