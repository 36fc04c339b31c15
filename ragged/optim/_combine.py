"""Combinators: :func:`chain`, :func:`masked` and :func:`multi_transform`.

[Note: per-element masks over a DBuffer]
A DBuffer holds many leaves in one flat tensor, so "apply this transform to these leaves" is
a per-element mask: for each leaf this rank holds a piece of (``plan.local_pieces(rank)``), the
piece's elements take the leaf's value; padding is False in every mask. A mask is built once per
(plan, rank, device) and cached, and applying it is one ``torch.where`` per buffer. The inner
transform runs over the whole buffer with the gradients outside the mask set to zero (so its
state stays zero there, and global quantities such as norms see only the masked leaves); its
state therefore has the size of the whole buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._pytree import pytree
from ragged.optim._base import GradientTransformation, collectives_of, keywords_checked, settings_of
from ragged.spec import LayoutPlan, LeafLayout
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = [
    "chain",
    "masked",
    "multi_transform",
    "MaskedState",
    "MultiTransformState",
    "leaf_masks",
    "leaf_labels",
]


@keywords_checked
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` one after the other; the state is a tuple of their states.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.chain(rg.optim.scale(2.0), rg.optim.scale(-0.5))
        >>> opt.update(torch.ones(2), opt.init(torch.ones(2)))[0]
        tensor([-1., -1.])
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise RaggedTypeError(
                f"chain argument {i} is a {type(t).__name__}, not a GradientTransformation "
                "(did you pass a function instead of calling it, e.g. rg.optim.scale_by_adam()?)."
            )

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if len(state) != len(transforms):
            raise RaggedValueError(f"chain of {len(transforms)} transforms got a state of {len(state)} entries.")
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def fingerprint(state):
        return tuple(kv for i, (t, s) in enumerate(zip(transforms, state)) for kv in settings_of(t, s, f"chain[{i}]"))

    return GradientTransformation(init, update, donates=any(t.donates for t in transforms),
                                  collectives=collectives_of(transforms), fingerprint=fingerprint)


# ---- masks -------------------------------------------------------------------------------

LeafFn = Callable[[LeafLayout], Any]


def _labels_buffer(plan: LayoutPlan, rank: int, fn: LeafFn, labels: tuple, device, *, replicated: int | None = None):
    """An int8 tensor: for each element, the index of ``fn(leaf)`` in ``labels`` (-1 on padding).

    ``replicated``: the replicated buffer's length (its offsets are aligned, so it may be longer
    than the replicated leaves) to label that buffer instead of the shard.
    """
    if replicated is not None:
        out = torch.full((replicated,), -1, dtype=torch.int8, device=device)
        spans = [(leaf, leaf.offset, leaf.numel) for leaf in plan.replicated]
    else:
        out = torch.full((plan.shard_size,), -1, dtype=torch.int8, device=device)
        spans = [(p.leaf, p.local_offset, p.numel) for p in plan.local_pieces(rank)]
    for leaf, start, n in spans:
        label = fn(leaf)
        if label not in labels:
            raise RaggedValueError(
                f"the label function returned {label!r} for params{leaf.path} (shape {leaf.shape}), "
                f"which is not one of the transforms' labels {list(labels)}. Fix: return one of those "
                "labels for every leaf, or add a transform for this label."
            )
        out[start : start + n] = labels.index(label)
    return out


def _call_checked(fn, what):
    def call(leaf):
        try:
            return fn(leaf)
        except Exception as e:  # name the leaf in the error
            raise type(e)(f"{what} failed on params{leaf.path} (shape {leaf.shape}): {e}") from e

    return call


class _MaskCache:
    """Per-(plan, rank, device) label buffers of one label function."""

    def __init__(self, fn: LeafFn, labels: tuple, what: str):
        self.fn = _call_checked(fn, what)
        self.labels = labels
        self.cache: dict = {}

    def get(self, dbuf: DBuffer) -> DBuffer:
        device = torch.device("cpu") if dbuf.data.is_meta else dbuf.data.device  # labels of meta buffers are known
        key = (dbuf.plan, dbuf.rank, device, dbuf.replicated.numel())
        hit = self.cache.get(key)
        if hit is None:
            data = _labels_buffer(dbuf.plan, dbuf.rank, self.fn, self.labels, device)
            rep = _labels_buffer(dbuf.plan, dbuf.rank, self.fn, self.labels, device, replicated=dbuf.replicated.numel())
            hit = DBuffer(data=data, replicated=rep, plan=dbuf.plan, rank=dbuf.rank)
            if len(self.cache) > 16:
                self.cache.clear()
            self.cache[key] = hit
        return hit


def _label_tree(cache: _MaskCache, tree):
    """Maps every DBuffer in ``tree`` to its label buffers; other leaves are rejected."""

    def one(x):
        if isinstance(x, DBuffer):
            return cache.get(x)
        raise RaggedTypeError(
            f"a leaf-function mask needs DBuffers (ragged.shard(...) output), got a {type(x).__name__}. "
            "Fix: pass a pytree of bools (like the params) as the mask for plain tensor trees."
        )

    return pytree.map(one, tree, is_leaf=is_dbuffer)


def leaf_labels(tree, label_fn: LeafFn, labels) -> Any:
    """Per-element label indices (int8; -1 on padding) for every DBuffer in ``tree``.

    Args:
        tree: a pytree of DBuffers.
        label_fn: ``LeafLayout -> label``.
        labels: the possible labels, in order (index = value in the result).

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(2, 2), "b": torch.empty(2)}, world_size=1, align=1)
        >>> from ragged._dbuffer import DBuffer
        >>> d = DBuffer(data=torch.zeros(6), replicated=torch.zeros(0), plan=plan, rank=0)
        >>> rg.optim.leaf_labels(d, lambda leaf: len(leaf.shape) == 2, (False, True)).data.tolist()
        [0, 0, 1, 1, 1, 1]
    """
    return _label_tree(_MaskCache(label_fn, tuple(labels), "label_fn"), tree)


def leaf_masks(tree, predicate: LeafFn) -> Any:
    """Per-element boolean masks (False on padding) for every DBuffer in ``tree``.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(2, 2), "b": torch.empty(2)}, world_size=2, align=1)
        >>> from ragged._dbuffer import DBuffer
        >>> d = DBuffer(data=torch.zeros(plan.shard_size), replicated=torch.zeros(0), plan=plan, rank=0)
        >>> m = rg.optim.leaf_masks(d, lambda leaf: leaf.path == "['w']")
        >>> m.data.sum().item() == sum(p.numel for p in plan.local_pieces(0) if p.leaf.path == "['w']")
        True
    """
    labels = leaf_labels(tree, lambda leaf: bool(predicate(leaf)), (False, True))
    return pytree.map(lambda t: t == 1, labels)


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transform's state.

    Examples:
        >>> import torch, ragged as rg
        >>> rg.optim.masked(rg.optim.trace(0.9), {"a": True, "b": False}).init({"a": torch.zeros(1), "b": torch.zeros(1)})
        MaskedState(inner_state=TraceState(trace={'a': tensor([0.]), 'b': tensor([0.])}))
    """

    inner_state: Any


