"""Installs what ragged needs and this interpreter lacks; touches nothing that is there.

    python3 scripts/install_missing.py               # runtime: torch, optree, numpy, rich
    python3 scripts/install_missing.py --extra test  # + pytest, hypothesis, nbclient, ...
    python3 scripts/install_missing.py --check       # only say what is missing (exit 1 if anything)
    python3 scripts/install_missing.py --extra test --only optree pytest --wheels .gpu-wheels
                                                     # these alone, from the wheels offline first

Rules (the promise of README "Install"):

* torch: any installed torch inside ``pyproject.toml``'s range (``torch>=2.11,<2.15``) is kept,
  whatever its build (CPU, CUDA, ROCm). Only when there is no torch at all is ``torch==2.13.0``
  installed, from ``$TORCH_INDEX_URL`` when set (``https://download.pytorch.org/whl/cpu`` is
  the CPU-only build; plain PyPI gives the CUDA build on Linux, several GB). A torch outside
  the range is never replaced: the script stops with one line saying how to install one inside.
* the other requirements of ``pyproject.toml`` (and its ``--extra``): installed when missing or
  outside their bounds, with the installed torch pinned so that pip cannot swap it.
* ragged itself: installed in editable mode (``pip install --no-deps -e .``) only when
  ``import ragged`` does not work from outside the checkout; an install from another checkout
  is left alone (``scripts/main.sh`` and ``scripts/test.sh`` run this checkout regardless).
* pip's output is shown; a failed install stops with a non-zero exit and one line saying what
  failed.
* ``--only NAME...`` (``scripts/gpu_check.sh``): only these requirements, never torch and never
  ragged itself (the caller runs this checkout from ``PYTHONPATH``); ``--wheels DIR``: from the
  wheels in DIR first, offline (``pip --no-index --find-links DIR``), then what is still missing
  from the index (one try, a short timeout: a machine that reaches nothing answers in seconds).
  What stays missing is named in one line, exit status 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def requirements(extra: str | None) -> list[str]:
    """``dependencies`` (+ ``optional-dependencies[extra]``) of ``pyproject.toml``."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        text = f.read().decode()
    try:
        import tomllib

        project = tomllib.loads(text)["project"]
        reqs = list(project["dependencies"])
        if extra:
            reqs += project["optional-dependencies"][extra]
        return reqs
    except ImportError:  # Python 3.10: the two lists are one line each (keep them so)
        def listed(key):
            m = re.search(rf"^{key}\s*=\s*\[(.*?)\]", text, re.M)
            return re.findall(r'"([^"]+)"', m.group(1)) if m else []

        return listed("dependencies") + (listed(extra) if extra else [])


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(reqs: list[str]) -> tuple[list[tuple[str, str | None]], str | None]:
    """``([(requirement, installed version or None)], installed torch version or None)``
    for the requirements not met."""
    todo, torch_version = [], None
    for req in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(?:>=\s*([0-9.]+))?\s*(?:,\s*<\s*([0-9.]+))?\s*", req)
        if not m:
            raise SystemExit(f"error: scripts/install_missing.py cannot read the requirement {req!r} "
                             "(only 'name', 'name>=version' and 'name>=low,<high' are supported).")
        name, low, high = m.groups()
        have = _installed(name)
        if name == "torch":
            torch_version = have
        if have is None or (low and _version_tuple(have) < _version_tuple(low)) or (
                high and _version_tuple(have) >= _version_tuple(high)):
            todo.append((req, have))
    return todo, torch_version


def ragged_importable_outside() -> str | None:
    """Where ``import ragged`` resolves from a neutral directory, or None."""
    out = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('ragged'); "
                          "print(s.origin if s and s.origin else '')"],
                         cwd=tempfile.gettempdir(), capture_output=True, text=True)
    return out.stdout.strip() or None


