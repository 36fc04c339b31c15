"""README.md and every docs/*.md page as a new user meets them: every ```python block runs as
pasted into a file with plain ``python`` (and the block written for torchrun also runs under
torchrun), every fenced block says what it is, every command they quote (in ```bash blocks and
inline) exists with the flags it shows: its argparse parser accepts them (the job itself is not
run), and every ``[Note: title]`` they point to is in the file they name."""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import os
import re
import shlex
import subprocess
import sys
import unittest.mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


PAGES = {rel: _read(rel) for rel in ["README.md", *sorted(os.path.relpath(p, ROOT)
                                                          for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]}
README = PAGES["README.md"]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
LANGUAGES = {"python", "bash", "text"}


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def fenced_blocks():
    """``[(id, language, code)]`` over every page: the id names the page and the section
    (``README.md:plan-shard-gather``, ``docs/engine.md:engine-2``)."""
    blocks = []
    for page, text in PAGES.items():
        fences = [m.span() for m in FENCE.finditer(text)]
        headings = [(m.start(), _slug(m.group(1))) for m in re.finditer(r"^#{1,4} (.+)$", text, re.M)
                    if not any(a <= m.start() < b for a, b in fences)]  # a comment in a block is no heading
        seen = {}
        for m in FENCE.finditer(text):
            section = [name for pos, name in headings if pos < m.start()][-1:] or ["top"]
            key = (section[0], m.group(1))
            seen[key] = seen.get(key, 0) + 1
            name = f"{page}:{section[0]}" + ("" if seen[key] == 1 else f"-{seen[key]}")
            blocks.append((name, m.group(1).strip(), m.group(2)))
    return blocks


PYTHON = [(name, code) for name, lang, code in fenced_blocks() if lang == "python"]
BASH = [(name, code) for name, lang, code in fenced_blocks() if lang == "bash"]
SLOW_BLOCKS = {"docs/planning.md:planning"}  # plans a whole DeepSeek-V3 layer at m=256 and draws it


def _env():
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + (os.pathsep + path if path else ""))


def test_every_fenced_block_says_what_it_is():
    for name, lang, code in fenced_blocks():
        assert lang in LANGUAGES, f"block {name!r} is fenced as {lang!r}; use one of {sorted(LANGUAGES)}"
    assert len(PYTHON) >= 7 and BASH
    assert sum(name.startswith("README.md:") for name, _ in PYTHON) == 4, "the README shows four examples"


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
    for span in (span for text in PAGES.values() for span in re.findall(r"`([^`\n]+)`", text.replace("```", ""))):
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
    from ragged.__main__ import build_parser

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
DESIGN = PAGES["docs/design.md"]


def _section(title: str, text: str = DESIGN) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n#", start + 4)
    return text[start : end if end >= 0 else len(text)]


def _map_rows(text: str = DESIGN):
    """``{"ragged/spec": "its text", ...}`` from a package map table."""
    rows = {}
    for line in _section("Package map", text).splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) >= 2:
            for where in re.findall(r"`([^`]+)`", cells[0]):
                rows[where] = cells[1]
    return rows


def test_readme_package_map_names_every_package():
    """The README's compact map has a row for every package of ragged/, and every path it names exists."""
    rows = _map_rows(README)
    for where in rows:
        assert os.path.exists(os.path.join(ROOT, where)), f"the README's package map names {where}, which does not exist"
    package_dir = os.path.join(ROOT, "ragged")
    for entry in sorted(os.listdir(package_dir)):
        if os.path.exists(os.path.join(package_dir, entry, "__init__.py")):
            assert f"ragged/{entry}" in rows, f"ragged/{entry} is not in the README's package map"


def test_package_map_names_every_package_and_module():
    """Every package and module of ragged/ is in docs/design.md's map, in its package's row, and
    every file the map names exists (a new module, or a moved one, must update the map)."""
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
    """Every name docs/design.md's glossary gives a word is real."""
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


# ---- pointers, layout and the lab-notebook rule ------------------------------------------------
_NOTE_AFTER = re.compile(r"\[Note: ([^\]]+)\]`?(?: in | \()`(ragged/[\w/]+\.py)`")  # [Note: x] in `file`
_NOTE_BEFORE = re.compile(r"\(`(ragged/[\w/]+\.py)`, \[Note: ([^\]]+)\]")  # (`file`, [Note: x])


def _flat(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text)  # a pointer may wrap across lines


def _note_pointers():
    """``[(page, title, file)]`` for every ``[Note: title] in `ragged/...py``` and ``(`ragged/...py`, [Note: title])``."""
    found = []
    for page, text in PAGES.items():
        found += [(page, m.group(1), m.group(2)) for m in _NOTE_AFTER.finditer(_flat(text))]
        found += [(page, m.group(2), m.group(1)) for m in _NOTE_BEFORE.finditer(_flat(text))]
    return found


def _notes_defined(rel: str) -> set[str]:
    """The Notes a module defines: the title alone on its line, or opening a comment or a
    docstring (a reference that wraps to a line's start runs on with text)."""
    text = _read(rel)
    return (set(re.findall(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$", text, re.M))
            | set(re.findall(r'^\s*(?:#|""")\s*\[Note: ([^\]]+)\]', text, re.M)))


def test_every_note_pointer_names_a_note_in_that_file():
    pointers = _note_pointers()
    assert len(pointers) >= 20, pointers
    for page, title, rel in pointers:
        assert os.path.isfile(os.path.join(ROOT, rel)), f"{page} points to [Note: {title}] in {rel}, which does not exist"
        assert title in _notes_defined(rel), f"{page} points to [Note: {title}] in {rel}, which does not define it"


def test_every_note_named_exists_somewhere():
    """A Note named without a file is still defined by some module of ragged/."""
    defined = set().union(*(_notes_defined(os.path.relpath(p, ROOT))
                            for p in glob.glob(os.path.join(ROOT, "ragged", "**", "*.py"), recursive=True)))
    for page, text in PAGES.items():
        for title in re.findall(r"\[Note: ([^\]]+)\]", _flat(text)):
            assert title in defined, f"{page} names [Note: {title}], which no module of ragged/ defines"


def test_readme_is_read_in_ten_minutes():
    assert README.count("\n") <= 300, f"README.md has {README.count(chr(10))} lines; move detail to docs/"


def test_readme_commands_are_what_ci_runs():
    """The README's two commands are the main job and the test suite, and the test suite is what
    .ci/run executes."""
    block = next(code for name, code in BASH if name.startswith("README.md:the-two-commands"))
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["bash scripts/main.sh", "bash scripts/test.sh"], commands
    ci = [line.strip() for line in _read(".ci/run").splitlines() if line.strip() and not line.startswith("#")]
    assert "exec bash scripts/test.sh" in ci, ci


def test_no_lab_notebook_in_the_docs():
    """No clock times, load averages or issue numbers in README or docs prose (dates belong to the
    generated performance tables' headers)."""
    for page, text in PAGES.items():
        for pattern in (r"\b\d\d:\d\d UTC\b", r"load average", r"\bissue[ -]\d+", r"#\d{2,}\b"):
            hit = re.search(pattern, text, re.I)
            assert hit is None, f"{page}: {hit.group(0)!r} at {text[:hit.start()].count(chr(10)) + 1}"


def test_the_docs_link_to_pages_that_exist():
    """Every relative link between README and docs resolves (api.md and gpu.md are generated or
    written elsewhere and may not exist in every checkout yet)."""
    for page, text in PAGES.items():
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
            if os.path.basename(path) in ("api.md", "gpu.md"):
                continue
            assert os.path.isfile(path), f"{page} links to {target}, which does not exist"
