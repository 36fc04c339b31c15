"""Quantization formats: frozen, hashable values (pytree leaves, like specs) that pin every bit.

[Note: the formats, pinned]
A format tiles the last two dimensions of a tensor with ``r x c`` blocks (a vector is one row;
a 3-D expert tensor is tiled matrix by matrix) and stores one code per element plus one scale
per block. Everything is computed in float32 (a float64 or bf16 tensor is cast to float32
first), so any two implementations of these rules agree bit for bit:

* ``fp8(block=(r, c))``: e4m3 codes (``torch.float8_e4m3fn``); scale = ``amax(|block|) / 448``
  in float32 (a correctly rounded division on every device: [Note: a division every device
  rounds alike] in ``ragged/_divide.py``), and 1.0 where that is 0 (an all-zero block, or one so small that ``amax / 448``
  underflows float32: its codes are then all 0); codes = ``(x / scale).clamp(-448, 448)`` cast
  to e4m3 (round to nearest even; clamping first because devices differ on overflow). This is
  DeepSeek-V3's tile format (128 x 128 weights, 1 x 128 activations).
* ``int8(block=(r, c))``: scale = ``amax / 127`` (1.0 where that is 0); codes =
  ``round_half_even(x / scale)`` clamped to [-127, 127], as int8.
* ``mxfp8(block=k)``: OCP Microscaling v1.0's MXFP8 (E4M3): ``1 x k`` blocks along the last
  dimension (``k = 32`` in the standard); scale = ``2 ** e`` with ``e = floor(log2(amax)) - 8``
  (8: the exponent of e4m3's largest normal, 448), clamped to e8m0's range [-127, 127], and
  ``2 ** -127`` for an all-zero block; a block holding inf or NaN gets e8m0's NaN. Codes as
  fp8's (clamped to +-448, cast to e4m3).

``dequantize`` is ``codes.float() * scale`` per block in float32, then cast to the asked dtype.
Non-finite input stays non-finite: a block holding inf or NaN dequantizes to NaN or inf (its
scale carries it), never to finite numbers. Scales are float32 in the API for every format; on
the wire an e8m0 scale travels as its one exponent byte (see ``ragged/quant/_wire.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["Format", "fp8", "int8", "mxfp8", "KINDS"]

KINDS = ("fp8", "int8", "mxfp8")
_CODE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "mxfp8": torch.float8_e4m3fn}
_QMAX = {"fp8": 448.0, "int8": 127.0, "mxfp8": 448.0}


@dataclasses.dataclass(frozen=True, slots=True)
class Format:
    """A block quantization format: its kind and its ``(rows, cols)`` block. Build one with
    :func:`fp8`, :func:`int8` or :func:`mxfp8`; see [Note: the formats, pinned] in
    ``ragged/quant/_format.py``.

    Attributes:
        kind: ``"fp8"``, ``"int8"`` or ``"mxfp8"``.
        block: ``(r, c)``: rows and columns of one block over the last two dimensions
            (mxfp8: ``(1, k)``).

    Examples:
        >>> import ragged as rg
        >>> fmt = rg.quant.fp8(block=(128, 128))
        >>> fmt, fmt.code_dtype, fmt.scale_nbytes
        (fp8(block=(128, 128)), torch.float8_e4m3fn, 4)
        >>> rg.quant.mxfp8() == rg.quant.mxfp8(block=32), rg.quant.mxfp8().scale_nbytes
        (True, 1)
        >>> len({rg.quant.int8(block=(32, 32)), rg.quant.int8(block=(32, 32))})   # hashable
        1
    """

    kind: str
    block: tuple[int, int]

    replace = dataclasses.replace

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RaggedValueError(f"Format.kind must be one of {KINDS}, got {self.kind!r}.")
        block = self.block
        if not isinstance(block, (tuple, list)) or len(block) != 2:
            raise RaggedTypeError(f"{self.kind}: block must be a pair (rows, cols) of positive ints, got {block!r}.")
        for name, value in zip(("rows", "cols"), block):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RaggedValueError(f"{self.kind}: block {name} must be a positive int, got {value!r} in {block!r}.")
        if self.kind == "mxfp8" and block[0] != 1:
            raise RaggedValueError(f"mxfp8 blocks are 1 x k along the last dimension; got block {tuple(block)}.")
        object.__setattr__(self, "block", (int(block[0]), int(block[1])))

    def __repr__(self) -> str:
        if self.kind == "mxfp8":
            return f"mxfp8(block={self.block[1]})"
        return f"{self.kind}(block={self.block})"

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype of the codes (one byte each)."""
        return _CODE_DTYPES[self.kind]

    @property
    def qmax(self) -> float:
        """The largest code magnitude: 448 (e4m3's largest normal) or 127."""
        return _QMAX[self.kind]

    @property
    def scale_nbytes(self) -> int:
        """Bytes of one block's scale on the wire: 4 (float32) or 1 (mxfp8's e8m0 exponent)."""
        return 1 if self.kind == "mxfp8" else 4

    @property
    def block_numel(self) -> int:
        """Elements of one block."""
        return self.block[0] * self.block[1]


