"""Where 8-bit Adam keeps what: the quantized pieces of a rank's shard and the state containers.

This module is also the internal API ``ragged/checkpoint/_quant8.py`` uses to store 8-bit Adam
moments (see [Note: 8-bit moments in a checkpoint] there); the checkpoint asks the optimizer only
these names, so the codec, the layout and the transform can change as long as they keep their
meaning: :func:`quantized_block` (how a leaf's moments are kept: 8-bit blocks or fp32),
:func:`adam8bit_leaf_state` (views of this rank's part of each leaf's moments),
:func:`init_moments` (a fresh state laid out for a DBuffer, to load into),
:class:`Quant8Moments` and :class:`ScaleByAdam8bitState` (the state containers).

[Note: blocks are the plan's blocks]
Each quantization block is one block of the layout: an ``r x c`` tile of a leaf planned with
``spec.Blocks(r, c)`` (tiles over the last two dims; the last tile of a row band is narrower
when ``c`` does not divide the row, the last band of a 2-D leaf shorter when ``r`` does not
divide the rows), or a run of ``n`` elements of a leaf planned with ``spec.Elements(n)`` (the
last run of a leaf may be shorter). The planner never lets a rank boundary cut a block, so each
rank quantizes whole blocks of its own shard: no communication, and every block sees exactly the
same values whatever the world size. All arithmetic is element-wise or an exact max, so the
state is bit-identical on every world size for the same gradients.

Which leaves are quantized: floating leaves of at least ``min_size`` elements (default 4096)
planned with ``Blocks(r, c)`` (``r * c >= 32``) or ``Elements(n)`` (``n >= 32``). Every other
leaf -- small ones, ``Rows(n)`` leaves, tiny blocks, and ``Replicate()`` leaves -- keeps fp32
moments (in one compact tensor per buffer). Plans from ``strategy="naive"`` that cut blocks are
rejected.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import LayoutError
from ragged.optim._quant8_codec import codec
from ragged.spec import Blocks, Elements, LayoutPlan

__all__ = [
    "MIN_BLOCK",
    "Quant8Moments",
    "ScaleByAdam8bitState",
    "QPiece",
    "ShardLayout",
    "quantized_block",
    "shard_layout",
    "init_moments",
    "adam8bit_leaf_state",
    "chunk_limit",
    "chunks",
]

MIN_BLOCK = 32


class Quant8Moments(NamedTuple):
    """8-bit Adam moments of one DBuffer.

    Attributes:
        mu_codes: uint8 codes of the first moment of every quantized element (compact, in
            buffer order).
        nu_codes: uint8 codes of the second moment.
        mu_scales: fp32 absmax per quantized block (buffer order; tiles band-major).
        nu_scales: same for the second moment.
        mu_fp32: fp32 first moment of the other (non-quantized, non-padding) elements.
        nu_fp32: fp32 second moment of those.
        mu_rep: fp32 first moment of the replicated buffer.
        nu_rep: fp32 second moment of the replicated buffer.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> plan = rg.make_plan({"w": torch.empty(64, 64)}, spec.Blocks(32, 32), world_size=1)
        >>> m = rg.optim.scale_by_adam_8bit(min_size=1).init(rg.shard(plan, {"w": torch.zeros(64, 64)}, rank=0)).moments
        >>> m.mu_codes.dtype, m.mu_codes.numel(), m.mu_scales.numel()    # one fp32 scale per 32x32 block
        (torch.uint8, 4096, 4)
    """

    mu_codes: torch.Tensor
    nu_codes: torch.Tensor
    mu_scales: torch.Tensor
    nu_scales: torch.Tensor
    mu_fp32: torch.Tensor
    nu_fp32: torch.Tensor
    mu_rep: torch.Tensor
    nu_rep: torch.Tensor


class ScaleByAdam8bitState(NamedTuple):
    """State of :func:`ragged.optim.scale_by_adam_8bit`: step count and one :class:`Quant8Moments`
    per DBuffer of the params tree (same tree structure, DBuffers replaced).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> plan = rg.make_plan({"w": torch.empty(64, 64)}, spec.Blocks(32, 32), world_size=1)
        >>> state = rg.optim.scale_by_adam_8bit(min_size=1).init(rg.shard(plan, {"w": torch.zeros(64, 64)}, rank=0))
        >>> state.count, type(state.moments).__name__
        (tensor(0), 'Quant8Moments')
    """

    count: torch.Tensor
    moments: Any


@dataclasses.dataclass(frozen=True, slots=True)
class QPiece:
    """One quantized leaf piece of a rank's shard, viewed as ``(rows, cols)`` in ``(br, bc)`` blocks.

    ``local_offset`` is its start in the shard, ``code_offset`` / ``scale_offset`` its start in
    the compact code / scale arrays of :class:`Quant8Moments`.
    """

    path: str
    local_offset: int
    numel: int
    rows: int
    cols: int
    br: int
    bc: int
    code_offset: int
    scale_offset: int

    @property
    def bands(self) -> int:
        return -(-self.rows // self.br)

    @property
    def tiles(self) -> int:
        return -(-self.cols // self.bc)

    @property
    def num_blocks(self) -> int:
        return self.bands * self.tiles


@dataclasses.dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where one rank's 8-bit moments live.

    Attributes:
        qpieces: the quantized pieces, in shard order.
        fp32_pieces: ``(path, local_offset, numel, compact offset)`` of the fp32-moment pieces.
        fp32_index: int64 positions in the shard of the fp32-moment elements (compact order).
        num_codes, num_blocks, num_fp32: sizes of the compact arrays.
    """

    qpieces: tuple[QPiece, ...]
    fp32_pieces: tuple[tuple[str, int, int, int], ...]
    fp32_index: torch.Tensor
    num_codes: int
    num_blocks: int
    num_fp32: int


