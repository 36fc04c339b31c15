"""One spec per parameter leaf from a spec tree that is the params tree or a prefix of it.

Both planners take specs this way (:func:`~ragged.make_plan`: granularities;
:func:`~ragged.spec.make_mesh_plan`: placements, where a plain ``{axis: placement}`` dict is a
*leaf*), so both use :func:`broadcast_specs`: the same prefix rule, the same checks, the same
errors.
"""

from __future__ import annotations

from collections.abc import Callable

import optree

from ragged._errors import RaggedValueError
from ragged._pytree import key_mismatch, keystr

__all__ = ["broadcast_specs"]


class _Box:
    """Hides a spec leaf (possibly a dict, or None) from optree while the prefix is broadcast."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def broadcast_specs(
    specs,
    params,
    treedef,
    *,
    check_leaf: Callable[[str, object], None],
    none_means: str,
    is_leaf: Callable[[object], bool] | None = None,
) -> list:
    """The spec leaf that stands for each leaf of ``params`` (in ``treedef`` order).

    Args:
        specs: ``params``' structure or a prefix of it (one spec leaf stands for a subtree).
            ``None`` leaves are kept as ``None`` (the caller gives them their meaning).
        params: the parameter tree.
        treedef: ``params``' treedef (namespace ``"ragged"``).
        check_leaf: ``check_leaf(key path, spec)`` raises a clear ``RaggedTypeError`` for a
            spec leaf that is not a spec (called for every leaf before broadcasting).
        none_means: what a ``None`` leaf means, for the error message.
        is_leaf: which spec subtrees are leaves (e.g. ``{axis: placement}`` dicts).

    Raises:
        RaggedValueError: ``specs`` is not a prefix of ``params`` (names which tree has which
            keys, and the fix).

    Examples:
        >>> import optree
        >>> params = {"a": [1, 2], "b": 3}
        >>> treedef = optree.tree_structure(params, namespace="ragged")
        >>> broadcast_specs({"a": "x", "b": None}, params, treedef, check_leaf=lambda p, s: None, none_means="-")
        ['x', 'x', None]
        >>> broadcast_specs({"c": "x"}, params, treedef, check_leaf=lambda p, s: None, none_means="the default")
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedValueError: specs has key(s) ['c'] that params does not have, and params has key(s) ['a', 'b'] that specs does not cover.
        Fix: give specs the structure of params, or a prefix of it (one spec stands for a whole subtree, e.g. {'layers': spec.Rows(1)}); None leaves mean the default.
    """
    accessors, leaves, _ = optree.tree_flatten_with_accessor(specs, is_leaf=is_leaf, none_is_leaf=True, namespace="ragged")
    for accessor, s in zip(accessors, leaves):
        check_leaf(keystr(accessor), s)
    boxed = optree.tree_map(_Box, specs, is_leaf=is_leaf, none_is_leaf=True, namespace="ragged")
    try:
        full = optree.tree_broadcast_prefix(boxed, params, namespace="ragged")
    except ValueError:
        errors = optree.prefix_errors(boxed, params, namespace="ragged")
        if not errors:
            raise
        said = key_mismatch(boxed, params, prefix_name="specs", full_name="params") or errors[0]("specs")
        raise RaggedValueError(
            f"{str(said).rstrip('.')}.\nFix: give specs the structure of params, or a prefix of it (one spec stands "
            f"for a whole subtree, e.g. {{'layers': spec.Rows(1)}}); None leaves mean {none_means}."
        ) from None
    return [box.value for box in treedef.flatten_up_to(full)]
