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
from ragged._pytree import pytree
from ragged.checkpoint import _format as fmt
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["Quant8", "bind_quant8", "unbind"]

_SEP = "::"


@dataclasses.dataclass(frozen=True, slots=True)
class Quant8:
    """8-bit Adam moments bound to the params DBuffer they belong to (a checkpoint leaf).

    Attributes:
        moments: a ``ragged.optim.Quant8Moments`` (this rank's compact state).
        params: the DBuffer the moments were initialised from (gives plan and rank).
        min_size: the ``min_size`` the optimizer was built with.
    """

    moments: Any
    params: DBuffer
    min_size: int = 4096


def _is_state(x) -> bool:
    from ragged.optim._quant8_state import ScaleByAdam8bitState

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
    from ragged.optim._quant8_state import Quant8Moments

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
    DBuffer (undoes :func:`bind_quant8`, ``bind_packed`` and ``bind_muon``)."""
    from ragged.checkpoint._packed import Packed

    def one(x):
        if isinstance(x, Quant8):
            return x.moments
        return x.dbuf if isinstance(x, Packed) else x

    return pytree.map(one, state, is_leaf=lambda x: isinstance(x, (Quant8, Packed)))


def _leaf_kinds(plan, min_size: int) -> dict[str, dict[str, Any]]:
    """Per leaf: how 8-bit Adam stores it (blocks, total blocks) -- the same rule as the
    optimizer's own layout."""
    from ragged.optim._quant8_state import quantized_block

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


def describe(where: str, leaf: Quant8, comm) -> dict[str, Any]:
    from ragged.optim._quant8_state import Quant8Moments

    if not isinstance(leaf.moments, Quant8Moments) or not isinstance(leaf.params, DBuffer):
        raise RaggedTypeError(f"{where} is a Quant8 whose moments/params are not Quant8Moments/DBuffer; build it with rg.checkpoint.bind_quant8.")
    d = leaf.params
    if d.rank != comm.rank or d.plan.world_size != comm.world_size:
        raise RaggedValueError(
            f"{where} is bound to a DBuffer of rank {d.rank} / world_size {d.plan.world_size}, but the comm is "
            f"rank {comm.rank} of {comm.world_size}."
        )
    return {"kind": "quant8", "plan": fmt.describe_plan(d.plan), "min_size": leaf.min_size, "leaves": _leaf_kinds(d.plan, leaf.min_size)}


def fqn(entry_path: str, leaf_path: str, part: str) -> str:
    return f"{entry_path}{leaf_path}{_SEP}{part}"


def stored(entry_path: str, entry: dict) -> dict[str, tuple[int, torch.dtype]]:
    """``fqn -> (numel, dtype)`` of every tensor a quant8 entry is stored as (non-empty)."""
    out = {}
    for leaf_path, k in entry["leaves"].items():
        if not k["numel"]:
            continue
        if k["block"] is None:
            for part in ("mu", "nu"):
                out[fqn(entry_path, leaf_path, part)] = (k["numel"], torch.float32)
        else:
            for part in ("mu_codes", "nu_codes"):
                out[fqn(entry_path, leaf_path, part)] = (k["numel"], torch.uint8)
            for part in ("mu_scales", "nu_scales"):
                out[fqn(entry_path, leaf_path, part)] = (k["blocks"], torch.float32)
    return out


def pieces(entry_path: str, leaf: Quant8, rank: int, kinds=None):
    """``[(fqn, start, numel, 1-D tensor)]``: this rank's chunks of ``leaf.moments`` (views)."""
    from ragged.optim._quant8_state import shard_layout

    mom, d = leaf.moments, leaf.params
    kinds = kinds or _leaf_kinds(d.plan, leaf.min_size)
    lay = shard_layout(d, leaf.min_size)
    starts = {p.local_offset: p.start for p in d.plan.local_pieces(rank)}
    out = []
    for q in lay.qpieces:
        k, start = kinds[q.path], starts[q.local_offset]
        br, bc = k["block"]
        block_start = start // bc if br == 1 else (start // (br * q.cols)) * k["tiles"]
        cs, ss = q.code_offset, q.scale_offset
        out += [
            (fqn(entry_path, q.path, "mu_codes"), start, k["numel"], mom.mu_codes[cs : cs + q.numel]),
            (fqn(entry_path, q.path, "nu_codes"), start, k["numel"], mom.nu_codes[cs : cs + q.numel]),
            (fqn(entry_path, q.path, "mu_scales"), block_start, k["blocks"], mom.mu_scales[ss : ss + q.num_blocks]),
            (fqn(entry_path, q.path, "nu_scales"), block_start, k["blocks"], mom.nu_scales[ss : ss + q.num_blocks]),
        ]
    for path, local_offset, n, c in lay.fp32_pieces:
        start = starts[local_offset]
        out += [
            (fqn(entry_path, path, "mu"), start, kinds[path]["numel"], mom.mu_fp32[c : c + n]),
            (fqn(entry_path, path, "nu"), start, kinds[path]["numel"], mom.nu_fp32[c : c + n]),
        ]
    for rleaf in d.plan.replicated:
        if rleaf.numel:
            out += [
                (fqn(entry_path, rleaf.path, "mu"), 0, rleaf.numel, mom.mu_rep[rleaf.offset : rleaf.stop]),
                (fqn(entry_path, rleaf.path, "nu"), 0, rleaf.numel, mom.nu_rep[rleaf.offset : rleaf.stop]),
            ]
    return out


def compare(where: str, saved: dict, like: dict, problems: list[str]) -> None:
    for path in sorted(set(saved["leaves"]) & set(like["leaves"])):
        s, l = saved["leaves"][path], like["leaves"][path]
        if s["block"] != l["block"]:
            def say(k):
                return f"8-bit blocks {tuple(k['block'])}" if k["block"] else "fp32 moments"

            problems.append(
                f"{where}{path}: saved with {say(s)}, like_state's optimizer keeps {say(l)}; 8-bit codes only "
                "carry over between layouts with the same blocks (use the same spec and min_size for this leaf)"
            )


def allocate(leaf: Quant8):
    """A fresh zero state with ``leaf``'s layout (a new Quant8 sharing nothing with ``leaf``)."""
    from ragged.optim._quant8_state import init_moments

    moments = init_moments(leaf.params, leaf.min_size)
    moments = type(moments)(*[torch.zeros_like(t) for t in moments])
    return Quant8(moments, leaf.params, leaf.min_size)


def export(entry_path: str, entry: dict):
    """``[(name parts, output tensor, fqn, flat destination)]`` for a single-process full read:
    codes and fp32 moments in the leaf's shape, scales 1-D (one per block, band-major)."""
    out = []
    shapes = {l["path"]: tuple(l["shape"]) for l in entry["plan"]["leaves"] + entry["plan"]["replicated"]}
    for leaf_path, k in entry["leaves"].items():
        parts = ("mu", "nu") if k["block"] is None else ("mu_codes", "nu_codes", "mu_scales", "nu_scales")
        for part in parts:
            scales = part.endswith("scales")
            flat = torch.zeros(k["blocks"] if scales else k["numel"], dtype=torch.uint8 if part.endswith("codes") else torch.float32)
            view = flat if scales else flat.view(shapes[leaf_path])
            out.append((fmt.path_parts(leaf_path) + [part], view, fqn(entry_path, leaf_path, part), flat))
    return out
