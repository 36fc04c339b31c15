"""Block-wise 8-bit Adam: world-size independence, quantization maps, compiled vs eager, numerics vs fp32 AdamW."""

import math

import pytest
import torch

import ragged as rg
from ragged import _compat, spec
from ragged.optim import _quant8_fused
from ragged.optim._quant8_codec import codec

from tests.optim._cases import gather_all, padding_mask, shard_all


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return {
        "attn": r(100, 70),  # Blocks(32, 32): bands 32,32,32,4 x tiles 32,32,6 (edge tiles)
        "experts": r(4, 64, 48),  # 3-D, Blocks(32, 32): 8 bands x 2 tiles (last 16 wide)
        "flat": r(5000),  # Elements(256): last block 136 elements
        "mlp": r(96, 64),  # Rows(1): fp32 state
        "bias": r(70),  # small: fp32 state
        "norm": r(70),  # Replicate: fp32 state
    }


SPECS = {
    "attn": spec.Blocks(32, 32),
    "experts": spec.Blocks(32, 32),
    "flat": spec.Elements(256),
    "mlp": spec.Rows(1),
    "bias": spec.Elements(1),
    "norm": spec.Replicate(),
}
QUANTIZED = ("['attn']", "['experts']", "['flat']")


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(500 + step)
    return rg.pytree.map(lambda p: scale * torch.randn(p.shape, generator=g, dtype=p.dtype), params)


def _run(world_size, steps=4, opt=None, params=None, specs=SPECS, device="cpu"):
    params = params if params is not None else _params()
    plan = rg.make_plan(params, specs, world_size=world_size)
    opt = opt or rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000)
    on = lambda ds: [d.replace(data=d.data.to(device), replicated=d.replicated.to(device)) for d in ds]  # noqa: E731
    shards = on(shard_all(plan, params))
    states = [opt.init(s) for s in shards]
    for step in range(steps):
        gs = on(shard_all(plan, _grads(params, step)))
        for r in range(world_size):
            u, states[r] = opt.update(gs[r], states[r], shards[r])
            shards[r] = rg.apply_updates(shards[r], u)
    return plan, shards, states


def _leaf_states(plan, shards, states):
    """Per leaf path: every state tensor concatenated over ranks in rank order."""
    out = {}
    for r, (s, st) in enumerate(zip(shards, states)):
        per = rg.optim.adam8bit_leaf_state(st[0].moments, s, min_size=1000)
        for path, parts in per.items():
            if path in out and path in [l.path for l in plan.replicated]:
                continue  # replicated: once
            slot = out.setdefault(path, {})
            for k, v in parts.items():
                slot[k] = torch.cat([slot[k], v]) if k in slot else v.clone()
    return out


def _assert_same_state(a, b, what):
    assert a.keys() == b.keys()
    for path, parts in a.items():
        for k, v in parts.items():
            assert torch.equal(b[path][k], v), (what, path, k)


def test_state_bit_identical_across_world_sizes():
    runs = {m: _run(m) for m in (1, 2, 3, 4)}
    # the big leaves really are split across ranks at m=4
    plan4 = runs[4][0]
    assert any(len(plan4.owners(plan4.leaf(p))) > 1 for p in QUANTIZED)
    ref_state = _leaf_states(*runs[1])
    ref_params = gather_all(runs[1][1])
    for path in QUANTIZED:
        assert ref_state[path]["mu_codes"].dtype == torch.uint8
        assert ref_state[path]["nu_scales"].numel() > 1
    for m in (2, 3, 4):
        state = _leaf_states(*runs[m])
        assert state.keys() == ref_state.keys()
        for path, parts in ref_state.items():
            for k, v in parts.items():
                assert torch.equal(state[path][k], v), (m, path, k)
        params = gather_all(runs[m][1])
        rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), params, ref_params)


def test_padding_stays_zero_and_blocks_counted():
    plan, shards, states = _run(3)
    for r, s in enumerate(shards):
        pad = padding_mask(plan, r)
        assert torch.equal(s.data[pad], torch.zeros_like(s.data[pad]))
    total_blocks = sum(int(st[0].moments.mu_scales.numel()) for st in states)
    # attn: 4 bands x 3 tiles; experts: 4*64/32 = 8 bands x 2 tiles; flat: ceil(5000/256)
    assert total_blocks == 4 * 3 + 8 * 2 + math.ceil(5000 / 256)


