"""Leaf key paths in plans equal optree's accessor formatting, on every kind of tree."""

import collections

import optree
import pytest
import torch
from hypothesis import given

import ragged as rg
from ragged._pytree import keystr
from ragged.spec._planning import key_paths
from ragged.testing import strategies as rst

NT = collections.namedtuple("NT", "a b")


def _reference(tree):
    _, treedef = optree.tree_flatten(tree, namespace="ragged")
    return tuple(keystr(a) for a in treedef.accessors()), treedef


@pytest.mark.parametrize(
    "tree",
    [
        {"w": 1, "b": [2, (3, 4)], 5: {"x": 6}},
        [1, 2, (3,)],
        7,
        {"n": NT(1, [2, 3]), "z": None},
        collections.OrderedDict(b=1, a=2),
    ],
    ids=["mixed-keys", "list", "root-leaf", "namedtuple", "ordereddict"],
)
def test_paths_match_accessors(tree):
    ref, treedef = _reference(tree)
    assert key_paths(treedef) == ref


@given(rst.param_trees())
def test_plan_paths_match_accessors(params):
    ref, _ = _reference(params)
    plan = rg.make_plan(params, world_size=2)
    assert sorted(l.path for l in plan.leaves) == sorted(ref)


def test_namedtuple_params_keep_attribute_paths():
    plan = rg.make_plan(NT(torch.empty(4, device="meta"), [torch.empty(2, 2, device="meta")]), world_size=2)
    assert [l.path for l in sorted(plan.leaves, key=lambda l: l.index)] == [".a", ".b[0]"]
