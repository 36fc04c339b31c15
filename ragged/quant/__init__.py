"""Block quantization formats (fp8, int8, MXFP8), pinned bit for bit; pure torch, no communication.
The quantized all-gather and reduce-scatter over a plan are in ``ragged.transforms``."""

from ragged.quant._codec import dequantize as dequantize
from ragged.quant._codec import quantize as quantize
from ragged.quant._codec import check_shape as check_shape
from ragged.quant._format import Format as Format
from ragged.quant._format import fp8 as fp8
from ragged.quant._format import int8 as int8
from ragged.quant._format import mxfp8 as mxfp8