def pip(args: list[str], what: str, *, required: bool = True) -> int:
    """``pip install args``; a failure stops the script with one line when ``required``, else
    its exit status is returned."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+ " + " ".join(cmd), flush=True)
    env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore")
    code = subprocess.call(cmd, env=env)
    if code and required:
        raise SystemExit(f"error: pip could not install {what} (exit status {code}); pip's output is above.")
    return code


def _name(req: str) -> str:
    return re.split(r"[<>=,\s]", req.strip(), maxsplit=1)[0]


def install_only(reqs: list[str], only: list[str], wheels: str | None) -> int:
    """``--only``: the requirements named in ``only`` that are missing, from ``wheels`` offline
    first, then from the index; never torch, never ragged. Returns 1 (and says what) if any
    stays missing."""
    known = {_name(r).lower(): r for r in reqs}
    unknown = [n for n in only if n.lower() not in known or n.lower() == "torch"]
    if unknown:
        raise SystemExit(f"error: --only takes requirements of pyproject.toml other than torch; not one: "
                         f"{', '.join(unknown)} (known: {', '.join(sorted(k for k in known if k != 'torch'))}).")
    picked = [known[n.lower()] for n in only]
    todo = [req for req, _ in missing(picked)[0]]
    torch_version = _installed("torch")
    attempts = ([["--no-index", "--find-links", wheels]] if wheels and os.path.isdir(wheels) else []) + [
        ["--retries", "0", "--timeout", "15"]]
    for extra in attempts:
        if not todo:
            break
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
            pin.write(f"torch=={torch_version}\n" if torch_version else "")  # pip may not swap the torch that is here
        try:
            pip([*todo, *extra, "-c", pin.name], ", ".join(todo), required=False)
        finally:
            os.unlink(pin.name)
        todo = [req for req, _ in missing(picked)[0]]
    if todo:
        print(f"still missing: {', '.join(todo)} (no wheel for it in {wheels or 'no --wheels folder'}, and the "
              "package index did not provide it)", flush=True)
        return 1
    return 0


def _has_nvidia_gpu() -> bool:
    return os.path.exists("/proc/driver/nvidia/gpus") and bool(os.listdir("/proc/driver/nvidia/gpus"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extra", choices=("test",), default=None, help="also the optional dependencies of this extra")
    ap.add_argument("--check", action="store_true", help="install nothing: list what is missing, exit 1 if any")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these requirements (not torch, not ragged itself)")
    ap.add_argument("--wheels", metavar="DIR", help="with --only: from the wheels in DIR first, offline")
    args = ap.parse_args(argv)
    if sys.version_info < (3, 10):
        raise SystemExit(f"error: ragged needs Python >= 3.10; {sys.executable} is {sys.version.split()[0]}.")
    if args.only:
        return install_only(requirements(args.extra), args.only, args.wheels)
    todo, torch_version = missing(requirements(args.extra))
    torch_todo = [req for req, _ in todo if req.startswith("torch")]
    others = [req for req, _ in todo if not req.startswith("torch")]
    location = ragged_importable_outside()
    ours = os.path.join(ROOT, "ragged", "__init__.py")
    if args.check:
        for req, have in todo:
            print(f"missing: {req}" + (f" (installed: {have})" if have else ""))
        if location is None:
            print("missing: ragged (not importable outside this checkout)")
        return 1 if todo or location is None else 0
    if torch_todo and torch_version is not None:
        raise SystemExit(
            f"error: torch {torch_version} is installed and ragged needs {torch_todo[0]}; this script does not "
            f"replace a torch you have. Install one inside the range yourself: {sys.executable} -m pip install "
            f"{TORCH_PIN} (CPU-only build: add --index-url {CPU_INDEX})."
        )
    if importlib.util.find_spec("pip") is None:
        if todo or location is None:
            raise SystemExit(f"error: {sys.executable} has no pip, and {', '.join(r for r, _ in todo) or 'ragged'} "
                             "must be installed; use a virtual environment (python3 -m venv) or install pip.")
    if torch_todo:
        index = os.environ.get("TORCH_INDEX_URL")
        if index:
            pip([TORCH_PIN, "--index-url", index], TORCH_PIN)
        else:
            if not _has_nvidia_gpu():
                print(f"note: no torch here, installing {TORCH_PIN}. No NVIDIA GPU is visible: from plain PyPI this is "
                      f"the CUDA build (several GB); for the CPU-only build interrupt and rerun with "
                      f"TORCH_INDEX_URL={CPU_INDEX}", flush=True)
            pip([TORCH_PIN], TORCH_PIN)
        torch_version = _installed("torch")
    if others:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
            pin.write(f"torch=={torch_version}\n")  # pip may not swap the torch that is here
        try:
            pip([*others, "-c", pin.name], ", ".join(others))
        finally:
            os.unlink(pin.name)
    if location is None:
        pip(["--no-deps", "-e", ROOT], "ragged (editable, from this checkout)")
    elif os.path.realpath(location) != os.path.realpath(ours):
        print(f"note: ragged is installed from {os.path.dirname(location)}; left as it is. The scripts run this "
              f"checkout ({ROOT}).", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
