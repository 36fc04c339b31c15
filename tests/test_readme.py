"""README.md as a new user meets it: every ```python block runs as pasted into a file with plain
``python`` (and the block written for torchrun also runs under torchrun), every fenced block
says what it is, and every command the README quotes (in ```bash blocks and inline) exists
with the flags it shows: its argparse parser accepts them (the job itself is not run)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import shlex
import subprocess
import sys
import unittest.mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
LANGUAGES = {"python", "bash", "text"}


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def fenced_blocks():
    """``[(id, language, code)]``: the id names the section (``engine``, ``planning-2``)."""
    headings = [(m.start(), _slug(m.group(1))) for m in re.finditer(r"^#{2,4} (.+)$", README, re.M)]
    blocks, seen = [], {}
    for m in FENCE.finditer(README):
        section = [name for pos, name in headings if pos < m.start()][-1:] or ["top"]
        key = (section[0], m.group(1))
        seen[key] = seen.get(key, 0) + 1
        blocks.append((section[0] + ("" if seen[key] == 1 else f"-{seen[key]}"), m.group(1).strip(), m.group(2)))
    return blocks


PYTHON = [(name, code) for name, lang, code in fenced_blocks() if lang == "python"]
BASH = [(name, code) for name, lang, code in fenced_blocks() if lang == "bash"]
SLOW_BLOCKS = {"planning"}  # plans a whole GPT-OSS layer at m=256 and draws it


def _env():
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + (os.pathsep + path if path else ""))


def test_every_fenced_block_says_what_it_is():
    for name, lang, code in fenced_blocks():
        assert lang in LANGUAGES, f"README block in {name!r} is fenced as {lang!r}; use one of {sorted(LANGUAGES)}"
    assert len(PYTHON) >= 7 and BASH


@pytest.mark.parametrize("code", [pytest.param(code, id=name, marks=[pytest.mark.slow] if name in SLOW_BLOCKS else [])
                                  for name, code in PYTHON])
def test_python_block_runs_as_a_file(code, tmp_path):
    path = tmp_path / "block.py"
    path.write_text(code)
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


TORCHRUN = [(name, code) for name, code in PYTHON if "torchrun --nproc-per-node 2 this_file.py" in code]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("code", [pytest.param(code, id=name) for name, code in TORCHRUN])
def test_python_block_runs_under_torchrun(code, tmp_path):
    path = tmp_path / "block.py"
    path.write_text(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_a_block_is_written_for_torchrun():
    assert TORCHRUN, "the training-step block shows how its lines run under torchrun"


# ---- quoted commands --------------------------------------------------------------------
_ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _commands():
    """``[(where, argv, runnable)]`` of every command in ```bash blocks (runnable: the train
    job's cross-option rules apply too) and of inline spans that are whole commands (no
    ``...`` / ``[...]`` / ``a|b`` placeholders; prose may quote a command to show it refused)."""
    found = []
    for name, code in BASH:
        for line in code.splitlines():
            line = re.split(r" #| > | 2>| \| | && ", line)[0].strip()
            if line and not line.startswith("#"):
                found.append((line, line, True))
    for span in re.findall(r"`([^`\n]+)`", README.replace("```", "")):
        if re.match(r"^(?:[A-Z_]+=\S+ )*(?:python3?|bash|torchrun) ", span) and not re.search(r"\.\.\.|\[|\||<|>", span):
            found.append((span, span, False))
    return [(where, shlex.split(line), runnable) for where, line, runnable in found]


class _Parsed(Exception):
    pass


def _stop_after_parsing():
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    return unittest.mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args)


def _parse(parser, argv):
    try:
        return parser.parse_args(argv)
    except SystemExit as stop:  # --help exits 0: the flag exists
        if stop.code:
            raise
        return None


def _check_ragged(argv, runnable):
    from ragged._cli import build_parser

    args = _parse(build_parser(), argv)
    check = args and getattr(importlib.import_module(args.func.__module__), "check_args", None)
    if runnable and check is not None:
        check(args)


def _check_train(argv, env, runnable):
    from ragged.examples.train import build_parser, check_args

    args = _parse(build_parser(), argv)
    if runnable and args is not None:
        with unittest.mock.patch.dict(os.environ, env):
            check_args(args)


def _check_bench(script, argv):
    module = importlib.import_module("bench." + os.path.basename(script)[: -len(".py")])
    with _stop_after_parsing(), unittest.mock.patch.object(sys, "argv", [script, *argv]):
        with pytest.raises(_Parsed):
            module.main()


def check_command(argv, runnable=True) -> str:
    """Parses one quoted command with its own parser (``runnable``: and checks the train job's
    rules across options); returns what kind of command it was."""
    env = {}
    while argv and _ENV_ASSIGN.match(argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    if argv[:1] == ["flock"]:
        argv = argv[2:]
    prog, rest = argv[0], argv[1:]
    if prog in ("python", "python3") and rest[:2] == ["-m", "ragged"]:
        _check_ragged(rest[2:], runnable)
        return "ragged"
    if prog in ("python", "python3") and rest[:1] and rest[0].startswith("bench/"):
        assert os.path.exists(os.path.join(ROOT, rest[0])), rest[0]
        _check_bench(rest[0], rest[1:])
        return "bench"
    if prog == "bash" and rest[:1] == ["scripts/main.sh"]:
        _check_ragged(["train", "--nproc-per-node", env.get("NPROC", "2"), *rest[1:]], runnable)
        return "main.sh"
    if prog == "bash" and rest[:1] and rest[0].startswith("scripts/"):
        assert os.path.exists(os.path.join(ROOT, rest[0])), rest[0]
        return "script"
    if prog == "torchrun" or rest[:2] == ["-m", "torch.distributed.run"]:
        launcher = rest if prog == "torchrun" else rest[2:]
        if "-m" not in launcher:  # torchrun some_file.py
            return "other"
        i = launcher.index("-m")
        assert launcher[i + 1] == "ragged.examples.train", argv
        nproc = launcher[launcher.index("--nproc-per-node") + 1] if "--nproc-per-node" in launcher else "1"
        nproc = nproc if nproc.isdigit() else "2"
        _check_train(launcher[i + 2:], dict(env, RANK="0", WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc), runnable)
        return "torchrun"
    return "other"


COMMANDS = _commands()


@pytest.mark.parametrize("argv, runnable", [pytest.param(argv, runnable, id=where[:70])
                                            for where, argv, runnable in COMMANDS])
def test_quoted_command_parses(argv, runnable):
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        check_command(list(argv), runnable)


def test_the_commands_are_found():
    kinds = {}
    for _, argv, runnable in COMMANDS:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            kind = check_command(list(argv), runnable)
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds.get("ragged", 0) >= 5 and kinds.get("bench", 0) >= 10 and kinds.get("main.sh", 0) >= 1, kinds


def test_a_wrong_flag_is_caught():
    """The check can fail: a flag no parser knows, or a value the train job refuses."""
    with pytest.raises(SystemExit):
        check_command(["python3", "bench/step.py", "--no-such-flag"])
    with pytest.raises(SystemExit):
        check_command(["python", "-m", "ragged", "plan", "--model", "llama3-70b", "-m", "8", "--granularity", "rows:0"])
    from ragged._cli import UsageError

    with pytest.raises(UsageError):
        check_command(["NPROC=3", "bash", "scripts/main.sh"])


# ---- the package map and the glossary match the code -------------------------------------------
def _section(title: str) -> str:
    start = README.index(f"### {title}\n")
    return README[start : README.index("\n#", start + 4)]


def _map_rows():
    """``{"ragged/spec": "its text", ...}`` from the package map table."""
    rows = {}
    for line in _section("Package map").splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) >= 2:
            for where in re.findall(r"`([^`]+)`", cells[0]):
                rows[where] = cells[1]
    return rows


def test_package_map_names_every_package_and_module():
    """Every package and module of ragged/ is in the map, in its package's row, and every file the
    map names exists (a new module, or a moved one, must update the map)."""
    import fnmatch

    rows = _map_rows()
    for where in rows:
        assert os.path.exists(os.path.join(ROOT, where)), f"the package map names {where}, which does not exist"
    package_dir = os.path.join(ROOT, "ragged")
    for entry in sorted(os.listdir(package_dir)):
        path = os.path.join(package_dir, entry)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
            assert f"ragged/{entry}" in rows, f"ragged/{entry} is not in the package map"
            named = re.findall(r"`([\w*]+\.py)`", rows[f"ragged/{entry}"])
            for module in sorted(os.listdir(path)):
                if module.endswith(".py") and module != "__init__.py":
                    assert any(fnmatch.fnmatch(module, n) for n in named), (
                        f"ragged/{entry}/{module} is not named in the package map's ragged/{entry} row")
            for n in named:
                assert any(fnmatch.fnmatch(m, n) for m in os.listdir(path)), f"ragged/{entry} has no {n}"
        elif entry.endswith(".py") and entry not in ("__init__.py", "__main__.py"):
            text = " ".join(f"{k} {v}" for k, v in rows.items())
            assert f"ragged/{entry}" in text or f"`{entry}`" in text, f"ragged/{entry} is not in the package map"


def _resolve(dotted: str):
    import ragged

    parts = dotted.split(".")
    if parts[0] in ("rg", "ragged"):
        obj, rest = ragged, parts[1:]
        while rest and isinstance(obj, type(ragged)) and not hasattr(obj, rest[0]):
            obj = importlib.import_module(f"{obj.__name__}.{rest[0]}")  # a private module named in full
            rest = rest[1:]
    else:  # Type.attribute: the type is public in ragged, ragged.spec, fsdp or parallel
        homes = [ragged, ragged.spec, ragged.fsdp, ragged.parallel]
        obj = next((getattr(h, parts[0]) for h in homes if hasattr(h, parts[0])), None)
        assert obj is not None, f"the glossary names {dotted}: no public type {parts[0]}"
        rest = parts[1:]
    for name in rest:
        fields = {f.name for f in getattr(obj, "__dataclass_fields__", {}).values()}
        assert hasattr(obj, name) or name in fields, f"the glossary names {dotted}: {obj!r} has no {name!r}"
        obj = getattr(obj, name, None)
    return obj


def test_glossary_names_exist():
    """Every name the glossary gives a word (new and old) is real: public names resolve, and the
    renamed ones still exist."""
    names = set()
    for line in _section("Glossary").splitlines()[4:]:
        for cell in line.split(" | ")[2:]:
            for code in re.findall(r"`([^`]+)`", cell):
                head = re.split(r"[(\[ ]", code, maxsplit=1)[0]
                if re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", head):
                    names.add(head)
    assert len(names) > 30, names
    for name in sorted(names):
        _resolve(name)
