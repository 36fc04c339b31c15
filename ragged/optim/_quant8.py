"""Block-wise 8-bit AdamW over the plan's own blocks: the transforms.

Which elements are quantized and why the state is the same at every world size: [Note: blocks
are the plan's blocks] (``_quant8_state.py``). The codes: [Note: dynamic quantization maps]
(``_quant8_codec.py``). How one chunk's update runs: [Note: one chunk, no allocation]
(``_quant8_fused.py``).

[Note: one update]
Per quantized piece one step decodes both moments, runs Adam in fp32, writes the update (plus
``weight_decay * p``, times ``-lr``, when :func:`adamw_8bit` fuses the chain), takes each
block's new absmax and encodes both moments:

    m = table_mu[code] * (absmax_mu * b1) + g * (1 - b1)
    v = table_nu[code] * (absmax_nu * b2) + (g * g) * (1 - b2)
    u = m / (sqrt(v) + eps * c2) * (c2 / c1)      c1 = 1 - b1^t, c2 = sqrt(1 - b2^t); eps == 0: NaN -> 0
    u = u + p * weight_decay;  u = u * -lr                        (adamw_8bit)
    absmax = max |m| per block;  code = encode(m * (1 / absmax))  (same for v)

(Adam's ``m / c1 / (sqrt(v) / c2 + eps)``, each constant computed once per step in float64 and
rounded to float32.) The fp32 moments of the leaves that are not quantized take ``m * b1`` for
the first product.

It runs over chunks of whole blocks, with scratch bounded whatever the shard's size ([Note: the
update's scratch] in ``_quant8_state.py``). Only single-rounding
float32 ops in this order -- never lerp / addcmul / add(alpha=), whose vectorised and scalar-tail
paths may differ by an FMA -- and a correctly rounded square root, so the state never depends on
where an element sits in the buffer, nor on the world size. Small and non-block leaves and
replicated leaves keep fp32 moments, updated by the same function.
"""

from __future__ import annotations

import torch

from ragged._dbuffer import DBuffer, is_dbuffer, local_gaps
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged._pytree import pytree
from ragged.optim import _quant8_fused as fused
from ragged.optim._base import GradientTransformation, Schedule, keywords_checked
from ragged.optim._count import next_count, zero_count
from ragged.optim._quant8_codec import Workspace, codec
from ragged.optim._quant8_state import (
    Quant8Moments,
    ScaleByAdam8bitState,
    adam8bit_leaf_state,
    chunk_limit,
    chunks,
    init_moments,
    shard_layout,
)
from ragged.optim._transform import (
    AddDecayedWeightsState,
    ScaleByScheduleState,
    ScaleState,
    _check_adam,
    _check_nonneg,
)

# adam8bit_leaf_state lives in _quant8_state; tests import it from here too
__all__ = ["scale_by_adam_8bit", "adamw_8bit", "state_nbytes", "adam8bit_leaf_state"]


def _is_moments(x) -> bool:
    return isinstance(x, Quant8Moments)


def _check_dbuffers(tree, what: str) -> None:
    for leaf in pytree.leaves(tree, is_leaf=is_dbuffer):
        if not isinstance(leaf, DBuffer):
            raise RaggedTypeError(
                f"adamw_8bit works on DBuffers (rg.shard output); {what} has a "
                f"{type(leaf).__name__} leaf. Fix: pass the DBuffer(s), or use rg.optim.adamw."
            )


class _Hyper:
    """The scalars of one step: ``hp`` (:class:`~ragged.optim._quant8_fused.Scalars`: each
    computed in float64 and rounded once to float32; those of the step count on its device, the
    rest Python floats: no host sync) and the flags that select the formula's optional terms."""

    def __init__(self, b1, b2, eps, count, decay, lr):
        self.flags = dict(decay=decay is not None, lr=lr is not None, zero_eps=eps == 0)
        t = count.to(torch.float64)
        c1, c2 = 1.0 - b1**t, torch.sqrt(1.0 - b2**t)
        lr = 1.0 if lr is None else (lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr)
        self.hp = fused.Scalars.of(b1, b2, decay or 0.0, lr, eps=eps * c2, scale=c2 / c1)
        self._on: dict = {}

    def on(self, device) -> fused.Scalars:
        """``hp`` on ``device`` (its tensors copied once per device)."""
        key = str(device)
        if key not in self._on:
            self._on[key] = self.hp.to(device)
        return self._on[key]


