"""Hypothesis strategies for ragged's inputs: world sizes, shapes, parameter trees, specs, plans.

Modelled on ``xarray.testing.strategies``: small public building blocks, each a
``SearchStrategy`` (``@st.composite`` where one draw depends on another), that tests of
ragged and of code built on it combine freely. Parameter trees are shapes only (``meta``) by
default; ``param_trees(device="cpu")`` draws real standard-normal values.

Examples:
    >>> import torch
    >>> from hypothesis import given, settings
    >>> import ragged as rg
    >>> from ragged.testing import assert_trees_all_close, strategies as rst
    >>> real = rst.param_trees(device="cpu", dtype=torch.float64)      # values, not meta
    >>> @settings(max_examples=20, database=None, deadline=None)
    ... @given(rst.plan_inputs(params=real))
    ... def test_every_ranks_shard_end_to_end_is_the_parameters(inputs):
    ...     params, specs, world_size = inputs
    ...     plan = rg.make_plan(params, specs, world_size=world_size)
    ...     flat = torch.cat([rg.shard(plan, params, rank=r).data for r in range(world_size)])
    ...     assert_trees_all_close(rg.unflatten(plan, flat), params)   # every value where the plan says
    >>> test_every_ranks_shard_end_to_end_is_the_parameters()
"""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import torch

from ragged._pytree import pytree
from ragged.spec._granularity import Blocks, Elements, Replicate, Rows
from ragged.spec._planning import make_plan
from ragged._errors import RaggedValueError

__all__ = [
    "world_sizes",
    "shapes",
    "param_trees",
    "granularities",
    "block_specs",
    "spec_trees",
    "plan_inputs",
    "multi_buffer_inputs",
    "plans",
    "KEYS",
]

#: Dict keys drawn for parameter trees (sorted flattening makes their order matter).
KEYS = ("w", "b", "bias", "weight", "norm", "q", "k", "v", "experts", "a", "z")


def world_sizes(*, min_value: int = 1, max_value: int = 16) -> st.SearchStrategy[int]:
    """Shard-group sizes m in ``[min_value, max_value]`` (shrinks towards ``min_value``).

    Examples:
        >>> from hypothesis import find, settings
        >>> from ragged.testing import strategies as rst
        >>> find(rst.world_sizes(max_value=8), lambda m: m % 3 == 0, settings=settings(database=None))
        3
    """
    return st.integers(min_value=min_value, max_value=max_value)


def shapes(*, min_dims: int = 0, max_dims: int = 3, min_side: int = 0, max_side: int = 8) -> st.SearchStrategy:
    """Tensor shapes (tuples of ints); empty dims and 0-d tensors are included by default.

    Examples:
        >>> from hypothesis import given, settings
        >>> from ragged.testing import strategies as rst
        >>> @settings(max_examples=20, database=None)
        ... @given(rst.shapes(min_dims=1, max_side=4))
        ... def test(shape):
        ...     assert 1 <= len(shape) <= 3 and all(0 <= side <= 4 for side in shape)
        >>> test()
    """
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


def _make_leaf(shape, dtype, device, seed):
    if device == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


