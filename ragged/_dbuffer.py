"""DBuffer: this rank's flat shard of a plan, with zero-copy views of every leaf.

[Note: DBuffer is a pytree of two tensors]
A DBuffer is an optree dataclass in the ``"ragged"`` namespace whose children are the
two flat tensors ``data`` (this rank's S elements of the sharded buffer) and
``replicated`` (every replicated leaf, whole, on every rank); the plan and rank are static
metadata. So ``ragged.pytree.map(fn, dbuf)`` runs ``fn`` once per buffer (one kernel over all
leaves, never one per leaf), and optimizers written over pytrees work on DBuffers unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from optree.dataclasses import dataclass, field

from ragged._pytree import pytree
from ragged.spec._plan import LayoutPlan, piece_shape
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["DBuffer", "is_dbuffer", "unflatten", "norm", "norm_collectives", "leaf_positions", "local_gaps"]


@dataclass(frozen=True, namespace="ragged")
class DBuffer:
    """This rank's shard of a :class:`~ragged.spec.LayoutPlan`.

    Attributes:
        data: 1-D tensor of ``plan.shard_size`` elements (padding is zero).
        replicated: 1-D tensor holding every replicated leaf (may be empty).
        plan: the layout (static metadata).
        rank: this rank's index in the shard group (static metadata).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.arange(8.0).view(4, 2), "b": torch.ones(2)}
        >>> plan = rg.make_plan(params, world_size=2, align=1)
        >>> d = rg.shard(plan, params, rank=1)           # rank 1's S elements, no communication
        >>> d.data.shape == (plan.shard_size,), d.rank
        (True, 1)
        >>> d.views()["w"].tolist()                       # its piece of w keeps rows as rows
        [[4.0, 5.0], [6.0, 7.0]]
        >>> d.replace(data=d.data * 2).views()["w"][0].tolist()   # immutable: replace, don't mutate
        [8.0, 10.0]
    """

    data: torch.Tensor
    replicated: torch.Tensor
    plan: LayoutPlan = field(pytree_node=False)
    rank: int = field(pytree_node=False)

    replace = dataclasses.replace

    def views(self):
        """A pytree like the params whose leaves are zero-copy views of this rank's pieces.

        A leaf this rank holds none of is an empty view. Pieces keep rows as rows when the
        cut falls on row boundaries (see :func:`ragged.spec.piece_shape`).
        """
        plan = self.plan
        leaves = [None] * plan.num_leaves
        pieces = plan.local_pieces(self.rank) if self.rank < plan.world_size else ()
        held = {piece.leaf.index: piece for piece in pieces}
        for leaf in plan.leaves:
            piece = held.get(leaf.index)
            if piece is None:
                empty_shape = (0, *leaf.shape[1:]) if len(leaf.shape) >= 1 else (0,)
                leaves[leaf.index] = self.data[:0].view(empty_shape)
            else:
                view = self.data[piece.local_offset : piece.local_offset + piece.numel]
                leaves[leaf.index] = view.view(piece_shape(leaf.shape, piece.start, piece.stop))
        for leaf in plan.replicated:
            leaves[leaf.index] = self.replicated[leaf.offset : leaf.offset + leaf.numel].view(leaf.shape)
        return pytree.unflatten(plan.treedef, leaves)

    # ---- group-level ops: one kernel over the whole buffer, never one per leaf -------------
    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def zeros_like(self) -> DBuffer:
        """A DBuffer of zeros with this one's plan, rank, dtype and device.

        Examples:
            >>> import torch, ragged as rg
            >>> plan = rg.make_plan({"w": torch.empty(4, 2)}, world_size=2, align=1)
            >>> d = rg.shard(plan, {"w": torch.ones(4, 2)}, rank=1)
            >>> d.zeros_like().data.tolist()
            [0.0, 0.0, 0.0, 0.0]
        """
        return self.replace(data=torch.zeros_like(self.data), replicated=torch.zeros_like(self.replicated))

    def scale(self, factor) -> DBuffer:
        """``factor * self`` (padding stays zero)."""
        return self.replace(data=self.data * factor, replicated=self.replicated * factor)

    def add(self, other: DBuffer, *, alpha=1) -> DBuffer:
        """``self + alpha * other`` for a DBuffer of the same plan and rank."""
        _check_same_layout(self, other, "add")
        return self.replace(
            data=torch.add(self.data, other.data, alpha=alpha),
            replicated=torch.add(self.replicated, other.replicated, alpha=alpha),
        )

    def cast(self, dtype: torch.dtype) -> DBuffer:
        """This buffer in ``dtype`` (no copy when it already is). The plan is unchanged: a cast
        DBuffer is e.g. the bf16 compute copy of an fp32 master shard."""
        if dtype == self.data.dtype:
            return self
        return self.replace(data=self.data.to(dtype), replicated=self.replicated.to(dtype))

    def global_norm(self, comm=None, *, ord: float = 2.0) -> torch.Tensor:
        """The ``ord``-norm of all leaves together across the shard group (a 0-d float64 tensor,
        equal on every rank): :func:`norm` of this buffer.

        One local reduction per buffer and one all-reduce of a scalar; padding is zero so it
        does not contribute; replicated leaves are counted once (they are equal on every rank).
        Without ``comm`` the norm of this rank's part only.

        Examples:
            >>> import torch, ragged as rg
            >>> plan = rg.make_plan({"w": torch.empty(2, 2)}, world_size=2, align=1)
            >>> w = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
            >>> rg.collectives.simulate(2, lambda c: float(rg.shard(plan, {"w": w}, c).global_norm(c)))
            [5.0, 5.0]
        """
        return norm([self], comm, ord=ord)


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` in float64, 0-d (``ord=inf``'s part)."""
    return x.to(torch.float64).abs().amax() if x.numel() else torch.zeros((), dtype=torch.float64, device=x.device)


