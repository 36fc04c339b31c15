"""Every error ragged raises on purpose is a ``rg.RaggedError`` (and still the builtin kind)."""

import ast
import pathlib

import pytest
import torch

import ragged as rg
from ragged import spec

_PACKAGE = pathlib.Path(rg.__file__).parent
_BUILTINS = {"ValueError", "TypeError", "KeyError"}


def test_no_bare_builtin_raise_in_the_package():
    bare = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                if isinstance(func, ast.Name) and func.id in _BUILTINS:
                    bare.append(f"{path.relative_to(_PACKAGE.parent)}:{node.lineno} raise {func.id}")
    assert not bare, "raise a ragged error (rg.RaggedValueError, ...) instead of:\n" + "\n".join(bare)


@pytest.mark.parametrize(
    "call, builtin",
    [
        (lambda: spec.Rows(0), ValueError),
        (lambda: rg.make_plan({"w": torch.ones(2)}, {"w": "rows"}, world_size=2), TypeError),
        (lambda: rg.make_plan({"w": torch.ones(2)}, world_size=2).leaf("['nope']"), KeyError),
    ],
    ids=["value", "type", "key"],
)
def test_ragged_errors_are_also_builtin_errors(call, builtin):
    with pytest.raises(rg.RaggedError) as info:
        call()
    assert isinstance(info.value, builtin)
