"""CUDA's division by a host scalar, computed on the CPU: a dispatch mode under which every true
division whose divisor is a Python number or a 0-d tensor multiplies by the divisor's reciprocal
rounded to the opmath type, as ATen's ``div_true_kernel_cuda`` does for a divisor on the host
(see [Note: a division every device rounds alike] in ragged/_divide.py). On the CPU everything
is on the host, so a 0-d tensor counts as one (on CUDA it may be the device's, which divides):
code that must divide takes a one-element tensor of its dividend's dimensions
(``ragged._divide.divisor``).

    with cuda_division() as seen:
        scale = torch.div(amax, 448.0)     # amax * fp32(1 / 448), as a GPU computes it
    seen.count                             # divisions computed so
"""

from __future__ import annotations

import numbers

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["cuda_division"]

_aten = torch.ops.aten
_TRUE_DIVISIONS = {_aten.div.Tensor, _aten.div_.Tensor, _aten.div.Scalar, _aten.div_.Scalar, _aten.div.out,
                   _aten.div.Tensor_mode, _aten.div_.Tensor_mode, _aten.div.out_mode}


def _host_scalar(b) -> bool:
    return (isinstance(b, numbers.Number) and not isinstance(b, bool)) or (isinstance(b, torch.Tensor) and b.dim() == 0)


class cuda_division(TorchDispatchMode):  # noqa: N801 (used as a context manager, like torch's modes)
    """See the module docstring; ``count``: the divisions it computed as CUDA does."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _TRUE_DIVISIONS or kwargs.get("rounding_mode") is not None:
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        dtype = torch.result_type(a, b)
        if not _host_scalar(b) or not dtype.is_floating_point:
            return func(*args, **kwargs)
        opmath = torch.float64 if dtype == torch.float64 else torch.float32
        inverse = torch.ones((), dtype=opmath) / torch.as_tensor(b).to(opmath)  # the kernel's 1 / b
        value = (a.to(opmath) * inverse).to(dtype)
        self.count += 1
        out = kwargs.get("out")
        if out is not None:
            return out.copy_(value)
        if func in (_aten.div_.Tensor, _aten.div_.Scalar, _aten.div_.Tensor_mode):
            return a.copy_(value)
        return value