@st.composite
def param_trees(
    draw,
    *,
    shapes: st.SearchStrategy = shapes(),
    min_leaves: int = 1,
    max_leaves: int = 6,
    dtype: torch.dtype = torch.float32,
    device: str = "meta",
    nested: bool = True,
):
    """Pytrees (dicts, optionally with nested dicts and lists) of tensors.

    Args:
        shapes: strategy for each leaf's shape.
        min_leaves: fewest leaves.
        max_leaves: most leaves.
        dtype: floating dtype of every leaf.
        device: ``"meta"`` (default: shapes only, no memory) or a real device; real leaves hold
            standard-normal values from a drawn seed (never all zeros unless empty).
        nested: also draw nested dicts / lists.

    Returns:
        A strategy of pytrees whose leaves are tensors.

    Examples:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> import ragged as rg
        >>> from ragged.testing import strategies as rst
        >>> @settings(max_examples=20, database=None, deadline=None)
        ... @given(rst.param_trees(device="cpu", nested=False))
        ... def test(tree):
        ...     assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tree.values())
        ...     assert 1 <= len(rg.pytree.leaves(tree)) <= 6
        >>> test()
    """
    n = draw(st.integers(min_value=min_leaves, max_value=max_leaves))
    leaf_shapes = [draw(shapes) for _ in range(n)]
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    leaves = [_make_leaf(s, dtype, device, seed + i) for i, s in enumerate(leaf_shapes)]
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=n, max_size=n, unique=True)) if n <= len(KEYS) else [
        f"p{i}" for i in range(n)
    ]
    if not nested or n < 2:
        return dict(zip(keys, leaves))
    kind = draw(st.sampled_from(["flat", "list", "dict"]))
    if kind == "flat":
        return dict(zip(keys, leaves))
    split = draw(st.integers(min_value=1, max_value=n - 1))
    outer = dict(zip(keys[:split], leaves[:split]))
    inner_leaves = leaves[split:]
    if kind == "list":
        outer["layers"] = list(inner_leaves)
    else:
        outer["block"] = dict(zip(keys[split:], inner_leaves))
    return outer


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, limit + 1) if n % d == 0]


