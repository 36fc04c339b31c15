"""The internal API ``ragged/checkpoint/_quant8.py`` uses to store 8-bit Adam moments.

The checkpoint stores each leaf's part of :class:`Quant8Moments` as world-size-independent
tensors (see [Note: 8-bit moments in a checkpoint] in ``ragged/checkpoint/_quant8.py``) and
asks the optimizer only these names, so that ``_quant8``'s codec, block layout and transform
can change freely as long as these keep their meaning:

* :func:`quantized_block`: how a leaf's moments are kept (8-bit blocks, or fp32);
* :func:`adam8bit_leaf_state`: views of this rank's part of each leaf's moments;
* :func:`init_moments`: a fresh state laid out for a DBuffer (to load into);
* :class:`Quant8Moments`, :class:`ScaleByAdam8bitState`: the state containers.

(The split of ``_quant8`` into codec, layout + state and transform keeps these names here.)
"""

from __future__ import annotations

from ragged._dbuffer import DBuffer
from ragged.optim._quant8 import Quant8Moments, ScaleByAdam8bitState, _block_shape, _moments_init, adam8bit_leaf_state

__all__ = ["Quant8Moments", "ScaleByAdam8bitState", "quantized_block", "init_moments", "adam8bit_leaf_state"]


def quantized_block(leaf, min_size: int) -> tuple[int, int] | None:
    """``(block rows, block cols)`` if 8-bit Adam quantizes ``leaf`` (a ``LeafLayout``), else None
    (the leaf keeps fp32 moments; see [Note: blocks are the plan's blocks] in ``_quant8.py``).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged.optim._quant8_state import quantized_block
        >>> plan = rg.make_plan({"w": torch.zeros(64, 64)}, rg.spec.Blocks(32, 32), world_size=1)
        >>> quantized_block(plan.leaves[0], 4096), quantized_block(plan.leaves[0], 8192)
        ((32, 32), None)
    """
    if leaf.numel < min_size or not leaf.dtype.is_floating_point:
        return None
    return _block_shape(leaf)


def init_moments(dbuf: DBuffer, min_size: int) -> Quant8Moments:
    """Zero 8-bit moments for ``dbuf`` (what ``opt.init`` builds)."""
    return _moments_init(dbuf, min_size)
