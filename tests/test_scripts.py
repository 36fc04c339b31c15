"""scripts/: install only what is missing, never replace a torch that is there, fail loudly;
the main job's script refuses a bad value before anything starts."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def installer(monkeypatch):
    spec = importlib.util.spec_from_file_location("install_missing", os.path.join(ROOT, "scripts", "install_missing.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    monkeypatch.setattr(module, "pip", lambda args, what, **kw: calls.append(args))
    monkeypatch.setattr(module, "ragged_importable_outside", lambda: os.path.join(ROOT, "ragged", "__init__.py"))
    module.calls = calls
    return module


def test_reads_the_requirements_of_pyproject(installer):
    runtime, test = installer.requirements(None), installer.requirements("test")
    assert "torch>=2.11,<2.15" in runtime and set(runtime) < set(test) and "transformers>=5" in test


def test_nothing_missing_installs_nothing(installer, monkeypatch):
    monkeypatch.setattr(installer, "requirements", lambda extra: ["torch>=2.11,<2.15", "optree>=0.13"])
    assert installer.main([]) == 0 and installer.calls == []


@pytest.mark.parametrize("torch_version", ["2.10.2", "2.15.0", "3.0.0+cu130"])
def test_a_torch_outside_the_range_is_never_replaced(installer, monkeypatch, torch_version):
    real = installer._installed
    monkeypatch.setattr(installer, "_installed", lambda name: torch_version if name == "torch" else real(name))
    with pytest.raises(SystemExit) as info:
        installer.main([])
    assert str(info.value) == (
        f"error: torch {torch_version} is installed and ragged needs torch>=2.11,<2.15; this script does not replace "
        f"a torch you have. Install one inside the range yourself: {sys.executable} -m pip install torch==2.13.0 "
        "(CPU-only build: add --index-url https://download.pytorch.org/whl/cpu).")
    assert installer.calls == []


@pytest.mark.parametrize("torch_version", ["2.11.0", "2.12.1", "2.14.1+cu130"])
def test_a_torch_inside_the_range_is_kept(installer, monkeypatch, torch_version):
    real = installer._installed
    monkeypatch.setattr(installer, "_installed", lambda name: torch_version if name == "torch" else real(name))
    monkeypatch.setattr(installer, "requirements", lambda extra: ["torch>=2.11,<2.15", "optree>=0.13"])
    assert installer.main([]) == 0 and installer.calls == []


def test_missing_packages_are_installed_with_the_torch_pinned(installer, monkeypatch):
    pins = []
    monkeypatch.setattr(installer, "requirements", lambda extra: ["torch>=2.11,<2.15", "no-such-package-for-ragged>=1"])
    monkeypatch.setattr(installer, "pip", lambda args, what: (installer.calls.append(args),
                                                              pins.append(open(args[args.index("-c") + 1]).read())))
    assert installer.main([]) == 0
    assert installer.calls == [["no-such-package-for-ragged>=1", "-c", installer.calls[0][2]]]
    assert pins == [f"torch=={importlib.metadata.version('torch')}\n"]


def test_no_torch_installs_the_pin_from_the_chosen_index(installer, monkeypatch):
    monkeypatch.setattr(installer, "requirements", lambda extra: ["torch>=2.11,<2.15"])
    monkeypatch.setattr(installer, "_installed", lambda name: None)
    monkeypatch.setenv("TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
    assert installer.main([]) == 0
    assert installer.calls == [["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]]


def test_a_failed_install_stops_with_one_line(installer, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("install_missing_real", os.path.join(ROOT, "scripts", "install_missing.py"))
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)
    monkeypatch.setattr(real.subprocess, "call", lambda cmd, env: 1)
    with pytest.raises(SystemExit) as info:
        real.pip(["no-such-package-for-ragged"], "no-such-package-for-ragged")
    assert str(info.value) == ("error: pip could not install no-such-package-for-ragged (exit status 1); pip's output "
                               "is above.")


def test_check_lists_what_is_missing(installer, monkeypatch, capsys):
    monkeypatch.setattr(installer, "requirements", lambda extra: ["torch>=2.11,<2.15", "no-such-package-for-ragged>=1"])
    assert installer.main(["--check"]) == 1
    assert capsys.readouterr().out == "missing: no-such-package-for-ragged>=1\n" and installer.calls == []


def test_only_installs_the_named_missing_ones_from_the_wheels_first(installer, monkeypatch, tmp_path, capsys):
    """``--only`` (scripts/gpu_check.sh): what is missing of the names given, from the wheels
    offline, then the index; never torch, never ragged; what stays missing is named, exit 1."""
    monkeypatch.setattr(installer, "requirements", lambda extra: ["torch>=2.11,<2.15", "optree>=0.13",
                                                                  "no-such-package-for-ragged>=1", "pytest>=8"])
    monkeypatch.setattr(installer, "ragged_importable_outside", lambda: None)  # would be installed without --only
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    assert installer.main(["--only", "optree", "no-such-package-for-ragged", "--wheels", str(wheels)]) == 1
    offline, online = installer.calls
    assert offline[:4] == ["no-such-package-for-ragged>=1", "--no-index", "--find-links", str(wheels)]
    assert online[:5] == ["no-such-package-for-ragged>=1", "--retries", "0", "--timeout", "15"]
    assert "still missing: no-such-package-for-ragged>=1" in capsys.readouterr().out
    installer.calls.clear()
    assert installer.main(["--only", "optree", "pytest"]) == 0 and installer.calls == []  # nothing missing
    with pytest.raises(SystemExit, match="--only takes requirements of pyproject.toml other than torch; not one: torch"):
        installer.main(["--only", "torch"])


def test_main_sh_refuses_a_bad_value_before_training():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(["bash", "scripts/main.sh", "--steps", "0"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("python -m ragged train: error: argument --steps: must be >= 1, "
                                                     "got 0 (see python -m ragged train --help)")


# an import hook at the start of every Python process whose path holds its folder: these modules
# are missing (a machine that has not got them)
_BLOCK = """import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by a test)", name=name)
sys.meta_path.insert(0, _Block())
"""


def _without(tmp_path, *modules) -> dict:
    """An environment whose Python processes cannot import ``modules``."""
    folder = tmp_path / "without"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(_BLOCK.format(BLOCKED=set(modules)))
    return dict(os.environ, PYTHON=sys.executable, PYTHONPATH=os.pathsep.join([str(folder), ROOT]))


def test_gpu_check_skips_each_stage_whose_imports_are_missing(tmp_path):
    """Without optree (and no wheel of it, no index reached: it is "installed", only hidden) every
    stage is skipped with one line naming it; nothing fails, no report is made, and the exit
    status says that nothing ran."""
    out = tmp_path / "gpu"
    env = dict(_without(tmp_path, "optree"), BUDGET="600")
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run", str(out)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 3 and "gpu_check.sh: no stage ran" in run.stderr, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    stages = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == ["cuda-tests", "cuda-2.11-path", "step-fp32", "optim-8bit", "memory",
                                            "calibrate", "report"], stages
    assert all(s["rc"] == 0 and s["skipped"].startswith("it imports optree, which ") for s in stages), stages
    assert "== cuda-tests: skipped, it imports optree, which" in run.stdout


@pytest.mark.slow
def test_gpu_check_dry_run_starts_every_piece(tmp_path):
    """scripts/gpu_check.sh --dry-run on the CPU, on a Python without transformers, peft and the
    notebook packages (which it does not install): the CUDA tests are collected (and skip), also on
    torch 2.11's paths, the step bench (NCCL's shape against FSDP2 reported first), the 8-bit
    optimizer step, the memory harness, the calibration and the report each start and finish, the
    report says what one GPU cannot test and what stands in for it, and what comes back fits the
    device tool's limit (at most 8 files in OUTDIR, the logs packed)."""
    import json
    import tarfile

    out = tmp_path / "gpu"
    env = _without(tmp_path, "transformers", "peft", "nbclient", "nbformat", "ipykernel", "pytorch_optimizer")
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run", str(out)],
                         capture_output=True, text=True, timeout=1500, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["env.txt", "gpu-check.tar.gz", "stages.jsonl", "summary.json",
                                                      "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["cuda-tests", "cuda-2.11-path", "step-fp32", "optim-8bit",
                                                       "memory", "calibrate"]
    assert all(s["rc"] == 0 and "skipped" not in s for s in summary["stages"]), summary["stages"]
    assert summary["cuda_tests"]["tests"] >= 5 and summary["step"] and summary["memory"] and summary["calibrate"]
    assert summary["cuda_tests_2_11_path"]["tests"] >= 5
    assert "tests/distributed/test_nccl_rules_gloo.py" in summary["one_gpu_cannot"]
    assert "rg.optim.adamw_8bit (donate=True)" in [r["method"] for r in summary["optim"]["rows"]]
    md = (out / "summary.md").read_text()
    assert summary["one_gpu_cannot"] in md.splitlines()
    assert "## Training step" in md and "fake process group" in md and "## One collective call at W=1" in md
    # NCCL's shape against FSDP2 comes first: on gloo the dry run's --nccl-shaped method, as ragged on NCCL
    assert summary["nccl_shape"][0].startswith("NCCL's shape (ragged-nccl-shaped: native collectives"), summary["nccl_shape"]
    assert "## NCCL's shape against FSDP2" in md and md.index("NCCL's shape against FSDP2") < md.index("## Training step")
    assert "## One optimizer step: 8-bit AdamW against torch's AdamW" in md
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"cuda-tests.log", "cuda-tests.xml", "step.jsonl", "optim-step.json", "memory.jsonl", "calibrate.jsonl",
            "summary.md"} <= names
    assert "torch " in (out / "env.txt").read_text()
