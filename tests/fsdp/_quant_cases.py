"""The FSDP step with a quantized gather (and reduce-scatter) against torch references, on any
comm (simulated ranks: tests/fsdp/test_quant_step.py; gloo ranks in both transports:
tests/distributed/test_quant_gloo.py).

* ``gather_reference``: unsharded ``torch.optim.AdamW`` on the whole batch, the forward reading
  ``w + (dequantize(quantize(w)) - w).detach()`` for every quantized parameter (the straight-through
  rule), float64.
* ``reduce_reference``: SGD whose gradient is each rank's local-batch gradient quantized per
  block, dequantized, summed over ranks 0..m-1 in float64, divided by m: the quantized
  reduce-scatter's rank-order rule (the weights straight through as above).
"""

from __future__ import annotations

import copy

import torch

import ragged as rg
from ragged import fsdp, spec
from ragged.examples.data import rank_slice
from ragged.examples.gpt import loss_fn
from tests.fsdp._cases import Case

BLOCK = 16
FORMATS = {"fp8": rg.quant.fp8(block=(BLOCK, BLOCK)), "int8": rg.quant.int8(block=(BLOCK, BLOCK)),
           "mxfp8": rg.quant.mxfp8(block=BLOCK)}


def specs(path, t):
    """Blocks of the format for every matrix (and expert tensor) whose rows the block divides."""
    return spec.Blocks(BLOCK, BLOCK) if t.dim() >= 2 and t.shape[-2] % BLOCK == 0 else None


def chooser(name: str):
    """``shape -> format | None``: the format for every tensor it tiles (the MoE router, 4 x 32, is
    not: 4 rows)."""
    fmt = FORMATS[name]
    return lambda shape: fmt if len(shape) >= 2 and shape[-2] % fmt.block[0] == 0 and shape[-1] % fmt.block[1] == 0 \
        else None


def run(comm, case: Case, gather: str | None, reduce: str | None = None, *, compile: str | None = None, device=None):
    """``fsdp_run`` with ``gather_format`` / ``reduce_format``: (full params, losses);
    ``compile``: a torch.compile backend for every block (the step is given the module);
    ``device``: where the model and batches live (a CUDA device with NCCL)."""
    model = case.model() if device is None else case.model().to(device)
    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs)
    opt = case.make_optimizer()
    state = fsdp.init(units, model, opt, comm)
    pick = lambda name: (lambda leaf: chooser(name)(leaf.shape)) if name else None  # noqa: E731
    policy = fsdp.MixedPrecision(gather_format=pick(gather), reduce_format=pick(reduce))
    if compile:
        for block in model.blocks:
            block.compile(backend=compile)
    loss = loss_fn(model if compile else copy.deepcopy(model), checkpoint=case.activation_checkpointing)
    step = fsdp.make_step(units, loss, opt, comm, micro_batches=case.micro_batches, policy=policy,
                          module=model if compile else None)
    task, losses = case.task(), []
    index = getattr(comm, "replica_rank", 0) * comm.world_size + comm.rank
    total = comm.world_size * getattr(comm, "num_replicas", 1)
    for s in range(case.steps):
        batch = rank_slice(task.batch(s, case.batch), index, total)
        if device is not None:
            batch = tuple(t.to(device) for t in batch)
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    full = rg.gather(units, state.shards, comm)
    return {k: v.clone() for k, v in full.items()}, losses


def _straight_through(params: dict, name: str | None):
    if name is None:
        return params
    out = {}
    for k, w in params.items():
        fmt = chooser(name)(tuple(w.shape))
        out[k] = w if fmt is None else w + (rg.quant.dequantize(*rg.quant.quantize(w, fmt), fmt, dtype=w.dtype) - w).detach()
    return out


def gather_reference(case: Case, gather: str):
    """Unsharded AdamW on the global batch with straight-through quantized weights: (params, losses)."""
    model = case.model()
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=case.weight_decay)
    task, losses, fn = case.task(), [], loss_fn(model)
    for s in range(case.steps):
        opt.zero_grad()
        loss = fn(_straight_through(dict(model.named_parameters()), gather), task.batch(s, case.batch))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.named_parameters()}, losses


def reduce_reference(case: Case, world_size: int, gather: str | None, reduce: str):
    """SGD over ``world_size`` ranks' local gradients, each quantized per block and summed in rank
    order (float64, as the step reduces a float64 model): the params after ``case.steps`` steps."""
    model = case.model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    task, fn = case.task(), loss_fn(model)
    for s in range(case.steps):
        batch, total = task.batch(s, case.batch), None
        for r in range(world_size):
            leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
            grads = torch.autograd.grad(fn(_straight_through(leaves, gather), rank_slice(batch, r, world_size)),
                                        list(leaves.values()))
            seen = []
            for (k, w), g in zip(leaves.items(), grads):
                fmt = chooser(reduce)(tuple(g.shape))
                seen.append(g if fmt is None else rg.quant.dequantize(*rg.quant.quantize(g, fmt), fmt, dtype=g.dtype))
            total = seen if total is None else [a + b for a, b in zip(total, seen)]
        params = {k: w - case.lr * (g / world_size) for (k, w), g in zip(params.items(), total)}
    return params


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)