def _step_buffer(g: DBuffer, mom: Quant8Moments, p: DBuffer | None, h: _Hyper, *, min_size, donate):
    """One DBuffer's step: ``(update DBuffer, new moments)``."""
    lay = shard_layout(g, min_size)
    dev = g.data.device
    hp = h.on(dev)
    gdata = g.data.to(torch.float32)
    in_place = donate and gdata is g.data and not g.data.requires_grad
    pdata = p.data.detach().to(torch.float32) if h.flags["decay"] else None
    codes, scales = (mom.mu_codes, mom.nu_codes), (mom.mu_scales, mom.nu_scales)
    if in_place:  # the update overwrites the gradient chunk by chunk, after reading it
        out, new_codes, new_scales = gdata, codes, scales
    else:
        out = torch.empty(g.data.shape, dtype=torch.float32, device=dev)  # every element is written below
        new_codes = tuple(torch.empty_like(t) for t in codes)
        new_scales = tuple(torch.empty_like(t) for t in scales)
    for lo, hi in local_gaps(g.plan, g.rank):  # the padding
        out[lo:hi].zero_()
    limit = chunk_limit(dev.type)
    pieces = [c for q in lay.qpieces for c in chunks(q, dev.type)]
    grep = g.replicated.to(torch.float32)
    ws = Workspace(max([c.numel for c in pieces] + [min(n, limit) for n in (lay.num_fp32, grep.numel())]), dev)
    if pieces:
        cm, cv = codec(True, dev), codec(False, dev)
        decayed = (scales[0] * hp[fused.B1], scales[1] * hp[fused.B2])  # (before new_scales overwrites scales)
        for c in pieces:
            fused.chunk_update(c, gdata, pdata, out, codes, decayed, new_codes, new_scales, hp, cm, cv, ws, **h.flags)
    mu_fp32, nu_fp32 = _adam(mom.mu_fp32, mom.nu_fp32, gdata, pdata, lay.fp32_index, out, hp, h, in_place, ws, limit)
    prep = None if pdata is None else p.replicated.detach().to(torch.float32)
    u_rep = torch.empty(grep.shape, dtype=torch.float32, device=dev)
    mu_rep, nu_rep = _adam(mom.mu_rep, mom.nu_rep, grep, prep, None, u_rep, hp, h, in_place, ws, limit)
    new = Quant8Moments(*new_codes, *new_scales, mu_fp32, nu_fp32, mu_rep, nu_rep)
    wide = lambda t: torch.promote_types(t.dtype, torch.float32)  # noqa: E731  (bf16 grads: fp32 updates)
    return g.replace(data=out.to(wide(g.data)), replicated=u_rep.to(wide(g.replicated))), new


def _adam(mu, nu, g, p, index, out, hp, h: _Hyper, in_place: bool, ws: Workspace, limit: int):
    """The fp32 moments' step over elements ``index`` of ``g``, ``p`` and ``out`` (all of them when
    ``None``), ``limit`` at a time with scratch ``ws``: writes their updates into ``out`` and
    returns ``(new mu, new nu)``, updated in place when ``in_place``."""
    m, v = (mu, nu) if in_place else (mu.clone(), nu.clone())
    for lo in range(0, m.numel(), limit):
        hi = min(lo + limit, m.numel())
        mc, vc, n = m[lo:hi].mul_(hp[fused.B1]), v[lo:hi].mul_(hp[fused.B2]), hi - lo
        tmp = ws.acc[:n].view(torch.float32)  # int32 scratch, read as float32
        if index is None:
            fused.adam_into(mc, vc, g[lo:hi], None if p is None else p[lo:hi], hp, out[lo:hi], tmp, **h.flags)
            continue
        at = index[lo:hi]
        gc = torch.index_select(g, 0, at, out=ws.a[:n])
        pc = None if p is None else torch.index_select(p, 0, at, out=ws.b[:n])
        out.index_copy_(0, at, fused.adam_into(mc, vc, gc, pc, hp, ws.c[:n], tmp, **h.flags))
    return m, v


