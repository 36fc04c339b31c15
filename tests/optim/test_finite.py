"""Non-finite gradients and hyperparameters: apply_if_finite, clip_by_global_norm's
error_if_nonfinite, validated hyperparameters, integer parameters refused (simulated ranks;
the gloo versions are in tests/distributed/test_optim_finite_gloo.py)."""

from __future__ import annotations

import re

import pytest
import torch

import ragged as rg
from tests.optim import _finite_cases as cases

simulate = rg.collectives.simulate
nan, inf = float("nan"), float("inf")


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("schedule", sorted(cases.SCHEDULES))
def test_apply_if_finite_equals_reference(m, schedule):
    cases.check_apply_if_finite(simulate(m, cases.run_apply_if_finite, schedule), schedule)


@pytest.mark.parametrize("where", ["shard", "replicated", None])
def test_clip_error_if_nonfinite_on_every_rank(where):
    cases.check_clip_nonfinite(simulate(2, cases.run_clip_nonfinite, where), where)


def test_clip_error_if_nonfinite_matches_torch():
    """Finite: the same clipped gradients as torch.nn.utils.clip_grad_norm_; non-finite: both raise."""
    g = torch.tensor([3.0, 4.0, 12.0], dtype=torch.float64)
    opt = rg.optim.clip_by_global_norm(2.0, comm=None, error_if_nonfinite=True)
    ours = opt.update(g, opt.init(None))[0]
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], 2.0, error_if_nonfinite=True)
    torch.testing.assert_close(ours, p.grad, rtol=1e-15, atol=0)
    for bad in (nan, inf, -inf):
        p.grad = torch.tensor([1.0, bad, 2.0], dtype=torch.float64)
        with pytest.raises(RuntimeError):
            torch.nn.utils.clip_grad_norm_([p], 2.0, error_if_nonfinite=True)
        with pytest.raises(rg.optim.NonFiniteError, match="not finite"):
            opt.update(p.grad, opt.init(None))
    assert issubclass(rg.optim.NonFiniteError, RuntimeError) and issubclass(rg.optim.NonFiniteError, rg.RaggedError)
    # without the flag, as torch: the NaN propagates
    loose = rg.optim.clip_by_global_norm(2.0, comm=None)
    assert torch.isnan(loose.update(torch.tensor([1.0, nan]), loose.init(None))[0]).all()


def test_clip_with_custom_norm_refuses_a_nonfinite_norm():
    opt = rg.optim.clip_by_global_norm(1.0, comm=None, norm=lambda u: torch.tensor(nan), error_if_nonfinite=True)
    with pytest.raises(rg.optim.NonFiniteError):
        opt.update(torch.ones(2), opt.init(None))


def _sharded(m=2):
    params = cases.params()
    plan = rg.make_plan(params, cases.SPECS, world_size=m)
    return plan, [rg.shard(plan, params, rank=r) for r in range(m)]


@pytest.mark.parametrize(
    "make", [lambda: rg.optim.apply_if_finite(rg.optim.sgd(0.1), 1, comm=None),
             lambda: rg.optim.clip_by_global_norm(1.0, comm=None)], ids=["apply_if_finite", "clip"])
def test_sharded_updates_need_a_comm(make):
    _, shards = _sharded()
    opt = make()
    with pytest.raises(ValueError, match=re.escape("sharded over world_size=2 ranks but comm=None")):
        opt.update(shards[0], opt.init(shards[0]), shards[0])


