"""ragged's imports follow the layering docs/design.md states: no import circle among its modules,
no import upward, and an import inside a function only where a comment says why.

The layering is read from docs/design.md's line ``Layering, bottom up: `a`, `b` < `c` < ...``
(names relative to ``ragged``; ``ragged`` itself is the package root's re-exports): a module may
import from its own layer and the layers below. A function-level import is lazy (it runs when
the function does): it must carry a comment (on its line, or on the lines just above the imports
it opens), and one that goes upward must also be listed in :data:`LAZY_UPWARD` with its reason.
"""

from __future__ import annotations

import ast
import collections
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (importer, imported) -> why the import is upward and lazy. Keep it short: each is a debt.
LAZY_UPWARD = {
    ("ragged.fsdp._step", "ragged.predict._lower"):
        "step.lower: the predictor reads the step's schedule, so it sits above fsdp",
    ("ragged.fsdp", "ragged.predict"):
        "rg.fsdp.Lowered & co, published there first, are looked up in ragged.predict on first use",
    ("ragged.fsdp", "ragged.checkpoint._pretrained"):
        "rg.fsdp.save_pretrained lives with the Hugging Face reader in ragged.checkpoint (torch.distributed.checkpoint)",
    ("ragged.fsdp", "ragged.checkpoint._fsdp2"):
        "rg.fsdp.save_fsdp2 lives with the FSDP2 reader in ragged.checkpoint (torch.distributed.checkpoint)",
}


# ---- the checker -------------------------------------------------------------------------------
def modules(root: str, package: str) -> dict[str, str]:
    """``{dotted module name: file}`` for every ``.py`` under ``root/package``."""
    out = {}
    for folder, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def _target(name: str, known) -> str | None:
    """The module of ``known`` that importing ``name`` runs last (``a.b.c`` -> ``a.b`` if ``c`` is a name)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _comment_lines(source: str) -> set[int]:
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def imports(dotted: str, path: str, known) -> list[tuple[str, int, bool, bool]]:
    """``(imported module, line, lazy, commented)`` for every import in ``path`` (a module of
    ``known``, else the name as written: ``torch.distributed``, ``rich.table``); ``lazy``: inside a
    function; ``commented``: a comment on its lines, or on the lines just above the run of
    imports it belongs to."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    comments = _comment_lines(source)
    lines = source.splitlines()
    is_package = path.endswith("__init__.py")
    out = []

    def commented(node, run_start):
        if any(n in comments for n in range(node.lineno, node.end_lineno + 1)):
            return True
        above = run_start - 1  # the comment lines directly above the run (blank lines end it)
        return above >= 1 and above in comments and lines[above - 1].lstrip().startswith("#")

    def visit(body, lazy):
        run_start = None
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                run_start = node.lineno if run_start is None else run_start
                targets = {_target(name, known) or name for name in _names(node, dotted, is_package)}
                for target in sorted(targets - {dotted}):
                    out.append((target, node.lineno, lazy, commented(node, run_start)))
            else:
                run_start = None
            for child_body, child_lazy in _bodies(node, lazy):
                visit(child_body, child_lazy)

    visit(tree.body, False)
    return out


def _names(node, dotted: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = dotted.split(".") if is_package else dotted.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]  # a name, not a module: _target walks up to base