def _check_state(flat_g, flat_m, min_size) -> None:
    if len(flat_m) != len(flat_g):
        raise RaggedValueError(f"the 8-bit Adam state holds {len(flat_m)} buffers but the updates hold {len(flat_g)}.")
    for g, m in zip(flat_g, flat_m):
        lay = shard_layout(g, min_size)
        if m.mu_codes.numel() != lay.num_codes or m.mu_fp32.numel() != lay.num_fp32:
            raise RaggedValueError(
                f"adamw_8bit: the updates (DBuffer of rank {g.rank}, {g.plan!r}) do not match the 8-bit "
                f"state ({m.mu_codes.numel()} codes / {m.mu_fp32.numel()} fp32 moments, expected "
                f"{lay.num_codes} / {lay.num_fp32}). Fix: call opt.init on the DBuffer(s) whose "
                "gradients you pass to opt.update."
            )


def _step(updates, state: ScaleByAdam8bitState, params, *, b1, b2, eps, decay, lr, min_size, donate):
    """The step over every DBuffer of ``updates``: ``(new updates, new ScaleByAdam8bitState)``."""
    _check_dbuffers(updates, "updates")
    flat_g, treedef = pytree.flatten(updates, is_leaf=is_dbuffer)
    flat_m = pytree.leaves(state.moments, is_leaf=_is_moments)
    _check_state(flat_g, flat_m, min_size)
    flat_p = pytree.leaves(params, is_leaf=is_dbuffer) if decay is not None else [None] * len(flat_g)
    count = next_count(state.count)
    h = _Hyper(b1, b2, eps, count, decay, lr)
    results = [_step_buffer(g, m, p, h, min_size=min_size, donate=donate)
               for g, m, p in zip(flat_g, flat_m, flat_p)]
    new_updates = pytree.unflatten(treedef, [r[0] for r in results])
    moments = pytree.unflatten(pytree.structure(state.moments, is_leaf=_is_moments), [r[1] for r in results])
    return new_updates, ScaleByAdam8bitState(count=count, moments=moments)


def _init(params, min_size):
    _check_dbuffers(params, "params")
    moments = pytree.map(lambda d: init_moments(d, min_size), params, is_leaf=is_dbuffer)
    return ScaleByAdam8bitState(count=zero_count(params), moments=moments)


@keywords_checked
def scale_by_adam_8bit(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, min_size: int = 4096, donate: bool = False,
) -> GradientTransformation:
    """Adam's rescaling with block-wise 8-bit moments (see [Note: blocks are the plan's blocks]).

    Each step dequantizes a block's moments, updates them in fp32, computes the update from the
    fp32 values, then re-quantizes them with the block's new absmax (the formula: [Note: one
    update]).

    Args:
        b1, b2, eps: Adam's hyperparameters.
        min_size: leaves with fewer elements keep fp32 moments.
        donate: reuse the state's buffers (codes, scales, fp32 moments) and write the update
            into the fp32 gradient buffer passed to ``update`` (as
            :func:`ragged.optim.scale_by_adam` does): no shard-sized allocation per step, but
            the caller must not read the old state or the gradients afterwards. Results are
            bit-identical to ``donate=False``.

    The params must be a DBuffer or a pytree of DBuffers.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> plan = rg.make_plan({"w": torch.empty(64, 64)}, spec.Blocks(32, 32), world_size=1)
        >>> p = rg.shard(plan, {"w": torch.zeros(64, 64)}, rank=0)
        >>> opt = rg.optim.scale_by_adam_8bit(min_size=1)
        >>> state = opt.init(p)
        >>> state.moments.mu_codes.dtype, state.moments.mu_codes.numel()
        (torch.uint8, 4096)
        >>> u, state = opt.update(p.replace(data=torch.ones(4096)), state, p)
        >>> round(float(u.data[0]), 4)   # Adam's first step: g / (|g| + eps)
        1.0
    """
    _check_adam(b1, b2, eps)

    def update(updates, state, params=None):
        del params
        return _step(updates, state, None, b1=b1, b2=b2, eps=eps, decay=None, lr=None, min_size=min_size,
                     donate=donate)

    return GradientTransformation(lambda params: _init(params, min_size), update, donates=donate)


