"""What a step moves and keeps, counted (benchmark side; nothing in ragged).

* :class:`CommCounter`: every collective a method issues, as the full buffer (all-gather output,
  reduce-scatter input, all-reduce tensor, all-to-all input), calls and bytes per kind and axis, at
  ragged's ``Collectives`` object or at torch's process groups (every c10d call ends in a
  ``ProcessGroup`` method: FSDP2's, and ragged's native paths; torch's functional collectives do
  not). ``bench/step.py`` counts both methods' bytes with it, ``bench/predict.py --exact`` and
  ``tests/predict/_lower_cases.py`` compare its counts with ``step.lower``.
* :func:`storage_by_category`: a ``TrainState``'s unique storages by ``step.lower``'s categories.
"""

from __future__ import annotations

import collections
import functools

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "storage_by_category"]


def storage_by_category(state) -> dict[str, int]:
    """Bytes of the unique storages of a real ``TrainState``, by the categories of ``step.lower``'s
    ``state_bytes`` (``param_shards``, ``replicated``, ``optimizer.<field>``)."""
    from ragged._pytree import flatten_with_keystr
    from ragged.predict._persistent import category

    shards, opt_state = state
    paths, leaves, _ = flatten_with_keystr(opt_state)
    keyed = [("param_shards", d.data) for d in shards.values()] + [("replicated", d.replicated) for d in shards.values()]
    out, seen = collections.Counter(), set()
    for key, t in keyed + [(category(p), leaf) for p, leaf in zip(paths, leaves)]:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out[key] += s.nbytes()
    return dict(out)


def _nbytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list of them."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


# (method of ragged's Collectives, kind, axis, bytes of the call): the full buffer (all-gather output,
# reduce-scatter input, all-reduce tensor, all-to-all input); a multi-buffer plan's coalesced call is one call
_COMM_METHODS = (
    ("all_gather_into", "all_gather", "shard", lambda out, inp, **k: _nbytes(out)),
    ("all_gather_into_coalesced", "all_gather", "shard", lambda outs, ins, **k: _nbytes(outs)),
    ("reduce_scatter_into", "reduce_scatter", "shard", lambda out, inp, **k: _nbytes(inp)),
    ("reduce_scatter_into_coalesced", "reduce_scatter", "shard", lambda outs, ins, **k: _nbytes(ins)),
    ("all_reduce", "all_reduce", "shard", lambda t, **k: _nbytes(t)),
    ("all_reduce_replicas", "all_reduce", "replica", lambda t, **k: _nbytes(t)),
    ("all_to_all", "all_to_all", "shard", lambda out, inp, *a, **k: _nbytes(inp)),
    ("all_gather_object", "object", "mesh", lambda obj, **k: 0),
)

# (method of torch's ProcessGroup, kind, position of the argument whose bytes count): every
# c10d collective ends in one of these, whichever function issued it (torch.distributed's
# own, FSDP2's, or an alias bound at import, as ragged/_compat.py binds all_gather_single)
_PG_METHODS = (
    ("_allgather_base", "all_gather", 0), ("all_gather_single", "all_gather", 0),
    ("allgather_into_tensor_coalesced", "all_gather", 0), ("all_gather_single_coalesced", "all_gather", 0),
    ("_reduce_scatter_base", "reduce_scatter", 1), ("reduce_scatter_single", "reduce_scatter", 1),
    ("reduce_scatter_tensor_coalesced", "reduce_scatter", 1), ("reduce_scatter_single_coalesced", "reduce_scatter", 1),
    ("allreduce", "all_reduce", 0), ("allreduce_coalesced", "all_reduce", 0),
    ("alltoall_base", "all_to_all", 1), ("all_to_all_single", "all_to_all", 1),
    ("allgather", "object", None), ("broadcast", "broadcast", 0), ("barrier", "barrier", None),
    ("send", "send", 0), ("recv", "recv", 0),
)


