"""A torchao-style 8-bit AdamW for FSDP2: blocks are cut from each rank's *local* shard.

torchao's ``AdamW8bit`` (and bitsandbytes') quantizes each state tensor in 1-D blocks of
consecutive elements of the tensor it is given; under FSDP2 that tensor is the rank's local
``Shard(0)`` piece, so a block starts wherever the local shard starts and the last block of a
shard is cut short. Where the quantization blocks fall therefore depends on the world size
(pytorch/ao#4912). This file is our own re-implementation of that behaviour (torchao is not a
dependency), using the codec of ``rg.optim.adamw_8bit`` itself (``ragged.optim._quant8_codec``:
the same dynamic maps, one fp32 absmax per block, round to nearest code) so that the *only*
difference from ragged's 8-bit AdamW is where the blocks are:

* ``PerShardAdamW8bit``: blocks = ``block_size`` consecutive elements of the flattened local
  shard (the local shard as one row of ``(1, block_size)`` blocks);
* ragged: blocks = the plan's ``Blocks(32, 32)`` tiles of each full tensor, never cut by a rank
  boundary (the planner guarantees it), identical at every world size.

Tensors with fewer than ``min_size`` elements (whole tensor) keep fp32 moments, as in ragged.
"""

from __future__ import annotations

import math

import torch

from ragged.optim._quant8_codec import codec

__all__ = ["PerShardAdamW8bit", "local"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the tensor itself otherwise)."""
    inner = getattr(t, "_local_tensor", None)
    return t if inner is None else inner


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


class PerShardAdamW8bit(torch.optim.Optimizer):
    """AdamW with 8-bit moments quantized in blocks of the local shard (see the module docstring).

    Args:
        params: parameters (DTensors from ``fully_shard`` or plain tensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        block_size: elements per quantization block of the flattened local shard.
        min_size: parameters with fewer elements (whole tensor) keep fp32 moments.
        full_numel: ``tensor -> elements of the whole parameter`` when the optimizer is given
            plain local pieces (default: ``p.numel()``, which for a DTensor is the global size).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, block_size=1024,
                 min_size=4096, full_numel=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size, self.min_size = block_size, min_size
        self.full_numel = full_numel or (lambda p: p.numel())

    def _encode(self, signed, x):
        """(codes, absmax) of the 1-D ``x`` in blocks of ``block_size`` consecutive elements."""
        return codec(signed, x.device).encode_blocks(x.view(1, -1), (1, self.block_size))

    def _decode(self, signed, codes, absmax):
        n = codes.numel()
        return codec(signed, codes.device).decode_blocks(codes, absmax, (1, n), (1, self.block_size)).view(n)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                x = local(p)
                g = local(p.grad).reshape(-1).float()
                n = g.numel()
                st = self.state[p]
                quantized = self.full_numel(p) >= self.min_size
                if not st:
                    st["step"] = 0
                    if quantized:
                        nb = num_blocks(n, self.block_size)
                        zero = codec(True, g.device).zero
                        st["mu_codes"] = torch.full((n,), zero, dtype=torch.uint8, device=g.device)
                        st["nu_codes"] = torch.zeros(n, dtype=torch.uint8, device=g.device)
                        st["mu_scales"] = torch.zeros(nb, dtype=torch.float32, device=g.device)
                        st["nu_scales"] = torch.zeros(nb, dtype=torch.float32, device=g.device)
                    else:
                        st["mu"] = torch.zeros(n, dtype=torch.float32, device=g.device)
                        st["nu"] = torch.zeros(n, dtype=torch.float32, device=g.device)
                st["step"] += 1
                t = st["step"]
                if quantized and n:
                    m = self._decode(True, st["mu_codes"], st["mu_scales"])
                    v = self._decode(False, st["nu_codes"], st["nu_scales"])
                else:
                    m, v = st.get("mu"), st.get("nu")
                if n == 0:
                    continue
                m = m * b1 + g * (1.0 - b1)
                v = v * b2 + (g * g) * (1.0 - b2)
                bc1 = 1.0 - b1**t
                bc2_sqrt = math.sqrt(1.0 - b2**t)
                u = (m / (torch.sqrt(v).div_(bc2_sqrt).add_(eps))).div_(bc1)
                if quantized:
                    st["mu_codes"], st["mu_scales"] = self._encode(True, m)
                    st["nu_codes"], st["nu_scales"] = self._encode(False, v)
                else:
                    st["mu"], st["nu"] = m, v
                xf = x.view(-1)
                if wd:
                    xf.mul_(1.0 - lr * wd)
                xf.add_(u.to(xf.dtype), alpha=-lr)

    def state_tensors(self):
        return [v for st in self.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