@pytest.mark.parametrize("signed", [True, False])
def test_codec_roundtrip_error_bound(signed):
    c = codec(signed, "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 100, generator=g) * torch.logspace(-4, 0, 100)
    if not signed:
        x = x.abs()
    codes, absmax = c.encode_blocks(x, (32, 32))
    y = c.decode_blocks(codes, absmax, x.shape, (32, 32))
    assert absmax.numel() == 3 * 4
    # the absmax of each block is exact, and the map's relative step is at most 0.9/2 of a decade
    # slot: |y - x| <= 0.5 * gap between neighbouring table values around x, plus the rounding of
    # the normalisation (x times 1 / absmax) and of the decode (table value times absmax)
    table = rg.optim.dynamic_map(signed).double()
    scale = absmax.view(3, 1, 4, 1).expand(3, 32, 4, 32).reshape(96, 128)[:70, :100]
    xs = x.double() / scale.double()
    idx = torch.searchsorted(table, xs.clamp(-1, 1)).clamp(1, len(table) - 1)
    gap = (table[idx] - table[idx - 1]).float()
    eps = torch.finfo(torch.float32).eps
    assert torch.all((y - x).abs() <= 0.5 * gap * scale + 4 * eps * (x.abs() + scale * gap) + 1e-12)
    # max element of each block round-trips exactly
    assert torch.equal(y.abs().amax(), x.abs().amax())


@pytest.mark.parametrize("signed", [True, False])
def test_encode_is_nearest_code(signed):
    """The table lookup of the encoder picks the nearest map value, checked against a brute-force
    search on random values across the map's whole range, on the map's values, and at and next
    to every midpoint (the midpoints are float32: within one ulp of one either neighbour may
    win; exactly on it, the smaller magnitude)."""
    c = codec(signed, "cpu")
    values = rg.optim.dynamic_map(signed)
    mids = ((values[:-1].double() + values[1:].double()) / 2).float()
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))])
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(20000, generator=g) * torch.logspace(-9, 0, 20000)
    exact = torch.cat([rand, -rand, values, torch.tensor([0.0, -0.0, 1.0, 1e-30, 1e-45])])
    x = torch.cat([exact, near]).clamp(-1, 1)
    if not signed:
        x = x.abs()
    got = values[c.encode(x, torch.ones(())).long()].double()
    best = (values.double()[None, :] - x.double()[:, None]).abs().min(dim=1).values
    err = (got - x.double()).abs() - best
    assert torch.all(err[: len(exact)] == 0)  # a nearest value
    ulp = (torch.nextafter(x.abs(), torch.tensor(2.0)) - x.abs()).double()
    assert torch.all(err <= ulp)
    on_mid = values[c.encode(mids, torch.ones(())).long()]
    assert torch.equal(on_mid, torch.where(mids >= 0, values[:-1], values[1:]))  # the neighbour nearer to zero
    assert c.encode(torch.zeros(3), torch.ones(())).tolist() == [c.zero] * 3