# [Note: a norm that does not depend on the split]
# Where a rank boundary falls inside a leaf depends on the world size, so a norm summed per rank
# and then across ranks adds its terms in a different order at every world size, and floating
# point addition is not associative. So the norm core adds in two stages that do not depend on it:
# * per *block*: a run of ``_block(granule)`` elements of one leaf, aligned to the leaf's start.
#   A rank boundary falls on a multiple of the granule, which the block divides, so every block
#   (and a leaf's shorter last one) is whole on one rank; its ``|x| ** p`` are summed by one ``sum(dim=1)`` over an ``(n, block)`` view,
#   whose result for a row depends on that row alone (blocks of at most 4096 elements: longer rows
#   are split between threads depending on the number of rows);
# * across blocks, exactly: every block's sum, scaled by ``2 ** (_BITS - e)`` where ``2 ** e``
#   bounds the largest block sum of every rank (one all-reduce of the max), is cut into two
#   integers (the bits above 1, then the next ``_BITS``), and the integers are added in int64,
#   which is associative: one all-reduce of two int64. Up to ``2 ** (63 - _BITS)`` blocks, none
#   overflows; what is lost is each block's part below ``2 ** (e - 2 * _BITS)``, the same for
#   every split. The result is then the same bits at every world size, plan and grouping of the
#   same values (``tests/optim/test_norm_split.py``), and within ~1e-16 of the exact norm.
_BITS = 31
_MAX_BLOCK = 4096


@functools.lru_cache(maxsize=4096)
def _block(granule: int) -> int:
    """The largest divisor of ``granule`` that is at most ``_MAX_BLOCK``."""
    return max(d for d in range(1, min(granule, _MAX_BLOCK) + 1) if granule % d == 0)


