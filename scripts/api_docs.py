"""Renders docs/api.md, the API reference, from the docstrings of ragged's public names.

    python3 scripts/api_docs.py           # (re)writes docs/api.md
    python3 scripts/api_docs.py --check   # exit 1 when docs/api.md differs from what it would write

A public name is one a public package binds without a leading underscore (its re-exports),
modules aside. Each object is documented once, under the first package of ``PACKAGES`` that
binds it (``ragged.gather`` before ``ragged.transforms.gather``); later packages point there.
For a function or class: its signature (each ``typing.overload`` for a verb with two call
shapes), the summary paragraph of its docstring and its ``Args:`` section; a constant shows its
value; a package or module: its summary paragraph and its docstring's example. tests/test_api_docs.py fails when a public function or class has no docstring of its
own, or when docs/api.md is stale.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import textwrap
import types
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "api.md")
PACKAGES = ("ragged", "ragged.spec", "ragged.quant", "ragged.collectives", "ragged.transforms", "ragged.optim", "ragged.fsdp", "ragged.predict",
            "ragged.parallel", "ragged.checkpoint", "ragged.testing", "ragged.testing.strategies",
            "ragged.models")
SECTIONS = ("Args:", "Arguments:", "Returns:", "Yields:", "Raises:", "Examples:", "Example:", "Note:", "Notes:",
            "Attributes:", "See also:")


class _Raw:
    """An annotation written as a string (``from __future__ import annotations``), shown bare."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def _bare(annotation):
    return _Raw(annotation) if isinstance(annotation, str) else annotation


def _signature(name: str, fn) -> str:
    sig = inspect.signature(fn)
    sig = sig.replace(parameters=[p.replace(annotation=_bare(p.annotation)) for p in sig.parameters.values()],
                      return_annotation=_bare(sig.return_annotation))
    return re.sub(r" at 0x[0-9a-f]+", "", f"{name}{sig}")  # defaults that are functions: no addresses


def public_names(module) -> list[tuple[str, object]]:
    """``(name, object)`` for every public name ``module`` binds, in source order of binding, then
    those it looks up on first use (a module ``__getattr__`` / ``__dir__``) that no documented
    package binds itself (those are described there). A module with ``__all__``: those names only,
    not what it imports."""
    out, listed = [], getattr(module, "__all__", None)
    bound = {id(obj) for pkg in PACKAGES for obj in vars(importlib.import_module(pkg)).values()}
    lazy = [(name, getattr(module, name)) for name in dir(module) if name not in vars(module)]
    for name, obj in [*vars(module).items(), *((n, o) for n, o in lazy if id(o) not in bound)]:
        if listed is not None and name not in listed:
            continue
        if name.startswith("_") or isinstance(obj, types.ModuleType) or isinstance(obj, type(annotations)):
            continue
        out.append((name, obj))
    return out


def is_documentable(obj) -> bool:
    """Functions and classes need docstrings (constants, type aliases and namespaces do not)."""
    return inspect.isclass(obj) or inspect.isroutine(obj)


def own_doc(obj) -> str | None:
    """The object's own docstring (not inherited, not the one NamedTuple / dataclass generate)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc or not doc.strip():
        return None
    if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):
        return None  # generated: "Name(field, ...)"
    return inspect.cleandoc(doc)


def split_doc(doc: str) -> tuple[str, dict[str, str]]:
    """``(summary, {section header: body})`` of a Google-style docstring."""
    lines = doc.splitlines()
    summary, i = [], 0
    while i < len(lines) and lines[i].strip() and lines[i].strip() not in SECTIONS:
        summary.append(lines[i])
        i += 1
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines[i:]:
        if line.strip() in SECTIONS and not line.startswith(" "):
            current = line.strip()
            sections[current] = []
        elif current is not None:
            if line and not line.startswith(" "):
                current = None  # a paragraph after the section
            else:
                sections[current].append(line)
    return " ".join(s.strip() for s in summary), {k: textwrap.dedent("\n".join(v)).strip() for k, v in sections.items()}


def has_examples(obj) -> bool:
    doc = own_doc(obj)
    return doc is not None and ("Examples:" in split_doc(doc)[1] or "Example:" in split_doc(doc)[1])


def _signatures(qualname: str, obj) -> list[str]:
    if inspect.isroutine(obj):
        shapes = typing.get_overloads(obj) or [obj]
        return [_signature(qualname, f) for f in shapes]
    try:
        return [_signature(qualname, obj)]
    except (TypeError, ValueError):  # a Protocol or a builtin-backed class
        return []


def _entry(qualname: str, obj) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "function" if inspect.isroutine(obj) else "constant"
    out = [f"### `{qualname}`", ""]
    if kind == "constant":
        value = re.sub(r" at 0x[0-9a-f]+", "", repr(obj))
        out += [f"constant: `{value if len(value) < 100 else type(obj).__name__}`", ""]
        return out
    sigs = _signatures(qualname, obj)
    if sigs:
        out += ["```text", *((f"class {s.removesuffix(' -> None')}" if kind == "class" else s) for s in sigs), "```", ""]
    doc = own_doc(obj)
    if doc is None:
        return out + ["(no docstring)", ""]
    summary, sections = split_doc(doc)
    out += [_md(summary), ""]
    args = sections.get("Args:") or sections.get("Arguments:")
    if args:
        out += ["Args:", "", *_arg_items(args), ""]
    return out


def _md(text: str) -> str:
    """reST inline markup as Markdown: a role (:func:, :class: ...) becomes code, ``~`` keeps
    the last name only, double backquotes become single ones."""
    text = re.sub(r":[a-z]+:`(~?)([^`]+)`", lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return text.replace("``", "`")


def _arg_items(args: str) -> list[str]:
    """``- `name`: description`` per argument of an ``Args:`` body (continuation lines joined)."""
    items: list[str] = []
    for line in args.splitlines():
        if not line.strip():
            continue
        if line.startswith(" ") and items:
            items[-1] += " " + line.strip()
        else:
            name, _, text = line.partition(":")
            items.append(f"- `{name.strip()}`: {text.strip()}")
    return [_md(item) for item in items]


def render() -> str:
    seen: dict[int, str] = {}
    lines = ["# API reference", "",
             "Generated from the docstrings by `python3 scripts/api_docs.py` (do not edit; "
             "`tests/test_api_docs.py` fails when this file is stale). Each object is described once, under the "
             "first package that exports it; the examples in the docstrings run as doctests.", ""]
    for pkg in PACKAGES:
        module = importlib.import_module(pkg)
        lines += [f"## `{pkg}`", ""]
        doc = inspect.cleandoc(module.__doc__ or "")
        if doc:
            lines += [_md(doc.split("\n\n")[0].replace("\n", " ")), ""]
            example = split_doc(doc)[1].get("Examples:")
            if example:  # a module's own example, shown as the doctest it runs as
                lines += ["Example:", "", "```text", example, "```", ""]
        for name, obj in public_names(module):
            qualname = f"{pkg}.{name}"
            key = id(obj)
            if is_documentable(obj) and key in seen:
                lines += [f"- `{qualname}`: the same object as `{seen[key]}`", ""]
                continue
            if is_documentable(obj):
                seen[key] = qualname
            lines += _entry(qualname, obj)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale; write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        have = open(OUT).read() if os.path.exists(OUT) else ""
        if have != text:
            print(f"{OUT} is stale: run python3 scripts/api_docs.py", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
