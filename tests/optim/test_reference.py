"""Optimizers over per-rank DBuffers equal torch.optim on the full tensors (float64).

Each rank's shard is updated on its own (no communication is needed for element-wise
optimizers), then the shards are reassembled and compared with single-process torch.optim.
"""

import pytest
import torch

import ragged as rg
from ragged import spec

from tests.optim._cases import gather_all, padding_mask, shard_all

STEPS = 5


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        "emb": r(7, 5),
        "layers": [{"w": r(6, 4), "b": r(6)}, {"w": r(3, 3, 4), "b": r(3)}],
        "norm": r(5),
        "scalar": r(()),
    }


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return rg.pytree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)


SPECS = {
    "emb": spec.Rows(2),
    "layers": [{"w": spec.Rows(1), "b": spec.Elements(1)}, {"w": spec.Rows(3), "b": spec.Elements(1)}],
    "norm": spec.Replicate(),
    "scalar": spec.Elements(1),
}


def _run_ragged(opt, world_size, params, steps=STEPS, align=4):
    plan = rg.make_plan(params, SPECS, world_size=world_size, align=align)
    shards = shard_all(plan, params)
    states = [opt.init(s) for s in shards]
    for step in range(steps):
        gshards = shard_all(plan, _grads(params, step))
        for r in range(world_size):
            u, states[r] = opt.update(gshards[r], states[r], shards[r])
            shards[r] = rg.apply_updates(shards[r], u)
    for r, s in enumerate(shards):  # padding stays exactly zero
        assert torch.equal(s.data[padding_mask(plan, r)], torch.zeros_like(s.data[padding_mask(plan, r)]))
    return gather_all(shards), plan


def _run_torch(make, params, steps=STEPS):
    ref = rg.pytree.map(lambda p: p.clone().requires_grad_(True), params)
    leaves = rg.pytree.leaves(ref)
    opt = make(leaves)
    for step in range(steps):
        for p, g in zip(leaves, rg.pytree.leaves(_grads(params, step))):
            p.grad = g.clone()
        opt.step()
    return rg.pytree.map(lambda p: p.detach(), ref)


CASES = {
    "sgd": (lambda: rg.optim.sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd-momentum": (lambda: rg.optim.sgd(0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "sgd-nesterov-wd": (
        lambda: rg.optim.sgd(0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
    ),
    "adam": (lambda: rg.optim.adam(0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
    "adamw": (
        lambda: rg.optim.adamw(0.01, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3),
    ),
}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_optim(name, world_size):
    make_ours, make_torch = CASES[name]
    params = _params()
    ours, _ = _run_ragged(make_ours(), world_size, params)
    ref = _run_torch(make_torch, params)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12), ours, ref)
    # and the params really moved
    assert not torch.allclose(ours["layers"][0]["w"], params["layers"][0]["w"])


def test_adamw_schedule_matches_torch_lambda_lr():
    params = _params(3)
    sched = rg.optim.warmup_cosine_decay_schedule(0.0, 0.02, warmup_steps=2, decay_steps=6, end_value=0.001)
    ours, _ = _run_ragged(rg.optim.adamw(sched, weight_decay=0.1), 3, params, steps=7)

    def make(ps):
        opt = torch.optim.AdamW(ps, lr=0.0, weight_decay=0.1)
        orig, count = opt.step, [0]

        def step():  # lr of step t is sched(t), t = updates already applied
            opt.param_groups[0]["lr"] = float(sched(count[0]))
            orig()
            count[0] += 1

        opt.step = step
        return opt

    ref = _run_torch(make, params, steps=7)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12), ours, ref)


def test_apply_updates_reexported_and_pure():
    p = {"w": torch.ones(2)}
    out = rg.apply_updates(p, {"w": torch.ones(2)})
    assert torch.equal(p["w"], torch.ones(2)) and torch.equal(out["w"], torch.full((2,), 2.0))


def test_masked_weight_decay_only_on_matrices():
    params = _params(5)
    is_matrix = lambda leaf: len(leaf.shape) >= 2  # noqa: E731
    ours, plan = _run_ragged(rg.optim.adamw(0.01, weight_decay=0.5, mask=is_matrix), 2, params)
    ref = rg.pytree.map(lambda p: p.clone().requires_grad_(True), params)
    leaves = rg.pytree.leaves(ref)
    mats = [p for p in leaves if p.ndim >= 2]
    rest = [p for p in leaves if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}], lr=0.01)
    for step in range(STEPS):
        for p, g in zip(leaves, rg.pytree.leaves(_grads(params, step))):
            p.grad = g.clone()
        opt.step()
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12), ours, ref)


