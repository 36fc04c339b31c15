"""Checkpointing packed DBuffers: the state of ``multi_transform(compact=...)`` labels (e.g. the
AdamW part of ``rg.optim.muon``).

[Note: packed DBuffers in a checkpoint]
A compact label's state holds DBuffers whose ``data`` is only this rank's elements of the
leaves with that label (``masked_select`` of the buffer: pieces in buffer order, padding
dropped) and whose ``replicated`` is those replicated leaves back to back. Which leaves those
are is decided by the label function, which the state does not hold, so the state is bound to
it (:func:`bind_packed`, :func:`bind_muon`): each included leaf is then stored like any DBuffer
leaf (a 1-D tensor of ``numel`` elements, one chunk per piece) and loads into any world size or
plan with the same labels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._errors import RaggedValueError
from ragged._pytree import pytree
from ragged.checkpoint import _format as fmt
from ragged.checkpoint._dcp import Piece
from ragged.checkpoint._entry import EntryKind, compare_dtypes, compare_plans, consolidate_plan_leaves, plan_leaf_tensors
from ragged.optim._combine import MultiTransformState
from ragged.optim._muon import default_muon_filter

__all__ = ["Packed", "bind_packed", "bind_muon", "PackedKind"]


@dataclasses.dataclass(frozen=True, slots=True)
class Packed:
    """A packed DBuffer (see [Note: packed DBuffers in a checkpoint]) and the key paths of the
    leaves it holds (in plan order).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(4, 4), "b": torch.randn(4)}
        >>> def fn(comm):
        ...     state = rg.optim.muon(0.1, comm=comm).init(rg.shard(rg.make_plan(params, world_size=1), params, comm))
        ...     packed = rg.checkpoint.bind_muon(state).inner_states["adam"][0].mu
        ...     return type(packed).__name__, packed.paths, packed.dbuf.data.numel()
        >>> rg.collectives.simulate(1, fn)[0]          # AdamW's part holds only the bias
        ('Packed', ("['b']",), 4)
    """

    dbuf: DBuffer
    paths: tuple[str, ...]


def _included(plan, paths):
    keep = set(paths)
    return [l for l in plan.leaves if l.path in keep], sorted((l for l in plan.replicated if l.path in keep), key=lambda l: l.offset)


def packed_sizes(plan, rank: int, paths) -> tuple[int, int]:
    """Elements of ``data`` and ``replicated`` of a packed DBuffer holding ``paths`` on ``rank``."""
    sharded, replicated = _included(plan, paths)
    keep = {l.path for l in sharded}
    return sum(p.numel for p in plan.local_pieces(rank) if p.leaf.path in keep), sum(l.numel for l in replicated)


def bind_packed(opt_state, labels: Callable, compact) -> Any:
    """Returns ``opt_state`` with the DBuffers of every compact label of every
    ``MultiTransformState`` wrapped in :class:`Packed`; undo with
    :func:`ragged.checkpoint.unbind`.

    Args:
        opt_state: the optimizer state.
        labels: the ``LeafLayout -> label`` function given to ``multi_transform``.
        compact: the labels given as ``compact=`` to ``multi_transform``.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(4, 4), "b": torch.randn(4)}
        >>> label = lambda leaf: "mat" if len(leaf.shape) == 2 else "vec"
        >>> opt = rg.optim.multi_transform({"mat": rg.optim.sgd(0.1), "vec": rg.optim.adam(0.1)}, label, compact=("vec",))
        >>> def fn(comm):
        ...     state = opt.init(rg.shard(rg.make_plan(params, world_size=1), params, comm))
        ...     bound = rg.checkpoint.bind_packed(state, label, ("vec",))
        ...     return bound.inner_states["vec"][0].mu.paths, rg.checkpoint.unbind(bound).inner_states["vec"][0].mu.data.numel()
        >>> rg.collectives.simulate(1, fn)[0]
        (("['b']",), 4)
    """
    compact = frozenset(compact)

    def wrap(label):
        def one(x):
            if not isinstance(x, DBuffer):
                return x
            plan = x.plan
            paths = tuple(l.path for l in plan.leaves + plan.replicated if labels(l) == label)
            n, r = packed_sizes(plan, x.rank, paths)
            if x.data.numel() != n or x.replicated.numel() != r:
                raise RaggedValueError(
                    f"a DBuffer in the state of compact label {label!r} holds {x.data.numel()} + {x.replicated.numel()} "
                    f"elements, but the leaves with that label hold {n} + {r} on rank {x.rank}: the labels "
                    "function differs from the one the optimizer was built with."
                )
            return Packed(x, paths)

        return one

    def bind(state):
        inner = {
            k: pytree.map(wrap(k), v, is_leaf=is_dbuffer) if k in compact else v
            for k, v in state.inner_states.items()
        }
        return state._replace(inner_states=inner)

    is_mt = lambda x: isinstance(x, MultiTransformState)  # noqa: E731
    return pytree.map(lambda x: bind(x) if is_mt(x) else x, opt_state, is_leaf=is_mt)


def bind_muon(opt_state, muon_filter: Callable | None = None) -> Any:
    """:func:`bind_packed` for ``rg.optim.muon`` (its AdamW part is a compact label).

    Args:
        opt_state: the state of ``rg.optim.muon(...)``.
        muon_filter: the ``muon_filter`` the optimizer was built with (default: muon's default).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(4, 4), "b": torch.randn(4)}
        >>> def fn(comm):
        ...     local = rg.shard(rg.make_plan(params, world_size=1), params, comm)
        ...     state = rg.optim.muon(0.1, comm=comm).init(local)
        ...     return rg.checkpoint.bind_muon(state).inner_states["adam"][0].mu
        >>> rg.collectives.simulate(1, fn)[0].paths
        ("['b']",)
    """
    f = default_muon_filter if muon_filter is None else muon_filter
    return bind_packed(opt_state, lambda leaf: "muon" if f(leaf) else "adam", ("adam",))


class PackedKind(EntryKind):
    """A :class:`Packed` DBuffer: each included leaf stored like a DBuffer leaf."""

    name = "packed"
    holds = Packed
    holds_leaves = True
    whole = True

    def describe(self, where, leaf, comm):
        d = leaf.dbuf
        if d.rank != comm.rank or d.plan.world_size != comm.world_size:
            raise RaggedValueError(
                f"{where} is a packed DBuffer of rank {d.rank} / world_size {d.plan.world_size}, but the comm is "
                f"rank {comm.rank} of {comm.world_size}."
            )
        n, r = packed_sizes(d.plan, d.rank, leaf.paths)
        if d.data.numel() != n or d.replicated.numel() != r:
            raise RaggedValueError(f"{where} holds {d.data.numel()} + {d.replicated.numel()} elements; its leaves hold {n} + {r}.")
        return {
            "kind": self.name,
            "dtype": fmt.dtype_name(d.data.dtype),
            "replicated_dtype": fmt.dtype_name(d.replicated.dtype),
            "paths": list(leaf.paths),
            "plan": fmt.describe_plan(d.plan),
        }

    def pieces(self, path, leaf, rank, index):
        d = leaf.dbuf
        sharded, replicated = _included(d.plan, leaf.paths)
        keep = {l.path for l in sharded}
        data, rep = d.data.detach(), d.replicated.detach()
        out, off = [], 0
        for piece in d.plan.local_pieces(rank):
            if piece.leaf.path in keep:
                out.append(Piece(fmt.leaf_fqn(path, piece.leaf.path), piece.start, piece.leaf.numel, data[off : off + piece.numel]))
                off += piece.numel
        off = 0
        for l in replicated:
            if l.numel:
                out.append(Piece(fmt.leaf_fqn(path, l.path), 0, l.numel, rep[off : off + l.numel]))
            off += l.numel
        return out

    def stored(self, path, entry):
        return plan_leaf_tensors(path, entry, keep=set(entry["paths"]))

    def compare(self, where, saved, like, leaf, site, problems):
        compare_plans(where, saved["plan"], like["plan"], problems)
        if saved["paths"] != like["paths"]:
            problems.append(f"{where}: saved a packed buffer of leaves {saved['paths']}, like_state's holds {like['paths']} (other labels)")
        compare_dtypes(where, saved, like, problems, replicated_matters=True)

    def allocate(self, leaf, entry):
        d = leaf.dbuf
        return Packed(d.replace(data=torch.zeros_like(d.data), replicated=torch.zeros_like(d.replicated)), leaf.paths)

    def consolidate(self, path, entry):
        return consolidate_plan_leaves(path, entry, keep=set(entry["paths"]))
