"""``torch.optim`` semantics for parameters no rank produced a gradient for, over any ragged
optimizer.

[Note: parameters without a gradient]
``torch.optim`` skips a parameter whose ``.grad`` is ``None``: no update, no weight decay, no
moment decay. The step knows per leaf whether any rank produced a gradient (folded into its
end-of-call agreement, see ``_grad.py``). When some leaf got none, it saves that leaf's elements
of every optimizer-state subtree laid out like the shards (``{unit: DBuffer}``: Adam's moments,
momentum), runs the optimizer, writes the saved elements back and zeroes the leaf's update.
So the leaf and its state are left exactly as they were, whether the optimizer updates in place
or not. Two differences from ``torch.optim`` remain, stated here: step counters are per
optimizer, not per parameter (a leaf skipped in some steps gets the bias correction of the
optimizer's count when it is next used; exact whenever a leaf is used in every step or never),
and state not laid out like the shards (the 8-bit AdamW codes) still advances for such leaves.
``make_step(skip_unused=False)`` treats them as zero gradients instead.
"""

from __future__ import annotations

import functools

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import RaggedValueError
from ragged._pytree import pytree

__all__ = ["freeze_unused", "restore_unused"]



@functools.lru_cache(maxsize=1024)
def _positions(plan, rank: int, unused: frozenset, paths: tuple):
    """Element positions of the leaves named in ``unused`` in ``rank``'s shard and in the replicated buffer."""
    picked = {i for i, p in enumerate(paths) if p in unused}
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    data = [torch.arange(p.local_offset, p.local_offset + p.numel) for p in plan.local_pieces(rank)
            if p.leaf.index in picked]
    rep = [torch.arange(l.offset, l.stop) for l in plan.replicated if l.index in picked]
    return cat(data), cat(rep)


def _subtrees(tree, shards):
    """The subtrees of ``tree`` laid out like ``shards`` (``{unit: DBuffer}`` with the same plans)."""
    def like(x):
        return (isinstance(x, dict) and x.keys() == shards.keys()
                and all(isinstance(v, DBuffer) and v.plan == shards[k].plan for k, v in x.items()))
    return [x for x in pytree.leaves(tree, is_leaf=like, none_is_leaf=True) if like(x)]


def freeze_unused(units, unused: dict, shards: dict, opt_state):
    """What :func:`restore_unused` writes back (see [Note: parameters without a gradient]);
    ``shards``: the trainable parts the optimizer updates (``_trainable.trainable_shards``)."""
    where = {}
    for u in units:
        if u.name in unused:
            d = shards[u.name]
            pos = _positions(d.plan, d.rank, unused[u.name], u.trainable_paths)
            where[u.name] = tuple(p.to(d.data.device) for p in pos)
    saved = [{name: (t[name].data[pos[0]].clone(), t[name].replicated[pos[1]].clone()) for name, pos in where.items()}
             for t in _subtrees(opt_state, shards)]
    return where, saved


def restore_unused(frozen, shards: dict, updates: dict, opt_state):
    """Zeroes the unused leaves' updates and writes their saved state back (in place)."""
    where, saved = frozen
    subtrees = _subtrees(opt_state, shards)
    if len(subtrees) != len(saved):
        raise RaggedValueError("the optimizer changed the structure of its state; skip_unused=True needs it fixed.")
    with torch.no_grad():
        for name, (data_pos, rep_pos) in where.items():
            updates[name].data[data_pos] = 0
            updates[name].replicated[rep_pos] = 0
            for tree, values in zip(subtrees, saved):
                tree[name].data[data_pos] = values[name][0]
                tree[name].replicated[rep_pos] = values[name][1]