def _bodies(node, lazy):
    """The statement lists inside ``node``; those of a function (or lambda) run lazily."""
    inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    for field in ("body", "orelse", "finalbody"):
        value = getattr(node, field, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value, inner
    for handler in getattr(node, "handlers", []):
        yield handler.body, inner
    for case in getattr(node, "cases", []):
        yield case.body, inner


def layers(text: str, package: str) -> dict[str, int]:
    """``{module prefix: layer}`` from the ``Layering, bottom up:`` line of ``text``."""
    m = re.search(r"Layering, bottom up:(.*?)(?:;|\n\n|$)", text, re.S)
    assert m, "docs/design.md has no 'Layering, bottom up:' line"
    out = {}
    for rank, group in enumerate(m.group(1).split(" < ")):
        for name in re.findall(r"`([^`]+)`", group):
            out[package if name == package else f"{package}.{name}"] = rank
    return out


def layer_of(module: str, ranks: dict[str, int]) -> int | None:
    """The layer of the longest prefix of ``module`` named in ``ranks``."""
    name = module
    while name:
        if name in ranks:
            return ranks[name]
        name = name.rpartition(".")[0]
    return None


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def check(root: str, package: str, design_text: str, lazy_upward=LAZY_UPWARD) -> list[str]:
    """Every breach of the layering in ``root/package``, one line each."""
    known = modules(root, package)
    ranks = layers(design_text, package)
    problems, edges = [], collections.defaultdict(set)
    for dotted, path in sorted(known.items()):
        mine = layer_of(dotted, ranks)
        if mine is None:
            problems.append(f"{dotted}: in no layer of docs/design.md's 'Layering, bottom up:' line")
            continue
        for target, line, lazy, commented in imports(dotted, path, known):
            where = f"{os.path.relpath(path, root)}:{line}: {dotted} imports {target}"
            if lazy and not commented:
                problems.append(f"{where} inside a function with no comment saying why")
            if target not in known:
                continue
            edges[dotted].add(target)
            theirs = layer_of(target, ranks)
            if theirs is not None and theirs > mine:
                if not lazy:
                    problems.append(f"{where}: upward, at import time")
                elif (dotted, target) not in lazy_upward:
                    problems.append(f"{where}: upward (lazy, but not in LAZY_UPWARD)")
    problems += [f"import circle: {' -> '.join(c)}" for c in cycles(edges)]
    return problems


# ---- the tests ---------------------------------------------------------------------------------
def _design() -> str:
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        return f.read()


def test_ragged_has_no_import_circle_and_no_upward_import():
    problems = check(ROOT, "ragged", _design())
    assert problems == [], "\n".join(problems)


def test_every_lazy_upward_import_is_still_there():
    known = modules(ROOT, "ragged")
    found = {(d, t) for d, p in known.items() for t, _, lazy, _ in imports(d, p, known) if lazy}
    assert set(LAZY_UPWARD) <= found, f"listed but gone, remove them: {set(LAZY_UPWARD) - found}"


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_the_checker_finds_a_circle_an_upward_import_and_an_unexplained_lazy_one(tmp_path):
    design = "Layering, bottom up: `low` < `mid` < `high` < `pkg`.\n"
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/low.py": "x = 1\n", "pkg/mid/__init__.py": "",
                      "pkg/mid/_a.py": "from pkg.mid._b import y\nx = 1\n",
                      "pkg/mid/_b.py": "from pkg.mid import _a\ny = 2\n",
                      "pkg/high.py": "from pkg import low\n"})
    assert check(tmp_path, "pkg", design, {}) == ["import circle: pkg.mid._a -> pkg.mid._b"]
    _write(tmp_path, {"pkg/mid/_b.py": "y = 2\n", "pkg/low.py": "from pkg.high import z\n"})
    assert check(tmp_path, "pkg", design, {}) == ["pkg/low.py:1: pkg.low imports pkg.high: upward, at import time",
                                                  "import circle: pkg.high -> pkg.low"]
    _write(tmp_path, {"pkg/low.py": "def f():\n    from pkg.high import z\n    return z\n"})
    found = check(tmp_path, "pkg", design, {})
    assert found == ["pkg/low.py:2: pkg.low imports pkg.high inside a function with no comment saying why",
                     "pkg/low.py:2: pkg.low imports pkg.high: upward (lazy, but not in LAZY_UPWARD)",
                     "import circle: pkg.high -> pkg.low"], found
    _write(tmp_path, {"pkg/low.py": "def f():\n    # why: ...\n    from pkg.mid import _a\n    return _a\n"})
    assert check(tmp_path, "pkg", design, {}) == ["pkg/low.py:3: pkg.low imports pkg.mid._a: upward (lazy, but not in "
                                                  "LAZY_UPWARD)"]
    assert check(tmp_path, "pkg", design, {("pkg.low", "pkg.mid._a"): "why"}) == []
