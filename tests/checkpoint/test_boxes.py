"""Flat element ranges <-> N-D boxes (``checkpoint/_boxes.py``): the boxes of a range tile exactly
its elements, in range order, each one contiguous range of the flattened tensor; at most
``2 * ndim - 1`` of them; ``box_range`` inverts a box and refuses one that is not contiguous."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged.checkpoint._boxes import box_range, boxes


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    stop = draw(st.integers(start, n))
    return shape, start, stop


@settings(max_examples=300)
@given(shape_and_range())
def test_boxes_tile_the_range_in_order(case):
    shape, start, stop = case
    numbered = torch.arange(math.prod(shape)).reshape(shape)
    got, pos = [], start
    out = boxes(shape, start, stop)
    assert len(out) <= max(2 * len(shape) - 1, 1)
    for offsets, sizes in out:
        assert all(s > 0 for s in sizes)
        lo, hi = box_range(shape, (offsets, sizes))
        assert lo == pos  # contiguous, in range order
        region = numbered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert region.reshape(-1).tolist() == list(range(lo, hi))  # the box's elements are exactly [lo, hi)
        got.append((lo, hi))
        pos = hi
    assert pos == stop


@pytest.mark.parametrize("shape,box", [((4, 3), ((0, 1), (2, 2))), ((2, 3, 4), ((0, 1, 0), (2, 1, 4))),
                                       ((4, 3), ((3, 0), (2, 3)))], ids=["partial-rows", "strided", "outside"])
def test_box_range_refuses_a_box_that_is_not_one_range(shape, box):
    with pytest.raises(ValueError, match="not one contiguous range|outside"):
        box_range(shape, box)


def test_boxes_refuse_a_range_outside_the_tensor():
    with pytest.raises(ValueError, match=r"\[2, 7\) is not a range of a tensor of shape \(2, 3\)"):
        boxes((2, 3), 2, 7)
