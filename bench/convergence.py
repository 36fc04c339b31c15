"""The example GPT trained with AdamW, SOAP and Shampoo: steps to reach AdamW's final loss.

Each optimizer trains the same model on the same data from the same weights (``python -m ragged
train``: the main job, 2 gloo ranks, its warmup + cosine schedule and weight decay; SOAP and
Shampoo precondition every matrix in ``Blocks(b, b)`` and give norms and embeddings AdamW, see
``ragged/examples/train.py``). The target is AdamW's final loss (the mean of its last ``--window``
steps); a run reaches it at the first step whose mean loss over the ``--window`` steps ending
there is at or below the target. A benchmark, not a test: one seed, one task.

Usage::

    python3 bench/convergence.py --steps 300                  # ~15 min on a quiet 2-core machine
    python3 bench/convergence.py --steps 20 --window 5         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPTIMIZERS = ("adamw", "soap", "shampoo")


def train(optimizer: str, args, out: str) -> list[float]:
    """One run of the main job; its per-step losses."""
    cmd = [sys.executable, "-m", "ragged", "train", "--nproc-per-node", str(args.nproc), "--steps", str(args.steps),
           "--optimizer", optimizer, "--precondition-block", str(args.block),
           "--precondition-frequency", str(args.frequency), "--seed", str(args.seed), "--quiet", "--json", out,
           *args.train_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, cwd=ROOT, env=env, check=False, stdout=subprocess.DEVNULL)  # exit 1: "not learnt" is a result
    with open(out) as f:
        return [h["loss"] for h in json.load(f)["history"]]


def reach(losses: list[float], target: float, window: int) -> int | None:
    """The first step (1-based) whose trailing ``window``-step mean loss is at or below ``target``."""
    for s in range(window, len(losses) + 1):
        if sum(losses[s - window:s]) / window <= target:
            return s
    return None


def markdown(result: dict) -> str:
    lines = [f"| optimizer | final loss (mean of the last {result['window']}) | steps to AdamW's final loss "
             f"({result['target']:.4f}) | vs AdamW |", "|---|---|---|---|"]
    base = result["runs"]["adamw"]["reach"]
    for name, run in result["runs"].items():
        got = run["reach"]
        lines.append(f"| {name} | {run['final']:.4f} | {got if got else 'not reached'} | "
                     f"{f'{got / base:.2f}x' if got and base else '-'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--frequency", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("train_args", nargs="*", help="more options for python -m ragged train (after --)")
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in OPTIMIZERS:
            runs[name] = {"losses": train(name, args, os.path.join(tmp, f"{name}.json"))}
    w = args.window
    for run in runs.values():
        run["final"] = sum(run["losses"][-w:]) / w
    target = runs["adamw"]["final"]
    for run in runs.values():
        run["reach"] = reach(run["losses"], target, w)
    result = {"command": " ".join(["python3", *sys.argv]), "steps": args.steps, "window": w, "block": args.block,
              "frequency": args.frequency, "target": target, "runs": runs}
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
