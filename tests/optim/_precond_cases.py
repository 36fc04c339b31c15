"""SOAP / Shampoo cases shared by the single-process and the gloo tests: the parameters and specs,
per-step gradients, the optimizers, running every rank of a world size in one process, and the
whole state reassembled from the ranks' (so world sizes can be compared bit for bit)."""

from __future__ import annotations

import torch

import ragged as rg
from ragged import spec
from tests.optim import _precond_reference as ref

STEPS = 5  # SOAP: eigh at step 1, refreshes at steps 3 and 5; Shampoo: roots at steps 2 and 4
FREQ = 2


def exact_params(dtype=torch.float64) -> dict:
    """Square blocks only, so every block's statistics have distinct eigenvalues after one step
    and SOAP's eigenbases are unique (see docs/optimizers.md, 'rank-deficient statistics')."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return {"w": r(8, 12), "e": r(2, 8, 4), "b": r(12), "n": r(4), "emb": r(5, 4)}


EXACT_SPECS = {"w": spec.Blocks(4, 4), "e": spec.Blocks(4, 4), "b": spec.Rows(1), "n": spec.Replicate(),
               "emb": spec.Rows(1)}
EXACT_BLOCKS = {"w": (4, 4), "e": (4, 4)}  # the others fall back (1-D, replicated, Rows without a width)


def edge_params(dtype=torch.float32) -> dict:
    """Edge tiles in both directions, a 3-D leaf, a 1-D leaf of Elements granules (precondition_1d),
    leaves of 32 interior 5 x 7 and 18 33 x 31 blocks (sizes whose rounding in MKL depends on the slot: see
    _blocks.py), computed in batches of 4 and 3 that rank boundaries cut."""
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return {"w": r(10, 13), "e": r(3, 8, 6), "v": r(23), "b": r(7), "n": r(3), "big": r(40, 30), "odd": r(297, 62)}


EDGE_SPECS = {"w": spec.Blocks(4, 5), "e": spec.Blocks(4, 4), "v": spec.Elements(5), "b": spec.Rows(1),
              "n": spec.Replicate(), "big": spec.Blocks(5, 7),
              "odd": spec.Blocks(33, 31)}


def grads(params: dict, steps: int = STEPS, seed: int = 100) -> list[dict]:
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        out.append({k: torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype) for k, v in params.items()})
    return out


SOAP_HP = dict(lr=0.02, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, shampoo_beta=0.9, precondition_frequency=FREQ,
               normalize_grads=False, correct_bias=True)
SHAMPOO_HP = dict(lr=0.02, b1=0.9, b2=0.99, matrix_eps=1e-6, weight_decay=0.1, precondition_frequency=FREQ,
                  start_preconditioning_step=FREQ, grafting="adam", grafting_b2=0.999, grafting_eps=1e-8, exponent=0.25)


def make_soap(matrix_dtype=torch.float64, **kw):
    h = SOAP_HP
    return rg.optim.soap(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"],
                         shampoo_beta=h["shampoo_beta"], precondition_frequency=h["precondition_frequency"],
                         matrix_dtype=matrix_dtype, **kw)


def make_shampoo(matrix_dtype=torch.float64, **kw):
    h = SHAMPOO_HP
    return rg.optim.shampoo(h["lr"], b1=h["b1"], b2=h["b2"], matrix_eps=h["matrix_eps"], weight_decay=h["weight_decay"],
                            precondition_frequency=h["precondition_frequency"],
                            start_preconditioning_step=h["start_preconditioning_step"], grafting=h["grafting"],
                            grafting_b2=h["grafting_b2"], grafting_eps=h["grafting_eps"], matrix_dtype=matrix_dtype, **kw)


def reference(name: str, params: dict, gs: list[dict]) -> dict:
    if name == "soap":
        return ref.soap_reference(params, gs, EXACT_BLOCKS, SOAP_HP)
    return ref.shampoo_reference(params, gs, EXACT_BLOCKS, SHAMPOO_HP)


def run_rank(plan, params, gs, opt, rank: int):
    """``rank``'s DBuffer and optimizer state after the steps (no communication: the optimizer
    needs none, and each rank's gradient shard is cut from the same full gradients)."""
    local = rg.shard(plan, params, rank=rank)
    state = opt.init(local)
    for g in gs:
        updates, state = opt.update(rg.shard(plan, g, rank=rank), state, local)
        local = rg.apply_updates(local, updates)
    return local, state


def whole(plan, per_rank: list) -> dict:
    """The params and every state tensor reassembled from all ranks' (one-buffer plans):
    ``{"params": {...}, "<field>": {...}, "<factor field>": {(leaf, part): tensor}}``."""
    def tree(bufs):
        return rg.unflatten(plan, torch.cat([d.data for d in bufs]), bufs[0].replicated)

    out = {"params": tree([local for local, _ in per_rank])}
    state0 = per_rank[0][1]
    for field in state0._fields:
        if field in ("count", "factors") or getattr(state0, field) is None:
            continue
        out[field] = tree([getattr(st, field) for _, st in per_rank])
    blocks: dict = {}
    for _, st in per_rank:
        for path, parts in rg.optim.block_state(st.factors).items():
            for part, entry in parts.items():
                for k, v in entry.items():
                    if isinstance(v, torch.Tensor):
                        blocks.setdefault((k, path, part), []).append(v)
    out["factors"] = {key: torch.cat(vs) for key, vs in blocks.items()}
    return out


def run_world(params, specs, gs, make_opt, world_size: int) -> dict:
    plan = rg.make_plan(params, specs, world_size=world_size)
    return whole(plan, [run_rank(plan, params, gs, make_opt(), r) for r in range(world_size)])


def assert_bit_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for field in a:
        x, y = a[field], b[field]
        assert x.keys() == y.keys(), (what, field)
        for k in x:
            assert torch.equal(x[k], y[k]), f"{what}: {field}[{k}] differs"