@st.composite
def block_specs(draw, shape, *, max_r: int = 4, max_c: int = 4):
    """A ``spec.Blocks(r, c)`` valid for ``shape`` (at least 2-D; for stacked matrices ``r``
    divides ``shape[-2]`` so bands line up).

    Examples:
        >>> from hypothesis import find, settings
        >>> from ragged.testing import strategies as rst
        >>> find(rst.block_specs((6, 8)), lambda b: b.r > 1 and b.c > 1, settings=settings(database=None))
        Blocks(r=2, c=2)
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise RaggedValueError(f"Blocks need a leaf of at least 2 dims, got shape {shape}.")
    if len(shape) >= 3 and math.prod(shape[:-2]) > 1:
        r = draw(st.sampled_from(_divisors(shape[-2], max_r) if shape[-2] else list(range(1, max_r + 1))))
    else:
        r = draw(st.integers(min_value=1, max_value=max_r))
    return Blocks(r, draw(st.integers(min_value=1, max_value=max_c)))


@st.composite
def granularities(draw, shape, *, max_n: int = 4, replicate: bool = False, blocks: bool = True):
    """A granularity valid for a leaf of ``shape``: ``Elements(n)``, ``Rows(n)``, ``Blocks``
    (2-D and up, when ``blocks``) or, when ``replicate``, ``Replicate()``.

    Examples:
        >>> from hypothesis import given, settings
        >>> from ragged import spec
        >>> from ragged.testing import strategies as rst
        >>> @settings(max_examples=30, database=None)
        ... @given(rst.granularities((5,)))
        ... def test(g):
        ...     assert isinstance(g, (spec.Elements, spec.Rows))   # no Blocks for a 1-D leaf
        >>> test()
    """
    shape = tuple(shape)
    kinds = ["elements", "rows"]
    if blocks and len(shape) >= 2:
        kinds.append("blocks")
    if replicate:
        kinds.append("replicate")
    kind = draw(st.sampled_from(kinds))
    if kind == "elements":
        return Elements(draw(st.integers(min_value=1, max_value=max_n)))
    if kind == "rows":
        return Rows(draw(st.integers(min_value=1, max_value=max_n)))
    if kind == "blocks":
        return draw(block_specs(shape, max_r=max_n, max_c=max_n))
    return Replicate()


@st.composite
def spec_trees(draw, params, *, max_n: int = 4, replicate: bool = False, allow_none: bool = True):
    """A full spec tree for ``params`` (same structure), one valid granularity per leaf;
    with ``allow_none`` some leaves are ``None`` (= ``Rows(1)``).

    Examples:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> import ragged as rg
        >>> from ragged.testing import strategies as rst
        >>> params = {"w": torch.empty(4, 6, device="meta"), "b": torch.empty(6, device="meta")}
        >>> @settings(max_examples=20, database=None)
        ... @given(rst.spec_trees(params))
        ... def test(specs):
        ...     assert set(specs) == {"w", "b"}
        ...     rg.make_plan(params, specs, world_size=3)   # every drawn spec applies
        >>> test()
    """
    leaves, treedef = pytree.flatten(params)
    return pytree.unflatten(treedef, [
        None if allow_none and draw(st.integers(0, 4)) == 0
        else draw(granularities(tuple(leaf.shape), max_n=max_n, replicate=replicate))
        for leaf in leaves
    ])


@st.composite
def plan_inputs(
    draw,
    *,
    params: st.SearchStrategy | None = None,
    world_sizes: st.SearchStrategy = world_sizes(),
    max_n: int = 4,
    replicate: bool = False,
):
    """``(params, specs, world_size)`` ready for :func:`ragged.make_plan`.

    Examples:
        >>> from hypothesis import given, settings
        >>> import ragged as rg
        >>> from ragged.testing import strategies as rst
        >>> @settings(max_examples=10, database=None, deadline=None)
        ... @given(rst.plan_inputs(world_sizes=rst.world_sizes(min_value=2, max_value=4)))
        ... def test(inputs):
        ...     params, specs, world_size = inputs
        ...     assert rg.make_plan(params, specs, world_size=world_size).world_size == world_size
        >>> test()
    """
    tree = draw(params if params is not None else param_trees())
    return tree, draw(spec_trees(tree, max_n=max_n, replicate=replicate)), draw(world_sizes)


@st.composite
def multi_buffer_inputs(
    draw,
    *,
    max_leaves: int = 5,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    world_sizes: st.SearchStrategy = world_sizes(min_value=3, max_value=6),
):
    """``(params, specs, world_size)`` whose leaves are matrices of several row lengths, long
    enough to cross rank boundaries: inputs where ``make_plan(..., max_buffers=K)`` often uses
    more than one buffer (about a quarter of draws with ``align=1``).

    Examples:
        >>> from hypothesis import given, settings
        >>> import ragged as rg
        >>> from ragged.testing import strategies as rst
        >>> @settings(max_examples=10, database=None, deadline=None)
        ... @given(rst.multi_buffer_inputs())
        ... def test(inputs):
        ...     params, specs, world_size = inputs
        ...     plan = rg.make_plan(params, specs, world_size=world_size, max_buffers=4, align=1)
        ...     assert 1 <= plan.num_buffers <= 4 and plan.padding >= 0
        >>> test()
    """
    n = draw(st.integers(min_value=2, max_value=max(2, max_leaves)))
    shapes = [(draw(st.integers(4, 16)), draw(st.integers(1, 7))) for _ in range(n)]
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    params = {f"p{i}": _make_leaf(s, dtype, device, seed + i) for i, s in enumerate(shapes)}
    specs = {k: Rows(draw(st.sampled_from([1, 1, 2]))) for k in params}
    return params, specs, draw(world_sizes)


@st.composite
def plans(draw, *, strategy: str = "dp", align: int | None = None, inputs: st.SearchStrategy | None = None):
    """A :class:`~ragged.spec.LayoutPlan` of drawn :func:`plan_inputs`.

    Examples:
        >>> from hypothesis import given, settings
        >>> from ragged.testing import strategies as rst
        >>> @settings(max_examples=20, database=None, deadline=None)
        ... @given(rst.plans())
        ... def test(plan):
        ...     assert plan.buffer_numel == plan.world_size * plan.shard_size >= plan.numel
        >>> test()
    """
    params, specs, world_size = draw(inputs if inputs is not None else plan_inputs())
    return make_plan(params, specs, world_size=world_size, align=align, strategy=strategy)