def test_multi_transform_sgd_and_adamw_by_label():
    params = _params(6)
    label = lambda leaf: "adamw" if len(leaf.shape) >= 2 else "sgd"  # noqa: E731
    opt = rg.optim.multi_transform({"adamw": rg.optim.adamw(0.01, weight_decay=0.1), "sgd": rg.optim.sgd(0.1)}, label)
    ours, _ = _run_ragged(opt, 3, params)
    ref = rg.pytree.map(lambda p: p.clone().requires_grad_(True), params)
    leaves = rg.pytree.leaves(ref)
    o1 = torch.optim.AdamW([p for p in leaves if p.ndim >= 2], lr=0.01, weight_decay=0.1)
    o2 = torch.optim.SGD([p for p in leaves if p.ndim < 2], lr=0.1)
    for step in range(STEPS):
        for p, g in zip(leaves, rg.pytree.leaves(_grads(params, step))):
            p.grad = g.clone()
        o1.step()
        o2.step()
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12), ours, ref)


def test_multi_transform_unknown_label_names_the_leaf():
    params = _params()
    plan = rg.make_plan(params, SPECS, world_size=2, align=4)
    shards = shard_all(plan, params)
    opt = rg.optim.multi_transform({"a": rg.optim.sgd(0.1)}, lambda leaf: "b" if leaf.path == "['emb']" else "a")
    with pytest.raises(ValueError, match=r"params\['emb'\] \(shape \(7, 5\)\).*not one of the transforms' labels"):
        opt.update(shards[0], opt.init(shards[0]), shards[0])


def test_adam_eps_zero_keeps_padding_zero():
    params = _params()
    ours, plan = _run_ragged(rg.optim.adamw(0.01, eps=0.0), 3, params)
    assert all(torch.isfinite(t).all() for t in rg.pytree.leaves(ours))


def test_chain_rejects_uncalled_transform():
    with pytest.raises(TypeError, match="did you pass a function instead of calling it"):
        rg.optim.chain(rg.optim.scale_by_adam)


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_donate_gives_the_same_params(name):
    """donate=True (in-place state, update written into the gradient buffer, in-place apply)
    equals the functional path bit for bit, and really reuses the buffers."""
    params = _params(9)
    plan = rg.make_plan(params, SPECS, world_size=2, align=4)
    make = {"adamw": lambda d: rg.optim.adamw(0.01, weight_decay=0.2, donate=d), "adam": lambda d: rg.optim.adam(0.01, donate=d)}[name]
    out = {}
    for donate in (False, True):
        opt = make(donate)
        shards = shard_all(plan, params)
        states = [opt.init(s) for s in shards]
        for step in range(STEPS):
            gs = shard_all(plan, _grads(params, step))
            for r in range(2):
                mu_before = states[r][0].mu.data
                u, states[r] = opt.update(gs[r], states[r], shards[r])
                assert (u.data.data_ptr() == gs[r].data.data_ptr()) == donate
                assert (states[r][0].mu.data.data_ptr() == mu_before.data_ptr()) == donate
                new = rg.apply_updates(shards[r], u, donate=donate)
                assert (new.data.data_ptr() == shards[r].data.data_ptr()) == donate
                shards[r] = new
        out[donate] = gather_all(shards)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), out[True], out[False])


def test_fused_adamw_equals_the_chain():
    params = _params(4)
    sched = rg.optim.linear_schedule(0.02, 0.005, 4)
    fused, _ = _run_ragged(rg.optim.adamw(sched, weight_decay=0.3), 3, params)
    chained, _ = _run_ragged(rg.optim.chain(rg.optim.scale_by_adam(), rg.optim.add_decayed_weights(0.3),
                                            rg.optim.scale_by_learning_rate(sched)), 3, params)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14), fused, chained)


def test_multi_transform_compact_equals_full_and_state_is_small():
    params = _params(8)
    label = lambda leaf: "adamw" if len(leaf.shape) >= 2 else "sgd"  # noqa: E731
    make = lambda compact: rg.optim.multi_transform(  # noqa: E731
        {"adamw": rg.optim.adamw(0.01, weight_decay=0.1),
         "sgd": rg.optim.chain(rg.optim.clip_by_global_norm(0.3, comm=None), rg.optim.sgd(0.1, momentum=0.9))},
        label, compact=compact)
    full, plan = _run_ragged(make(()), 1, params)
    packed, _ = _run_ragged(make(("adamw", "sgd")), 1, params)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14), packed, full)
    d = shard_all(plan, params)[0]
    state = make(("adamw",)).init(d)
    n_matrix = sum(l.numel for l in plan.leaves if len(l.shape) >= 2)
    adam_state = state.inner_states["adamw"][0]
    assert adam_state.mu.data.numel() == n_matrix < plan.shard_size
    with pytest.raises(ValueError, match="compact names labels"):
        rg.optim.multi_transform({"a": rg.optim.sgd(0.1)}, label, compact=("b",))


