"""Checkpointing 8-bit Adam moments (``rg.optim.adamw_8bit``) across world sizes, exactly.

[Note: 8-bit moments in a checkpoint]
``Quant8Moments`` holds each rank's moments compactly (codes of its quantized elements, one
absmax per block, fp32 moments of the other elements), in the order of that rank's buffer.
Read on their own they cannot be resharded: the compact order depends on the plan, the rank and
``min_size``. Bound to their params DBuffer (:class:`Quant8`), each leaf's part becomes
DCP chunks of world-size-independent 1-D tensors:

* a quantized leaf (blocks ``(br, bc)``): ``mu_codes`` / ``nu_codes`` of ``numel`` uint8
  (element order; a piece starting at element ``s`` is the chunk at ``s``) and ``mu_scales`` /
  ``nu_scales`` with one fp32 per block (band-major; a piece starting at band ``b`` is the
  chunk at ``b * tiles``): the plan never cuts a block, so every rank holds whole blocks;
* any other leaf: ``mu`` / ``nu`` fp32 of ``numel`` elements.

Loading copies codes and scales verbatim into the target layout, so the state after a
world-size change is bit-identical (dequantized values included). The target must quantize each
leaf with the same blocks (same ``spec.Blocks`` / ``spec.Elements`` and ``min_size`` class);
otherwise codes cannot carry over and the load is refused, naming the leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged._pytree import path_parts, pytree
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._dcp import Piece
from ragged.checkpoint._entry import EntryKind, Consolidated, compare_plans, full_tensor
from ragged.checkpoint._packed import Packed
from ragged.optim._quant8_state import (
    Quant8Moments,
    ScaleByAdam8bitState,
    adam8bit_leaf_state,
    init_moments,
    quantized_block,
)

__all__ = ["Quant8", "bind_quant8", "unbind", "Quant8Kind"]

_SEP = "::"


@dataclasses.dataclass(frozen=True, slots=True)
class Quant8:
    """8-bit Adam moments bound to the params DBuffer they belong to (a checkpoint leaf).

    Attributes:
        moments: a ``ragged.optim.Quant8Moments`` (this rank's compact state).
        params: the DBuffer the moments were initialised from (gives plan and rank).
        min_size: the ``min_size`` the optimizer was built with.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(8, 64)}
        >>> local = rg.shard(rg.make_plan(params, {"w": rg.spec.Blocks(4, 32)}, world_size=1), params, rank=0)
        >>> bound = rg.checkpoint.bind_quant8(rg.optim.adamw_8bit(1e-3, min_size=1).init(local), local, min_size=1)
        >>> q = bound[0].moments
        >>> type(q).__name__, q.params is local, q.min_size
        ('Quant8', True, 1)
    """

    moments: Any
    params: DBuffer
    min_size: int = 4096


def _is_state(x) -> bool:
    return isinstance(x, ScaleByAdam8bitState)


def bind_quant8(opt_state, params, *, min_size: int = 4096):
    """Returns ``opt_state`` with each 8-bit Adam moments value wrapped in :class:`Quant8`
    (paired with its DBuffer of ``params``), ready for :func:`ragged.checkpoint.save` / as a
    ``like_state`` for :func:`ragged.checkpoint.load`. Undo with :func:`unbind`.

    Args:
        opt_state: any optimizer state; every ``ScaleByAdam8bitState`` in it is bound.
        params: the DBuffer (or pytree of DBuffers) passed to ``opt.init``.
        min_size: the optimizer's ``min_size``.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(8, 64)}
        >>> def fn(comm):
        ...     plan = rg.make_plan(params, {"w": rg.spec.Blocks(4, 32)}, world_size=1)
        ...     local = rg.shard(plan, params, comm)
        ...     state = rg.optim.adamw_8bit(1e-3, min_size=256).init(local)
        ...     return rg.checkpoint.bind_quant8(state, local, min_size=256)[0].moments
        >>> bound = rg.collectives.simulate(1, fn)[0]
        >>> type(bound).__name__, bound.moments.mu_scales.numel()  # 2 x 2 tiles of 4 x 32
        ('Quant8', 4)
    """
    def bind(state):
        moments = pytree.map(
            lambda q, d: Quant8(q, d, min_size),
            state.moments,
            params,
            is_leaf=lambda x: isinstance(x, (Quant8Moments, DBuffer)),
        )
        return state._replace(moments=moments)

    return pytree.map(lambda x: bind(x) if _is_state(x) else x, opt_state, is_leaf=_is_state)


def unbind(state):
    """``state`` with every :class:`Quant8` replaced by its moments and every ``Packed`` by its
    DBuffer (undoes :func:`bind_quant8`, ``bind_packed`` and ``bind_muon``).

    Args:
        state: a state with :class:`Quant8` / ``Packed`` leaves (or none: it is returned as is).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(8, 64)}
        >>> plan = rg.make_plan(params, {"w": rg.spec.Blocks(4, 32)}, world_size=1)
        >>> local = rg.shard(plan, params, rank=0)
        >>> state = rg.optim.adamw_8bit(1e-3, min_size=1).init(local)
        >>> bound = rg.checkpoint.bind_quant8(state, local, min_size=1)
        >>> type(bound[0].moments).__name__, type(rg.checkpoint.unbind(bound)[0].moments).__name__
        ('Quant8', 'Quant8Moments')
    """
    def one(x):
        if isinstance(x, Quant8):
            return x.moments
        return x.dbuf if isinstance(x, Packed) else x

    return pytree.map(one, state, is_leaf=lambda x: isinstance(x, (Quant8, Packed)))


def _leaf_kinds(plan, min_size: int) -> dict[str, dict[str, Any]]:
    """Per leaf: how 8-bit Adam stores it (blocks, total blocks): the optimizer's own rule."""
    kinds = {}
    for leaf in plan.leaves:
        block = quantized_block(leaf, min_size)
        if block is None:
            kinds[leaf.path] = {"block": None, "numel": leaf.numel, "blocks": 0, "replicated": False}
            continue
        br, bc = block
        if br == 1:
            blocks, tiles = -(-leaf.numel // bc), 0
        else:
            cols = leaf.shape[-1]
            tiles = -(-cols // bc)
            blocks = -(-(leaf.numel // cols) // br) * tiles
        kinds[leaf.path] = {"block": [br, bc], "numel": leaf.numel, "blocks": blocks, "tiles": tiles, "replicated": False}
    for leaf in plan.replicated:
        kinds[leaf.path] = {"block": None, "numel": leaf.numel, "blocks": 0, "replicated": True}
    return kinds


def fqn(entry_path: str, leaf_path: str, part: str) -> str:
    return f"{entry_path}{leaf_path}{_SEP}{part}"


_CODES, _SCALES, _FP32 = ("mu_codes", "nu_codes"), ("mu_scales", "nu_scales"), ("mu", "nu")


class Quant8Kind(EntryKind):
    """8-bit Adam moments bound to their params (:class:`Quant8`): see [Note: 8-bit moments in a
    checkpoint]."""

    name = "quant8"
    holds = Quant8
    holds_leaves = True
    whole = True

    def describe(self, where, leaf, comm):
        if not isinstance(leaf.moments, Quant8Moments) or not isinstance(leaf.params, DBuffer):
            raise RaggedTypeError(
                f"{where} is a Quant8 whose moments/params are not Quant8Moments/DBuffer; build it with rg.checkpoint.bind_quant8."
            )
        d = leaf.params
        if d.rank != comm.rank or d.plan.world_size != comm.world_size:
            raise RaggedValueError(
                f"{where} is bound to a DBuffer of rank {d.rank} / world_size {d.plan.world_size}, but the comm is "
                f"rank {comm.rank} of {comm.world_size}."
            )
        return {"kind": self.name, "plan": fmt.describe_plan(d.plan), "min_size": leaf.min_size,
                "leaves": _leaf_kinds(d.plan, leaf.min_size)}

    def pieces(self, path, leaf, rank, index):
        """This rank's chunks of ``leaf.moments`` (views): codes at the piece's first element,
        scales at its first block (band-major), fp32 moments at its first element."""
        d = leaf.params
        kinds = _leaf_kinds(d.plan, leaf.min_size)
        starts = {p.leaf.path: p.start for p in d.plan.local_pieces(rank)}
        out = []
        for leaf_path, parts in adam8bit_leaf_state(leaf.moments, d, min_size=leaf.min_size).items():
            k = kinds[leaf_path]
            start = 0 if k["replicated"] else starts[leaf_path]
            if k["block"] is None:
                if k["replicated"] and not k["numel"]:
                    continue
                out += [Piece(fqn(path, leaf_path, part), start, k["numel"], parts[part]) for part in _FP32]
                continue
            br, bc = k["block"]
            block_start = start // bc if br == 1 else (start // (br * d.plan.leaf(leaf_path).shape[-1])) * k["tiles"]
            out += [Piece(fqn(path, leaf_path, part), start, k["numel"], parts[part]) for part in _CODES]
            out += [Piece(fqn(path, leaf_path, part), block_start, k["blocks"], parts[part]) for part in _SCALES]
        return out

    def stored(self, path, entry):
        out = {}
        for leaf_path, k in entry["leaves"].items():
            if not k["numel"]:
                continue
            if k["block"] is None:
                out.update({fqn(path, leaf_path, part): (k["numel"], "float32") for part in _FP32})
            else:
                out.update({fqn(path, leaf_path, part): (k["numel"], "uint8") for part in _CODES})
                out.update({fqn(path, leaf_path, part): (k["blocks"], "float32") for part in _SCALES})
        return out

    def compare(self, where, saved, like, leaf, site, problems):
        compare_plans(where, saved["plan"], like["plan"], problems)
        for path in sorted(set(saved["leaves"]) & set(like["leaves"])):
            s, l = saved["leaves"][path], like["leaves"][path]
            if s["block"] != l["block"]:
                def say(k):
                    return f"8-bit blocks {tuple(k['block'])}" if k["block"] else "fp32 moments"

                problems.append(
                    f"{where}{path}: saved with {say(s)}, like_state's optimizer keeps {say(l)}; 8-bit codes only "
                    "carry over between layouts with the same blocks (use the same spec and min_size for this leaf)"
                )

    def allocate(self, leaf, entry):
        """A fresh zero state with ``leaf``'s layout (a new Quant8 sharing nothing with ``leaf``)."""
        moments = init_moments(leaf.params, leaf.min_size)
        moments = type(moments)(*[torch.zeros_like(t) for t in moments])
        return Quant8(moments, leaf.params, leaf.min_size)

    def consolidate(self, path, entry):
        """Codes and fp32 moments in the leaf's shape, scales 1-D (one per block, band-major)."""
        out = []
        shapes = {l["path"]: tuple(l["shape"]) for l in entry["plan"]["leaves"] + entry["plan"]["replicated"]}
        for leaf_path, k in entry["leaves"].items():
            parts = _FP32 if k["block"] is None else _CODES + _SCALES
            for part in parts:
                scales = part.endswith("scales")
                dtype = torch.uint8 if part.endswith("codes") else torch.float32
                flat, pieces = full_tensor(fqn(path, leaf_path, part), k["blocks"] if scales else k["numel"], dtype)
                out.append(Consolidated(path_parts(leaf_path) + [part], "", flat if scales else flat.view(shapes[leaf_path]), pieces))
        return out
