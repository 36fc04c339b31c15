"""A torchao-style 8-bit AdamW for FSDP2: blocks are cut from each rank's *local* shard.

torchao's ``AdamW8bit`` (and bitsandbytes') quantizes each state tensor in 1-D blocks of
consecutive elements of the tensor it is given; under FSDP2 that tensor is the rank's local
``Shard(0)`` piece, so a block starts wherever the local shard starts and the last block of a
shard is cut short. Where the quantization blocks fall therefore depends on the world size
(pytorch/ao#4912). This file is our own re-implementation of that behaviour (torchao is not a
dependency), using exactly the quantizer of ``rg.optim.adamw_8bit`` (the same dynamic maps,
one fp32 absmax per block, round to nearest code) so that the *only* difference from ragged's
8-bit AdamW is where the blocks are:

* ``PerShardAdamW8bit``: blocks = ``block_size`` consecutive elements of the flattened local shard;
* ragged: blocks = the plan's ``Blocks(32, 32)`` tiles of each full tensor, never cut by a rank
  boundary (the planner guarantees it), identical at every world size.

Tensors with fewer than ``min_size`` elements (whole tensor) keep fp32 moments, as in ragged.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PerShardAdamW8bit", "BlockCodec", "local"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the tensor itself otherwise)."""
    inner = getattr(t, "_local_tensor", None)
    return t if inner is None else inner


class BlockCodec:
    """1-D block-wise quantizer with the dynamic maps of ``rg.optim.dynamic_map``."""

    def __init__(self, signed: bool, block_size: int, device):
        from ragged.optim import dynamic_map

        self.table = dynamic_map(signed).to(device)
        self.bounds = ((self.table[:-1].double() + self.table[1:].double()) / 2).to(torch.float32)
        self.block = block_size

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        nb = -(-n // self.block)
        pad = nb * self.block - n
        return (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(nb, self.block)

    def encode(self, x: torch.Tensor):
        """x: 1-D fp32 -> (uint8 codes of x.numel(), fp32 absmax per block)."""
        xb = self._blocks(x)
        absmax = xb.abs().amax(dim=1)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        codes = torch.bucketize(xb / safe[:, None], self.bounds).to(torch.uint8)
        return codes.reshape(-1)[: x.numel()], absmax

    def decode(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        n = codes.numel()
        values = self._blocks(self.table[codes.long()])
        return (values * absmax[:, None]).reshape(-1)[:n]


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
        self._codecs = {}

    def _codec(self, signed, device):
        key = (signed, str(device))
        if key not in self._codecs:
            self._codecs[key] = BlockCodec(signed, self.block_size, device)
        return self._codecs[key]

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
                        cm = self._codec(True, g.device)
                        zero = int(torch.searchsorted(cm.table, torch.zeros(())))
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
                    cm, cv = self._codec(True, g.device), self._codec(False, g.device)
                    m = cm.decode(st["mu_codes"], st["mu_scales"])
                    v = cv.decode(st["nu_codes"], st["nu_scales"])
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
                    st["mu_codes"], st["mu_scales"] = cm.encode(m)
                    st["nu_codes"], st["nu_scales"] = cv.encode(v)
                else:
                    st["mu"], st["nu"] = m, v
                xf = x.view(-1)
                if wd:
                    xf.mul_(1.0 - lr * wd)
                xf.add_(u.to(xf.dtype), alpha=-lr)

    def state_tensors(self):
        return [v for st in self.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
