"""What ``import ragged`` costs over ``import torch``, and what ``python -m ragged --help`` takes.

Each repeat starts fresh interpreters (bytecode cached, as an installed package has it), in turn (the order alternating between repeats):
``import torch`` alone, ``import ragged`` (which imports torch), each timed inside the interpreter
from before the import to after it, and ``python -m ragged --help`` timed from outside (interpreter
start included) next to ``python -c "import torch"`` timed the same way. The figure that matters is
the paired one: per repeat, ragged's import minus torch's, measured seconds apart on the same
machine; reported as the median over repeats, with each side's median. Also listed: which heavy
torch packages ``import ragged`` leaves unloaded (they are imported when used: ``torch.compile``'s
dynamo and inductor, DTensor, ``torch.distributed.checkpoint``; transformers and safetensors too).

Usage (about a minute)::

    python3 bench/import_time.py --repeats 15
    python3 bench/report.py record import-time -- python3 bench/import_time.py --repeats 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: Loaded only when used: ``import ragged`` must leave them out (tests/test_import.py checks the first three).
LAZY = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.distributed.checkpoint", "transformers",
        "safetensors")
_TIMED = ("import sys, time; t = time.perf_counter(); import {module}; seconds = time.perf_counter() - t; "
          "print(seconds, *[name for name in {lazy!r} if name in sys.modules])")


def _env() -> dict:
    """This checkout first on the path; bytecode written and read (``__pycache__``, git-ignored), as
    an installed package has it: without it every module is compiled at every import."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def timed_import(module: str) -> tuple[float, list[str]]:
    """Seconds ``import module`` takes in a fresh interpreter, and which of :data:`LAZY` it loaded."""
    out = subprocess.run([sys.executable, "-c", _TIMED.format(module=module, lazy=LAZY)], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), out[1:]


def wall(argv: list[str]) -> float:
    """Wall seconds of ``python argv`` (interpreter start included)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=_env(), cwd=ROOT, capture_output=True, check=True)
    return time.perf_counter() - start


def run(repeats: int) -> dict:
    """Every repeat: both imports and both walls, the order alternating; plain values."""
    samples = {"torch": [], "ragged": [], "torch_wall": [], "help_wall": []}
    loaded = set()
    wall(["-m", "ragged", "--help"])  # warm-up: writes the bytecode of every module --help imports
    for r in range(repeats):
        for which in (("torch", "ragged") if r % 2 == 0 else ("ragged", "torch")):
            seconds, lazy = timed_import(which)
            samples[which].append(seconds)
            loaded.update(lazy if which == "ragged" else ())
        for which in (("torch_wall", "help_wall") if r % 2 == 0 else ("help_wall", "torch_wall")):
            samples[which].append(wall(["-c", "import torch"] if which == "torch_wall" else ["-m", "ragged", "--help"]))
    paired = [g - t for g, t in zip(samples["ragged"], samples["torch"])]
    help_over = [h - t for h, t in zip(samples["help_wall"], samples["torch_wall"])]
    return {"repeats": repeats, "samples": samples,
            "median": {k: statistics.median(v) for k, v in samples.items()},
            "ragged_over_torch": statistics.median(paired), "help_over_torch": statistics.median(help_over),
            "lazy_loaded_by_import_ragged": sorted(loaded), "lazy_checked": list(LAZY)}


def markdown(data: dict) -> str:
    """The result as one markdown table (docs/performance.md)."""
    m = data["median"]
    rows = [("`import torch`", m["torch"], ""), ("`import ragged`", m["ragged"], data["ragged_over_torch"]),
            ("`python -c 'import torch'` (wall)", m["torch_wall"], ""),
            ("`python -m ragged --help` (wall)", m["help_wall"], data["help_over_torch"])]
    lines = [f"| median of {data['repeats']} fresh interpreters | seconds | paired: over torch's, seconds |",
             "|---|---|---|"]
    lines += [f"| {what} | {s:.2f} | {'' if over == '' else f'{over:+.2f}'} |" for what, s, over in rows]
    loaded = ", ".join(data["lazy_loaded_by_import_ragged"]) or "none"
    lines.append(f"| loaded by `import ragged` of {', '.join(f'`{n}`' for n in data['lazy_checked'])} | {loaded} | |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from rich.table import Table

    from ragged._console import console

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    data = run(args.repeats)
    m = data["median"]
    table = Table(title=f"import time, median of {args.repeats} fresh interpreters (paired: the same repeat)")
    for col in ("what", "seconds", "over torch's (paired)"):
        table.add_column(col, justify="right")
    table.add_row("import torch", f"{m['torch']:.2f}", "")
    table.add_row("import ragged", f"{m['ragged']:.2f}", f"{data['ragged_over_torch']:+.2f}")
    table.add_row("python -c 'import torch' (wall)", f"{m['torch_wall']:.2f}", "")
    table.add_row("python -m ragged --help (wall)", f"{m['help_wall']:.2f}", f"{data['help_over_torch']:+.2f}")
    out = console()
    out.print(table)
    out.print(f"loaded by import ragged (of {', '.join(LAZY)}): {', '.join(data['lazy_loaded_by_import_ragged']) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
