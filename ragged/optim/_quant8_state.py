"""The small internal API ``ragged.checkpoint`` uses to store 8-bit Adam moments.

The checkpoint stores each leaf's part of :class:`~ragged.optim.Quant8Moments` as
world-size-independent tensors (see [Note: 8-bit moments in a checkpoint] in
``ragged/checkpoint/_quant8.py``). It needs three facts about the optimizer, and asks only these
functions for them, so that ``_quant8``'s codec, block layout and transform can change freely
as long as these keep their meaning:

* :func:`leaf_block`: how a leaf's moments are kept (8-bit blocks, or fp32);
* :func:`leaf_parts`: views of this rank's part of each leaf's moments;
* :func:`zero_moments`: a fresh state laid out for a DBuffer (to load into).
"""

from __future__ import annotations

from ragged._dbuffer import DBuffer
from ragged.optim._quant8 import Quant8Moments, _block_shape, adam8bit_leaf_state, scale_by_adam_8bit

__all__ = ["leaf_block", "leaf_parts", "zero_moments"]


def leaf_block(leaf, min_size: int) -> tuple[int, int] | None:
    """``(block rows, block cols)`` of the 8-bit blocks of a plan leaf (a ``LeafLayout``) under
    ``adamw_8bit(min_size=min_size)``, or None when the leaf keeps fp32 moments (see [Note:
    blocks are the plan's blocks] in ``_quant8.py``). A 1-D run of ``n`` elements is ``(1, n)``.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(64, 64), "b": torch.empty(64)},
        ...                     {"w": rg.spec.Blocks(32, 32), "b": rg.spec.Elements(32)}, world_size=1)
        >>> [(leaf.path, leaf_block(leaf, 1024)) for leaf in plan.leaves]
        [("['b']", None), ("['w']", (32, 32))]
    """
    if leaf.numel < min_size or not leaf.dtype.is_floating_point:
        return None
    return _block_shape(leaf)


def leaf_parts(moments: Quant8Moments, dbuf: DBuffer, *, min_size: int) -> dict[str, dict]:
    """Views of this rank's part of each leaf's moments: ``{path: {"mu_codes", "nu_codes",
    "mu_scales", "nu_scales"}}`` for 8-bit leaves (codes in element order, one scale per block,
    band-major), ``{path: {"mu", "nu"}}`` for fp32 and replicated ones. Writing into the views
    writes into ``moments``."""
    return adam8bit_leaf_state(moments, dbuf, min_size=min_size)


def zero_moments(dbuf: DBuffer, *, min_size: int) -> Quant8Moments:
    """A :class:`~ragged.optim.Quant8Moments` laid out for ``dbuf`` (what ``opt.init`` builds)."""
    return scale_by_adam_8bit(min_size=min_size).init(dbuf).moments