@keywords_checked
def adamw_8bit(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    min_size: int = 4096,
    donate: bool = False,
) -> GradientTransformation:
    """AdamW with block-wise 8-bit moments over the plan's blocks (same contract as
    :func:`ragged.optim.adamw`).

    ``chain(scale_by_adam_8bit, add_decayed_weights, scale_by_learning_rate)`` fused into one
    pass per block (same state, bit-identical results). ``donate=True`` updates the state in
    place and writes the update into the gradient buffer (see :func:`scale_by_adam_8bit`);
    results are bit-identical.

    About 2 bytes of state per parameter plus 8 bytes per block (e.g. +0.008 B/param for
    ``Blocks(32, 32)``), and fp32 moments for small or non-block leaves (see
    [Note: blocks are the plan's blocks]). The state is bit-identical on every world size.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> from ragged._dbuffer import DBuffer
        >>> params = {"w": torch.randn(64, 128), "b": torch.randn(64)}
        >>> plan = rg.make_plan(params, {"w": spec.Blocks(32, 32), "b": spec.Elements(1)}, world_size=1)
        >>> flat = torch.cat([params[l.path[2]].reshape(-1) for l in plan.leaves])  # b, w (key order)
        >>> local = DBuffer(data=flat, replicated=torch.zeros(0), plan=plan, rank=0)
        >>> opt = rg.optim.adamw_8bit(1e-3, min_size=1024)
        >>> state = opt.init(local)
        >>> updates, state = opt.update(local, state, local)
        >>> state[0].moments.mu_codes.dtype, state[0].moments.mu_scales.numel()  # 2 x 4 tiles
        (torch.uint8, 8)
    """
    _check_adam(b1, b2, eps, weight_decay)
    rate = _check_nonneg("learning_rate", learning_rate)
    scheduled = callable(rate)

    def init(params):
        lr_state = ScaleByScheduleState(count=zero_count(params)) if scheduled else ScaleState()
        return (_init(params, min_size), AddDecayedWeightsState(), lr_state)

    def update(updates, state, params=None):
        adam, decay_state, lr_state = state
        if weight_decay and params is None:
            raise RaggedValueError("adamw_8bit with weight_decay needs the params: call opt.update(grads, opt_state, params).")
        if weight_decay:
            _check_dbuffers(params, "params")
        lr = -1.0 * rate(lr_state.count) if scheduled else -rate
        updates, adam = _step(updates, adam, params, b1=b1, b2=b2, eps=eps, decay=weight_decay or None, lr=lr,
                              min_size=min_size, donate=donate)
        new_lr_state = ScaleByScheduleState(count=next_count(lr_state.count)) if scheduled else lr_state
        return updates, (adam, decay_state, new_lr_state)

    return GradientTransformation(init, update, donates=donate)


def state_nbytes(state) -> int:
    """Bytes of every tensor in an optimizer state (step counters included).

    Args:
        state: any pytree (an ``opt.init`` result).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> plan = rg.make_plan({"w": torch.empty(64, 64)}, spec.Blocks(32, 32), world_size=1)
        >>> p = rg.shard(plan, {"w": torch.zeros(64, 64)}, rank=0)
        >>> rg.optim.state_nbytes(rg.optim.adamw(1e-3).init(p))       # two fp32 moments + an int64 step count
        32776
        >>> rg.optim.state_nbytes(rg.optim.adamw_8bit(1e-3, min_size=1).init(p)) < 32776 // 3
        True
    """
    return sum(t.numel() * t.element_size() for t in pytree.leaves(state) if isinstance(t, torch.Tensor))
