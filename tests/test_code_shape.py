"""The shape of the code in ``ragged/``: no function longer than 80 code lines (from ``def`` to its
end, its docstring not counted) and no module longer than 450 lines; see the guide's "One concept
per module". An exception names its owner and why it is one, and goes once the code is split."""

from __future__ import annotations

import ast
import pathlib

MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ragged"

# path (relative to ragged/) or "path:function" -> why it is allowed for now
EXCEPTIONS: dict[str, str] = {
}


def _docstring_lines(node) -> int:
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def code_lines(node) -> int:
    """Lines from ``def`` to the function's last line, less its docstring."""
    return node.end_lineno - node.lineno + 1 - _docstring_lines(node)


def shape_offenders(root: pathlib.Path = PACKAGE) -> dict[str, int]:
    """``{"path:function": code lines}`` over the limit and ``{"path": lines}`` of long modules."""
    found = {}
    for file in sorted(root.rglob("*.py")):
        rel, text = file.relative_to(root).as_posix(), file.read_text(encoding="utf-8")
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            found[rel] = n
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > MAX_FUNCTION_LINES:
                found[f"{rel}:{node.name}"] = code_lines(node)
    return found


def test_no_long_function_or_module():
    over = {k: n for k, n in shape_offenders().items() if k not in EXCEPTIONS}
    assert not over, (f"over {MAX_FUNCTION_LINES} code lines per function or {MAX_MODULE_LINES} lines per module: "
                      f"{over}. Split it (plan, then execute), or fold repeats.")


def test_every_exception_is_still_needed():
    stale = sorted(set(EXCEPTIONS) - set(shape_offenders()))
    assert not stale, f"{stale} fit the limits now: take them off EXCEPTIONS."


def test_the_measure_counts_code_not_the_docstring(tmp_path):
    def function(name, body_lines):
        doc = '    """A docstring of many lines.\n' + "\n" * 40 + '    """\n'
        return f"def {name}():\n{doc}" + "".join(f"    x = {i}\n" for i in range(body_lines))

    (tmp_path / "fits.py").write_text(function("fits", MAX_FUNCTION_LINES - 1))
    (tmp_path / "long.py").write_text(function("long", MAX_FUNCTION_LINES) + "\n" * MAX_MODULE_LINES)
    assert shape_offenders(tmp_path) == {"long.py": MAX_MODULE_LINES + MAX_FUNCTION_LINES + 43,
                                         "long.py:long": MAX_FUNCTION_LINES + 1}