def _block_sums(x: torch.Tensor, block: int, p: float, weight: float = 1.0) -> torch.Tensor:
    """``sum |x| ** p`` of every ``block`` consecutive elements of ``x`` and of the shorter rest, if
    any (a leaf whose last granule is short: it ends the leaf, on one rank), float64, times ``weight``."""
    y = x.to(torch.float64)
    y = torch.square(y) if p == 2.0 else y.abs().pow(p)
    whole = y.numel() - y.numel() % block
    y = torch.cat([y[:whole].view(-1, block).sum(dim=1), y[whole:].sum().reshape(1)]) if whole < y.numel() \
        else y.view(-1, block).sum(dim=1)
    return y if weight == 1.0 else y * weight


def _pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2 ** k`` in two halves, so that no factor overflows (``k`` up to about +-2100)."""
    half = torch.div(k, 2, rounding_mode="floor")
    return torch.ldexp(torch.ldexp(x, half.to(torch.float64)), (k - half).to(torch.float64))


def _limbs(sums: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Two int64: the block ``sums`` times ``2 ** k`` cut at 1 and at ``2 ** -_BITS``, each part summed."""
    if not sums.numel():
        return torch.zeros(2, dtype=torch.int64, device=sums.device)
    x = _pow2(torch.where(torch.isfinite(sums), sums, 0.0), k)
    hi = torch.floor(x)
    lo = torch.floor((x - hi) * float(2 ** _BITS))
    return torch.stack([hi.to(torch.int64).sum(), lo.to(torch.int64).sum()])


def _sharded_blocks(d: DBuffer, p: float, weights) -> tuple[list, list]:
    """Block sums of ``d``'s pieces (sharded) and of its replicated leaves (the same on every rank)."""
    w = (lambda leaf: weights.get(leaf.index, 1.0)) if weights else (lambda leaf: 1.0)
    sharded = [_block_sums(d.data[q.local_offset : q.local_offset + q.numel], _block(q.leaf.granule), p, w(q.leaf))
               for q in d.plan.local_pieces(d.rank) if q.numel]
    local = [_block_sums(d.replicated[l.offset : l.stop], _block(l.granule or l.numel), p, w(l))
             for l in d.plan.replicated if l.numel]
    return sharded, local


def norm(parts, comm=None, *, others=(), ord: float = 2.0) -> torch.Tensor:
    """The ``ord``-norm of ``parts`` over every rank, each element counted once (0-d float64,
    equal on every rank): the one norm core under ``rg.global_norm`` of every layout,
    :meth:`DBuffer.global_norm` and ``rg.optim.tree_norm``.

    ``parts``: DBuffers (this rank's shards: their ``data`` is reduced over ``comm``, their
    replicated leaves count once), ``(DBuffer, {leaf index: weight})`` pairs (a leaf copied on
    another axis of size k weighs 1/k there, so reducing over that axis counts it once), and
    plain tensors (the same on every rank: counted once). The sum does not depend on how the
    elements are split among ranks (see [Note: a norm that does not depend on the split]): one
    all-reduce of the largest block sum over ``comm`` and one of two int64 (none without a DBuffer),
    the same over each comm of ``others`` (axes whose copies the weights divided out). No host sync.
    ``ord=inf``: the largest magnitude (weights do not matter; one all-reduce of the max).
    """
    p = float(ord)
    sharded, local, any_sharded = [], [], False  # any_sharded: the same on every rank (not whether it holds pieces)
    for part in parts:
        if isinstance(part, torch.Tensor):
            local.append(_abs_max(part) if p == math.inf else _block_sums(part, _block(max(part.numel(), 1)), p))
            continue
        d, weights = part if isinstance(part, tuple) else (part, None)
        any_sharded = True
        if p == math.inf:  # padding is zero, so whole buffers
            sharded.append(_abs_max(d.data))
            local.append(_abs_max(d.replicated))
            continue
        more_sharded, more_local = _sharded_blocks(d, p, weights)
        sharded += more_sharded
        local += more_local
    device = next((t.device for t in sharded + local), None)
    shard_comm = norm_collectives(comm, any_sharded, p)
    if p == math.inf:
        total = functools.reduce(torch.maximum, sharded + local, torch.zeros((), dtype=torch.float64, device=device))
        total = total.reshape(1)
        if shard_comm:
            comm.all_reduce(total, op="max")
        for other in others:
            other.all_reduce(total, op="max")
        return total[0]
    zero = torch.zeros(0, dtype=torch.float64, device=device)
    sharded, local = torch.cat(sharded) if sharded else zero, torch.cat(local) if local else zero
    both = torch.cat([sharded, local])
    finite = torch.isfinite(both)
    stats = torch.stack([torch.where(finite, both, 0.0).amax() if both.numel() else zero.new_zeros(()),
                         torch.isnan(both).any().double(), torch.isinf(both).any().double()])
    reduce_over = ([comm] if shard_comm else []) + list(others)
    for c in reduce_over:
        c.all_reduce(stats, op="max")
    k = _BITS - torch.frexp(stats[0]).exponent.to(torch.int64)
    limbs = _limbs(sharded, k)
    if shard_comm:
        comm.all_reduce(limbs, op="sum")
    limbs = limbs + _limbs(local, k)
    for other in others:
        other.all_reduce(limbs, op="sum")
    total = _pow2(limbs[0].double(), -k) + _pow2(limbs[1].double(), -k - _BITS)
    total = torch.where(stats[1] > 0, math.nan, torch.where(stats[2] > 0, math.inf, total))
    return torch.sqrt(total) if p == 2.0 else total.pow(1.0 / p)


