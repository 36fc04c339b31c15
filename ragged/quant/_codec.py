"""``quantize`` / ``dequantize`` of a whole tensor, and the same rules over a flat run of whole
blocks (a rank's piece of a leaf), which is what makes the gathered weights independent of the
world size.

[Note: a run of whole blocks]
Blocks tile the last two dimensions; flatten the leading ones and a tensor is an ``(N, C)``
matrix (a vector is one row, ``N = 1``; a 3-D expert tensor with ``R % r == 0`` is its matrices
stacked, and its blocks are each matrix's blocks). A contiguous run of its flat elements that
starts and ends on block boundaries, a *run of whole blocks*, is quantized on its own exactly as
inside the whole tensor: for ``r x c`` blocks with ``r > 1`` a run is whole bands of ``r`` rows;
for ``1 x c`` blocks any run of whole ``c``-element pieces of rows. Its scales are the blocks' in
row-major order. A rank's piece of a leaf is such a run when the plan's granule holds whole
blocks (``ragged/quant/_wire.py`` checks it), so each rank quantizes what it owns with no
communication and the result is the single-process quantizer's, whatever the world size.
"""

from __future__ import annotations

import math

import torch

from ragged._divide import divisor
from ragged._errors import LayoutError, RaggedTypeError
from ragged.quant._format import Format

__all__ = ["quantize", "dequantize", "check_shape", "quantize_run", "dequantize_run", "fits_shape", "e8m0_to_float", "float_to_e8m0"]


def _check_format(fmt) -> Format:
    if not isinstance(fmt, Format):
        raise RaggedTypeError(
            f"fmt must be a rg.quant format (rg.quant.fp8(...), int8(...), mxfp8(...)), got {type(fmt).__name__} {fmt!r}."
        )
    return fmt


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of a shape's flattened matrix (see [Note: a run of whole blocks])."""
    if len(shape) == 1:
        return 1, shape[0]
    return shape[-2], shape[-1]


def fits_shape(shape: tuple[int, ...], fmt: Format) -> bool:
    """Whether ``fmt``'s blocks tile ``shape`` exactly (see :func:`check_shape`)."""
    if len(shape) == 0 or 0 in shape:
        return False
    rows, cols = _matrix(tuple(shape))
    return rows % fmt.block[0] == 0 and cols % fmt.block[1] == 0


def check_shape(shape, fmt: Format, *, path: str = "x") -> None:
    """Refuses a shape the format's blocks do not tile (a 0-d or empty tensor, a vector under
    blocks of several rows, a dimension the block does not divide or is larger than).

    Raises:
        LayoutError: naming the shape, the block and the fix.

    Examples:
        >>> import ragged as rg
        >>> from ragged.quant import check_shape
        >>> check_shape((256, 384), rg.quant.fp8(block=(128, 128)))
        >>> check_shape((256, 100), rg.quant.fp8(block=(128, 128)), path="['w']")
        Traceback (most recent call last):
        ...
        ragged._errors.LayoutError: ['w'] has shape (256, 100), which fp8(block=(128, 128)) does not tile: ...
    """
    shape = tuple(int(d) for d in shape)
    r, c = fmt.block
    if fits_shape(shape, fmt):
        return
    if len(shape) == 0 or 0 in shape:
        why = "a 0-d or empty tensor has no blocks"
    else:
        rows, cols = _matrix(shape)
        dims = "a vector is one row, so the block must have 1 row" if len(shape) == 1 else \
            f"the last two dimensions ({rows}, {cols}) must be multiples of the block ({r}, {c})"
        why = f"{dims} (a 3-D tensor is tiled matrix by matrix)"
    raise LayoutError(
        f"{path} has shape {shape}, which {fmt!r} does not tile: {why}. Fix: choose a block that divides "
        f"the last two dimensions, or leave this tensor unquantized (a gather_format callable returns None "
        f"for it).",
        path=path, shape=shape,
    )


