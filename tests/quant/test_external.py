"""rg.quant's formats against code nobody here wrote, where it is installed (neither is a test
dependency, so these skip in CI and say why; docs/quantization.md records the runs):

* torchao's MX conversion (``torchao.prototype.mx_formats.mx_tensor.to_mx``, scale mode FLOOR:
  OCP MX v1.0's rule) against ``rg.quant.mxfp8(block=32)``: the e8m0 bytes and the codes, bit for
  bit. torchao's prototype API moves between releases and its import prints warnings about its
  CUDA kernels on a CPU machine, so it stays out of the test extra.
* DeepSeek-V3's published kernels (``inference/kernel.py`` of deepseek-ai/DeepSeek-V3, triton):
  ``act_quant`` (1 x 128 blocks, scale ``amax / 448``) against ``rg.quant.fp8(block=(1, 128))``,
  and ``weight_dequant`` (what ``fp8_cast_bf16.py`` applies to every fp8 weight: 128 x 128 tiles,
  ``x.float() * s``) against ``rg.quant.dequantize``. The interpreter's own fp32 -> e4m3 cast
  drops the carry when rounding overflows the mantissa (triton-lang/triton#8322: 124.3 -> 64),
  which a GPU's cast does not: the codes are compared with torch's cast of the kernel's ``x / s``,
  and the interpreter's codes checked to differ by that defect only. They run on a CPU in triton's interpreter
  (``TRITON_INTERPRET=1``) in a subprocess; set ``RAGGED_DEEPSEEK_V3_INFERENCE`` to the
  repository's ``inference`` folder (its code is not copied here) and install triton.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import ragged as rg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mx_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-40, 40, (64, 1), generator=g).float())
    x[0, :32] = 0.0                                       # an all-zero block
    x[1, :32] = torch.linspace(-4.0, 4.0, 32)            # amax exactly a power of two
    x[2, :32] = 4.0 * (1 - 2.0 ** -24)                   # just below one: codes clamp to 448
    return x


def test_mxfp8_equals_torchao_to_mx_floor():
    try:
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
    except ImportError as err:
        pytest.skip(f"torchao is not installed ({err}); it is not a test dependency (see this module's docstring)")
    x = _mx_inputs()
    scale_e8m0, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    codes, scales = rg.quant.quantize(x, rg.quant.mxfp8(block=32))
    assert torch.equal(scale_e8m0.view(torch.uint8), scales.to(torch.float8_e8m0fnu).view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), codes.view(torch.uint8))


def test_mxfp8_differs_from_torchao_only_below_its_normal_scale():
    # torchao divides by max(scale, 2**-126) (a workaround for triton's subnormals) while storing the
    # scale 2**-127: for a block whose scale is 2**-127 but which is not all zero, its codes are half
    # of what its own scale says. rg.quant keeps x / scale, so dequantize(quantize(x)) stays close to x.
    try:
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
    except ImportError as err:
        pytest.skip(f"torchao is not installed ({err}); it is not a test dependency (see this module's docstring)")
    x = torch.full((1, 32), 2.0 ** -120)
    scale_e8m0, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    codes, scales = rg.quant.quantize(x, rg.quant.mxfp8(block=32))
    assert scale_e8m0.view(torch.uint8).item() == 0 and scales.item() == 2.0 ** -127
    assert data.float()[0, 0].item() == 64.0 and codes.float()[0, 0].item() == 128.0
    assert rg.quant.dequantize(codes, scales, rg.quant.mxfp8(block=32))[0, 0].item() == 2.0 ** -120


_DEEPSEEK = r"""
import json, os, sys, torch
sys.path.insert(0, os.environ["RAGGED_DEEPSEEK_V3_INFERENCE"])
import kernel  # DeepSeek-V3's inference/kernel.py, run by triton's interpreter
import ragged as rg
g = torch.Generator().manual_seed(0)
x = torch.randn(8, 512, generator=g) * torch.exp2(torch.randint(-8, 8, (8, 1), generator=g).float())
x[0, :128] = torch.linspace(-3.0, 3.0, 128)
y, s = kernel.act_quant(x.contiguous(), 128)
codes, scales = rg.quant.quantize(x, rg.quant.fp8(block=(1, 128)))
big = x.view(8, 4, 128).abs().amax(-1) >= 1e-4        # act_quant clamps amax to 1e-4 first
mine, theirs = codes.float().view(8, 4, 128)[big], y.float().view(8, 4, 128)[big]
# the kernel's own x / s, cast by torch (round to nearest even), is what rg.quant computes
rne = (x.view(8, 4, 128) / s.unsqueeze(-1)).to(torch.float8_e4m3fn).float()[big]
# triton's interpreter loses the carry when rounding overflows the mantissa (triton-lang/triton#8322):
# 124.3 -> 64 instead of 128. Every other code must be equal.
lost = (theirs != mine)
carry = bool(torch.all(theirs[lost] * 2 == mine[lost]) and torch.all(torch.frexp(mine[lost]).mantissa.abs() == 0.5))
out = {"act_scales": bool(torch.equal(s[big], scales[big])), "act_codes_rne": bool(torch.equal(rne, mine)),
       "other_codes_differ_by_the_lost_carry_only": carry, "blocks": int(big.sum())}
w = torch.randn(256, 384, generator=g) * 0.02
fmt = rg.quant.fp8(block=(128, 128))
wc, ws = rg.quant.quantize(w, fmt)
torch.set_default_dtype(torch.float32)
out["weight_dequant"] = bool(torch.equal(kernel.weight_dequant(wc.contiguous(), ws.contiguous()), rg.quant.dequantize(wc, ws, fmt)))
print(json.dumps(out))
"""


def test_fp8_equals_deepseek_v3_kernels():
    where = os.environ.get("RAGGED_DEEPSEEK_V3_INFERENCE")
    if not where or not os.path.exists(os.path.join(where, "kernel.py")):
        pytest.skip("RAGGED_DEEPSEEK_V3_INFERENCE does not name DeepSeek-V3's inference/ folder (see this module's docstring)")
    try:
        import triton  # noqa: F401
    except ImportError as err:
        pytest.skip(f"triton is not installed ({err}); DeepSeek-V3's kernels need it (its interpreter runs them on a CPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", _DEEPSEEK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"act_scales": True, "act_codes_rne": True, "other_codes_differ_by_the_lost_carry_only": True,
                   "blocks": 32, "weight_dequant": True}, got