def _block_pair(block, kind: str) -> tuple[int, int]:
    if isinstance(block, int) and not isinstance(block, bool):
        raise RaggedTypeError(f"{kind}: block must be a pair (rows, cols), e.g. block=({block}, {block}); got {block!r}.")
    return tuple(block) if isinstance(block, (tuple, list)) else block


def fp8(block=(128, 128)) -> Format:
    """e4m3 codes with one float32 scale (``amax / 448``) per ``r x c`` block (DeepSeek-V3's
    weight tiles are 128 x 128). See [Note: the formats, pinned].

    Args:
        block: ``(r, c)``, rows and columns of a block over the last two dimensions.

    Examples:
        >>> import torch, ragged as rg
        >>> fmt = rg.quant.fp8(block=(2, 2))
        >>> codes, scales = rg.quant.quantize(torch.tensor([[448.0, 1.0], [-2.0, 0.0]]), fmt)
        >>> codes.float().tolist(), scales.tolist()
        ([[448.0, 1.0], [-2.0, 0.0]], [[1.0]])
    """
    return Format("fp8", _block_pair(block, "fp8"))


def int8(block=(32, 32)) -> Format:
    """int8 codes (round half to even of ``x / scale``) with one float32 scale (``amax / 127``)
    per ``r x c`` block. See [Note: the formats, pinned].

    Args:
        block: ``(r, c)``, rows and columns of a block over the last two dimensions.

    Examples:
        >>> import torch, ragged as rg
        >>> codes, scales = rg.quant.quantize(torch.tensor([[127.0, 0.5, 1.5, -2.5]]), rg.quant.int8(block=(1, 4)))
        >>> codes.tolist(), scales.tolist()                 # ties to even: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
        ([[127, 0, 2, -2]], [[1.0]])
    """
    return Format("int8", _block_pair(block, "int8"))


def mxfp8(block: int = 32) -> Format:
    """OCP MX v1.0 MXFP8 (E4M3): ``1 x block`` blocks along the last dimension, each with a
    power-of-two (e8m0) scale ``2 ** (floor(log2(amax)) - 8)``. See [Note: the formats, pinned].

    Args:
        block: elements per block along the last dimension (the standard's is 32).

    Examples:
        >>> import torch, ragged as rg
        >>> codes, scales = rg.quant.quantize(torch.tensor([3.0, -1.0, 0.25, 0.0]), rg.quant.mxfp8(block=4))
        >>> scales.tolist(), codes.float().tolist()          # amax 3: 2 ** (1 - 8)
        ([0.0078125], [384.0, -128.0, 32.0, 0.0])
    """
    if isinstance(block, bool) or not isinstance(block, int):
        raise RaggedTypeError(f"mxfp8: block is the number of elements along the last dimension (an int), got {block!r}.")
    return Format("mxfp8", (1, block))
