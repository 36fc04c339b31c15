"""Collects what ``scripts/gpu_check.sh`` wrote under OUTDIR into ``summary.json`` and ``summary.md``:
the machine, each stage's exit status and time (or why it was skipped), what one GPU cannot test and
the emulated test that stands in for it (one line), NCCL's shape against FSDP2 (one line per step run:
ragged over native collectives + the deferred ledger, the default on NCCL, ``--nccl-shaped`` on the
dry run's gloo), the CUDA tests' outcome, the step tables (``bench/step.py --json``), the optimizer step of 8-bit AdamW against torch's AdamW
(``bench/optim.py --json``), the memory table (``bench/memory.py --json``) and the per-call
cost of the collectives at W=1 (``bench/calibrate.py --json``).

    python3 scripts/gpu_report.py OUTDIR [--dry-run 0|1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# what one GPU cannot test, and what stands in for it (the lead's emulation of NCCL's rules on gloo)
ONE_GPU_CANNOT = (
    "One GPU cannot test NCCL across ranks (NCCL refuses two ranks on one device): a timed wait on unfinished work, "
    "device progress that differs between ranks, the same collectives in the same order on every rank and "
    "communicator (HSDP); NCCL's rules emulated on gloo stand in for it, on every commit: "
    "tests/distributed/test_nccl_rules_gloo.py.")


def _lines(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _json(path):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _tests(path):
    """``{tests, failures, errors, skipped}`` and the names of the tests that did not pass, from a JUnit file."""
    if not os.path.isfile(path):
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    bad = [f"{c.get('classname')}.{c.get('name')}" for c in suite.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "not_passed": bad}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--dry-run", type=int, default=0)
    args = ap.parse_args(argv)
    import torch

    from bench.memory import markdown as memory_markdown
    from bench.memory import row
    from bench.report import optim_tables
    from bench.step import markdown as step_markdown
    from bench.step import nccl_shape_line

    out = args.outdir
    smi = ""
    if os.path.isfile(os.path.join(out, "nvidia-smi.txt")):
        with open(os.path.join(out, "nvidia-smi.txt")) as f:
            smi = f.read()
    machine = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dry_run": bool(args.dry_run),
    }
    stages = _lines(os.path.join(out, "stages.jsonl"))
    steps = _lines(os.path.join(out, "step.jsonl"))
    cells = _lines(os.path.join(out, "memory.jsonl"))
    calls = _lines(os.path.join(out, "calibrate.jsonl"))
    tests = _tests(os.path.join(out, "cuda-tests.xml"))
    tests_211 = _tests(os.path.join(out, "cuda-2.11-path.xml"))
    optim = _json(os.path.join(out, "optim-step.json"))
    nccl_shape = [nccl_shape_line(s) for s in steps]
    summary = {"machine": machine, "stages": stages, "one_gpu_cannot": ONE_GPU_CANNOT, "cuda_tests": tests,
               "cuda_tests_2_11_path": tests_211, "nccl_shape": nccl_shape, "step": steps, "optim": optim,
               "memory": cells, "calibrate": calls}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    md = [f"# gpu_check {'(dry run, CPU) ' if args.dry_run else ''}{machine['date_utc']}", "",
          f"Machine: {machine['gpu'] or 'no GPU'}, torch {machine['torch']} (CUDA {machine['cuda']}), Python "
          f"{machine['python']}, host `{machine['host']}`.", "", ONE_GPU_CANNOT, "",
          "| stage | exit status | seconds |", "|---|---|---|"]
    md += [f"| {s['stage']} | {'skipped: ' + s['skipped'] if 'skipped' in s else s['rc']} | {s['seconds']} |"
           for s in stages]
    if nccl_shape:
        md += ["", "## NCCL's shape against FSDP2", "", *[f"- {line}" for line in nccl_shape]]
    for name, t in (("CUDA tests", tests), ("CUDA tests on torch 2.11's paths", tests_211)):
        if t is not None:
            md += ["", f"{name}: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, "
                       f"{t['skipped']} skipped" + (f"; not passed: {', '.join(t['not_passed'])}" if t["not_passed"] else "")]
    for s in steps:
        md += ["", f"## Training step ({s.get('backend', '?')})", "", step_markdown(s)]
    if optim is not None:
        md += ["", f"## One optimizer step: 8-bit AdamW against torch's AdamW ({optim['device']})", "",
               optim_tables({"data": optim})[0]]
    if cells:
        rows = [row(c["model"], c["checkpointing"], c, c.get("units", "default")) for c in cells]
        md += ["", "## One rank's peak memory, fake process group", "", memory_markdown(rows)]
    if calls:
        md += ["", "## One collective call at W=1 (bench/calibrate.py; no link is crossed)", "",
               "| backend | collective | MiB | raw us | ragged us |", "|---|---|---|---|---|"]
        md += [f"| {c['backend']} | {c['collective']} | {c['mib']} | {c['raw_us']:.0f} | {c['ragged_us']:.0f} |"
               for c in calls]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {os.path.join(out, 'summary.json')} and summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
