"""Shared cases for the FSDP step tests (simulated backend and gloo workers).

``fsdp_run(comm, case)`` trains a tiny GPT with ``rg.fsdp`` on this rank's rows of every global
batch; ``reference_run(case)`` trains the same model unsharded in one process with
``torch.optim.AdamW`` on the whole global batch. Both return ``{name: tensor}`` parameters.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.data import SyntheticLM, rank_slice
from ragged.examples.gpt import GPT, GPTConfig, loss_fn


@dataclasses.dataclass(frozen=True)
class Case:
    moe: bool = False
    steps: int = 3
    batch: int = 8  # global
    micro_batches: int = 1
    lr: float = 1e-2
    weight_decay: float = 0.1
    dtype: torch.dtype = torch.float64
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    prefetch: bool = True
    reshard_after_forward: bool = True
    num_layers: int = 3
    seed: int = 0
    optimizer: str = "adamw"  # or "sgd"
    donate: bool = False
    max_inflight_reduce: int = 1
    replicate_vectors: bool = False  # spec.Replicate() for every 1-D parameter (norms, biases)
    activation_checkpointing: bool = False  # examples.gpt.loss_fn(checkpoint=True): blocks recomputed in backward
    max_buffers: int | str = 1  # make_units(max_buffers=...)
    split_buffers: bool = False  # every unit one buffer per granule (rg.testing.with_buffers), whatever the padding

    def make_optimizer(self):
        if self.optimizer == "sgd":
            return rg.optim.sgd(self.lr)
        return rg.optim.adamw(self.lr, weight_decay=self.weight_decay, donate=self.donate)

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=64, dim=32, num_layers=self.num_layers, num_heads=4, ffn_dim=48,
                         max_seq_len=16, num_experts=4 if self.moe else 0)

    def model(self) -> GPT:
        model = GPT(self.config())
        # an explicit generator: simulated ranks are threads, the global RNG is shared between them
        model.reset_parameters(torch.Generator().manual_seed(self.seed))
        return model.to(self.dtype)

    def task(self) -> SyntheticLM:
        return SyntheticLM(64, 16, seed=self.seed + 1)


def fsdp_run(comm, case: Case, *, trace: bool = False):
    """Returns (full params after training, list of per-step metrics)."""
    model = case.model()
    specs = (lambda path, t: rg.spec.Replicate() if t.dim() == 1 else None) if case.replicate_vectors else None
    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs, max_buffers=case.max_buffers)
    if case.split_buffers:
        units = units.replace(units=tuple(u.replace(plan=rg.testing.with_buffers(u.plan)) for u in units))
    opt = case.make_optimizer()
    state = fsdp.init(units, model, opt, comm)
    loss = loss_fn(copy.deepcopy(model), checkpoint=case.activation_checkpointing)
    step = fsdp.make_step(units, loss, opt, comm, micro_batches=case.micro_batches,
                          compute_dtype=case.compute_dtype, reduce_dtype=case.reduce_dtype, prefetch=case.prefetch,
                          reshard_after_forward=case.reshard_after_forward, trace=trace, donate=case.donate,
                          max_inflight_reduce=case.max_inflight_reduce)
    task, metrics = case.task(), []
    replicas = getattr(comm, "num_replicas", 1)  # HSDP: replica-major data-parallel index
    index, total = getattr(comm, "replica_rank", 0) * comm.world_size + comm.rank, comm.world_size * replicas
    for s in range(case.steps):
        state, m = step(state, rank_slice(task.batch(s, case.batch), index, total))
        metrics.append(m)
    full = fsdp.gather(units, state.shards, comm)
    return {k: v.clone() for k, v in full.items()}, metrics


def reference_run(case: Case):
    """Unsharded single-process torch.optim.AdamW on the global batch: (params, losses)."""
    model = case.model()
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=case.weight_decay)
    task, losses, fn = case.task(), [], loss_fn(model)
    for s in range(case.steps):
        opt.zero_grad()
        loss = fn(dict(model.named_parameters()), task.batch(s, case.batch))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.named_parameters()}, losses


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    diffs = {k: (a[k].double() - b[k].double()).abs().max().item() for k in b}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst
