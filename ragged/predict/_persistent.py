"""A lowered step's persistent bytes: the ``TrainState`` the step threads, built on ``meta`` by
the same code as :func:`ragged.fsdp.init` (see [Note: lowering a step] in ``ragged/predict/_lower.py``),
by category: ``param_shards``, ``replicated`` and ``optimizer.<field>``."""

from __future__ import annotations

import re

import torch

from ragged._dbuffer import DBuffer
from ragged._pytree import flatten_with_keystr
from ragged.fsdp._trainable import trainable_shards

__all__ = ["category", "meta_shards", "state_bytes", "given_state_bytes", "sample_ranks"]

_FIELD = re.compile(r"\.([A-Za-z_]\w*)")
_KEY = re.compile(r"\[(?:'[^']*'|\"[^\"]*\"|[^\]]*)\]")  # a subscript: a unit's name may hold dots


def category(path: str) -> str:
    """The category of an optimizer-state leaf at key path ``path``: its field, not its unit's name.

    Examples:
        >>> category("[0].mu['model.layers.0'].data"), category("[0].count"), category("[1]")
        ('optimizer.mu', 'optimizer.count', 'optimizer.state')
    """
    fields = _FIELD.findall(_KEY.sub("", path))
    if fields and fields[-1] in ("data", "replicated"):  # a DBuffer's children: name it by its field
        fields = fields[:-1]
    return "optimizer." + (fields[-1] if fields else "state")


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def meta_shards(units, rank: int) -> dict[str, DBuffer]:
    """``rank``'s parameter shards on meta, in each plan's dtype (as ``fsdp.init`` makes them)."""
    return {u.name: DBuffer(data=torch.empty(u.plan.shard_size, dtype=u.plan.dtype, device="meta"),
                            replicated=torch.empty(u.plan.replicated_numel, dtype=u.plan.dtype, device="meta"),
                            plan=u.plan, rank=rank) for u in units}


def state_bytes(units, optimizer, rank: int) -> dict[str, int]:
    """Persistent bytes of ``rank``'s TrainState by category, built on meta."""
    shards = meta_shards(units, rank)
    return given_state_bytes((shards, optimizer.init(trainable_shards(units, shards))))


def given_state_bytes(state) -> dict[str, int]:
    """Persistent bytes of a given ``TrainState`` (real or meta tensors) by category."""
    shards, opt_state = state
    out = {"param_shards": sum(_tensor_bytes(d.data) for d in shards.values()),
           "replicated": sum(_tensor_bytes(d.replicated) for d in shards.values())}
    paths, leaves, _ = flatten_with_keystr(opt_state)
    for path, leaf in zip(paths, leaves):
        key = category(path)
        out[key] = out.get(key, 0) + _tensor_bytes(leaf)
    return out


def sample_ranks(m: int, max_ranks: int) -> tuple[int, ...]:
    """Every rank of ``m`` up to ``max_ranks``, else ``max_ranks`` evenly spread ones (the first and the last among them)."""
    if m <= max_ranks:
        return tuple(range(m))
    return tuple(sorted({round(k * (m - 1) / (max_ranks - 1)) for k in range(max_ranks)}))
