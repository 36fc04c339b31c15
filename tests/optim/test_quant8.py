"""Block-wise 8-bit Adam: world-size independence, quantization maps, the update against its definition, numerics vs fp32 AdamW."""

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ragged as rg
from ragged import spec
from ragged.optim import _quant8_fused
from ragged.optim._quant8_codec import Workspace, codec

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


def _midpoint_counts(signed, magnitudes):
    """The definition of a code's magnitude: how many of the map's positive midpoints (rounded
    to float32) lie below each of ``magnitudes``, by search."""
    values = rg.optim.dynamic_map(signed)
    pos = values[values >= 0].double()
    mids = ((pos[:-1] + pos[1:]) / 2).float()
    return torch.searchsorted(mids, magnitudes.contiguous(), right=False)


@pytest.mark.parametrize("signed", [True, False])
def test_encode_counts_midpoints_on_every_pattern(signed):
    """The encoder's integer ops give the code of 0 plus or minus the count of midpoints below
    |x|, for every float32 pattern with |x| < 2 (unsigned map: every pattern, by |x|). Within
    one 16-bit key interval the code ``(y + lookup[key]) >> 16`` is non-decreasing in the key
    ``y`` (x's pattern, every bit flipped where x < 0), so checking both ends of every interval
    and the patterns on both sides of every midpoint, for both signs, checks them all."""
    c = codec(signed, "cpu")
    values = rg.optim.dynamic_map(signed)
    mids = ((values[values >= 0][:-1].double() + values[values >= 0][1:].double()) / 2).float()
    starts = torch.arange(1 << 15, dtype=torch.int32) << 16
    near = mids.view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)
    magnitudes = torch.cat([starts, starts + 0xFFFF, near.reshape(-1)]).view(torch.float32)
    x = torch.cat([magnitudes, -magnitudes])
    if signed:
        x = x[x.abs() < 2]
    n = _midpoint_counts(signed, x.abs())
    want = c.zero + torch.where(x.view(torch.int32) < 0, -n, n) if signed else n
    ws = Workspace(len(x), "cpu")
    got = c.encode_into(x.clone().view(torch.int32), torch.empty(len(x), dtype=torch.uint8), ws.idx, ws.acc)
    assert torch.equal(got.long(), want)


@pytest.mark.parametrize("signed", [True, False])
def test_encode_is_nearest_code(signed):
    """The encoder picks the nearest map value, checked against a brute-force search on
    random values across the map's whole range, on the map's values, and at and next to every
    midpoint (the midpoints are float32: within one ulp of one either neighbour may win;
    exactly on it, the smaller magnitude)."""
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


def test_sqrt_is_correctly_rounded():
    """The update's square root is the float64 root rounded to float32 (the rounding the CPU's
    and CUDA's float32 root instructions give), also where torch's float32 root on the CPU is
    an ulp off."""
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.rand(100_000, generator=g) * torch.logspace(-30, 30, 100_000), torch.tensor([0.0, 1.0, 4.0])])
    want = torch.sqrt(v.double()).float()
    got = _quant8_fused.sqrt_into(v, torch.empty_like(v))
    assert torch.equal(got, want)


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

    make = lambda: rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000)  # noqa: E731
    reference = _run(2, opt=make())
    monkeypatch.setitem(_quant8_state.CHUNK, "cpu", limit)
    chunked = _run(2, opt=make())  # the fp32-moment and replicated elements in chunks too
    _assert_same_state(_leaf_states(*reference), _leaf_states(*chunked), limit)
    for a, b in zip(reference[1], chunked[1]):
        assert torch.equal(a.data, b.data) and torch.equal(a.replicated, b.replicated), limit