def quantized_block(leaf, min_size: int) -> tuple[int, int] | None:
    """``(block rows, block cols)`` if 8-bit Adam quantizes ``leaf`` (a ``LeafLayout``), else None
    (the leaf keeps fp32 moments; see [Note: blocks are the plan's blocks]).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged.optim._quant8_state import quantized_block
        >>> plan = rg.make_plan({"w": torch.zeros(64, 64)}, rg.spec.Blocks(32, 32), world_size=1)
        >>> quantized_block(plan.leaves[0], 4096), quantized_block(plan.leaves[0], 8192)
        ((32, 32), None)
    """
    if leaf.numel < min_size or not leaf.dtype.is_floating_point:
        return None
    s = leaf.granularity
    if isinstance(s, Elements) and s.n >= MIN_BLOCK:
        return (1, s.n)
    if isinstance(s, Blocks) and len(leaf.shape) >= 2 and s.r * s.c >= MIN_BLOCK:
        return (s.r, s.c)
    return None


def _build(plan: LayoutPlan, rank: int, device, min_size: int) -> ShardLayout:
    if plan.split_blocks:
        raise LayoutError(
            f"adamw_8bit needs whole blocks on every rank, but this plan (strategy={plan.strategy!r}) "
            f"cuts {plan.split_blocks} block(s) at rank boundaries. Fix: plan with strategy='dp' "
            "or 'exact' (the default), which never cuts a block."
        )
    qpieces, fp32_pieces = [], []
    codes = blocks = nfp = 0
    for piece in plan.local_pieces(rank):
        leaf = piece.leaf
        block = quantized_block(leaf, min_size)
        if block is None:
            fp32_pieces.append((leaf.path, piece.local_offset, piece.numel, nfp))
            nfp += piece.numel
            continue
        br, bc = block
        if br == 1:  # Elements(n): one row of n-element blocks
            if piece.start % bc:
                raise LayoutError(f"params{leaf.path}: piece starts at {piece.start}, inside a block of {bc}.")
            rows, cols = 1, piece.numel
        else:
            C = leaf.shape[-1]
            if piece.start % (br * C):
                raise LayoutError(
                    f"params{leaf.path} (shape {leaf.shape}): rank {rank}'s piece starts at row "
                    f"{piece.start // C}, inside a band of {br} rows."
                )
            rows, cols = piece.numel // C, C
        q = QPiece(leaf.path, piece.local_offset, piece.numel, rows, cols, br, bc, codes, blocks)
        qpieces.append(q)
        codes += piece.numel
        blocks += q.num_blocks
    runs = [torch.arange(lo, lo + n, dtype=torch.int64) for _, lo, n, _ in fp32_pieces]
    index = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.int64)
    return ShardLayout(tuple(qpieces), tuple(fp32_pieces), index.to(device), codes, blocks, nfp)


_LAYOUTS: dict = {}


def shard_layout(dbuf: DBuffer, min_size: int) -> ShardLayout:
    """The :class:`ShardLayout` of ``dbuf``'s rank (cached per plan, rank, device, ``min_size``).

    Raises:
        LayoutError: the plan cuts a block at a rank boundary (``strategy="naive"``).
    """
    key = (dbuf.plan, dbuf.rank, dbuf.data.device, min_size)
    hit = _LAYOUTS.get(key)
    if hit is None:
        if len(_LAYOUTS) > 64:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = _build(dbuf.plan, dbuf.rank, dbuf.data.device, min_size)
    return hit


def init_moments(dbuf: DBuffer, min_size: int) -> Quant8Moments:
    """Zero 8-bit moments for ``dbuf`` (codes of 0, zero scales, zero fp32 moments)."""
    lay = shard_layout(dbuf, min_size)
    dev = dbuf.data.device
    f32 = dict(dtype=torch.float32, device=dev)
    zero_rep = torch.zeros(dbuf.replicated.shape, **f32)
    return Quant8Moments(
        mu_codes=torch.full((lay.num_codes,), codec(True, dev).zero, dtype=torch.uint8, device=dev),
        nu_codes=torch.zeros(lay.num_codes, dtype=torch.uint8, device=dev),
        mu_scales=torch.zeros(lay.num_blocks, **f32),
        nu_scales=torch.zeros(lay.num_blocks, **f32),
        mu_fp32=torch.zeros(lay.num_fp32, **f32),
        nu_fp32=torch.zeros(lay.num_fp32, **f32),
        mu_rep=zero_rep,
        nu_rep=zero_rep.clone(),
    )


