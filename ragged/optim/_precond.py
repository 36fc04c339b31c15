"""What SOAP and Shampoo share: the per-block state containers, the batch loop, and the views of
the state for people (which leaves are preconditioned, and each block's matrices).

The blocks and their batches: ``_blocks.py`` ([Note: each granule's tiles are the blocks],
[Note: fixed slots, the same numbers at every world size]). The optimizers: ``_soap.py``,
``_shampoo.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from optree.dataclasses import dataclass, field

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._errors import RaggedTypeError, RaggedValueError, check_int
from ragged._pytree import pytree
from ragged.optim._blocks import BlockLayout, BlockRule, LeafBlocks, Part, batches, block_layout

__all__ = ["SoapFactors", "ShampooFactors", "preconditioned_leaves", "block_state", "run_batches", "layouts",
           "check_block", "check_matrix_dtype"]


def _summary(name: str, layout: BlockLayout) -> str:
    pre = [l for l in layout.leaves if l.block is not None]
    lines = [f"{name}(rank {layout.rank}: {len(pre)} leaves preconditioned in {sum(l.blocks for l in pre)} blocks, "
             f"{sum(p.local for p in layout.parts)} of them here"]
    for leaf in layout.leaves:
        what = f"{leaf.blocks} blocks of {leaf.block[0]} x {leaf.block[1]}" if leaf.block else f"fallback: {leaf.reason}"
        lines.append(f"  params{leaf.path} {tuple(leaf.shape)}: {what}")
    return "\n".join(lines) + ")"


@dataclass(frozen=True, namespace="ragged", repr=False)
class SoapFactors:
    """SOAP's matrices of the blocks one rank holds of one DBuffer, one tensor per part (see
    [Note: blocks by part and ordinal] in ``ragged/optim/_blocks.py``): ``left_stats`` ``L = EMA(G
    G^T)`` as ``(blocks, rows, rows)``, ``right_stats`` ``R = EMA(G^T G)`` as ``(blocks, cols,
    cols)``, and their eigenbases ``left_basis`` / ``right_basis`` (columns by decreasing
    eigenvalue). ``layout`` (static) says which leaf and part each tensor belongs to; the repr
    lists every leaf with its blocks or the reason it falls back to Adam.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> params = {"w": torch.zeros(8, 6), "b": torch.zeros(6)}
        >>> local = rg.shard(rg.make_plan(params, {"w": spec.Blocks(4, 4), "b": None}, world_size=1), params, rank=0)
        >>> f = rg.optim.soap(1e-3).init(local).factors
        >>> [tuple(t.shape) for t in f.left_stats], [tuple(t.shape) for t in f.right_basis]
        ([(2, 4, 4), (2, 4, 4)], [(2, 4, 4), (2, 2, 2)])
        >>> print(f)
        SoapFactors(rank 0: 1 leaves preconditioned in 4 blocks, 4 of them here
          params['b'] (6,): fallback: not a matrix (1-D)
          params['w'] (8, 6): 4 blocks of 4 x 4)
    """

    left_stats: tuple
    right_stats: tuple
    left_basis: tuple
    right_basis: tuple
    layout: BlockLayout = field(pytree_node=False)

    def __repr__(self) -> str:
        return _summary("SoapFactors", self.layout)


@dataclass(frozen=True, namespace="ragged", repr=False)
class ShampooFactors:
    """Shampoo's matrices of the blocks one rank holds of one DBuffer, one tensor per part:
    ``left_stats`` / ``right_stats`` (``L``, ``R``, EMAs or sums of ``G G^T`` / ``G^T G``) and
    their inverse roots ``left_root`` / ``right_root`` (identity until the first root). The repr
    lists every leaf with its blocks or the reason it falls back to the grafting method.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> local = rg.shard(rg.make_plan({"w": torch.zeros(8, 8)}, spec.Blocks(4, 8), world_size=1), {"w": torch.zeros(8, 8)}, rank=0)
        >>> f = rg.optim.shampoo(1e-3).init(local).factors
        >>> tuple(f.left_root[0].shape), bool((f.left_root[0] == torch.eye(4)).all())
        ((2, 4, 4), True)
    """

    left_stats: tuple
    right_stats: tuple
    left_root: tuple
    right_root: tuple
    layout: BlockLayout = field(pytree_node=False)

    def __repr__(self) -> str:
        return _summary("ShampooFactors", self.layout)


FACTORS = (SoapFactors, ShampooFactors)


def _is_factors(x) -> bool:
    return isinstance(x, FACTORS)


def check_block(name: str, block) -> tuple[int, int] | None:
    """``block`` as ``(rows, cols)`` (an int ``b`` is ``(b, b)``), or None."""
    if block is None:
        return None
    if isinstance(block, int) and not isinstance(block, bool):
        block = (block, block)
    if not isinstance(block, tuple) or len(block) != 2:
        raise RaggedValueError(f"{name}: block must be None, an int b (b x b blocks) or a pair (rows, cols), got {block!r}.")
    return (check_int(f"{name}: block rows", block[0]), check_int(f"{name}: block cols", block[1]))


def check_matrix_dtype(name: str, dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.float64):
        raise RaggedValueError(f"{name}: matrix_dtype must be torch.float32 or torch.float64, got {dtype!r}.")
    return dtype


def layouts(tree, rule: BlockRule) -> tuple[list[DBuffer], list[BlockLayout], Any]:
    """The DBuffers of ``tree`` (flattened), the :class:`BlockLayout` of each, and the treedef."""
    bufs, treedef = pytree.flatten(tree, is_leaf=is_dbuffer)
    for d in bufs:
        if not isinstance(d, DBuffer):
            raise RaggedTypeError(
                f"{rule.name} works on DBuffers (rg.shard output), got a {type(d).__name__} leaf. Fix: pass the "
                "DBuffer(s); a plain tensor has no plan, so no blocks.")
        if not d.data.is_floating_point() or d.data.is_complex():
            raise RaggedTypeError(f"{rule.name}: the DBuffer holds {d.data.dtype}; it updates real floating-point "
                                  "parameters.")
    return bufs, [block_layout(rule, d.plan, d.rank) for d in bufs], treedef


def wide(dtype: torch.dtype) -> torch.dtype:
    """At least float32: the dtype of the moments and updates (bf16 params: fp32 updates)."""
    return torch.promote_types(dtype, torch.float32)


def _pad(x: torch.Tensor, n: int, lo: int, hi: int, slot: int) -> torch.Tensor:
    """Blocks ``[lo, hi)`` of ``x`` in slots ``[slot, ...)`` of a batch of ``n`` (zeros elsewhere);
    ``x`` itself when it already is that batch, at the start of its storage (so every block has
    the same address alignment as in a fresh batch: see [Note: fixed slots, the same numbers at
    every world size])."""
    if lo == 0 and hi == n == x.shape[0] and slot == 0 and x.storage_offset() == 0 and x.is_contiguous():
        return x
    out = x.new_zeros((n, *x.shape[1:]))
    out[slot : slot + hi - lo] = x[lo:hi]
    return out


def run_batches(p: Part, inputs: dict[str, torch.Tensor], fn: Callable[[dict], dict]) -> dict[str, torch.Tensor]:
    """Runs ``fn`` on every batch of part ``p`` this rank holds a block of.

    ``inputs``: name -> this rank's blocks of the part, ``(local, ...)``; ``fn`` gets the same
    names as batches ``(n, ...)`` and returns name -> batch results; the results come back as
    ``(local, ...)`` tensors (the slots of other ranks' blocks dropped).
    """
    out: dict[str, torch.Tensor] = {}
    for n, lo, hi, slot in batches(p):
        res = fn({k: _pad(v, n, lo, hi, slot) for k, v in inputs.items()})
        for k, v in res.items():
            if k not in out:
                out[k] = v.new_empty((p.local, *v.shape[1:]))
            out[k][lo:hi] = v[slot : slot + hi - lo]
    return out


def eye_blocks(local: int, n: int, dtype, device) -> torch.Tensor:
    return torch.eye(n, dtype=dtype, device=device).expand(local, n, n).clone()


def init_factors(cls, layout: BlockLayout, dtype, device, *, eye_derived: bool):
    """Zero statistics, and zero (or identity, ``eye_derived``) derived matrices, per part."""
    def zeros(side):
        return tuple(torch.zeros((p.local, getattr(p, side), getattr(p, side)), dtype=dtype, device=device)
                     for p in layout.parts)

    def derived(side):
        if eye_derived:
            return tuple(eye_blocks(p.local, getattr(p, side), dtype, device) for p in layout.parts)
        return zeros(side)

    return cls(zeros("rows"), zeros("cols"), derived("rows"), derived("cols"), layout)


def factors_of(state_tree) -> list:
    return pytree.leaves(state_tree, is_leaf=_is_factors)


def check_state(rule: BlockRule, bufs, factors) -> None:
    """The state was built by ``init`` for these DBuffers (same plan, rank and rule)."""
    if len(factors) != len(bufs) or any(not _is_factors(f) for f in factors):
        raise RaggedValueError(f"{rule.name}: the state holds {len(factors)} block states but the updates hold "
                               f"{len(bufs)} DBuffers. Fix: call opt.init on the DBuffer(s) whose gradients you pass.")
    for d, f in zip(bufs, factors):
        lay = f.layout
        if lay.plan == d.plan and lay.rank == d.rank and lay.rule != rule:
            raise RaggedValueError(
                f"{rule.name}: the optimizer state was built with other block options ({lay.rule}) than this "
                f"optimizer's ({rule}; a precondition_filter compares by identity). Fix: update with the optimizer "
                "whose init built the state.")
        if lay.plan != d.plan or lay.rank != d.rank:
            raise RaggedValueError(
                f"{rule.name}: the updates (DBuffer of rank {d.rank}, {d.plan!r}) do not match the optimizer state "
                f"(built for rank {lay.rank}, {lay.plan!r}). Fix: call opt.init on the DBuffer(s) whose gradients "
                "you pass to opt.update.")


def preconditioned_leaves(opt_state) -> dict[str, LeafBlocks]:
    """How SOAP / Shampoo treat each leaf: its blocks, or why it falls back, by key path.

    Args:
        opt_state: a state holding :class:`SoapFactors` / :class:`ShampooFactors` (an
            ``rg.optim.soap`` or ``rg.optim.shampoo`` state, alone or inside combinators).

    Returns:
        ``{path: LeafBlocks(path, shape, granularity, block, blocks, reason)}``; ``path`` is the
        leaf's key path (after ``[i]``, the DBuffer's index, when two DBuffers hold leaves of the
        same path). ``block`` is None for a leaf that falls back, with the ``reason``.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> params = {"w": torch.zeros(8, 8), "emb": torch.zeros(10, 8), "b": torch.zeros(8)}
        >>> plan = rg.make_plan(params, {"w": spec.Blocks(4, 4), "emb": spec.Rows(1), "b": None}, world_size=1)
        >>> state = rg.optim.soap(1e-3).init(rg.shard(plan, params, rank=0))
        >>> for path, leaf in rg.optim.preconditioned_leaves(state).items():
        ...     print(path, leaf.block, leaf.blocks, leaf.reason)
        ['b'] None 0 not a matrix (1-D)
        ['emb'] None 0 Rows(1) has no block width: give the optimizer block=(1, c), or plan it with spec.Blocks(r, c)
        ['w'] (4, 4) 4 None
    """
    found = [f for f in pytree.leaves(opt_state, is_leaf=_is_factors) if _is_factors(f)]
    if not found:
        raise RaggedValueError("preconditioned_leaves: opt_state holds no SOAP or Shampoo state (SoapFactors / "
                               "ShampooFactors); pass the state of rg.optim.soap or rg.optim.shampoo.")
    paths = [leaf.path for f in found for leaf in f.layout.leaves]
    clash = len(paths) != len(set(paths))  # FSDP units' plans name their leaves in full: no clash
    out = {}
    for i, f in enumerate(found):
        for leaf in f.layout.leaves:
            out[(f"[{i}]" if clash else "") + leaf.path] = leaf
    return out


def block_state(factors) -> dict[str, dict[str, dict[str, Any]]]:
    """This rank's block matrices of one DBuffer, by leaf and part, for inspection.

    Args:
        factors: a :class:`SoapFactors` or :class:`ShampooFactors` (``state.factors`` for one
            DBuffer).

    Returns:
        ``{leaf path: {part: {"first", "count", "block", field: (blocks, n, n) tensor ...}}}``:
        ``first`` is the ordinal of this rank's first block of the part (band-major over the
        whole leaf), ``count`` the part's blocks in the whole leaf; concatenating a part's
        tensors over ranks in rank order gives the whole leaf's. The tensors are the state's own
        (not copies). :func:`ragged.checkpoint.consolidate` gives them whole from a checkpoint.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> local = rg.shard(rg.make_plan({"w": torch.zeros(8, 6)}, spec.Blocks(4, 4), world_size=1), {"w": torch.zeros(8, 6)}, rank=0)
        >>> parts = rg.optim.block_state(rg.optim.soap(1e-3).init(local).factors)["['w']"]
        >>> {k: (v["first"], v["count"], v["block"], tuple(v["right_stats"].shape)) for k, v in parts.items()}
        {'interior': (0, 2, (4, 4), (2, 4, 4)), 'right': (0, 2, (4, 2), (2, 2, 2))}
    """
    if not _is_factors(factors):
        raise RaggedTypeError(f"block_state takes a SoapFactors or ShampooFactors (state.factors of one DBuffer), "
                              f"got {type(factors).__name__}.")
    names = [k for k in type(factors).__dataclass_fields__ if k != "layout"]
    out: dict = {}
    for i, p in enumerate(factors.layout.parts):
        entry = {"first": p.first, "count": p.count, "block": (p.rows, p.cols)}
        entry.update({k: getattr(factors, k)[i] for k in names})
        out.setdefault(p.path, {})[p.part] = entry
    return out