class CommCounter:
    """Counts collectives per (method, kind, axis): calls and bytes, while ``active`` names the method.

    Two boundaries, the same convention (see the module docstring): :meth:`install_comm` counts a
    ragged ``Collectives`` object's calls, :meth:`install_torch` every call on a torch process
    group. ``object`` (ragged's ``all_gather_object``, torch's list ``allgather``) counts calls, no bytes.
    ``parts`` counts buffers: a coalesced call of ``n`` buffers is one call and ``n`` parts.

    Examples:
        >>> from bench._counts import CommCounter
        >>> import ragged as rg, torch
        >>> def one_all_reduce(comm):
        ...     counter = CommCounter()
        ...     counter.install_comm(comm, "ragged")
        ...     comm.all_reduce(torch.zeros(3))          # not counted: no method is active
        ...     counter.active = "ragged"
        ...     comm.all_reduce(torch.zeros(3))
        ...     return counter.records("ragged")
        >>> rg.collectives.simulate(2, one_all_reduce)[0]
        {('all_reduce', 'shard'): (1, 12)}
    """

    def __init__(self):
        self.active: str | None = None
        self.bytes = collections.Counter()
        self.calls = collections.Counter()
        self.parts = collections.Counter()

    def add(self, kind: str, axis: str, nbytes: int, parts: int = 1):
        if self.active is not None:
            self.bytes[(self.active, kind, axis)] += nbytes
            self.calls[(self.active, kind, axis)] += 1
            self.parts[(self.active, kind, axis)] += parts

    def reset(self):
        self.bytes.clear()
        self.calls.clear()
        self.parts.clear()

    def per(self, method: str) -> dict[str, int]:
        """``{kind: bytes}`` of ``method``, every axis together (objects left out)."""
        out = collections.Counter()
        for (m, kind, _), v in self.bytes.items():
            if m == method and kind != "object":
                out[kind] += v
        return dict(out)

    def records(self, method: str) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(kind, axis): (calls, bytes)}`` of ``method`` (objects left out: see ``calls``)."""
        return {(kind, axis): (n, self.bytes[(m, kind, axis)])
                for (m, kind, axis), n in self.calls.items() if m == method and kind != "object"}

    def parts_of(self, method: str) -> dict[tuple[str, str], int]:
        """``{(kind, axis): buffers moved}`` of ``method`` (objects left out)."""
        return {(kind, axis): n for (m, kind, axis), n in self.parts.items() if m == method and kind != "object"}

    def install_torch(self, method: str, axes: dict | None = None):
        """Counts every call on a torch ``ProcessGroup`` (patched on the class) while ``self.active ==
        method``. ``axes``: ``{process group (None: skipped): axis name}``; any other group is
        ``"world"`` (the default group) or ``"group<size>"``."""
        names = {pg.group_name: axis for pg, axis in (axes or {}).items() if pg is not None}
        default = dist.distributed_c10d._get_default_group().group_name

        def axis_of(pg):
            name = pg.group_name
            return names.get(name) or ("world" if name == default else f"group{pg.size()}")

        for name, kind, arg in _PG_METHODS:
            orig = getattr(dist.ProcessGroup, name, None)
            if orig is None:
                continue

            def wrapped(pg, *a, _orig=orig, _kind=kind, _arg=arg, **k):
                if self.active == method:
                    self.add(_kind, axis_of(pg), 0 if _arg is None or len(a) <= _arg else _nbytes(a[_arg]))
                return _orig(pg, *a, **k)

            setattr(dist.ProcessGroup, name, functools.wraps(orig)(wrapped))

    def install_comm(self, comm, method: str, axis: str | None = None):
        """Counts a ragged ``Collectives`` object's calls while ``self.active == method``; ``axis``
        names every call's axis (a data group's comm: ``"data0"``), else the method's own."""
        for name, kind, own, size in _COMM_METHODS:
            orig = getattr(comm, name, None)
            if orig is None:
                continue

            def wrapped(*a, _orig=orig, _key=(kind, axis or own), _size=size, _many=name.endswith("_coalesced"), **k):
                if self.active == method:
                    self.add(*_key, _size(*a, **k), len(a[0]) if _many else 1)
                return _orig(*a, **k)

            setattr(comm, name, functools.wraps(orig)(wrapped))