@keywords_checked
def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Applies ``inner`` only where ``mask`` holds; elsewhere updates pass through unchanged.

    Args:
        inner: the transformation to restrict.
        mask: a predicate ``LeafLayout -> bool`` evaluated per leaf of each DBuffer (e.g.
            ``lambda leaf: len(leaf.shape) >= 2`` to skip biases and norms, or a test of
            ``leaf.path``), or, for plain tensor trees, a pytree of bools like the params.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.masked(rg.optim.scale(10.0), {"a": True, "b": False})
        >>> g = {"a": torch.ones(1), "b": torch.ones(1)}
        >>> opt.update(g, opt.init(g))[0]
        {'a': tensor([10.]), 'b': tensor([1.])}
    """
    cache = _MaskCache(lambda leaf: bool(mask(leaf)), (False, True), "mask") if callable(mask) else None

    def element_masks(tree):
        if cache is not None:  # cached label buffers of the predicate
            return pytree.map(lambda t: t == 1, _label_tree(cache, tree))
        return pytree.map(lambda m, t: torch.full_like(t, bool(m), dtype=torch.bool), mask, tree)

    def init(params):
        return MaskedState(inner_state=inner.init(params))

    def update(updates, state, params=None):
        m = element_masks(updates)
        inside = pytree.map(lambda g, k: torch.where(k, g, torch.zeros_like(g)), updates, m)
        new, inner_state = inner.update(inside, state.inner_state, params)
        out = pytree.map(lambda u, g, k: torch.where(k, u, g.to(torch.promote_types(u.dtype, g.dtype))), new, updates, m)
        return out, MaskedState(inner_state=inner_state)

    return GradientTransformation(init, update, donates=inner.donates, collectives=inner.collectives,
                                  fingerprint=lambda state: settings_of(inner, state.inner_state, "masked"))


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`: one inner state per label (a dict).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.multi_transform({"x": rg.optim.scale(2.0), "y": rg.optim.trace(0.5)}, {"a": "x", "b": "y"})
        >>> opt.init({"a": torch.zeros(1), "b": torch.zeros(1)})
        MultiTransformState(inner_states={'x': EmptyState(), 'y': TraceState(trace={'a': tensor([0.]), 'b': tensor([0.])})})
    """

    inner_states: Any


