"""Quantized all-gather and reduce-scatter cases run on any comm: the simulated backend
(tests/transforms/test_quantized.py) and real gloo ranks in both transports
(tests/distributed/test_quant_gloo.py). Each returns plain values (bools, ints) per rank."""

from __future__ import annotations

import torch

import ragged as rg
from ragged import spec

FORMATS = {"fp8": rg.quant.fp8(block=(16, 16)), "int8": rg.quant.int8(block=(16, 16)), "mxfp8": rg.quant.mxfp8(block=16)}


def params(seed: int = 0, dtype=torch.float64):
    """Float64 masters (cast to float32 before quantizing): matrices, an expert tensor, vectors,
    and replicated leaves (one of them a matrix, quantized in place)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return {"w": r(64, 32), "experts": r(3, 32, 16), "emb": r(48, 16), "b": r(32), "norm": r(16), "head": r(16, 32)}


SPECS = {"w": spec.Blocks(16, 16), "experts": spec.Blocks(16, 16), "emb": spec.Rows(16), "b": None,
         "norm": spec.Replicate(), "head": spec.Replicate()}


def plan(world_size: int, *, buffers: int = 1):
    p = rg.make_plan(params(), SPECS, world_size=world_size)
    return rg.testing.with_buffers(p) if buffers > 1 else p


def reference(tree, fmt, dtype):
    """The single-process result: every leaf of two or more dimensions ``dequantize(quantize(w))``
    of the whole tensor, the rest cast."""
    return {k: rg.quant.dequantize(*rg.quant.quantize(v, fmt), fmt, dtype=dtype) if v.dim() >= 2 else v.to(dtype)
            for k, v in tree.items()}


def gathered_equal_reference(comm, name: str, dtype=torch.float64, buffers: int = 1) -> bool:
    """The quantized gather at this world size equals the single-process quantizer, bit for bit."""
    fmt, p = FORMATS[name], plan(comm.world_size, buffers=buffers)
    full = rg.gather(rg.shard(p, params(), comm), comm, dtype=dtype, format=fmt)
    ref = reference(params(), fmt, dtype)
    return all(full[k].dtype == dtype and torch.equal(full[k], ref[k]) for k in ref)


def zero_plus_like_zeropp(world_size: int, group: int = 64):
    """ZeRO++'s qwZ rule for comparison: ZeRO-3 partitions each parameter into ``ceil(n / W)``
    flat elements per rank, and qwZ quantizes int8 over groups of ``group`` elements of each
    rank's partition (computed here without communication: what every rank would gather)."""
    out = {}
    for k in ("w", "experts", "emb"):
        w = params()[k].to(torch.float32).reshape(-1)
        part = -(-w.numel() // world_size)
        pieces = []
        for lo in range(0, w.numel(), part):
            local = w[lo : lo + part]
            for g in range(0, local.numel(), group):
                x = local[g : g + group]
                scale = x.abs().amax() / 127
                scale = scale if scale > 0 else torch.ones(())
                pieces.append(torch.round(x / scale) * scale)
        out[k] = torch.cat(pieces).view(params()[k].shape).double()
    return out


def grads(rank: int, seed: int = 11):
    return params(seed=seed + rank)


def reduce_scatter_equals_rank_order(comm, name: str, op: str = "sum", dtype=torch.float32) -> bool:
    """The quantized reduce-scatter equals its rank-order reference exactly: rank ``i``'s
    gradient quantized per block of the whole tensor, dequantized, summed over ranks 0, 1, ...,
    m - 1 in float32 (float64 for float64); with replicas (HSDP, 2 of them: a sum of two is
    exact in either order) the replicas' sums added; then divided for "mean"."""
    fmt, p, m = FORMATS[name], plan(comm.world_size), comm.world_size
    got = rg.reduce_scatter(p, grads(comm.replica_rank * m + comm.rank), comm, op=op, dtype=dtype, format=fmt)
    acc_dtype = torch.promote_types(dtype, torch.float32)
    total = torch.zeros(p.shard_size, dtype=acc_dtype)
    for replica in range(comm.num_replicas):
        acc = torch.zeros(p.shard_size, dtype=acc_dtype)
        for i in range(m):  # the shard group's sum, in rank order
            g = {k: v.to(dtype) for k, v in grads(replica * m + i).items()}
            seen = {k: rg.quant.dequantize(*rg.quant.quantize(v, fmt), fmt) if v.dim() >= 2 and k not in ("norm", "head")
                    else v for k, v in g.items()}
            acc = acc + rg.shard(p, seen, rank=comm.rank).data.to(acc_dtype)
        total = total + acc.to(dtype).to(acc_dtype)
    want = total.to(dtype)
    if op == "mean":
        want = want / (m * comm.num_replicas)
    return torch.equal(got.data, want.to(p.dtype))


def straight_through(comm, name: str) -> bool:
    """The gradient with respect to the quantized weights reaches the shard unchanged: the same
    as the unquantized gather's."""
    fmt, p = FORMATS[name], plan(comm.world_size)
    out = []
    for f in (fmt, None):
        d = rg.shard(p, params(), comm)
        data = d.data.clone().requires_grad_(True)
        full = rg.gather(d.replace(data=data), comm, format=f)
        loss = sum((v * (i + 1)).sum() for i, v in enumerate(full.values()))
        loss.backward()
        out.append(data.grad)
    return torch.equal(out[0], out[1])
