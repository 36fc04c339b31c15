"""docs/api.md is generated from the docstrings (scripts/api_docs.py): every public function
and class has a docstring of its own, the file is what the script writes now, and the names
without an ``Examples:`` section are exactly the known list below (it may only shrink: add an
example, then remove the name). The examples themselves run as doctests (``--doctest-modules``)."""

import importlib
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Public names whose docstring has no Examples: section yet: what needs a real process group or
# DeviceMesh, and the fsdp step's own types (their modules are being reworked). Remove a name
# once it has one.
WITHOUT_EXAMPLES = {
    "ragged.CollectiveError", "ragged.collectives.TorchCollectives", "ragged.collectives.from_torch",
    "ragged.fsdp.Unit", "ragged.fsdp.Units", "ragged.fsdp.TrainState", "ragged.fsdp.ValueAndGrad",
    "ragged.fsdp.Step", "ragged.parallel.from_device_mesh", "ragged.parallel.to_dtensor",
}


@pytest.fixture(scope="module")
def api_docs():
    spec = importlib.util.spec_from_file_location("api_docs", os.path.join(ROOT, "scripts", "api_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documented(api_docs):
    """``{qualified name: object}``, each object once, under the first package exporting it."""
    seen, out = set(), {}
    for pkg in api_docs.PACKAGES:
        for name, obj in api_docs.public_names(importlib.import_module(pkg)):
            if api_docs.is_documentable(obj) and id(obj) not in seen:
                seen.add(id(obj))
                out[f"{pkg}.{name}"] = obj
    return out


def test_every_public_function_and_class_has_a_docstring(api_docs):
    names = _documented(api_docs)
    assert len(names) > 100  # the walk found the packages' re-exports
    missing = sorted(q for q, obj in names.items() if api_docs.own_doc(obj) is None)
    assert missing == [], f"public names without a docstring: {missing}"


def test_examples_only_missing_where_known(api_docs):
    names = _documented(api_docs)
    without = {q for q, obj in names.items() if not api_docs.has_examples(obj)}
    assert without - WITHOUT_EXAMPLES == set(), f"new public names without an Examples: section: {sorted(without - WITHOUT_EXAMPLES)}"
    assert WITHOUT_EXAMPLES - without == set(), f"these have examples now, remove them from WITHOUT_EXAMPLES: {sorted(WITHOUT_EXAMPLES - without)}"


def test_docs_api_md_is_current(api_docs):
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        have = f.read()
    assert have == api_docs.render(), "docs/api.md is stale: run python3 scripts/api_docs.py"
    for heading in ("## `ragged`", "### `ragged.gather`", "### `ragged.optim.tree_norm`", "### `ragged.checkpoint.consolidate`"):
        assert heading in have, heading


def test_the_parser_reads_google_sections(api_docs):
    summary, sections = api_docs.split_doc(
        "One line\ncontinued.\n\nArgs:\n    x: the x.\n        more.\n\nReturns:\n    y.\n\nExamples:\n    >>> 1\n    1")
    assert summary == "One line continued."
    assert sections["Args:"] == "x: the x.\n    more." and sections["Returns:"] == "y." and "Examples:" in sections
