"""SOAP and Shampoo over DBuffers: float64 against the references written from the papers, the
same bits at every world size, and every fallback and refusal of the blocks."""

import pytest
import torch

import ragged as rg
from ragged import spec
from tests.optim import _precond_cases as cases

MAKE = {"soap": cases.make_soap, "shampoo": cases.make_shampoo}


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_float64_equals_reference_at_every_world_size(name):
    params = cases.exact_params()
    gs = cases.grads(params)
    want = cases.reference(name, params, gs)
    runs = {w: cases.run_world(params, cases.EXACT_SPECS, gs, MAKE[name], w) for w in (1, 2, 3, 4)}
    for w, got in runs.items():
        for k, v in want.items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-10, atol=1e-10, msg=lambda m: f"W={w} {k}: {m}")
        moved = (got["params"]["w"] - params["w"]).abs().max()
        assert moved > 1e-3, "the test must move the parameters"
        cases.assert_bit_identical(got, runs[1], f"{name} W={w} vs W=1")


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_fp32_state_bit_identical_at_every_world_size_with_edge_tiles(name):
    """Edge tiles of every part, a 3-D leaf and (SOAP) 1-D blocks: params, moments, statistics and
    eigenbases / roots, after 5 steps with two refreshes, at W = 1, 2, 3, 4."""
    params = cases.edge_params()
    gs = cases.grads(params)
    kw = {"precondition_1d": True} if name == "soap" else {}
    make = lambda: MAKE[name](torch.float32, **kw)  # noqa: E731
    one = cases.run_world(params, cases.EDGE_SPECS, gs, make, 1)
    assert {k[2] for k in one["factors"]} == {"interior", "right", "bottom", "corner"}
    for w in (2, 3, 4):
        cases.assert_bit_identical(cases.run_world(params, cases.EDGE_SPECS, gs, make, w), one, f"{name} W={w}")


# ---- fallbacks: visible per leaf, and numerically the element-wise method ------------------------

FALLBACKS = {  # name: (shape, spec, optimizer options, the reason's words)
    "0-d": ((), spec.Rows(1), {}, "not a matrix (0-D)"),
    "1-D": ((6,), spec.Elements(2), {}, "not a matrix (1-D)"),
    "replicated": ((4, 4), spec.Replicate(), {}, "replicated (spec.Replicate())"),
    "Elements": ((4, 4), spec.Elements(4), {}, "Elements(n=4) granules are not matrix blocks"),
    "Rows without a width": ((4, 4), spec.Rows(2), {}, "Rows(2) has no block width"),
    "max_precondition_dim": ((8, 8), spec.Blocks(8, 8), {"max_precondition_dim": 4},
                             "8 x 8 blocks exceed max_precondition_dim=4"),
    "precondition_filter": ((4, 4), spec.Blocks(4, 4), {"precondition_filter": lambda leaf: leaf.path != "['x']"},
                            "precondition_filter excludes it"),
}


@pytest.mark.parametrize("name", ["soap", "shampoo"])
@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallback_is_visible_and_is_the_elementwise_method(name, case):
    """The leaf ``x`` falls back (the reason in preconditioned_leaves and in the state's repr) and
    moves as the reference's element-wise method; the block leaf ``w`` beside it is preconditioned."""
    shape, x_spec, kw, reason = FALLBACKS[case]
    g = torch.Generator().manual_seed(5)
    params = {"x": torch.randn(shape, generator=g, dtype=torch.float64),
              "w": torch.randn(8, 4, generator=g, dtype=torch.float64)}
    gs = cases.grads(params)
    make = lambda: MAKE[name](**kw)  # noqa: E731
    plan = rg.make_plan(params, {"x": x_spec, "w": spec.Blocks(4, 4)}, world_size=2)
    per_rank = [cases.run_rank(plan, params, gs, make(), r) for r in range(2)]
    leaves = rg.optim.preconditioned_leaves(per_rank[0][1])
    assert leaves["['x']"].block is None and reason in leaves["['x']"].reason
    assert leaves["['w']"].block == (4, 4) and leaves["['w']"].reason is None
    assert reason in repr(per_rank[0][1].factors)
    blocks = {"w": (4, 4)}
    want = (cases.ref.soap_reference(params, gs, blocks, cases.SOAP_HP) if name == "soap"
            else cases.ref.shampoo_reference(params, gs, blocks, cases.SHAMPOO_HP))
    got = cases.whole(plan, per_rank)["params"]
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")