def test_numerics_close_to_fp32_adamw():
    """8-bit vs fp32 AdamW on a least-squares problem: loss curves within 5% relative."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 64, generator=g)
    W_true = torch.randn(64, 96, generator=g)
    Y = X @ W_true + 0.01 * torch.randn(256, 96, generator=g)
    params = {"w": 0.1 * torch.randn(64, 96, generator=g)}
    plan = rg.make_plan(params, {"w": spec.Blocks(32, 32)}, world_size=2)

    def loss_and_grad(full):
        w = full["w"].clone().requires_grad_(True)
        loss = ((X @ w - Y) ** 2).mean()
        loss.backward()
        return loss.item(), {"w": w.grad}

    curves = {}
    for name, opt in {"fp32": rg.optim.adamw(3e-2, weight_decay=0.01),
                      "8bit": rg.optim.adamw_8bit(3e-2, weight_decay=0.01, min_size=1024)}.items():
        shards = shard_all(plan, params)
        states = [opt.init(s) for s in shards]
        losses = []
        for _ in range(150):
            loss, grads = loss_and_grad(gather_all(shards))
            losses.append(loss)
            gs = shard_all(plan, grads)
            for r in range(2):
                u, states[r] = opt.update(gs[r], states[r], shards[r])
                shards[r] = rg.apply_updates(shards[r], u)
        curves[name] = torch.tensor(losses)
    assert curves["8bit"][-1] < 0.05 * curves["8bit"][0]  # it trains
    rel = (curves["8bit"] - curves["fp32"]).abs() / curves["fp32"]
    assert rel.max() < 0.05, rel.max()


def test_state_bytes_about_two_per_param():
    params = {"w": torch.randn(256, 256), "e": torch.randn(8192)}
    plan = rg.make_plan(params, {"w": spec.Blocks(32, 32), "e": spec.Elements(256)}, world_size=2)
    shards = shard_all(plan, params)
    n = sum(p.numel() for p in params.values())
    nbytes = sum(rg.optim.state_nbytes(rg.optim.adamw_8bit(1e-3).init(s)) for s in shards)
    fp32 = sum(rg.optim.state_nbytes(rg.optim.adamw(1e-3).init(s)) for s in shards)
    # fp32 Adam keeps 8 bytes per buffer element (padding included); 8-bit keeps 2 per real
    # element plus 8 per block (Blocks(32, 32): 1024 elements, Elements(256): 256)
    assert fp32 == 8 * plan.buffer_numel + 2 * 8
    assert nbytes == 2 * n + 8 * (256 * 256 // 1024 + 8192 // 256) + 2 * 8


def test_rejects_naive_plan_that_cuts_blocks():
    params = {"w": torch.randn(64, 64)}
    plan = rg.make_plan(params, {"w": spec.Blocks(32, 32)}, world_size=3, strategy="naive")
    assert plan.split_blocks > 0
    with pytest.raises(rg.LayoutError, match="cuts .* block.*strategy='dp'"):
        rg.optim.adamw_8bit(1e-3, min_size=1).init(shard_all(plan, params)[0])


def test_rejects_plain_tensors():
    with pytest.raises(TypeError, match="adamw_8bit works on DBuffers"):
        rg.optim.adamw_8bit(1e-3).init({"w": torch.zeros(3)})


@pytest.mark.parametrize("world_size", [1, 3])
def test_donate_is_bit_identical_and_reuses_buffers(world_size):
    make = lambda donate: rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000, donate=donate)  # noqa: E731
    plan, shards, states = _run(world_size, opt=make(False))
    plan_d, shards_d, states_d = _run(world_size, opt=make(True))
    assert plan == plan_d
    ref, got = _leaf_states(plan, shards, states), _leaf_states(plan_d, shards_d, states_d)
    assert ref.keys() == got.keys()
    for path, parts in ref.items():
        for k, v in parts.items():
            assert torch.equal(got[path][k], v), (path, k)
    for a, b in zip(shards, shards_d):
        assert torch.equal(a.data, b.data) and torch.equal(a.replicated, b.replicated)
    # the update is written into the donated gradient buffer, the codes into the state's
    params = _params()
    local = shard_all(plan_d, params)[0]
    opt = make(True)
    state = opt.init(local)
    codes_ptr = state[0].moments.mu_codes.data_ptr()
    grads = shard_all(plan_d, _grads(params, 0))[0]
    grads_ptr = grads.data.data_ptr()
    updates, state = opt.update(grads, state, local)
    assert updates.data.data_ptr() == grads_ptr and state[0].moments.mu_codes.data_ptr() == codes_ptr
    pad = padding_mask(plan_d, 0)
    assert torch.equal(updates.data[pad], torch.zeros_like(updates.data[pad]))


@pytest.mark.parametrize("limit", [1, 700, 5000, 1 << 30])
def test_chunked_quantization_changes_nothing(limit, monkeypatch):
    from ragged.optim import _quant8_state

    make = lambda: rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000, kernel="eager")  # noqa: E731
    reference = _leaf_states(*_run(2, opt=make()))
    monkeypatch.setattr(_quant8_state.chunks, "__defaults__", (limit,))
    chunked = _leaf_states(*_run(2, opt=make()))
    _assert_same_state(reference, chunked, limit)


def _big_params():
    """Leaves of several chunks (``CHUNK`` elements each), edge tiles, a long Elements run with a
    short last block, and leaves of one band, one tile and one row, next to the usual ones."""
    g = torch.Generator().manual_seed(2)
    out = _params()
    out["wide"] = torch.randn(70, 2100, generator=g)  # Blocks(32, 32): 3 bands, last 4 rows; last tile 20 wide
    out["long"] = torch.randn(300_000, generator=g)  # Elements(256): 2 chunks, the last of 37 blocks
    out["one_band"] = torch.randn(20, 300, generator=g)  # one band of 20 rows, last tile 12 wide
    out["one_tile"] = torch.randn(200, 30, generator=g)  # one tile per band
    out["one_row"] = torch.randn(1, 5000, generator=g)  # a 2-D leaf of one row
    return out


BIG_SPECS = dict(SPECS, wide=spec.Blocks(32, 32), long=spec.Elements(256), one_band=spec.Blocks(32, 32),
                 one_tile=spec.Blocks(32, 32), one_row=spec.Blocks(32, 32))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_and_eager_bit_identical_and_compiled_once(monkeypatch):
    """kernel="compiled" (torch.compile of the fused update) gives the eager ops' state and
    updates bit for bit, at world sizes 1 and 3 (so it is world-size independent too), with and
    without donation, through chunks of one band, one tile, one row and edge tiles; and it
    compiles one graph per key (here Blocks(32, 32) and Elements(256)), never recompiling across
    steps, buffers, pieces, chunk sizes or world sizes. Where torch's inductor cannot lower the
    Elements(256) key (torch 2.11), kernel="compiled" is refused naming the torch it needs."""
    monkeypatch.setattr(_quant8_fused, "_compiled", {})
    if _compat.ADAMW_8BIT_COMPILE_NOTE:
        opt = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000, kernel="compiled")
        said = r"(?s)\(1, 256\) blocks .*needs torch >= 2\.13 .*Fix: kernel='auto'"
        with pytest.raises(rg.RaggedValueError, match=said):
            _run(1, steps=1, opt=opt, params=_big_params(), specs=BIG_SPECS)
        return
    before = _graphs()
    for world_size in (1, 3):
        for donate in (False, True):
            runs = {}
            for kernel in ("compiled", "eager"):
                opt = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000, donate=donate, kernel=kernel)
                runs[kernel] = _run(world_size, steps=3, opt=opt, params=_big_params(), specs=BIG_SPECS)
            _assert_same_state(_leaf_states(*runs["eager"]), _leaf_states(*runs["compiled"]), (world_size, donate))
            for a, b in zip(runs["compiled"][1], runs["eager"][1]):
                assert torch.equal(a.data, b.data) and torch.equal(a.replicated, b.replicated)
    keys = _quant8_fused._compiled
    assert len(keys) == 2 and all(callable(f) for f in keys.values()), keys
    assert _graphs() - before == 2


@pytest.mark.slow
def test_compiled_chain_without_decay_matches_eager(monkeypatch):
    """The compiled form of scale_by_adam_8bit (no decay, no learning rate: another key) with
    eps=0 (NaN -> 0) equals the eager ops."""
    monkeypatch.setattr(_quant8_fused, "_compiled", {})
    params = {"w": torch.randn(100, 70, generator=torch.Generator().manual_seed(4))}
    specs = {"w": spec.Blocks(32, 32)}
    make = lambda k: rg.optim.chain(rg.optim.scale_by_adam_8bit(eps=0.0, min_size=1000, kernel=k))  # noqa: E731
    runs = {k: _run(2, steps=3, opt=make(k), params=params, specs=specs) for k in ("compiled", "eager")}
    _assert_same_state(_leaf_states(*runs["eager"]), _leaf_states(*runs["compiled"]), "eps=0")


def test_auto_falls_back_to_eager_with_a_warning_when_compile_fails(monkeypatch):
    """kernel="auto" without $RAGGED_QUANT8_KERNEL: a compile that fails means the eager ops,
    one warning that says why, and the same result; kernel="compiled" raises instead."""
    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_quant8_fused, "_compiled", {})
    monkeypatch.delenv(_quant8_fused.ENV, raising=False)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    with pytest.warns(RuntimeWarning, match="eager torch ops .*no compiler here"):
        got = _leaf_states(*_run(1, steps=2, opt=rg.optim.adamw_8bit(1e-2, min_size=1000, kernel="auto")))
    want = _leaf_states(*_run(1, steps=2, opt=rg.optim.adamw_8bit(1e-2, min_size=1000, kernel="eager")))
    _assert_same_state(want, got, "fallback")
    said = r"kernel='compiled' \(the update of \(32, 32\) blocks on cpu, torch .*\): torch.compile failed.*no compiler"
    with pytest.raises(rg.RaggedValueError, match=said):
        _run(1, steps=1, opt=rg.optim.adamw_8bit(1e-2, min_size=1000, kernel="compiled"))


def test_auto_refuses_compiled_result_that_differs(monkeypatch):
    """The first compiled chunk is checked against the eager ops: one differing bit and
    kernel="auto" keeps the eager ops (with a warning naming what differed)."""
    def off_by_one_bit(fn, **kw):
        def run(*args):
            u, mc, ms, vc, vs = fn(*args)
            return (u.view(torch.int32) ^ 1).view(torch.float32), mc, ms, vc, vs

        return run

    monkeypatch.setattr(_quant8_fused, "_compiled", {})
    monkeypatch.setenv(_quant8_fused.ENV, "compiled")
    monkeypatch.setattr(torch, "compile", off_by_one_bit)
    with pytest.raises(rg.RaggedValueError, match="update differ from the eager ops'"):
        _run(1, steps=1, opt=rg.optim.adamw_8bit(1e-2, min_size=1000))
    monkeypatch.setattr(_quant8_fused, "_compiled", {})
    monkeypatch.delenv(_quant8_fused.ENV)
    with pytest.warns(RuntimeWarning, match="update differ"):
        _run(1, steps=1, opt=rg.optim.adamw_8bit(1e-2, min_size=1000))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_on_cuda_equals_eager_on_cuda_and_cpu(monkeypatch):
    """On CUDA (Triton): the compiled update equals CUDA's eager ops and the CPU's, bit for bit."""
    monkeypatch.setattr(_quant8_fused, "_compiled", {})
    results = {}
    for device, kernel in (("cuda", "compiled"), ("cuda", "eager"), ("cpu", "eager")):
        opt = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000, kernel=kernel)
        plan, shards, states = _run(1, steps=3, opt=opt, params=_big_params(), specs=BIG_SPECS, device=device)
        results[device, kernel] = {path: {k: v.cpu() for k, v in parts.items()}
                                   for path, parts in _leaf_states(plan, shards, states).items()}
    assert callable(next(iter(_quant8_fused._compiled.values())))
    _assert_same_state(results["cpu", "eager"], results["cuda", "eager"], "cuda eager")
    _assert_same_state(results["cpu", "eager"], results["cuda", "compiled"], "cuda compiled")


def test_fused_adamw_8bit_equals_the_chain():
    """adamw_8bit fuses weight decay and the learning rate into the 8-bit pass: same state
    structure and bit-identical updates as the chain it replaces (here with a schedule). Eager
    ops; the compiled form equals them for both (the two compiled tests above)."""
    kernel = "eager"
    lr = rg.optim.linear_schedule(1e-2, 1e-3, 4)
    fused = rg.optim.adamw_8bit(lr, weight_decay=0.1, min_size=1000, kernel=kernel)
    chain = rg.optim.chain(rg.optim.scale_by_adam_8bit(min_size=1000, kernel=kernel),
                           rg.optim.add_decayed_weights(0.1), rg.optim.scale_by_learning_rate(lr))
    (plan, shards_f, states_f), (_, shards_c, states_c) = _run(2, opt=fused), _run(2, opt=chain)
    assert rg.pytree.structure(states_f) == rg.pytree.structure(states_c)
    _assert_same_state(_leaf_states(plan, shards_c, states_c), _leaf_states(plan, shards_f, states_f), kernel)
    for a, b in zip(shards_f, shards_c):
        assert torch.equal(a.data, b.data) and torch.equal(a.replicated, b.replicated)


def test_rejects_unknown_kernel():
    with pytest.raises(rg.RaggedValueError, match="kernel must be one of"):
        rg.optim.adamw_8bit(1e-3, kernel="c")