def norm_collectives(comm, sharded: bool, ord: float = 2.0) -> tuple[tuple[str, str, int, int], ...]:
    """What :func:`norm` issues on ``comm`` (``(kind, axis, calls, bytes)``, see
    ``GradientTransformation.collectives``; its ``others`` aside): when some part is sharded over
    more than one rank, two all-reduces, of three float64 (the largest block sum and two flags) and
    of two int64 (see [Note: a norm that does not depend on the split]); ``ord=inf``: one of the
    max. :func:`norm` issues exactly this."""
    if not (sharded and comm is not None and comm.world_size > 1):
        return ()
    return (("all_reduce", "shard", 1, 8),) if float(ord) == math.inf else (("all_reduce", "shard", 2, 24 + 16),)


@functools.lru_cache(maxsize=256)
def _leaf_runs(plan: LayoutPlan, rank: int, picked: frozenset) -> tuple[tuple, tuple]:
    """``(lo, hi)`` runs of the ``picked`` leaves in ``rank``'s shard and in the replicated buffer."""
    data = tuple((p.local_offset, p.local_offset + p.numel) for p in plan.local_pieces(rank) if p.leaf.index in picked)
    return data, tuple((l.offset, l.stop) for l in plan.replicated if l.index in picked)


def leaf_positions(plan: LayoutPlan, rank: int, picked: frozenset, device=None):
    """Positions of the ``picked`` leaves (by index) in ``rank``'s shard and in the replicated
    buffer, as int64 tensors on ``device``: made there (one ``arange`` per run), not copied from
    the host, so no host-device sync and nothing kept on the device between calls."""
    def cat(runs):
        parts = [torch.arange(lo, hi, device=device) for lo, hi in runs]
        return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.zeros(0, dtype=torch.int64, device=device)

    return tuple(cat(runs) for runs in _leaf_runs(plan, rank, picked))


@functools.lru_cache(maxsize=256)
def local_gaps(plan: LayoutPlan, rank: int) -> tuple[tuple[int, int], ...]:
    """``(lo, hi)`` ranges of ``rank``'s padding inside its shard (between and after leaves)."""
    gaps, pos = [], 0
    for piece in plan.local_pieces(rank):
        if piece.local_offset > pos:
            gaps.append((pos, piece.local_offset))
        pos = piece.local_offset + piece.numel
    if plan.shard_size > pos:
        gaps.append((pos, plan.shard_size))
    return tuple(gaps)


