"""Checkpointing SOAP's and Shampoo's per-block matrices across world sizes, exactly.

[Note: block matrices in a checkpoint]
A :class:`~ragged.optim.SoapFactors` / :class:`~ragged.optim.ShampooFactors` holds, per part of
each preconditioned leaf (see [Note: blocks by part and ordinal] in ``ragged/optim/_blocks.py``),
this rank's blocks' matrices in ordinal order; its static layout says which leaf, part and
ordinals they are. So each (leaf, part, field) is stored as one world-size-independent 1-D tensor,
every block's ``n x n`` matrix after the previous one's (``count * n * n`` elements), and each rank
writes its blocks as the chunk starting at ``first * n * n``: the plan never cuts a block, and a
rank's blocks of a part are one run of ordinals. Loading copies the chunks the target rank's
blocks need, bit for bit, into any world size or plan that gives the leaf the same blocks; a leaf
with other blocks (another ``spec.Blocks`` or ``block=``) is refused by name. The moments (``mu``,
``nu``, ``graft_nu``) are DBuffers and reshard as any DBuffer does.
"""

from __future__ import annotations

import torch

from ragged._errors import RaggedValueError
from ragged._pytree import path_parts
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._dcp import Piece
from ragged.checkpoint._entry import Consolidated, EntryKind, compare_plans, full_tensor
from ragged.optim._blocks import leaf_parts
from ragged.optim._precond import FACTORS

__all__ = ["BlockFactorsKind"]

_SEP = "::"


def _fields(cls) -> list[str]:
    return [k for k in cls.__dataclass_fields__ if k != "layout"]


def _side(field: str) -> int:
    """Which block side a field's matrices have: 0 (rows: left) or 1 (cols: right)."""
    return 0 if field.startswith("left") else 1


def _fqn(entry_path: str, leaf_path: str, part: str, field: str) -> str:
    return f"{entry_path}{leaf_path}{_SEP}{part}{_SEP}{field}"


def _leaves(layout) -> dict[str, dict[str, list[int]]]:
    """``{leaf path: {part: [rows, cols, count]}}`` of the preconditioned leaves (the whole leaves')."""
    return {leaf.path: {p: [r, c, n] for p, r, c, n in leaf_parts(leaf)} for leaf in layout.leaves if leaf.block}


class BlockFactorsKind(EntryKind):
    """SOAP's / Shampoo's block matrices: see [Note: block matrices in a checkpoint]."""

    name = "block_factors"
    holds = FACTORS
    holds_leaves = True
    whole = True

    def describe(self, where, leaf, comm):
        lay = leaf.layout
        if lay.rank != comm.rank or lay.plan.world_size != comm.world_size:
            raise RaggedValueError(
                f"{where} holds the blocks of rank {lay.rank} of {lay.plan.world_size}, but the comm is rank "
                f"{comm.rank} of {comm.world_size}. Each rank saves its own optimizer state.")
        dtypes = {t.dtype for f in _fields(type(leaf)) for t in getattr(leaf, f)}
        return {"kind": self.name, "type": type(leaf).__name__, "plan": fmt.describe_plan(lay.plan),
                "dtype": fmt.dtype_name(dtypes.pop() if dtypes else torch.float32), "leaves": _leaves(lay)}

    def pieces(self, path, leaf, rank, index):
        out = []
        for i, p in enumerate(leaf.layout.parts):
            for field in _fields(type(leaf)):
                n = (p.rows, p.cols)[_side(field)] ** 2
                out.append(Piece(_fqn(path, p.path, p.part, field), p.first * n, p.count * n,
                                 getattr(leaf, field)[i].detach().reshape(-1)))
        return out

    def _tensors(self, path, entry):
        """``(fqn, leaf path, part, field, count, n)`` of every stored tensor."""
        fields = _fields(next(c for c in FACTORS if c.__name__ == entry["type"]))
        for leaf_path, parts in entry["leaves"].items():
            for part, (r, c, count) in parts.items():
                for field in fields:
                    n = (r, c)[_side(field)]
                    yield _fqn(path, leaf_path, part, field), leaf_path, part, field, count, n

    def stored(self, path, entry):
        return {fqn: (count * n * n, entry["dtype"]) for fqn, _, _, _, count, n in self._tensors(path, entry)}

    def compare(self, where, saved, like, leaf, site, problems):
        compare_plans(where, saved["plan"], like["plan"], problems)
        if saved["type"] != like["type"]:
            problems.append(f"{where}: saved a {saved['type']}, like_state's optimizer keeps a {like['type']}")
            return
        if saved["dtype"] != like["dtype"]:
            problems.append(f"{where}: saved matrices in {saved['dtype']}, like_state's in {like['dtype']} (matrix_dtype)")
        for path in sorted(set(saved["leaves"]) | set(like["leaves"])):
            s, l = saved["leaves"].get(path), like["leaves"].get(path)
            if s != l:
                def say(k):
                    return "no blocks" if k is None else ", ".join(f"{n} x {p} {r} x {c}" for p, (r, c, n) in k.items())

                problems.append(f"{where}{path}: saved with blocks ({say(s)}), like_state's optimizer has ({say(l)}); "
                                "block matrices carry over only between layouts with the same blocks (the same "
                                "spec.Blocks, or block=, for this leaf)")

    def allocate(self, leaf, entry):
        fields = _fields(type(leaf))
        return type(leaf)(*[tuple(torch.zeros_like(t) for t in getattr(leaf, f)) for f in fields], layout=leaf.layout)

    def consolidate(self, path, entry):
        """Each (leaf, part, field): ``(count, n, n)``, the blocks in ordinal order (band-major)."""
        out = []
        dtype = fmt.dtype_from_name(entry["dtype"])
        for fqn, leaf_path, part, field, count, n in self._tensors(path, entry):
            flat, pieces = full_tensor(fqn, count * n * n, dtype)
            out.append(Consolidated(path_parts(leaf_path) + [part, field], "", flat.view(count, n, n), pieces))
        return out
