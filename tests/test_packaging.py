"""Packaging as a new user meets it: a clone named ``ragged``, installed in editable mode, is
imported as the package even from the folder that holds the clone (where the clone folder
itself would otherwise be picked up as an empty namespace package)."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_folder_holding_a_clone_named_ragged_imports_the_package(tmp_path):
    clone = tmp_path / "ragged"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), clone / name)
    shutil.copytree(os.path.join(ROOT, "ragged"), clone / "ragged", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    # this interpreter's site-packages seen through a .pth file: torch & co. are there, and pip (the one
    # installed) builds with the installed setuptools. (--system-site-packages would give the base
    # interpreter's when this one is itself a venv, as in scripts/compat_check.sh.)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    inner = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    with open(os.path.join(inner, "_outer_site.pth"), "w") as f:
        f.write("".join(p + "\n" for p in outer))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(clone)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    probe = ("import importlib.util as u; s = u.find_spec('ragged'); print(s.origin)")
    for cwd in (tmp_path, clone, "/"):
        out = subprocess.run([python, "-c", probe], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == str(clone / "ragged" / "__init__.py"), (cwd, out.stdout, out.stderr)
    out = subprocess.run([python, "-c", "import ragged; print(callable(ragged.make_plan))"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr
    same = "import importlib.metadata as m, ragged; print(m.version('ragged-fsdp') == ragged.__version__)"
    out = subprocess.run([python, "-c", same], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr  # one version: pyproject reads ragged.__version__
