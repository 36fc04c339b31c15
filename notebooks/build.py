"""Writes the notebooks from the cell lists below and executes them in place, so the
committed .ipynb files carry their outputs (readable on GitHub without running anything).

    python notebooks/build.py            # all notebooks
    python notebooks/build.py 01         # the ones whose file name contains "01"

CI does not use this script: tests/test_notebooks.py executes the committed notebooks.
"""

from __future__ import annotations

import pathlib
import sys

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).parent


def md(text: str):
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str):
    return nbformat.v4.new_code_cell(text.strip("\n"))


def build(name: str, cells) -> None:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, HERE / name)
    print("wrote", HERE / name)


def main(argv):
    import importlib

    sys.path.insert(0, str(HERE))
    for module_name in sorted(p.stem for p in HERE.glob("_nb*.py")):
        module = importlib.import_module(module_name)
        if argv and not any(a in module.NAME for a in argv):
            continue
        build(module.NAME, module.CELLS)


if __name__ == "__main__":
    main(sys.argv[1:])