@keywords_checked
def multi_transform(
    transforms: Mapping[Any, GradientTransformation], labels, *, compact=()
) -> GradientTransformation:
    """Applies ``transforms[label]`` to the elements of the leaves with that label.

    Args:
        transforms: label -> transformation.
        labels: a function ``LeafLayout -> label`` evaluated per leaf of each DBuffer, or, for
            plain tensor trees, a pytree of labels like the params.
        compact: labels whose transformation sees only its own elements: each buffer is
            packed (one ``masked_select``) into a short 1-D tensor before the transformation and
            the result scattered back (one ``masked_scatter``), so its state holds only those
            elements instead of the whole buffer. Only for transformations that do not use the
            layout (element-wise ones such as ``adamw``, ``sgd``, and ``clip_by_global_norm``,
            whose norm stays correct: packed DBuffers keep sharded and replicated parts apart).

    Padding elements (no leaf) get a zero update. Without ``compact`` each transformation runs
    over whole buffers with zero gradients outside its elements (see [Note: per-element masks
    over a DBuffer]).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.multi_transform({"x": rg.optim.scale(2.0), "y": rg.optim.scale(3.0)},
        ...                                {"a": "x", "b": "y"})
        >>> g = {"a": torch.ones(1), "b": torch.ones(1)}
        >>> opt.update(g, opt.init(g))[0]
        {'a': tensor([2.]), 'b': tensor([3.])}
    """
    names = tuple(transforms)
    if not names:
        raise RaggedValueError("multi_transform needs at least one transformation.")
    compact = frozenset(compact)
    if not compact <= set(names):
        raise RaggedValueError(f"compact names labels {sorted(map(str, compact - set(names)))} that have no transformation.")
    cache = _MaskCache(labels, names, "labels") if callable(labels) else None

    def label_index(tree):
        if cache is not None:
            return _label_tree(cache, tree)
        def one(lab, t):
            if lab not in names:
                raise RaggedValueError(f"label {lab!r} is not one of the transforms' labels {list(names)}.")
            return torch.full(t.shape, names.index(lab), dtype=torch.int8, device=t.device)
        return pytree.map(one, labels, tree)

    def pack(tree, m):  # meta tensors (a lowered step's state) get their packed length from the labels
        return pytree.map(lambda t, k: t.new_empty(int(k.sum())) if t.is_meta else t[k], tree, m)

    def masks(tree):
        idx = label_index(tree)
        return {k: pytree.map(lambda t: t == i, idx) for i, k in enumerate(names)}

    def init(params):
        m = masks(params) if compact else None
        return MultiTransformState(inner_states={
            k: transforms[k].init(pack(params, m[k]) if k in compact else params) for k in names
        })

    def collectives(params):
        m = masks(params) if compact else None
        return tuple(c for k in names if transforms[k].collectives is not None
                     for c in transforms[k].collectives(pack(params, m[k]) if k in compact else params))

    def update(updates, state, params=None):
        m_of = masks(updates)
        out = None  # created at the first result: dtype wide enough for every transform's updates
        new_states = {}

        def widen(out, new):
            like = lambda g, u: torch.zeros_like(g, dtype=torch.promote_types(g.dtype, u.dtype))  # noqa: E731
            if out is None:
                return pytree.map(like, updates, new)
            return pytree.map(lambda o, u: o if o.dtype == torch.promote_types(o.dtype, u.dtype) else o.to(u.dtype), out, new)

        for name in names:
            m = m_of[name]
            if name in compact:
                p = pack(params, m) if params is not None else None
                new, new_states[name] = transforms[name].update(pack(updates, m), state.inner_states[name], p)
                out = widen(out, new)
                out = pytree.map(lambda o, u, k: o.masked_scatter(k, u.to(o.dtype)), out, new, m)
                continue
            inside = pytree.map(lambda g, k: torch.where(k, g, torch.zeros_like(g)), updates, m)
            new, new_states[name] = transforms[name].update(inside, state.inner_states[name], params)
            out = widen(out, new)
            out = pytree.map(lambda o, u, k: torch.where(k, u.to(o.dtype), o), out, new, m)
        return out, MultiTransformState(inner_states=new_states)

    def fingerprint(state):
        return tuple(kv for k in names for kv in settings_of(transforms[k], state.inner_states[k], f"[{k!r}]"))

    return GradientTransformation(init, update, donates=any(t.donates for t in transforms.values()),
                                  collectives=collectives if any(t.collectives for t in transforms.values()) else None,
                                  fingerprint=fingerprint)
