"""A divisor that every device divides by: the one way ragged divides a tensor by a number whose
result is pinned (a quantization scale) or compared bit for bit (a gradient mean).

[Note: a division every device rounds alike]
``torch.div(t, 448.0)`` divides on the CPU, but CUDA's true-division kernel, given a divisor on
the host (a Python number or a 0-d CPU tensor), multiplies by its reciprocal rounded to the
opmath type (ATen's ``div_true_kernel_cuda``: "this may lose one bit of precision"). The two
differ in the last bit for many values (for ``q = 448`` more than half of float32's): the CPU's
``amax / 448`` is not the GPU's. Divided by a tensor on the dividend's own device, both devices
divide, and IEEE division is correctly rounded on both: one result everywhere, the CPU's of
today. The divisor has the opmath type (float32 for bf16 / fp16 / float32, float64 for
float64), so a count above 256 stays exact and a bf16 mean is ``bf16(float(x) / n)`` as on the
CPU's scalar path; it has one element, broadcast, and ``t.div_(divisor(t, n))`` works in place
for any dtype of ``t`` that division allows. ``tests/_cuda_division.py`` computes divisions by a
host scalar as CUDA does, so CPU tests see the difference (``tests/quant/test_formats.py``,
``tests/transforms/test_transforms_sim.py``).
"""

from __future__ import annotations

import torch

__all__ = ["divisor"]


def divisor(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a one-element tensor on ``like``'s device, in ``like``'s opmath dtype, with
    ``like``'s number of dimensions (see [Note: a division every device rounds alike]); made by a
    fill, no host-device copy.

    Examples:
        >>> import torch
        >>> from ragged._divide import divisor
        >>> t = torch.tensor([3.0, 6.0], dtype=torch.bfloat16)
        >>> d = divisor(t, 3)
        >>> d.shape, d.dtype, t.div_(d).tolist()
        (torch.Size([1]), torch.float32, [1.0, 2.0])
    """
    dtype = torch.promote_types(like.dtype, torch.float32) if like.is_floating_point() else torch.float32
    return torch.full((1,) * like.dim(), value, dtype=dtype, device=like.device)
