"""Multi-buffer plans on 2 real gloo ranks (float64, references computed in each worker):
the transforms through every gloo path (the default coalesced p2p batch, "native", and a comm
without coalesced ops), gather's backward, redistribute across buffer counts, AdamW and Muon,
checkpoints saved with one buffer count and loaded with another, and the FSDP step on
multi-buffer units against the single-buffer run and torch.optim.AdamW."""

import dataclasses

import pytest
import torch

import ragged as rg
from ragged import spec
from tests.distributed._harness import comm, workers_fixture

pytestmark = pytest.mark.distributed

workers2 = workers_fixture(2)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"emb": r(11, 8), "w": r(9, 5), "experts": r(3, 4, 6), "b": r(9), "norm": r(8)}


SPECS = {"emb": spec.Rows(2), "w": None, "experts": spec.Blocks(4, 6), "b": None, "norm": spec.Replicate()}


def _plans(m):
    one = rg.make_plan(_params(), SPECS, world_size=m)
    return one, rg.testing.with_buffers(one), rg.testing.with_buffers(one, [[l.path] for l in reversed(one.leaves)])


class _NoCoalesced:
    """A comm without the optional coalesced ops: the transforms fall back to one call per buffer."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name.endswith("_coalesced"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def _grads(rank, seed=5):
    g = torch.Generator().manual_seed(seed + rank)
    return rg.pytree.map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), _params())


def _transforms(algorithm):
    c = comm(handshake="deferred") if algorithm == "native" else comm()
    if algorithm == "fallback":
        c = _NoCoalesced(c)
    m, params = c.world_size, _params()
    plans = _plans(m)
    grads = [_grads(r) for r in range(m)]
    want_rs = rg.pytree.map(lambda *xs: sum(xs) / m, *grads)
    out = []
    for plan in plans:
        d = rg.shard(plan, params, c)
        full = rg.gather(d, c)
        rs = rg.reduce_scatter(plan, grads[c.rank], c, op="mean")
        x = d.data.clone().requires_grad_()
        tree = rg.gather(d.replace(data=x), c)
        loss = sum((tree[k] * grads[c.rank][k]).sum() for k in ("emb", "w", "experts", "b"))
        back = rg.gather(d.replace(data=torch.autograd.grad(loss, x)[0]), c)
        moved = [torch.equal(rg.redistribute(d, p, c).data, rg.shard(p, params, rank=c.rank).data) for p in plans]
        out.append(dict(
            gather=all(torch.equal(full[k], params[k]) for k in params),
            rs=all(torch.allclose(rg.gather(rs, c)[k], want_rs[k], rtol=1e-12, atol=1e-14) for k in params),
            back={k: back[k] for k in ("emb", "w", "experts", "b")},
            moved=all(moved), buffers=plan.num_buffers, norm=float(d.global_norm(c)),
        ))
    return out


@pytest.mark.parametrize("algorithm", ["default", "native", "fallback"])
def test_transforms_on_multi_buffer_plans(workers2, algorithm):
    for per_rank in workers2.run(_transforms, algorithm):
        one = per_rank[0]
        assert [r["buffers"] for r in per_rank][1:] != [1, 1]
        for r in per_rank:
            assert r["gather"] and r["rs"] and r["moved"]
            assert r["norm"] == pytest.approx(one["norm"], rel=1e-12)
            for k, v in r["back"].items():  # gather's backward: the sum of every rank's leaf gradient
                torch.testing.assert_close(v, one["back"][k], rtol=0, atol=0)
        want = sum(_grads(r)["w"] for r in range(2))
        torch.testing.assert_close(one["back"]["w"], want, rtol=1e-12, atol=1e-14)


def _optimizers():
    c = comm()
    from tests.optim import _muon_cases

    out = []
    for i in range(3):
        plan = _plans(c.world_size)[i]
        local = rg.shard(plan, _params(), c)
        opt = rg.optim.adamw(0.02, weight_decay=0.1)
        state = opt.init(local)
        for step in range(3):
            upd, state = opt.update(rg.reduce_scatter(plan, _grads(c.rank, 10 * step), c), state, local)
            local = rg.apply_updates(local, upd)
        mplan = rg.make_plan(_muon_cases._params(), _muon_cases.SPECS, world_size=c.world_size)
        if i:
            mplan = rg.testing.with_buffers(mplan, [[l.path] for l in reversed(mplan.leaves)] if i == 2 else None)
        mlocal = rg.shard(mplan, _muon_cases._params(), c)
        muon = rg.optim.muon(_muon_cases.LR, comm=c, momentum=_muon_cases.MOM, weight_decay=_muon_cases.WD,
                             adam=rg.optim.adamw(1e-2, weight_decay=_muon_cases.WD), num_waves=2)
        mstate = muon.init(mlocal)
        for step in range(_muon_cases.STEPS):
            upd, mstate = muon.update(rg.shard(mplan, _muon_cases._grads(step), c), mstate, mlocal)
            mlocal = rg.apply_updates(mlocal, upd)
        out.append((rg.gather(local, c), rg.gather(mlocal, c), mplan.num_buffers))
    return out, _muon_cases._reference()


def test_adamw_and_muon_on_multi_buffer_plans(workers2):
    for per_plan, muon_ref in workers2.run(_optimizers):
        (adam1, muon1, _), *rest = per_plan
        for adam, muon, buffers in rest:
            assert buffers > 1
            rg.testing.assert_trees_all_close(adam, adam1, rtol=1e-12, atol=1e-14)
            rg.testing.assert_trees_all_close(muon, muon1, rtol=0, atol=0)
        rg.testing.assert_trees_all_close(muon1, muon_ref, rtol=1e-10, atol=1e-10)


def _checkpoint(path, save_with, load_with):
    c = comm()
    plans = _plans(c.world_size)
    rg.checkpoint.save(path, {"params": rg.shard(plans[save_with], _params(), c), "step": 3}, c)
    like = {"params": rg.shard(plans[load_with], _params(9), c), "step": 0}
    got = rg.checkpoint.load(path, like, c)
    return got["step"], all(torch.equal(v, _params()[k]) for k, v in rg.gather(got["params"], c).items())


@pytest.mark.parametrize("save_with,load_with", [(2, 0), (0, 1), (1, 2)])
def test_checkpoint_across_buffer_counts(workers2, tmp_path, save_with, load_with):
    for step, same in workers2.run(_checkpoint, str(tmp_path / "ckpt"), save_with, load_with):
        assert step == 3 and same


def _step(case):
    from tests.fsdp._cases import fsdp_run, max_diff, reference_run

    params, metrics = fsdp_run(comm(), case)
    single, _ = fsdp_run(comm(), dataclasses.replace(case, split_buffers=False))
    ref, ref_losses = reference_run(case)
    return max_diff(params, single)[0], max_diff(params, ref), max(abs(m["loss"] - r) for m, r in zip(metrics, ref_losses))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fsdp_step_on_multi_buffer_units(workers2, moe):
    from tests.fsdp._cases import Case

    for to_single, (diff, where), loss_err in workers2.run(_step, Case(split_buffers=True, moe=moe, micro_batches=2)):
        assert to_single < 1e-12
        assert diff < 1e-10, f"{where} differs by {diff}"
        assert loss_err < 1e-9