def test_rows_with_a_block_width_and_1d_blocks_match_the_reference():
    """``Rows(4)`` with ``block=(4, 4)``: 4 x 4 tiles of each 4-row band; SOAP's ``precondition_1d``
    on an ``Elements(4)`` leaf: 1 x 4 blocks (the reference: each granule a 1 x 4 matrix)."""
    g = torch.Generator().manual_seed(6)
    params = {"h": torch.randn(8, 8, generator=g, dtype=torch.float64),
              "w": torch.randn(8, 4, generator=g, dtype=torch.float64)}
    gs = cases.grads(params)
    specs = {"h": spec.Rows(4), "w": spec.Blocks(4, 4)}
    got = cases.run_world(params, specs, gs, lambda: cases.make_shampoo(block=(4, 4)), 2)["params"]
    want = cases.ref.shampoo_reference(params, gs, {"h": (4, 4), "w": (4, 4)}, cases.SHAMPOO_HP)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    vec = {"v": torch.randn(12, generator=g, dtype=torch.float64)}
    gs = cases.grads(vec)
    got = cases.run_world(vec, {"v": spec.Elements(4)}, gs, lambda: cases.make_soap(precondition_1d=True), 3)["params"]
    want = cases.ref.soap_reference({"v": vec["v"].view(3, 4)}, [{"v": x["v"].view(3, 4)} for x in gs],
                                    {"v": (1, 4)}, cases.SOAP_HP)
    torch.testing.assert_close(got["v"], want["v"].view(12), rtol=1e-10, atol=1e-12)


# ---- refusals: before any update, naming the spec to plan with ----------------------------------

REFUSALS = {  # name: (shape, spec, the words of the error)
    "other Blocks": ((8, 8), spec.Blocks(8, 8), "whose tiles are 8 x 8"),
    "other Rows": ((8, 8), spec.Rows(2), "whose bands are 2 rows, not 4"),
    "Elements": ((8, 8), spec.Elements(1), "which may cut a row anywhere"),
}