def _grid(n: int, cols: int, fmt: Format) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block view of the run's elements, its scales' shape broadcast against it)."""
    r, c = fmt.block
    if r == 1:
        return (n // c, c), (n // c, 1)
    bands = n // (r * cols)
    return (bands, r, cols // c, c), (bands, 1, cols // c, 1)


def quantize_run(x: torch.Tensor, cols: int, fmt: Format, *, codes=None, scales=None):
    """Codes and scales of a flat run of whole blocks of an ``(N, cols)`` matrix (see [Note: a
    run of whole blocks]); ``codes`` / ``scales`` optional flat outputs (code dtype, float32).

    Returns:
        ``(codes, scales)``: flat, ``x.numel()`` codes and one float32 scale per block in
        row-major block order.
    """
    n = x.numel()
    view, sview = _grid(n, cols, fmt)
    blocks = x.reshape(view)
    if blocks.dtype != torch.float32:
        blocks = blocks.to(torch.float32)
    dims = (1,) if len(view) == 2 else (1, 3)
    amax = torch.amax(torch.abs(blocks), dim=dims, keepdim=True) if n else blocks.new_zeros(sview)
    scale = _scale(amax, fmt)
    q = torch.div(blocks, scale)
    if fmt.kind == "int8":
        q = torch.round(q).clamp_(-127.0, 127.0)
    else:
        q = q.clamp_(-448.0, 448.0)
    if codes is None:
        codes = torch.empty(n, dtype=fmt.code_dtype, device=x.device)
    codes.view(view).copy_(q)
    if scales is None:
        return codes, scale.reshape(-1)
    scales.copy_(scale.reshape(-1))
    return codes, scales


def _scale(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """One float32 scale per block from its ``amax`` (see [Note: the formats, pinned])."""
    if fmt.kind != "mxfp8":  # divided on every device (see [Note: a division every device rounds alike])
        scale = torch.div(amax, divisor(amax, fmt.qmax))
        return torch.where(scale == 0, torch.ones_like(scale), scale)
    # floor(log2(amax)) exactly, subnormals included: frexp's mantissa is in [0.5, 1)
    exponent = torch.frexp(amax).exponent - 1 - 8
    bits = torch.clamp(exponent, -127, 127) + 127
    bits = torch.where(amax == 0, torch.zeros_like(bits), bits)
    bits = torch.where(torch.isfinite(amax), bits, torch.full_like(bits, 255))
    return e8m0_to_float(bits.to(torch.uint8))


def e8m0_to_float(bits: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** (bits - 127)`` of e8m0 exponent bytes (255: NaN), exactly (``2 ** -127``
    is a float32 subnormal)."""
    return bits.view(torch.float8_e8m0fnu).to(torch.float32)


def float_to_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """The exponent byte of float32 powers of two in e8m0's range (the inverse of
    :func:`e8m0_to_float`; NaN -> 255)."""
    return scales.to(torch.float8_e8m0fnu).view(torch.uint8)


def _e4m3_times_256(codes: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * 2**-8`` of e4m3 codes, exactly, by their bits.

    [Note: decoding e4m3 through float16]
    torch's CPU cast from ``float8_e4m3fn`` to float32 is element by element (about 8 ns each
    here); the codes are decoded instead as float16 bit patterns: sign, then the 4 exponent and 3
    mantissa bits shifted into float16's, which reads every e4m3 value, subnormals included, as
    that value times ``2**-8`` (the biases differ by 8); float16 to float32 is vectorized. So
    ``dequantize`` computes ``fp32(code * 2**-8) * (scale * 2**8)``: both factors exact, the same
    real product as ``codes.float() * scale``, rounded once to the same float32 (an e4m3 NaN code
    reads as a finite value, but such a code only comes from a block whose scale is NaN or inf).
    """
    b = codes.view(torch.int8).to(torch.int16)  # sign-extended: the sign bit lands on bit 15
    return (((b & 0x7F) << 7) | ((b & -128) << 8)).view(torch.float16).to(torch.float32)


def dequantize_run(codes: torch.Tensor, scales: torch.Tensor, cols: int, fmt: Format, *, out=None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes.float() * scale`` per block of a flat run (float32 product, then ``dtype``), into
    ``out`` (a flat contiguous tensor) when given."""
    n = codes.numel()
    view, sview = _grid(n, cols, fmt)
    scales = scales.reshape(sview).to(torch.float32)
    if fmt.kind == "int8":
        values = codes.reshape(view).to(torch.float32)
    else:  # see [Note: decoding e4m3 through float16]
        values, scales = _e4m3_times_256(codes.reshape(-1)).view(view), scales * 256.0
    if out is not None and out.dtype == torch.float32:
        torch.mul(values, scales, out=out.view(view))
        return out
    value = torch.mul(values, scales)
    if out is None:
        return value.reshape(-1).to(dtype)
    out.view(view).copy_(value)
    return out


