"""Small models for the lifecycle tests (init, meta init, placeholders, export), shared by the
simulated and the gloo tests."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import ragged as rg
from ragged import fsdp


class Rotary(nn.Module):
    """A non-persistent buffer computed in ``__init__`` (as HF rotary ``inv_freq``) and again in
    ``reset_parameters`` (so a meta build can be initialised)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self):
        return 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))

    def reset_parameters(self):
        self.inv_freq.copy_(self._inv_freq())


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Tiny(nn.Module):
    """Embedding, 2 blocks, a BatchNorm (persistent buffers), a rotary-style buffer and a head
    (tied to the embedding when ``tied``)."""

    def __init__(self, vocab: int = 11, dim: int = 6, *, tied: bool = True, device=None):
        super().__init__()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
            self.bn = nn.BatchNorm1d(dim)
            self.rotary = Rotary(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens):
        x = self.emb(tokens) * self.rotary.inv_freq.to(self.emb.weight.dtype).repeat(2)
        for b in self.blocks:
            x = b(x)
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x)


def tiny(seed: int = 0, *, tied: bool = True, dtype=torch.float64) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(tied=tied).to(dtype)


def meta_tiny(*, tied: bool = True, dtype=torch.float64) -> Tiny:
    return Tiny(tied=tied, device="meta").to(dtype)


def exported_init(comm, model, *, groups=None, seed=0, rank0_only=False, **init_kw):
    """``fsdp.init`` then ``fsdp.export(module=model)``: the initial full state dict."""
    units = fsdp.make_units(model, world_size=comm.world_size, groups=groups)
    state = fsdp.init(units, model, rg.optim.sgd(0.1), comm, seed=seed, **init_kw)
    return fsdp.export(units, state.shards, comm, module=model, rank0_only=rank0_only, device="cpu")


def assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b), (list(a), list(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k