@pytest.mark.parametrize("name", ["adamw", "sgd", "adamw_8bit", "muon", "multi", "masked"])
def test_bf16_grads_on_fp32_params(name):
    """Mixed precision: bf16 gradient shards, fp32 master shards -> fp32 updates equal to
    feeding the same (bf16-rounded) gradients in fp32."""
    from ragged import spec as sp

    g = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(64, 96, generator=g), "b": torch.randn(96, generator=g)}
    make = {
        "adamw": lambda: rg.optim.adamw(1e-2, weight_decay=0.1),
        "sgd": lambda: rg.optim.sgd(0.1, momentum=0.9),
        "adamw_8bit": lambda: rg.optim.adamw_8bit(1e-2, min_size=1000),
        "muon": lambda: rg.optim.muon(0.02, comm=None),
        "multi": lambda: rg.optim.multi_transform({"a": rg.optim.adamw(1e-3), "b": rg.optim.sgd(0.1)},
                                                  lambda leaf: "a" if len(leaf.shape) == 2 else "b", compact=("b",)),
        "masked": lambda: rg.optim.adamw(1e-3, weight_decay=0.1, mask=lambda leaf: len(leaf.shape) == 2),
    }[name]
    grads = rg.pytree.map(lambda p: torch.randn(p.shape, generator=g).bfloat16(), params)
    results = {}
    for gdtype in (torch.bfloat16, torch.float32):
        opt = make()
        world = 1 if name == "muon" else 2  # muon with comm=None: one rank
        pl = rg.make_plan(params, {"w": sp.Blocks(32, 32), "b": sp.Elements(1)}, world_size=world)
        shards = shard_all(pl, params)
        gsh = [s.replace(data=s.data.to(gdtype), replicated=s.replicated.to(gdtype)) for s in shard_all(pl, grads)]
        states = [opt.init(s) for s in shards]
        for _ in range(2):
            for r in range(world):
                u, states[r] = opt.update(gsh[r], states[r], shards[r])
                assert u.data.dtype == torch.float32
                shards[r] = rg.apply_updates(shards[r], u)
        results[gdtype] = gather_all(shards)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), results[torch.bfloat16], results[torch.float32])


@pytest.mark.parametrize("name", ["adamw", "sgd", "adam_chain", "adamw_8bit", "muon"])
def test_state_for_other_params_is_a_clear_error(name):
    from ragged import spec as sp

    params = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    specs = {"w": sp.Blocks(32, 32), "b": sp.Elements(1)}
    a = shard_all(rg.make_plan(params, specs, world_size=2), params)[0]
    b = shard_all(rg.make_plan(params, specs, world_size=1), params)[0]
    opt = {"adamw": lambda: rg.optim.adamw(1e-3), "sgd": lambda: rg.optim.sgd(0.1, momentum=0.9),
           "adam_chain": lambda: rg.optim.chain(rg.optim.scale_by_adam(), rg.optim.scale(-1.0)),
           "adamw_8bit": lambda: rg.optim.adamw_8bit(1e-3, min_size=1000),
           "muon": lambda: rg.optim.muon(0.02, comm=None)}[name]()
    state = opt.init(b)
    with pytest.raises(ValueError, match=r"do not match the (8-bit |optimizer )?state.*Fix: call opt.init"):
        opt.update(a, state, a)


def test_adamw_params_for_other_params_than_its_state_are_a_clear_error():
    """With weight decay adamw reads the params leaf by leaf beside the moments: params of
    another plan are refused by name, never zipped against the wrong buffers."""
    from ragged import spec as sp

    params = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    specs = {"w": sp.Blocks(32, 32), "b": sp.Elements(1)}
    a = shard_all(rg.make_plan(params, specs, world_size=2), params)[0]
    b = shard_all(rg.make_plan(params, specs, world_size=1), params)[0]
    opt = rg.optim.adamw(1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"adamw: the params do not match the optimizer state.*Fix: call opt.init"):
        opt.update(b, opt.init(b), a)


def test_every_public_constructor_names_the_keyword_meant():
    """A misspelt keyword of any rg.optim constructor (anything returning a transformation or a
    schedule) is a TypeError that suggests the right name, before anything is built."""
    import inspect

    checked = 0
    for name in sorted(dir(rg.optim)):
        fn = getattr(rg.optim, name)
        if not inspect.isfunction(fn) or inspect.signature(fn).return_annotation not in (
                "GradientTransformation", "Schedule"):
            continue
        keywords = [p.name for p in inspect.signature(fn).parameters.values()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        wrong = keywords[-1][:-1] + "x" if keywords else "learning_rate"
        with pytest.raises(TypeError) as info:
            fn(**{wrong: 1})
        assert isinstance(info.value, rg.RaggedError), name
        want = f"did you mean `{keywords[-1]}`?" if keywords else "It takes no keywords."
        assert f"rg.optim.{name}() got an unexpected keyword argument {wrong!r}" in str(info.value), str(info.value)
        assert want in str(info.value), str(info.value)
        checked += 1
    assert checked >= 20  # the filter found the constructors


@pytest.mark.parametrize("kw, meant", [({"lr": 1e-3}, "`learning_rate`"), ({"betas": (0.9, 0.99)}, "`b1` and `b2`"),
                                       ({"weight_decy": 0.1}, "`weight_decay`")])
def test_torch_spellings_name_the_keyword_to_use(kw, meant):
    with pytest.raises(TypeError, match=f"did you mean {meant}"):
        rg.optim.adamw(**kw) if "lr" in kw else rg.optim.adamw(1e-3, **kw)