def is_dbuffer(x) -> bool:
    """The ``is_leaf`` of pytree functions that treat each DBuffer as one leaf."""
    return isinstance(x, DBuffer)


def _check_same_layout(a: DBuffer, b: DBuffer, what: str) -> None:
    if not isinstance(b, DBuffer):
        raise RaggedTypeError(f"DBuffer.{what} needs another DBuffer, got {type(b).__name__}.")
    if a.plan != b.plan or a.rank != b.rank:
        raise RaggedValueError(
            f"DBuffer.{what}: the two buffers have different plans or ranks ({a.plan!r} rank {a.rank} vs "
            f"{b.plan!r} rank {b.rank}). Fix: redistribute one onto the other's plan first."
        )


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def unflatten(plan: LayoutPlan, buffer: torch.Tensor, replicated: torch.Tensor | None = None):
    """Views of every leaf in a gathered flat buffer of ``plan.buffer_numel`` elements.

    Zero-copy: each returned tensor shares ``buffer``'s (or ``replicated``'s) storage. See
    [Note: leaf views of a flat buffer].

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"a": torch.empty(2), "b": torch.empty(3)}, world_size=2, align=1)
        >>> flat = torch.arange(float(plan.buffer_numel))
        >>> tree = rg.unflatten(plan, flat)
        >>> tree["b"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        True
    """
    leaves = [None] * plan.num_leaves
    _views_into(leaves, plan.leaves, buffer, "buffer")
    if plan.replicated:
        if replicated is None:
            raise RaggedValueError("the plan has replicated leaves; pass the replicated buffer too.")
        _views_into(leaves, plan.replicated, replicated, "replicated buffer")
    return pytree.unflatten(plan.treedef, leaves)


def _views_into(out: list, layouts, buffer: torch.Tensor, what: str) -> None:
    """[Note: leaf views of a flat buffer]
    Without autograd, one ``as_strided`` per leaf (~3x cheaper than slice + view; units of
    DeepSeek-like models hold 100s of leaves). With autograd, ``split_with_sizes`` over leaves and
    gaps: its backward is ONE concatenation into a buffer-sized gradient, where a slice per leaf
    would allocate a zero-filled buffer-sized gradient per leaf (backward O(leaves x buffer):
    436 ms instead of ~10 for a 112-leaf block of 3M elements).
    """
    need = max((l.stop for l in layouts), default=0)
    if buffer.dim() != 1 or buffer.numel() < need:
        raise RaggedValueError(f"unflatten: the {what} must be 1-D with at least {need} elements, got shape {tuple(buffer.shape)}.")
    if buffer.requires_grad:
        segs = segments(layouts, buffer.numel())
        for (leaf, _), part in zip(segs, buffer.split_with_sizes([n for _, n in segs])):
            if leaf is not None:
                out[leaf.index] = part.view(leaf.shape)
        return
    if buffer.stride(0) != 1:  # views of a strided buffer would not be the contiguous leaves the plan describes
        raise RaggedValueError(f"unflatten: the {what} must be contiguous (stride 1), got stride {buffer.stride(0)}.")
    base = buffer.storage_offset()
    for leaf in layouts:
        out[leaf.index] = buffer.as_strided(leaf.shape, _contiguous_strides(leaf.shape), base + leaf.offset)


@functools.lru_cache(maxsize=1024)
def segments(layouts: tuple, end: int) -> tuple:
    """``(leaf layout, or None for a gap, length)`` covering a flat buffer of ``end`` elements
    in which ``layouts`` (leaf layouts with ``offset``/``numel``) lie without overlap."""
    segs, pos = [], 0
    for leaf in sorted(layouts, key=lambda l: l.offset):
        if leaf.offset > pos:
            segs.append((None, leaf.offset - pos))
        segs.append((leaf, leaf.numel))
        pos = leaf.stop
    if end > pos:
        segs.append((None, end - pos))
    return tuple(segs)
