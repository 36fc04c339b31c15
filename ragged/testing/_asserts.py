"""Tree-level assertions for tests (optax ``test_utils`` style)."""

from __future__ import annotations

import torch

from ragged._pytree import flatten_with_keystr
from ragged._errors import RaggedValueError

__all__ = ["assert_trees_all_close"]


def assert_trees_all_close(actual, expected, *, rtol: float | None = None, atol: float | None = None,
                           check_dtype: bool = True, check_device: bool = False, equal_nan: bool = False,
                           msg: str | None = None) -> None:
    """Asserts two pytrees have the same structure and close leaves.

    Leaves are compared with :func:`torch.testing.assert_close` (tensors, numbers). Default
    tolerances are torch's per-dtype defaults; pass ``rtol`` and ``atol`` together to override.
    The first failure names the leaf's key path.

    Args:
        actual: a pytree (flattened in the ``"ragged"`` optree namespace, so DBuffers and
            ragged optimizer states are nodes).
        expected: a pytree of the same structure.
        rtol: relative tolerance (with ``atol``).
        atol: absolute tolerance (with ``rtol``).
        check_dtype: require equal dtypes.
        check_device: require equal devices.
        equal_nan: treat NaNs in the same places as equal.
        msg: extra text prepended to the failure message.

    Raises:
        AssertionError: the structures differ, or a leaf differs beyond the tolerance.

    Examples:
        >>> import torch
        >>> from ragged.testing import assert_trees_all_close
        >>> a = {"w": torch.ones(2, 2, dtype=torch.float64), "b": [torch.zeros(3)]}
        >>> assert_trees_all_close(a, {"w": torch.ones(2, 2, dtype=torch.float64), "b": [torch.zeros(3)]})
        >>> assert_trees_all_close(a, {"w": 2 * torch.ones(2, 2, dtype=torch.float64), "b": [torch.zeros(3)]})
        Traceback (most recent call last):
        ...
        AssertionError: leaf ['w'] differs: ...
    """
    if (rtol is None) != (atol is None):
        raise RaggedValueError("pass rtol and atol together (or neither, for torch's per-dtype defaults).")
    prefix = f"{msg}: " if msg else ""
    paths_a, leaves_a, tree_a = flatten_with_keystr(actual)
    paths_b, leaves_b, tree_b = flatten_with_keystr(expected)
    if tree_a != tree_b:
        raise AssertionError(f"{prefix}tree structures differ:\n  actual:   {tree_a}\n  expected: {tree_b}")
    for path, x, y in zip(paths_a, leaves_a, leaves_b):
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            if isinstance(x, (int, float, complex)) and isinstance(y, (int, float, complex)):
                x, y = torch.as_tensor(x), torch.as_tensor(y)
            elif x != y:
                raise AssertionError(f"{prefix}leaf {path} differs: {x!r} != {y!r}")
            else:
                continue
        try:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, check_dtype=check_dtype,
                                       check_device=check_device, equal_nan=equal_nan)
        except AssertionError as err:
            raise AssertionError(f"{prefix}leaf {path} differs: {err}") from None
        except TypeError as err:
            raise AssertionError(f"{prefix}leaf {path} cannot be compared: {err}") from None