@pytest.mark.parametrize("name", ["soap", "shampoo"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_plan_not_matching_the_block_is_refused_at_init(name, case):
    shape, w_spec, words = REFUSALS[case]
    params = {"w": torch.zeros(shape), "b": torch.zeros(8)}
    local = rg.shard(rg.make_plan(params, {"w": w_spec, "b": None}, world_size=2), params, rank=1)
    with pytest.raises(rg.LayoutError) as err:
        MAKE[name](block=(4, 4)).init(local)
    assert words in str(err.value) and "spec.Blocks(4, 4)" in str(err.value) and "params['w']" in str(err.value)
    assert err.value.path == "['w']" and err.value.shape == shape


def test_plan_that_cuts_blocks_is_refused():
    params = {"w": torch.zeros(6, 4)}
    plan = rg.make_plan(params, spec.Blocks(3, 4), world_size=4, strategy="naive", align=1)
    assert plan.split_blocks
    for name in MAKE:
        with pytest.raises(rg.LayoutError, match="cuts .* granule"):
            MAKE[name]().init(rg.shard(plan, params, rank=0))


def test_bad_hyperparameters_are_refused_by_name():
    for make, words in [(lambda: rg.optim.soap(1e-3, b1=1.0), "b1"), (lambda: rg.optim.soap(1e-3, block=(4, 0)), "block cols"),
                        (lambda: rg.optim.soap(1e-3, matrix_dtype=torch.float16), "matrix_dtype"),
                        (lambda: rg.optim.shampoo(1e-3, b2=1.5), "b2"), (lambda: rg.optim.shampoo(1e-3, grafting="adagrad"), "grafting"),
                        (lambda: rg.optim.shampoo(1e-3, precondition_frequency=10, start_preconditioning_step=5),
                         "start_preconditioning_step"),
                        (lambda: rg.optim.shampoo(1e-3, precondition_frequency=0), "precondition_frequency")]:
        with pytest.raises(rg.RaggedError, match=words):
            make()
    with pytest.raises(TypeError, match="DBuffers"):
        rg.optim.soap(1e-3).init({"w": torch.zeros(4, 4)})
    plan = rg.make_plan({"w": torch.zeros(4, 4)}, spec.Blocks(2, 2), world_size=2)
    local, other = (rg.shard(plan, {"w": torch.zeros(4, 4)}, rank=r) for r in (0, 1))
    state = rg.optim.soap(1e-3).init(local)
    with pytest.raises(rg.RaggedError, match=r"state was built for .*DBuffer\(rank=0"):
        rg.optim.soap(1e-3).update(other, state, other)
    with pytest.raises(rg.RaggedError, match="other block options"):
        rg.optim.soap(1e-3, max_precondition_dim=1).update(local, state, local)


# ---- chained with clipping, schedules, multi_transform, apply_if_finite ---------------------------

@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_chains_with_clipping_and_a_schedule(name):
    params = cases.exact_params()
    gs = cases.grads(params)
    schedule = rg.optim.linear_schedule(0.02, 0.005, cases.STEPS)
    norm = 1.5  # below the gradients' norm: clipping acts on every step
    clipped = []
    for g in gs:
        total = torch.sqrt(sum((v**2).sum() for v in g.values()))
        clipped.append({k: v * min(1.0, norm / (float(total) + 1e-6)) for k, v in g.items()})
    hp = dict(cases.SOAP_HP if name == "soap" else cases.SHAMPOO_HP, lr=lambda c: float(schedule(c)))
    want = (cases.ref.soap_reference if name == "soap" else cases.ref.shampoo_reference)(params, clipped,
                                                                                        cases.EXACT_BLOCKS, hp)
    plan = rg.make_plan(params, cases.EXACT_SPECS, world_size=2)

    def fn(comm):
        local = rg.shard(plan, params, comm)
        opt = rg.optim.chain(rg.optim.clip_by_global_norm(norm, comm=comm), _with_lr(name, schedule))
        state = opt.init(local)
        for g in gs:
            updates, state = opt.update(rg.shard(plan, g, comm), state, local)
            local = rg.apply_updates(local, updates)
        return rg.gather(local, comm)

    for got in rg.collectives.simulate(2, fn):
        for k in params:
            torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")


def _with_lr(name, lr):
    h = cases.SOAP_HP if name == "soap" else cases.SHAMPOO_HP
    if name == "soap":
        return rg.optim.soap(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"],
                             shampoo_beta=h["shampoo_beta"], precondition_frequency=h["precondition_frequency"],
                             matrix_dtype=torch.float64)
    return rg.optim.shampoo(lr, b1=h["b1"], b2=h["b2"], matrix_eps=h["matrix_eps"], weight_decay=h["weight_decay"],
                            precondition_frequency=h["precondition_frequency"],
                            start_preconditioning_step=h["start_preconditioning_step"], matrix_dtype=torch.float64)


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_multi_transform_gives_other_leaves_to_another_optimizer(name):
    """SOAP / Shampoo for the block leaves (``precondition_filter`` the same predicate, so the
    other leaves cost no blocks), plain SGD for the rest."""
    params = cases.exact_params()
    gs = cases.grads(params)
    mine = lambda leaf: leaf.path in ("['w']", "['e']")  # noqa: E731
    inner = MAKE[name](precondition_filter=mine)
    opt = rg.optim.multi_transform({"pre": inner, "sgd": rg.optim.sgd(0.1)}, lambda leaf: "pre" if mine(leaf) else "sgd")
    plan = rg.make_plan(params, cases.EXACT_SPECS, world_size=3)
    per_rank = [cases.run_rank(plan, params, gs, opt, r) for r in range(3)]
    got = rg.unflatten(plan, torch.cat([d.data for d, _ in per_rank]), per_rank[0][0].replicated)
    sub = {k: params[k] for k in ("w", "e")}
    want = cases.reference(name, sub, [{k: g[k] for k in sub} for g in gs])
    for k in params:
        expect = want[k] if k in sub else params[k] - 0.1 * sum(g[k] for g in gs)
        torch.testing.assert_close(got[k], expect, rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")
    state = per_rank[0][1].inner_states["pre"]
    assert {p for p, leaf in rg.optim.preconditioned_leaves(state).items() if leaf.block} == {"['w']", "['e']"}


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_apply_if_finite_skips_a_nan_step_on_a_refresh(name):
    """A NaN gradient on the step that refreshes the bases / roots (the eigendecomposition of a NaN
    matrix) is skipped: parameters and state as if the step never came."""
    params = cases.exact_params()
    gs = cases.grads(params, cases.STEPS + 1)
    bad = 2 if name == "soap" else 1  # SOAP's first refresh is at call 3, Shampoo's first root at call 2
    gs[bad] = dict(gs[bad], w=torch.full_like(gs[bad]["w"], float("nan")))
    want = cases.reference(name, params, gs[:bad] + gs[bad + 1:])
    plan = rg.make_plan(params, cases.EXACT_SPECS, world_size=1)
    local, state = cases.run_rank(plan, params, gs, rg.optim.apply_if_finite(MAKE[name](), 3, comm=None), 0)
    assert int(state.total_notfinite) == 1
    got = rg.unflatten(plan, local.data, local.replicated)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("name, options", [
    ("soap", {"normalize_grads": True, "correct_bias": False}),
    ("shampoo", {"grafting": None, "exponent": 1 / 3, "b2": 1.0, "b1": 0.0}),
])
def test_other_options_match_the_reference(name, options):
    """SOAP's per-block normalisation without bias correction; Shampoo without grafting, with another
    root and summed (AdaGrad) statistics, no filtered gradient."""
    params = cases.exact_params()
    gs = cases.grads(params)
    hp = dict(cases.SOAP_HP if name == "soap" else cases.SHAMPOO_HP, **options)
    if name == "soap":
        make = lambda: cases.make_soap(normalize_grads=True, correct_bias=False)  # noqa: E731
        want = cases.ref.soap_reference(params, gs, cases.EXACT_BLOCKS, hp)
    else:
        make = lambda: rg.optim.shampoo(hp["lr"], b1=0.0, b2=1.0, matrix_eps=hp["matrix_eps"],  # noqa: E731
                                        weight_decay=hp["weight_decay"], precondition_frequency=cases.FREQ,
                                        grafting=None, inverse_exponent_override=1 / 3, matrix_dtype=torch.float64)
        want = cases.ref.shampoo_reference(params, gs, cases.EXACT_BLOCKS, hp)
    got = cases.run_world(params, cases.EXACT_SPECS, gs, make, 2)["params"]
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")
