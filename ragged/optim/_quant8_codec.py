"""Block-wise 8-bit quantization: the dynamic maps, their codes, and blocks of a 2-D tensor.

[Note: dynamic quantization maps]
Both Adam moments are stored as 8-bit codes into a 256-entry (255 used for the signed map) table
of values in [-1, 1], times one fp32 absmax per block, as in dynamic tree quantization (Dettmers,
"8-bit approximations for parallelism in deep learning", 2016; "8-bit optimizers via block-wise
quantization", 2022). A code is read as: (sign bit,) then ``e`` zero bits, a 1 bit, and the
remaining ``f`` bits a linear fraction; it stands for ``10^-e * (0.1 + 0.9 * (k + 1) / 2^f)``.
So large exponents trade fraction bits for range: values from 1e-6 (signed) or 1e-7 (unsigned)
up to exactly 1.0 (the absmax element of a block is represented exactly). The all-zero code is
0. The first moment uses the signed map (7 non-sign bits), the second moment, which is never
negative, the unsigned one (all 8 bits).

[Note: the nearest code from the float's bits]
A block is normalised by multiplying with the reciprocal of its absmax (one division per
block; the absmax element becomes 1.0 or the float just below it, whose nearest code is 1.0).
The code of a normalised value ``x`` is ``z + sign(x) * n(|x|)``, where ``z`` is the code of 0
and ``n(a)`` counts the positive midpoints between neighbouring table values that lie below
``a`` (the map is symmetric, so this is the nearest value; a tie goes to the smaller magnitude).
Read as an int32, the float32 pattern of ``x >= 0`` is monotone in ``x``; flipping every bit of
a negative ``x`` (``bits ^ (bits >> 31)``) makes it monotone over [-1, 1] (and non-negative), so
the code is a non-decreasing step function ``F`` of that key ``y``, one step per midpoint. Split
``y`` into its top 15 bits (the key) and its low 16 bits: no key's interval holds two steps
(checked when the table is built), so ``F(y)`` is ``F`` at the interval's start plus 1 where the
low bits pass the one step ``t`` inside it. One int32 per key,
``(F(key << 16) << 16) + (2^16 - 1 - t) - (key << 16)`` (``t = 2^16 - 1`` where the interval holds
no step), turns that into

    code = (y + lookup[y >> 16]) >> 16

since ``y - (key << 16)`` is the low part and it carries into bit 16 exactly when it exceeds
``t``. Every key from 0 to ``2^15 - 1`` has an entry, so nothing is clamped and no pattern
indexes outside the table. The second moment is never negative: its key is ``|x|``'s pattern.
``|x|`` reaches 2 only in a block whose absmax is infinite or NaN, where ``inf * 0`` makes NaN
and every value decodes to inf or NaN whatever its code; there the code is what the table says
(a NaN gets the code of 0 in the first moment and of 1.0 in the second).
``tests/optim/test_quant8.py`` compares the codes with the count of midpoints below ``|x|`` at
both ends of every interval and on both sides of every midpoint (within an interval the code is
non-decreasing in ``y``, so that covers every pattern with ``|x| < 2``; enumerating all 2^32
patterns once agreed too), and that count with the nearest table value.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["dynamic_map", "Codec", "codec", "Workspace", "blocks_of", "absmax_into", "abs_blocks", "mul_blocks",
           "inverse"]

_KEYS = 1 << 15  # every non-negative int32's top 15 bits
_FLIP = 0x7FFFFFFF  # y = _FLIP - |x|'s pattern for a negative x
_NEGATIVE = 0x40000000  # the keys of negative x (|x| < 2) start here (the signed map)


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
    return torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)


class Workspace:
    """Scratch tensors of one step, reused chunk after chunk (no allocation inside the loop):
    three fp32 (``a``, ``b``, ``c``), the lookup index and an accumulator (both int32: a CPU
    gathers from an int32 table by an int32 index faster than by int64).

    Examples:
        >>> ws = Workspace(8, "cpu")
        >>> ws.c.shape, ws.idx.dtype
        (torch.Size([8]), torch.int32)
    """

    def __init__(self, numel: int, device):
        f32 = dict(dtype=torch.float32, device=device)
        self.a, self.b, self.c = (torch.empty(numel, **f32) for _ in range(3))
        self.idx = torch.empty(numel, dtype=torch.int32, device=device)
        self.acc = torch.empty(numel, dtype=torch.int32, device=device)
        self.views: dict = {}  # chunk shape -> views of the above (see _quant8_fused.chunk_update)


class Codec:
    """Codes of one dynamic map, and the tables that encode and decode them.

    Build it with :func:`codec` (cached per map and device).

    Attributes:
        signed: which map.
        table: fp32 ``[256]``: the value of each code (the signed map's unused code 255 reads 1.0).
        zero: the code of 0.
        lookup: int32 ``[2^15]``: the encoder's entry per key (see [Note: the nearest code from
            the float's bits]).
    """

    def __init__(self, signed: bool, device):
        values = dynamic_map(signed)
        self.signed = signed
        self.zero = int((values == 0).nonzero()[0, 0])
        pos = values[self.zero :].double()  # 0, then the positive values ascending
        mids = ((pos[:-1] + pos[1:]) / 2).to(torch.float32).view(torch.int32).long()  # positive midpoints
        # where the code rises by one along y: just above each midpoint, and (signed) where a
        # negative |x| falls to a midpoint (y = _FLIP - |x|'s pattern)
        steps = mids + 1 if not signed else torch.cat([mids + 1, _FLIP - mids]).sort().values
        starts = torch.arange(_KEYS, dtype=torch.int64) << 16
        after = torch.searchsorted(steps, starts, right=True)  # the first step past each start
        inside = torch.searchsorted(steps, starts + (1 << 16), right=False) - after
        if int(inside.max()) > 1:
            raise AssertionError("quantization map too fine for a 15-bit key")
        t = torch.where(inside > 0, (steps[after.clamp(max=len(steps) - 1)] - 1) & 0xFFFF, torch.tensor(0xFFFF))
        self.lookup = ((self.code_of_key(starts, mids) << 16) + (0xFFFF - t) - starts).to(torch.int32).to(device)
        table = torch.cat([values, values[-1:]]) if len(values) == 255 else values
        self.table = table.to(device)
        self._table_bits = self.table.view(torch.int32)  # decode gathers bit patterns

    def code_of_key(self, y: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
        """The code of each key ``y`` (int64) by its definition: ``z`` plus or minus the count of
        ``mids`` (the positive midpoints' patterns) below the magnitude's pattern."""
        if not self.signed:
            return torch.searchsorted(mids, y, right=False)
        neg = y >= _NEGATIVE
        n = torch.searchsorted(mids, torch.where(neg, _FLIP - y, y), right=False)
        return torch.where(neg, self.zero - n, self.zero + n)

    def decode_into(self, codes: torch.Tensor, out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``out`` (fp32) = the table values of ``codes`` (uint8, flat; ``idx``: int32 scratch)."""
        torch.index_select(self._table_bits, 0, idx.copy_(codes), out=out.view(torch.int32))
        return out

    def encode_into(self, y: torch.Tensor, out: torch.Tensor, idx: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """``out`` (uint8, flat) = the codes of the normalised values whose float32 patterns are
        ``y`` (int32, contiguous; overwritten with their keys), as in [Note: the nearest code
        from the float's bits]. ``idx`` and ``acc`` (int32): scratch of ``out``'s size."""
        if self.signed:
            y.bitwise_xor_(torch.bitwise_right_shift(y, 31, out=acc))
        else:
            y.bitwise_and_(0x7FFFFFFF)  # |x|
        torch.index_select(self.lookup, 0, torch.bitwise_right_shift(y, 16, out=idx), out=acc)
        return out.copy_(acc.add_(y).bitwise_right_shift_(16))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 table values of ``codes`` (uint8, any shape): the normalised values."""
        return self.table.index_select(0, codes.reshape(-1).long()).view(codes.shape)

    def encode(self, x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
        """uint8 codes of ``x * inv_scale`` (broadcast; ``inv_scale`` positive: the reciprocal
        of each element's block absmax, so that the product lies in [-1, 1])."""
        normed = (x.to(torch.float32) * inv_scale).contiguous()
        out = torch.empty(normed.shape, dtype=torch.uint8, device=normed.device)
        ws = Workspace(normed.numel(), normed.device)
        self.encode_into(normed.view(-1).view(torch.int32), out.view(-1), ws.idx, ws.acc)
        return out

    def encode_blocks(self, x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantizes a 2-D fp32 ``(rows, cols)`` tensor in ``block = (r, c)`` tiles (the last
        band / tile shorter where ``r`` / ``c`` does not divide).

        Returns:
            ``(codes, absmax)``: uint8 codes of every element (``rows * cols``, row-major) and fp32
            absmax per tile (band-major: ``ceil(rows / r) * ceil(cols / c)``).

        Examples:
            >>> import torch
            >>> from ragged.optim._quant8_codec import codec
            >>> x = torch.tensor([[0.5, -1.0, 0.0, 2.0, 0.25]])
            >>> codes, absmax = codec(True, "cpu").encode_blocks(x, (1, 3))  # blocks of 3, then 2
            >>> absmax.tolist()
            [1.0, 2.0]
            >>> y = codec(True, "cpu").decode_blocks(codes, absmax, x.shape, (1, 3))
            >>> [round(v, 4) for v in y[0].tolist()]  # each block's absmax exact, the rest to the nearest code
            [0.4938, -1.0, 0.0, 2.0, 0.2562]
        """
        x = x.to(torch.float32).contiguous()
        ws = Workspace(x.numel(), x.device)
        grid = torch.empty(grid_of(x.shape, block), dtype=torch.float32, device=x.device)
        a = blocks_of(ws.a.view(x.shape), block)
        absmax_into(abs_blocks(blocks_of(x, block), a), grid)
        mul_blocks(blocks_of(x, block), inverse(grid), a)
        codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
        return self.encode_into(ws.a.view(torch.int32), codes, ws.idx, ws.acc), grid.reshape(-1)

    def decode_blocks(self, codes: torch.Tensor, absmax: torch.Tensor, shape, block: tuple[int, int]) -> torch.Tensor:
        """fp32 ``shape = (rows, cols)`` values of :meth:`encode_blocks`' output."""
        x = self.decode(codes).view(shape)
        parts = blocks_of(x, block)
        mul_blocks(parts, absmax.view(grid_of(shape, block)), parts)
        return x


def grid_of(shape, block) -> tuple[int, int]:
    """``(bands, tiles)``: the blocks of a ``shape = (rows, cols)`` tensor along each dim."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


@functools.lru_cache(maxsize=4096)
def _rects(rows: int, cols: int, r: int, c: int) -> tuple:
    """The rectangles of whole-height / whole-width blocks of a ``(rows, cols)`` tensor, each
    ``(row slice, col slice, (bands, h, tiles, w), band slice, tile slice)``; one rectangle
    with ``None`` slices when ``r`` and ``c`` divide (the whole tensor, no slicing)."""
    if rows % r == 0 and cols % c == 0:
        return ((None, None, (rows // r, r, cols // c, c), None, None),)

    def parts(n, b):
        whole, rest = divmod(n, b)
        out = [(0, whole * b, 0, whole, b)] if whole else []
        return out + ([(whole * b, n, whole, whole + 1, rest)] if rest else [])

    return tuple((slice(r0, r1), slice(c0, c1), (b1 - b0, h, t1 - t0, w), slice(b0, b1), slice(t0, t1))
                 for r0, r1, b0, b1, h in parts(rows, r) for c0, c1, t0, t1, w in parts(cols, c))


def blocks_of(x: torch.Tensor, block) -> list[tuple[torch.Tensor, tuple]]:
    """``x`` (rows, cols) as views ``(bands, h, tiles, w)`` of whole blocks (up to four: the
    main part, the short last band, the narrow last tile, their corner), each with its slices
    of the ``(bands, tiles)`` grid (``None``: all of it)."""
    return [(x.view(shape) if rs is None else x[rs, cs].view(shape), (bs, ts))
            for rs, cs, shape, bs, ts in _rects(x.shape[0], x.shape[1], block[0], block[1])]


def mul_blocks(parts: list, per_block: torch.Tensor, out: list) -> None:
    """``out = parts * per_block``, broadcast over each block (``parts``, ``out``:
    :func:`blocks_of` of two tensors of one shape, possibly the same; ``per_block``:
    ``(bands, tiles)``)."""
    for (xv, (bs, ts)), (ov, _) in zip(parts, out):
        grid = per_block if bs is None else per_block[bs, ts]
        torch.mul(xv, grid.view(grid.shape[0], 1, grid.shape[1], 1), out=ov)


def abs_blocks(parts: list, out: list) -> list:
    """``out = |parts|`` (:func:`blocks_of` lists); returns ``out``."""
    for (xv, _), (ov, _) in zip(parts, out):
        torch.abs(xv, out=ov)
    return out


def absmax_into(parts: list, grid: torch.Tensor) -> torch.Tensor:
    """``grid`` (``(bands, tiles)``) = the max per block of the non-negative ``parts``
    (:func:`blocks_of`)."""
    for view, (bs, ts) in parts:  # rows first: an element-wise max of whole rows
        rows_max = view[:, 0] if view.shape[1] == 1 else torch.amax(view, dim=1)
        torch.amax(rows_max, dim=2, out=grid if bs is None else grid[bs, ts])
    return grid


def inverse(absmax: torch.Tensor) -> torch.Tensor:
    """``1 / absmax`` per block, 1 where the absmax is 0 (an all-zero block)."""
    return torch.where(absmax > 0, absmax, 1.0).reciprocal_()


@functools.lru_cache(maxsize=None)
def _cached(signed: bool, device: str) -> Codec:
    return Codec(signed, torch.device(device))


def codec(signed: bool, device) -> Codec:
    """The :class:`Codec` of the signed or unsigned map on ``device`` (built once per process)."""
    return _cached(signed, str(torch.device(device)))