def adam8bit_leaf_state(moments: Quant8Moments, dbuf: DBuffer, *, min_size: int = 4096) -> dict[str, dict]:
    """This rank's part of the 8-bit Adam state, per leaf path.

    Returns ``{path: {"mu_codes", "nu_codes", "mu_scales", "nu_scales"}}`` for quantized leaves
    and ``{path: {"mu", "nu"}}`` for fp32 ones. Concatenating one leaf's entries over ranks in
    rank order gives the whole leaf's state (codes in element order, scales band-major), which
    is what the world-size-independence tests compare.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> plan = rg.make_plan({"w": torch.empty(64, 64), "b": torch.empty(64)},
        ...                     {"w": spec.Blocks(32, 32), "b": spec.Rows(1)}, world_size=1)
        >>> p = rg.shard(plan, {"w": torch.zeros(64, 64), "b": torch.zeros(64)}, rank=0)
        >>> state = rg.optim.scale_by_adam_8bit(min_size=1000).init(p)
        >>> {k: sorted(v) for k, v in rg.optim.adam8bit_leaf_state(state.moments, p, min_size=1000).items()}
        {"['w']": ['mu_codes', 'mu_scales', 'nu_codes', 'nu_scales'], "['b']": ['mu', 'nu']}
    """
    lay = shard_layout(dbuf, min_size)
    out: dict[str, dict] = {}
    for q in lay.qpieces:
        cs, ss = q.code_offset, q.scale_offset
        out[q.path] = {
            "mu_codes": moments.mu_codes[cs : cs + q.numel],
            "nu_codes": moments.nu_codes[cs : cs + q.numel],
            "mu_scales": moments.mu_scales[ss : ss + q.num_blocks],
            "nu_scales": moments.nu_scales[ss : ss + q.num_blocks],
        }
    for path, _, n, c in lay.fp32_pieces:
        out[path] = {"mu": moments.mu_fp32[c : c + n], "nu": moments.nu_fp32[c : c + n]}
    for leaf in dbuf.plan.replicated:
        out[leaf.path] = {
            "mu": moments.mu_rep[leaf.offset : leaf.stop],
            "nu": moments.nu_rep[leaf.offset : leaf.stop],
        }
    return out


# Elements updated at a time, per device type (see [Note: the update's scratch]).
CHUNK = {"cpu": 1 << 18}
CHUNK_ELSEWHERE = 1 << 22

# [Note: the update's scratch]
# The update runs over chunks of a buffer's elements (quantized pieces cut at block boundaries by
# :func:`chunks`; the fp32-moment and replicated elements cut anywhere) with one
# :class:`~ragged.optim._quant8_codec.Workspace` per buffer: 20 bytes per element of the largest
# chunk, plus 16 more for the float64 root where the update takes it (neither the CPU nor CUDA:
# ``_quant8_fused.root_form``), plus per-block products (8 bytes per block). A chunk is
# ``CHUNK[device type]`` elements, or at least one band of ``r`` rows (``Elements``: one block),
# so the scratch is at most 20 B x max(CHUNK, the widest band), whatever the shard's size: on a
# CPU 2^18 elements (5 MiB: the chunk's temporaries stay in the last-level cache between the
# update's ops), elsewhere 2^22 (80 MiB on CUDA; each of the chunk's ~35 kernels still moves
# 16 MiB or more, long against its launch). Every op is element-wise or per block, so the cut
# changes no bit. fp32 gradients and params are read in place; bf16 ones are converted whole
# first (4 bytes per element each), as the update they produce is fp32.


def chunk_limit(device_type: str) -> int:
    """Elements of one chunk on a device type (see [Note: the update's scratch])."""
    return CHUNK.get(device_type, CHUNK_ELSEWHERE)


def chunks(q: QPiece, device_type: str = "cpu"):
    """``q`` cut into sub-pieces of whole blocks, about :func:`chunk_limit` elements each.

    Every block is quantized on its own, so the cut changes no code and no scale; it only
    bounds the update's scratch (decoded moments, lookup keys) to one chunk instead of one leaf.
    """
    limit = chunk_limit(device_type)
    if q.numel <= limit:
        yield q
        return
    if q.rows == 1:  # Elements(n): one row of n-element blocks
        step = max(1, limit // q.bc)
        for t0 in range(0, q.tiles, step):
            c0, c1 = t0 * q.bc, min(q.cols, (t0 + step) * q.bc)
            yield dataclasses.replace(q, local_offset=q.local_offset + c0, numel=c1 - c0, cols=c1 - c0,
                                      code_offset=q.code_offset + c0, scale_offset=q.scale_offset + t0)
        return
    step = max(1, limit // (q.br * q.cols))
    for b0 in range(0, q.bands, step):
        r0, r1 = b0 * q.br, min(q.rows, (b0 + step) * q.br)
        n0, n = r0 * q.cols, (r1 - r0) * q.cols
        yield dataclasses.replace(q, local_offset=q.local_offset + n0, numel=n, rows=r1 - r0,
                                  code_offset=q.code_offset + n0, scale_offset=q.scale_offset + b0 * q.tiles)
