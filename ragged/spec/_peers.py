"""What other FSDP systems would all-gather for the same leaves (for comparison only).

Each rule gives the **per-device all-gather elements** of one FSDP unit with shard group
size ``W`` (what every rank holds and sends; ``W`` times it is the gathered buffer), from
the leaves' shapes alone:

* ``"fsdp2"`` (PyTorch FSDP2, ``Shard(0)`` per parameter): ``sum_i ceil(d0_i / W) *
  prod(d_i[1:])``; each parameter's dim 0 is padded to a multiple of ``W`` (a 0-d parameter
  counts as shape ``(1,)``).
* ``"fsdp1"`` (PyTorch FSDP1 flat parameter, ``use_orig_params=True``): parameters are
  concatenated with each start aligned to 16 bytes, then the whole buffer is cut into ``W``
  equal pieces: ``ceil((sum n_i + alignment pads) / W)``.
* ``"zero3"`` (DeepSpeed ZeRO-3): every parameter is partitioned on its own:
  ``sum_i ceil(n_i / W)``.
* ``"megatron"`` (Megatron-FSDP): chunk factor ``F = lcm(prod(shape[1:]))`` over the unit
  (1 for 1-D leaves); the buffer is padded to a multiple of ``W * F``, so each device holds
  ``ceil(sum n_i / (W * F)) * F``.

None of these cut at block or row boundaries in general (FSDP2 keeps dim-0 slices whole,
which for a 2-D weight means whole rows; the others cut anywhere), so their numbers are
padding for element-wise layouts. Compare with ``make_plan(...).shard_size``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ragged._pytree import pytree
from ragged._errors import RaggedTypeError, RaggedValueError, check_int

__all__ = ["PEERS", "PeerPadding", "peer_shard_numel", "peer_padding"]

#: Peers whose rules are implemented, in display order.
PEERS = ("fsdp2", "fsdp1", "zero3", "megatron")


def _fsdp2(shapes, itemsizes, W: int) -> int:
    total = 0
    for shape in shapes:
        shape = shape or (1,)
        total += -(-shape[0] // W) * math.prod(shape[1:])
    return total


def _fsdp1(shapes, itemsizes, W: int) -> int:
    p = 0
    for shape, itemsize in zip(shapes, itemsizes):
        align = max(1, 16 // itemsize)
        p = -(-p // align) * align  # each parameter starts 16-byte aligned
        p += math.prod(shape)
    return -(-p // W)


def _zero3(shapes, itemsizes, W: int) -> int:
    return sum(-(-math.prod(shape) // W) for shape in shapes)


def _megatron(shapes, itemsizes, W: int) -> int:
    F = math.lcm(1, *(max(1, math.prod(shape[1:])) for shape in shapes if len(shape) >= 2))
    total = sum(math.prod(shape) for shape in shapes)
    return -(-total // (W * F)) * F


_RULES = {"fsdp2": _fsdp2, "fsdp1": _fsdp1, "zero3": _zero3, "megatron": _megatron}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerPadding:
    """One peer's layout of one unit.

    Attributes:
        peer: ``"fsdp2"``, ``"fsdp1"``, ``"zero3"`` or ``"megatron"``.
        world_size: W.
        per_device: all-gather elements per device.
        numel: elements of the unit's leaves.
        padding: ``W * per_device - numel``.
        overhead: ``padding / numel`` (0.0 for an empty unit).

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> p = spec.peer_padding({"experts": torch.empty(3, 8, device="meta")}, world_size=4)["fsdp2"]
        >>> p.peer, p.per_device, p.numel, p.padding     # FSDP2 pads dim 0 to a multiple of W: 4 rows of 8
        ('fsdp2', 8, 24, 8)
    """

    peer: str
    world_size: int
    per_device: int
    numel: int

    @property
    def padding(self) -> int:
        return self.world_size * self.per_device - self.numel

    @property
    def overhead(self) -> float:
        return self.padding / self.numel if self.numel else 0.0


def _shapes_itemsizes(params):
    shapes, itemsizes = [], []
    for leaf in pytree.leaves(params):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None:
            raise RaggedTypeError(f"peer padding needs tensor leaves (meta tensors are fine), got {type(leaf).__name__}.")
        shapes.append(tuple(int(d) for d in shape))
        itemsizes.append(torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4)
    return shapes, itemsizes


def peer_shard_numel(params, world_size: int, peer: str) -> int:
    """Per-device all-gather elements of ``params`` (one FSDP unit) under ``peer``'s rule.

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> experts = {"w": torch.empty(128, 2880, 5760, device="meta")}
        >>> spec.peer_shard_numel(experts, 256, "fsdp2") * 256 // experts["w"].numel()
        2
    """
    return peer_padding(params, world_size, peers=(peer,))[peer].per_device


def peer_padding(params, world_size: int, *, peers=PEERS) -> dict[str, PeerPadding]:
    """Every peer's per-device elements and padding for the same leaves (one FSDP unit).

    Args:
        params: a pytree of tensors (meta tensors are fine) forming one FSDP unit.
        world_size: W, the shard group size.
        peers: which peers to evaluate (default: all of :data:`PEERS`).

    Returns:
        ``{peer: PeerPadding}`` in the order of ``peers``.

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> params = {"w": torch.empty(10, 4, device="meta"), "b": torch.empty(3, device="meta")}
        >>> {k: (v.per_device, v.padding) for k, v in spec.peer_padding(params, 4).items()}
        {'fsdp2': (13, 9), 'fsdp1': (11, 1), 'zero3': (11, 1), 'megatron': (12, 5)}
    """
    check_int("world_size", world_size)
    shapes, itemsizes = _shapes_itemsizes(params)
    numel = sum(math.prod(s) for s in shapes)
    out = {}
    for peer in peers:
        if peer not in _RULES:
            raise RaggedValueError(f"peer must be one of {PEERS}, got {peer!r}.")
        out[peer] = PeerPadding(peer=peer, world_size=world_size, per_device=_RULES[peer](shapes, itemsizes, world_size), numel=numel)
    return out
