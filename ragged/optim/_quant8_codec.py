"""Block-wise 8-bit quantization: the dynamic maps and a codec of codes + one absmax per block.

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

[Note: exact nearest-code lookup without a search]
A block is normalised by multiplying with the reciprocal of its absmax (one division per
block; the absmax element becomes 1.0 or the float just below it, whose nearest code is 1.0).
The code of a normalised value ``x`` is ``z + sign(x) * n(|x|)``, where ``z`` is the code of 0
and ``n(a)`` counts the positive midpoints between neighbouring table values that are below
``a`` (the map is symmetric, so this is the nearest value; a tie goes to the smaller magnitude).
``n`` is read from one table indexed by the top bits (``KEY_SHIFT``) of ``a``'s float32 pattern
(monotone in ``a``): each entry packs the count of midpoints below its interval and the low bits
of the one midpoint inside it, or a sentinel when there is none (the key is chosen so that no
interval holds two; checked when the table is built). Keys below the smallest midpoint's are
clamped to one entry that says 0, keys above 1.0 to the entry of 1.0. That is a handful of
element-wise integer ops and one lookup instead of a binary search per element, and, like
everything here, exact and independent of where an element sits in the buffer.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["dynamic_map", "Codec", "codec", "KEY_SHIFT"]

KEY_SHIFT = 16  # the lookup key keeps 8 exponent + 7 mantissa bits of |x|
_ONE_BITS = 0x3F800000  # float32 1.0


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


class Codec:
    """Codes of one dynamic map, and the tables that encode and decode them.

    Build it with :func:`codec` (cached per map and device).

    Attributes:
        signed: which map.
        table: fp32 ``[256]``: the value of each code (the signed map's unused code 255 reads 1.0).
        zero: the code of 0.
        packed: int32 lookup table of the encoder (see [Note: exact nearest-code lookup without a
            search]); entry ``key - key_min``.
        key_min, key_max: the range keys are clamped to.
    """

    def __init__(self, signed: bool, device):
        values = dynamic_map(signed)
        self.signed = signed
        self.zero = int((values == 0).nonzero()[0, 0])
        pos = values[self.zero :].double()  # 0, then the positive values ascending
        mids = ((pos[:-1] + pos[1:]) / 2).to(torch.float32).view(torch.int32).long()  # positive midpoints
        low = (1 << KEY_SHIFT) - 1
        self.key_min = int(mids[0] >> KEY_SHIFT) - 1  # this key and all below: no midpoint below them
        self.key_max = _ONE_BITS >> KEY_SHIFT
        keys = torch.arange(self.key_min, self.key_max + 1, dtype=torch.int64)
        base = torch.searchsorted(mids, keys << KEY_SHIFT, right=False)  # midpoints below the interval
        inside = torch.searchsorted(mids, ((keys + 1) << KEY_SHIFT) - 1, right=True) - base
        if int(inside.max()) > 1:
            raise AssertionError("quantization map too fine for the lookup key; lower KEY_SHIFT")
        thr = torch.where(inside > 0, mids[base.clamp(max=len(mids) - 1)] & low, torch.tensor(low + 1))
        self.packed = ((base << (KEY_SHIFT + 1)) | thr).to(torch.int32).to(device)
        table = torch.cat([values, values[-1:]]) if len(values) == 255 else values
        self.table = table.to(device)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 table values of ``codes`` (uint8, any shape): the normalised values."""
        return self.table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)

    def encode(self, x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
        """uint8 codes of ``x * inv_scale`` (broadcast; ``inv_scale``: the reciprocal of each
        element's block absmax, so that the product lies in [-1, 1])."""
        normed = x * inv_scale
        bits = normed.view(torch.int32) & 0x7FFFFFFF  # |normed|'s pattern
        key = (bits >> KEY_SHIFT).clamp_(self.key_min, self.key_max).sub_(self.key_min)
        entry = self.packed.index_select(0, key.reshape(-1)).view(key.shape)
        n = (entry >> (KEY_SHIFT + 1)).add_(((bits & ((1 << KEY_SHIFT) - 1)) > (entry & ((1 << (KEY_SHIFT + 1)) - 1))))
        if self.zero:
            n = torch.where(normed < 0, self.zero - n, n + self.zero)
        return n.to(torch.uint8)

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
        codes, absmax = self.encode_grid(x, block, grid_of(x.shape, block))
        return codes.reshape(-1), absmax

    def decode_blocks(self, codes: torch.Tensor, absmax: torch.Tensor, shape, block: tuple[int, int]) -> torch.Tensor:
        """fp32 ``shape = (rows, cols)`` values of :meth:`encode_blocks`' output."""
        return self.decode_grid(codes, absmax, shape, block, grid_of(shape, block))

    def encode_grid(self, x: torch.Tensor, block, grid) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`encode_blocks` with the ``grid`` (:func:`grid_of`) given; the codes as
        ``(rows, cols)``."""
        absmax = tiled(x.abs(), block, grid).amax(dim=(1, 3))
        inv = 1.0 / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        return self.encode(x, per_element(inv, x.shape, block, grid)), absmax.reshape(-1)

    def decode_grid(self, codes: torch.Tensor, absmax: torch.Tensor, shape, block, grid) -> torch.Tensor:
        """:meth:`decode_blocks` with the ``grid`` (:func:`grid_of`) given."""
        return self.decode(codes).view(shape).mul_(per_element(absmax, shape, block, grid))


def grid_of(shape, block) -> tuple[int, int]:
    """``(bands, tiles)``: the blocks of a ``shape = (rows, cols)`` tensor along each dim."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def tiled(x: torch.Tensor, block: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """``x`` (rows, cols), zero-padded to whole tiles, viewed as ``(bands, r, tiles, c)``
    (``grid``: :func:`grid_of`)."""
    rows, cols = x.shape
    (r, c), (bands, tiles) = block, grid
    pc, pr = tiles * c - cols, bands * r - rows
    if torch.compiler.is_compiling() or pr or pc:  # compiled: no branch on the sizes (one graph for all)
        x = F.pad(x, (0, pc, 0, pr))
    return x.view(bands, r, tiles, c)


def per_element(x: torch.Tensor, shape, block, grid) -> torch.Tensor:
    """The ``shape = (rows, cols)`` tensor of each element's block value, from one value per
    block ``x`` (band-major; a broadcast view, which a compiled graph reads by index)."""
    (r, c), (bands, tiles) = block, grid
    full = x.reshape(bands, 1, tiles, 1).expand(bands, r, tiles, c).reshape(bands * r, tiles * c)
    return full[: shape[0], : shape[1]]


@functools.lru_cache(maxsize=None)
def _cached(signed: bool, device: str) -> Codec:
    return Codec(signed, torch.device(device))


def codec(signed: bool, device) -> Codec:
    """The :class:`Codec` of the signed or unsigned map on ``device`` (built once per process)."""
    return _cached(signed, str(torch.device(device)))