@pytest.mark.parametrize(
    "build, name",
    [
        (lambda: rg.optim.adamw(nan), "learning_rate"),
        (lambda: rg.optim.adamw(inf), "learning_rate"),
        (lambda: rg.optim.adamw(-1e-3), "learning_rate"),
        (lambda: rg.optim.adam(nan), "learning_rate"),
        (lambda: rg.optim.adamw(1e-3, b1=1.0), "b1"),
        (lambda: rg.optim.adamw(1e-3, b1=nan), "b1"),
        (lambda: rg.optim.adamw(1e-3, b2=-0.1), "b2"),
        (lambda: rg.optim.adamw(1e-3, eps=-1e-8), "eps"),
        (lambda: rg.optim.adamw(1e-3, eps=nan), "eps"),
        (lambda: rg.optim.adamw(1e-3, eps=inf), "eps"),
        (lambda: rg.optim.adamw(1e-3, weight_decay=nan), "weight_decay"),
        (lambda: rg.optim.adamw(1e-3, weight_decay=-0.1), "weight_decay"),
        (lambda: rg.optim.scale_by_adam(b2=1.5), "b2"),
        (lambda: rg.optim.sgd(nan), "learning_rate"),
        (lambda: rg.optim.sgd(0.1, momentum=-0.5), "momentum"),
        (lambda: rg.optim.sgd(0.1, momentum=1.0), "momentum"),
        (lambda: rg.optim.sgd(0.1, momentum=nan), "momentum"),
        (lambda: rg.optim.sgd(0.1, weight_decay=inf), "weight_decay"),
        (lambda: rg.optim.clip_by_global_norm(nan, comm=None), "max_norm"),
        (lambda: rg.optim.clip_by_global_norm(-1.0, comm=None), "max_norm"),
        (lambda: rg.optim.clip_by_global_norm(inf, comm=None), "max_norm"),
        (lambda: rg.optim.trace(nan), "decay"),
        (lambda: rg.optim.constant_schedule(nan), "value"),
        (lambda: rg.optim.linear_schedule(0.0, inf, 10), "end_value"),
        (lambda: rg.optim.warmup_cosine_decay_schedule(0.0, nan, 2, 10), "peak_value"),
        (lambda: rg.optim.constant_schedule(-1.0), "value"),  # negative: gradient ascent
        (lambda: rg.optim.linear_schedule(-1e-3, 0, 10), "init_value"),
        (lambda: rg.optim.warmup_cosine_decay_schedule(0, -3e-3, 5, 50), "peak_value"),
        (lambda: rg.optim.cosine_decay_schedule(1e-3, 10, alpha=-0.5), "alpha"),
        (lambda: rg.optim.apply_if_finite(rg.optim.sgd(0.1), -1, comm=None), "max_consecutive_errors"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_hyperparameters_are_refused_by_name(build, name):
    with pytest.raises(rg.RaggedValueError) as info:
        build()
    text = str(info.value)
    assert re.search(rf"\b{name} must be", text), text
    if name == "momentum":
        assert "decay" not in text


@pytest.mark.parametrize("make", [
    lambda lr: rg.optim.adamw(lr), lambda lr: rg.optim.adamw(lr, weight_decay=0.1, mask=lambda leaf: True),
    lambda lr: rg.optim.sgd(lr, momentum=0.9), lambda lr: rg.optim.adamw_8bit(lr),
    lambda lr: rg.optim.soap(lr), lambda lr: rg.optim.shampoo(lr),
], ids=["adamw", "adamw-masked", "sgd", "adamw_8bit", "soap", "shampoo"])
@pytest.mark.parametrize("bad", [-3e-3, nan], ids=["negative", "nan"])
def test_a_schedule_is_checked_on_the_values_it_returns(make, bad):
    """The values a callable learning rate returns are checked where the update computes them (on
    the CPU: no device sync), naming the count; the step checks them before its agreement
    (tests/distributed/test_fsdp_gloo.py); a schedule that is fine until count 2 passes twice."""
    params = {"w": torch.randn(8, 8), "b": torch.randn(8)}
    plan = rg.make_plan(params, {"w": rg.spec.Blocks(8, 8), "b": None}, world_size=1)
    local = rg.shard(plan, params, rank=0)
    opt = make(lambda count: 1e-3 if count < 2 else bad)
    state = opt.init(local)
    for _ in range(2):
        assert opt.fingerprint(state)  # the settings the step's agreement compares (at counts 0 and 1)
        updates, state = opt.update(local, state, local)
    with pytest.raises(rg.RaggedValueError, match=r"learning_rate must be a finite float >= 0, got .* at count 2"):
        opt.update(local, state, local)
    with pytest.raises(rg.RaggedValueError, match=r"learning_rate must be a finite float >= 0, got .* at count 2"):
        opt.fingerprint(state)


def test_the_fingerprint_names_each_setting_and_a_schedule_by_its_value():
    """What the step's agreement compares: name, arguments (numbers exactly), a schedule's value at
    the state's count, a combinator's parts under a prefix; other values by their kind only."""
    sched = rg.optim.linear_schedule(1e-3, 0.0, 10)
    opt = rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=None),
                         rg.optim.multi_transform({"a": rg.optim.soap(sched, precondition_frequency=5),
                                                   "b": rg.optim.adamw(3e-4)}, lambda leaf: "a"))
    params = {"w": torch.zeros(4, 4)}
    plan = rg.make_plan(params, {"w": rg.spec.Blocks(4, 4)}, world_size=1)
    local = rg.shard(plan, params, rank=0)
    state = opt.init(local)
    _, state = opt.update(local, state, local)
    got = dict(opt.fingerprint(state))
    assert got["chain[0]"] == "clip_by_global_norm" and got["chain[0].max_norm"] == "1.0"
    assert got["chain[0].norm"] == "None" and got["chain[1].['b'].learning_rate"] == "0.0003"
    assert got["chain[1].['a']"] == "soap" and got["chain[1].['a'].precondition_frequency"] == "5"
    assert got["chain[1].['a'].learning_rate"] == f"{float(sched(1))!r} at count 1"
    assert rg.optim.soap(3e-2).fingerprint(None) != rg.optim.soap(3e-3).fingerprint(None)


def test_eps_zero_stays_allowed():
    """torch.optim.Adam accepts eps=0 (ragged maps 0/0 on padding to 0): kept."""
    assert rg.optim.adamw(1e-3, eps=0.0) is not None


@pytest.mark.parametrize("make", [lambda: rg.optim.adamw(1e-3), lambda: rg.optim.adam(1e-3), lambda: rg.optim.sgd(0.1),
                                  lambda: rg.optim.sgd(0.1, momentum=0.9), lambda: rg.optim.adamw(1e-3, weight_decay=0.1, mask=lambda leaf: True)],
                         ids=["adamw", "adam", "sgd", "sgd-momentum", "adamw-masked"])
def test_integer_params_are_refused_clearly(make):
    params = {"w": torch.arange(12).reshape(3, 4), "n": torch.arange(5)}
    plan = rg.make_plan(params, world_size=1)
    local = rg.shard(plan, params, rank=0)
    assert local.data.dtype == torch.int64
    with pytest.raises(rg.RaggedTypeError, match=re.escape("params.data (a DBuffer's buffer) has dtype torch.int64")):
        make().init(local)


def test_skipped_update_keeps_negative_zero():
    opt = rg.optim.apply_if_finite(rg.optim.sgd(0.1), 3, comm=None)
    p = torch.tensor([-0.0, 0.0, 1.5])
    u, state = opt.update(torch.tensor([1.0, nan, 1.0]), opt.init(p), p)
    out = rg.optim.apply_updates(p, u)
    assert torch.equal(torch.signbit(out), torch.signbit(p)) and torch.equal(out, p)
    assert int(state.total_notfinite) == 1 and not bool(state.last_finite)
