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


# ---- Hugging Face (tiny configs, float64) ---------------------------------------------------------------------------
HF_KINDS = {"llama-tied": ("llama", True), "llama": ("llama", False), "mixtral": ("mixtral", False)}


def hf_config(name):
    from ragged.examples import hf

    kind, tie = HF_KINDS[name]
    extra = {"experts_implementation": "eager"} if kind == "mixtral" else {}  # grouped_mm has no float64 kernel
    return hf.config(kind, vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=48, seq=16, experts=4, top_k=2,
                     tie=tie, **extra)


def hf_meta(name):
    from ragged.examples import hf

    return hf.build(hf_config(name), dtype=torch.float64)


def batches(n, batch=4, seq=8, vocab=64):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def hf_train(comm, name, steps, data):
    """The user's path: meta build, init, ``steps`` AdamW steps on this rank's rows, export."""
    import copy

    from ragged.examples import hf

    model = hf_meta(name)
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = rg.optim.adamw(1e-2, weight_decay=0.1)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, hf.loss_fn(copy.deepcopy(model)), opt, comm)  # simulated ranks: one module each
    rows = data[0][0].shape[0] // comm.world_size
    mine = slice(rows * comm.rank, rows * (comm.rank + 1))
    for x, y in data[:steps]:
        state, _ = step(state, (x[mine], y[mine]))
    return fsdp.export(units, state.shards, comm, module=model, rank0_only=False)


def hf_reference_train(name, initial, steps, data):
    """Single-process torch.optim.AdamW from the exported initial values, on the global batch."""
    from ragged.examples import hf

    model = hf.build(hf_config(name), device="cpu", dtype=torch.float64)
    model.load_state_dict(initial, strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loss = hf.loss_fn(model)
    for x, y in data[:steps]:
        opt.zero_grad()
        loss(dict(model.named_parameters()), (x, y)).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}