class _Allocated(TorchDispatchMode):
    """The peak bytes of the tensors the ops under it create, alive at once (views, ``out=`` and
    in-place results are not new; a tensor counts until it is freed)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in rg.pytree.leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in rg.pytree.leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.live += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, t.untyped_storage().nbytes())
        return out


def test_the_update_s_scratch_is_bounded_by_its_chunk(monkeypatch):
    """With ``donate=True`` a step allocates its scratch and little else: 20 bytes per element of
    its largest chunk (``CHUNK`` elements or one band), whatever the size of the fp32-moment part
    (here 6214 elements, chunked too) or of the quantized pieces (see [Note: the update's
    scratch])."""
    from ragged.optim import _quant8_state

    monkeypatch.setitem(_quant8_state.CHUNK, "cpu", 700)
    params = _params()
    plan = rg.make_plan(params, SPECS, world_size=1)
    opt = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000, donate=True)
    local = shard_all(plan, params)[0]
    state = opt.init(local)
    for step in range(2):
        grads = shard_all(plan, _grads(params, step))[0]
        with _Allocated() as allocated:
            _, state = opt.update(grads, state, local)
    widest = 32 * 70  # a band of "attn" (100 x 70, Blocks(32, 32)): more than 700
    blocks = state[0].moments.mu_scales.numel()
    assert allocated.peak <= 20 * widest + 8 * blocks + 4 * local.replicated.numel() + 1024, allocated.peak


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


def _reference(params, specs, steps, *, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, min_size=1000):
    """8-bit AdamW written out leaf by leaf from its definition ([Note: one update]), for
    comparison: codes by the midpoint search, each block's absmax and scale spelled out per
    block, the float64 root."""
    maps = {s: rg.optim.dynamic_map(s) for s in (True, False)}

    def encode(x, signed, br, bc):
        rows, cols = x.shape
        bands, tiles = -(-rows // br), -(-cols // bc)
        absmax = torch.stack([x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max()
                              for i in range(bands) for j in range(tiles)]).view(bands, tiles)
        inv = 1.0 / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        normed = x * inv.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        zero = int((maps[signed] == 0).nonzero())
        n = _midpoint_counts(signed, normed.abs().reshape(-1))
        return torch.where(normed.reshape(-1) < 0, zero - n, zero + n).to(torch.uint8), absmax

    def decode(codes, absmax, signed, shape, br, bc, decay):  # the values times b1 (or b2)
        table = torch.cat([maps[signed], maps[signed][-1:]])
        per = (absmax * decay).repeat_interleave(br, 0)[: shape[0]].repeat_interleave(bc, 1)[:, : shape[1]]
        return table[codes.long()].view(shape) * per

    plan = rg.make_plan(params, specs, world_size=1)
    leaves = {leaf.path: leaf for leaf in plan.leaves + plan.replicated}
    state, out = {}, {}
    for path, leaf in leaves.items():
        from ragged.optim._quant8_state import quantized_block

        block = None if leaf in plan.replicated else quantized_block(leaf, min_size)
        x = rg.pytree.leaves(params)[leaf.index].clone()
        shape = (1, x.numel()) if block is None or block[0] == 1 else (x.numel() // x.shape[-1], x.shape[-1])
        state[path] = (block, shape, None)
        out[path] = x
    for step in range(steps):
        grads = rg.pytree.leaves(_grads(params, step))
        t = step + 1
        for path, leaf in leaves.items():
            block, shape, st = state[path]
            g, p = grads[leaf.index].reshape(shape), out[path].reshape(shape)
            f32 = lambda x: torch.tensor(x, dtype=torch.float64).float()  # noqa: E731
            if st is None:  # step 0: zero moments (zero codes and scales)
                mb, vb = torch.zeros(shape), torch.zeros(shape)
            elif block is None:
                mb, vb = st[0] * f32(b1), st[1] * f32(b2)
            else:
                mb, vb = decode(*st[0], True, shape, *block, f32(b1)), decode(*st[1], False, shape, *block, f32(b2))
            m = mb + g * f32(1 - b1)
            v = vb + (g * g) * f32(1 - b2)
            c1, c2 = 1 - b1**t, torch.sqrt(1 - b2 ** torch.tensor(t, dtype=torch.float64))
            u = m / (torch.sqrt(v.double()).float() + (eps * c2).float()) * (c2 / c1).float()
            u = (u + p * f32(weight_decay)) * f32(-lr)
            out[path] = (p + u).view(leaf.shape)
            st = (m, v) if block is None else (encode(m, True, *block), encode(v, False, *block))
            state[path] = (block, shape, st)
    return out, state


def test_update_equals_its_definition():
    """Every code, scale and parameter after three steps equals the definition written out per
    leaf (:func:`_reference`), at world sizes 1 and 3, through edge tiles and bands, leaves of
    one band, tile or row, Elements runs, several chunks, fp32 and replicated leaves."""
    params = _big_params()
    for world_size in (1, 3):
        plan, shards, states = _run(world_size, steps=3, params=params, specs=BIG_SPECS)
        ref_params, ref_state = _reference(params, BIG_SPECS, 3)
        got = _leaf_states(plan, shards, states)
        for path, (block, _, st) in ref_state.items():
            if block is None:
                continue
            (mc, ms), (vc, vs) = st
            for k, want in (("mu_codes", mc), ("mu_scales", ms), ("nu_codes", vc), ("nu_scales", vs)):
                assert torch.equal(got[path][k], want.reshape(-1)), (world_size, path, k)
        full = gather_all(shards)
        for leaf in plan.leaves + plan.replicated:
            want = ref_params[leaf.path]
            assert torch.equal(rg.pytree.leaves(full)[leaf.index], want), (world_size, leaf.path)


def test_non_finite_gradients_poison_only_their_blocks():
    """An inf and a NaN gradient element: the step runs (no lookup out of range), and every
    block without one keeps the codes and scales of a run without them."""
    params = {"w": torch.randn(64, 96, generator=torch.Generator().manual_seed(3))}
    plan = rg.make_plan(params, {"w": spec.Blocks(32, 32)}, world_size=1)
    opt = rg.optim.adamw_8bit(1e-2, min_size=1000)
    runs = []
    for bad in (False, True):
        local = shard_all(plan, params)[0]
        state = opt.init(local)
        for step in range(3):
            grads = _grads(params, step)
            if bad and step == 1:
                grads["w"][0, 0] = float("inf")
                grads["w"][40, 90] = float("nan")
            u, state = opt.update(shard_all(plan, grads)[0], state, local)
            local = rg.apply_updates(local, u)
        runs.append(state[0].moments)
    clean, poisoned = runs
    hit = torch.zeros(2, 3, dtype=torch.bool)
    hit[0, 0] = hit[1, 2] = True
    for k in ("mu_scales", "nu_scales"):
        a, b = getattr(clean, k).view(2, 3), getattr(poisoned, k).view(2, 3)
        assert torch.equal(a[~hit], b[~hit]) and not torch.isfinite(b[hit]).all(), k
    blocks = lambda t: t.view(2, 32, 3, 32).permute(0, 2, 1, 3)  # noqa: E731
    for k in ("mu_codes", "nu_codes"):
        assert torch.equal(blocks(getattr(clean, k))[~hit], blocks(getattr(poisoned, k))[~hit]), k


def test_other_devices_forms_give_the_cpus_bits(monkeypatch):
    """The forms the update takes off the CPU (a product then a sum instead of ``addcdiv``, the
    float64 root instead of numpy's) give the CPU forms' state and updates bit for bit."""
    runs = {}
    for cpu in (True, False):
        monkeypatch.setattr(_quant8_fused, "_cpu_kernels", lambda t, cpu=cpu: cpu)
        runs[cpu] = _run(2, steps=3, params=_big_params(), specs=BIG_SPECS)
    _assert_same_state(_leaf_states(*runs[True]), _leaf_states(*runs[False]), "forms")
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a.data, b.data) and torch.equal(a.replicated, b.replicated)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_equals_cpu():
    """On CUDA: the same state and updates as on the CPU, bit for bit."""
    results = {}
    for device in ("cuda", "cpu"):
        opt = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000)
        plan, shards, states = _run(1, steps=3, opt=opt, params=_big_params(), specs=BIG_SPECS, device=device)
        results[device] = {path: {k: v.cpu() for k, v in parts.items()}
                           for path, parts in _leaf_states(plan, shards, states).items()}
        results[device, "params"] = [s.data.cpu() for s in shards]
    _assert_same_state(results["cpu"], results["cuda"], "cuda")
    assert all(torch.equal(a, b) for a, b in zip(results["cpu", "params"], results["cuda", "params"]))


def test_fused_adamw_8bit_equals_the_chain():
    """adamw_8bit fuses weight decay and the learning rate into the 8-bit pass: same state
    structure and bit-identical updates as the chain it replaces (here with a schedule)."""
    lr = rg.optim.linear_schedule(1e-2, 1e-3, 4)
    fused = rg.optim.adamw_8bit(lr, weight_decay=0.1, min_size=1000)
    chain = rg.optim.chain(rg.optim.scale_by_adam_8bit(min_size=1000), rg.optim.add_decayed_weights(0.1),
                           rg.optim.scale_by_learning_rate(lr))
    (plan, shards_f, states_f), (_, shards_c, states_c) = _run(2, opt=fused), _run(2, opt=chain)
    assert rg.pytree.structure(states_f) == rg.pytree.structure(states_c)
    _assert_same_state(_leaf_states(plan, shards_c, states_c), _leaf_states(plan, shards_f, states_f), "chain")
    for a, b in zip(shards_f, shards_c):
        assert torch.equal(a.data, b.data) and torch.equal(a.replicated, b.replicated)
