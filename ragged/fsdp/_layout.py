"""Pure per-unit layout of the FSDP step, computed once in ``make_step``: the mixed-precision
policy and, for every unit, what its gathered buffer and its gradient buffer look like.

Nothing here touches a tensor's data or communicates: :class:`UnitLayout` is frozen and
hashable, like the plans it is derived from.
"""

from __future__ import annotations

import dataclasses

import torch

from ragged._errors import RaggedTypeError
from ragged.fsdp._units import Units
from ragged.quant._format import Format
from ragged.quant._wire import gaps
from ragged.spec._plan import LayoutPlan
from ragged.spec._concat import replicated_size
from ragged.transforms._quantized import formats_of

__all__ = ["MixedPrecision", "UnitLayout", "unit_layouts"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MixedPrecision:
    """The step's mixed-precision policy (FSDP2's ``MixedPrecisionPolicy``).

    Attributes:
        compute_dtype: dtype the parameters are gathered and computed in (only the S-element
            shard is cast, before the all-gather). ``None``: each plan's (master) dtype.
        reduce_dtype: dtype gradients are reduce-scattered in. ``None``: each plan's (master)
            dtype, so bf16 gradients are reduced in fp32 when the master shard is fp32; pass
            ``reduce_dtype=compute_dtype`` for FSDP2's default (half the bytes, bf16 sums).
            The gradient shard is in the plan's dtype either way.
        frozen_dtype: dtype the frozen leaves (``requires_grad=False``) are gathered and computed
            in, e.g. ``torch.bfloat16`` for a LoRA base next to fp32 adapters, as FSDP2 users
            keep bf16 bases. ``None``: ``compute_dtype``. Their all-gather is then its own call
            after the trainable part's (one dtype per collective), unless the gather is quantized.
        gather_format: quantize the all-gather: a ``rg.quant`` format (every leaf of two or more
            dimensions; vectors travel unquantized), or a callable ``LeafLayout -> format | None``
            that sees each plan leaf (``leaf.path``, ``leaf.shape``, ...). Each rank quantizes the
            blocks it owns from its master shard; codes, scales and the unquantized leaves move
            in ONE collective per unit (frozen part included); the parameters the model sees are
            ``rg.quant.dequantize(*rg.quant.quantize(w, fmt), fmt, compute_dtype)`` of the whole
            tensor at any world size, and their gradient updates the master (straight through).
            A leaf whose granule does not hold whole blocks is refused when the step is made.
        reduce_format: quantize the gradient reduce-scatter (same forms): each rank quantizes
            its gradient per block, the owner of each block sums every rank's dequantized blocks
            in float32 in rank order (deterministic). Replicated leaves are all-reduced exactly.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> fsdp.MixedPrecision(compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        MixedPrecision(compute_dtype=torch.bfloat16, reduce_dtype=torch.float32, frozen_dtype=None)
        >>> fsdp.MixedPrecision(gather_format=rg.quant.fp8(block=(128, 128)))
        MixedPrecision(compute_dtype=None, reduce_dtype=None, frozen_dtype=None, gather_format=fp8(block=(128, 128)))
    """

    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    frozen_dtype: torch.dtype | None = None
    gather_format: object = None
    reduce_format: object = None

    replace = dataclasses.replace

    def __post_init__(self):
        for name in ("compute_dtype", "reduce_dtype", "frozen_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise RaggedTypeError(f"MixedPrecision.{name} must be a floating torch.dtype or None, got {value!r}.")
        for name in ("gather_format", "reduce_format"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Format) and not callable(value):
                raise RaggedTypeError(f"MixedPrecision.{name} must be None, a rg.quant format (rg.quant.fp8(...), "
                                      f"int8(...), mxfp8(...)) or a callable leaf -> format | None, got {value!r}.")

    def __repr__(self) -> str:
        fields = [f"compute_dtype={self.compute_dtype}", f"reduce_dtype={self.reduce_dtype}",
                  f"frozen_dtype={self.frozen_dtype}"]
        fields += [f"{name}={getattr(self, name)!r}" for name in ("gather_format", "reduce_format")
                   if getattr(self, name) is not None]
        return f"MixedPrecision({', '.join(fields)})"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UnitLayout:
    """What the step allocates for one unit (derived from its plan and the policy).

    Attributes:
        index: the unit's position in ``units``.
        name: the unit's name.
        dtype: compute dtype of the gathered buffer's trainable part and of the gradient buffer.
        frozen_dtype: compute dtype of its frozen part (the buffers after ``grad_numel``).
        frozen_offset: byte offset of the frozen part in the gathered storage.
        frozen_plan: the frozen part's buffers as a plan (offsets relative to ``grad_numel``), for
            its own all-gather when ``frozen_dtype != dtype``; ``None`` otherwise.
        reduce_dtype: dtype of the reduce-scatter (``None``: the plan's dtype).
        numel: elements of the gathered buffer (``world_size * shard_size``).
        nbytes: bytes of the gathered storage (both parts).
        leaves: ``(path, offset, stop, shape)`` of every sharded leaf, by offset.
        replicated: the same for every ``spec.Replicate()`` leaf (offsets into the replicated buffer).
        frozen: paths of the leaves that do not train (no gradient, no hook, ``requires_grad=False``).
        grad_plan: the layout of the unit's gradient (its trainable leaves, a prefix of the
            gathered buffer: see [Note: trainable buffers first] in ``ragged/spec/_concat.py``);
            ``None`` when nothing trains.
        grad_numel, grad_nbytes: elements and bytes of the gradient buffer (compute dtype).
        grad_gaps: padding ranges of the gradient buffer (zero in it).
        grad_replicated_numel: elements of the replicated part of the gradient.
        gather_formats: every leaf's format by index in the unit's plan (``None``: the gather
            is not quantized, nor is it where no leaf is); reduce_formats: the same over ``grad_plan``.
        gather_dtypes: every leaf's compute dtype by index (trainable: ``dtype``, frozen:
            ``frozen_dtype``): what an unquantized leaf travels in within a quantized gather.
    """

    index: int
    name: str
    dtype: torch.dtype
    frozen_dtype: torch.dtype
    frozen_offset: int
    frozen_plan: LayoutPlan | None
    reduce_dtype: torch.dtype | None
    numel: int
    nbytes: int
    leaves: tuple[tuple[str, int, int, tuple[int, ...]], ...]
    replicated: tuple[tuple[str, int, int, tuple[int, ...]], ...]
    frozen: frozenset[str]
    grad_plan: LayoutPlan | None
    grad_numel: int
    grad_nbytes: int
    grad_gaps: tuple[tuple[int, int], ...]
    grad_replicated_numel: int
    gather_formats: tuple | None = None
    reduce_formats: tuple | None = None
    gather_dtypes: tuple = ()

    @property
    def num_leaves(self) -> int:
        return len(self.leaves) + len(self.replicated)

    @property
    def trained(self) -> tuple[str, ...]:
        """Paths of the trainable leaves: sharded by offset, then replicated (the runtime's per-leaf order)."""
        return tuple(p for p, *_ in self.leaves + self.replicated if p not in self.frozen)


def unit_layouts(units: Units, policy: MixedPrecision) -> tuple[UnitLayout, ...]:
    """One :class:`UnitLayout` per unit, in unit order.

    Examples:
        >>> import torch
        >>> from ragged import fsdp
        >>> units = fsdp.make_units({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, world_size=2)
        >>> (layout,) = fsdp._layout.unit_layouts(units, fsdp.MixedPrecision(compute_dtype=torch.bfloat16))
        >>> layout.numel, layout.nbytes, [path for path, *_ in layout.leaves]
        (16, 32, ["['b']", "['w']"])
    """
    out = []
    for index, u in enumerate(units):
        plan = u.plan
        dtype = policy.compute_dtype or plan.dtype
        leaves = tuple((u.paths[l.index], l.offset, l.stop, l.shape) for l in sorted(plan.leaves, key=lambda l: l.offset))
        replicated = tuple((u.paths[l.index], l.offset, l.stop, l.shape) for l in plan.replicated)
        grad_plan = u.trainable_plan
        grad_numel = grad_plan.buffer_numel if grad_plan is not None else 0
        itemsize = dtype.itemsize
        frozen_dtype = policy.frozen_dtype or dtype
        offset = -(-grad_numel * itemsize // frozen_dtype.itemsize) * frozen_dtype.itemsize
        frozen_plan = None
        gather_formats, reduce_formats = _formats(u, policy)
        if frozen_dtype != dtype and u.frozen:
            k = len(grad_plan.buffers) if grad_plan is not None else 0
            frozen_plan = plan.replace(leaves=(), replicated=(), shard_size=plan.shard_size - (grad_plan.shard_size if k else 0),
                                       buffers=tuple((o - grad_numel, s) for o, s in plan.buffers[k:]))
        else:
            frozen_dtype = dtype
        out.append(UnitLayout(
            index=index, name=u.name, dtype=dtype, frozen_dtype=frozen_dtype, frozen_offset=offset,
            frozen_plan=frozen_plan, reduce_dtype=policy.reduce_dtype, numel=plan.buffer_numel,
            nbytes=offset + (plan.buffer_numel - grad_numel) * frozen_dtype.itemsize, leaves=leaves,
            replicated=replicated, frozen=u.frozen,
            grad_plan=grad_plan, grad_numel=grad_numel, grad_nbytes=grad_numel * itemsize,
            grad_gaps=gaps(grad_plan) if grad_plan is not None else (),
            grad_replicated_numel=replicated_size(grad_plan) if grad_plan is not None else 0,
            gather_formats=gather_formats, reduce_formats=reduce_formats,
            gather_dtypes=tuple(frozen_dtype if u.paths[i] in u.frozen else dtype for i in range(len(u.paths))),
        ))
    return tuple(out)


def _formats(unit, policy: MixedPrecision):
    """The unit's gather and reduce formats per leaf (checked here, when the step is made: before
    any communication, the same on every rank)."""
    where = f"MixedPrecision.%s (unit {unit.name!r})"
    gather = None if policy.gather_format is None else formats_of(unit.plan, policy.gather_format,
                                                                  where % "gather_format")
    grad_plan = unit.trainable_plan
    reduce = None if policy.reduce_format is None or grad_plan is None else formats_of(
        grad_plan, policy.reduce_format, where % "reduce_format", replicated=False)
    return gather, reduce