def quantize(x: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a whole tensor, in one process: the reference every sharded
    quantization equals bit for bit. See [Note: the formats, pinned].

    Args:
        x: a floating-point tensor whose last two dimensions the block divides (a vector is
            one row; a 3-D tensor is quantized matrix by matrix). Cast to float32 first.
        fmt: the format.

    Returns:
        ``(codes, scales)``: ``codes`` has ``x``'s shape (``float8_e4m3fn`` or ``int8``);
        ``scales`` are float32, one per block: shape ``(*x.shape[:-2], R // r, C // c)``
        (a vector: ``(n // c,)``).

    Raises:
        LayoutError: the block does not tile ``x``'s shape (see :func:`check_shape`).

    Examples:
        >>> import torch, ragged as rg
        >>> x = torch.tensor([[1.0, -2.0, 0.0, 0.0], [0.5, 4.0, 0.0, 0.0]])
        >>> codes, scales = rg.quant.quantize(x, rg.quant.fp8(block=(2, 2)))
        >>> scales.tolist()                        # amax / 448 per 2 x 2 block; 1.0 for the zero block
        [[0.008928571827709675, 1.0]]
        >>> rg.quant.dequantize(codes, scales, rg.quant.fp8(block=(2, 2))).tolist()
        [[1.0, -2.0, 0.0, 0.0], [0.5, 4.0, 0.0, 0.0]]
    """
    fmt = _check_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise RaggedTypeError(f"quantize takes a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}.")
    check_shape(tuple(x.shape), fmt)
    rows, cols = _matrix(tuple(x.shape))
    codes, scales = quantize_run(x.detach().contiguous().reshape(-1), cols, fmt)
    return codes.view(x.shape), scales.view(_scale_shape(tuple(x.shape), fmt))


def _scale_shape(shape: tuple[int, ...], fmt: Format) -> tuple[int, ...]:
    r, c = fmt.block
    if len(shape) == 1:
        return (shape[0] // c,)
    return (*shape[:-2], shape[-2] // r, shape[-1] // c)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: Format, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes.float() * scale`` per block (a float32 product), cast to ``dtype``: the inverse
    of :func:`quantize` up to its rounding.

    Args:
        codes: what :func:`quantize` returned (any shape the block tiles).
        scales: float32, one per block, shaped as :func:`quantize` returns them.
        fmt: the format they were made with.
        dtype: the result's dtype.

    Raises:
        LayoutError: the block does not tile ``codes``' shape, or ``scales`` has the wrong shape.

    Examples:
        >>> import torch, ragged as rg
        >>> fmt = rg.quant.int8(block=(1, 2))
        >>> codes, scales = rg.quant.quantize(torch.tensor([[1.0, 0.3]]), fmt)
        >>> codes.tolist(), rg.quant.dequantize(codes, scales, fmt, dtype=torch.float64).tolist()
        ([[127, 38]], [[1.0, 0.29921260476112366]])
    """
    fmt = _check_format(fmt)
    shape = tuple(codes.shape)
    check_shape(shape, fmt, path="codes")
    want = _scale_shape(shape, fmt)
    if tuple(scales.shape) != want:
        raise LayoutError(
            f"dequantize: scales have shape {tuple(scales.shape)}, but codes of shape {shape} under {fmt!r} have "
            f"{math.prod(want)} blocks shaped {want}. Fix: pass the scales quantize returned with these codes.",
            shape=tuple(scales.shape),
        )
    _, cols = _matrix(shape)
    return dequantize_run(codes.contiguous().reshape(-1), scales.to(torch.float32).reshape(-1), cols, fmt,
                          dtype=dtype).view(shape)
