"""Checkpointing every step: saving in the background against no checkpoint and against blocking
saves, side by side in one run.

The example GPT (``ragged.examples.gpt``, ``--model`` of ``bench/step.py``) trained with
``rg.fsdp.make_step`` and AdamW (``donate=True``) on W gloo ranks, ``--steps`` steps per method and
repeat:

* ``none``: the steps alone;
* ``background``: ``rg.checkpoint.save(path, state, comm, overwrite=True, blocking=False)`` after
  every step (each call publishes the save before it; ``result()`` after the last step);
* ``blocking``: ``rg.checkpoint.save(path, state, comm, overwrite=True)`` after every step.

Each repeat runs every method once, the order alternating; time = the slowest rank's; the paired
ratio is the median over repeats of method / ``none`` within one repeat, with a bootstrap 95%
interval. ``blocking save / step`` says how the model was sized: what one blocking save costs
next to one step (the issue's bar: about one). Memory (rank 0): the rise of the process's peak RSS
over one step, and over one step and a background save (until its files are written and hashed),
from a state with no staging buffers yet (torch's profiler, which counts tensors, cannot watch a
thread that writes meanwhile); and
``handle.staged_bytes``, the host copy a background save keeps between saves (see [Note: a save
in the background] in ``ragged/checkpoint/_background.py``).

Usage (CPU, gloo; about two minutes on a quiet 2-core machine)::

    python3 bench/background_save.py --model dense --world 1 --steps 4 --repeats 7   # one thread per rank (bench/_launch.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("none", "background", "blocking")


def _bench(rank, world, backend, model_name, steps, repeats, root):
    import torch

    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import SyntheticLM, rank_slice
    from ragged.examples.gpt import loss_fn

    from bench._launch import device_for
    from bench._measure import Timer, interleaved, median_ci, paired, reset_peak_rss, rss
    from bench._methods import build_model
    from bench.step import CONFIGS, model_config

    cfg = model_config(CONFIGS[model_name])
    device = device_for(backend, rank)
    comm = rg.collectives.from_torch()
    model = build_model(cfg, 0, device)
    units = fsdp.make_units(model, world_size=world)
    opt = rg.optim.adamw(1e-4, donate=True)
    state = [fsdp.init(units, model, opt, comm)]
    step = fsdp.make_step(units, loss_fn(model), opt, comm)
    task = SyntheticLM(cfg.vocab_size, cfg.max_seq_len, seed=1)
    batch = tuple(x.to(device) for x in rank_slice(task.batch(0, 2 * world), rank, world))
    paths = {m: os.path.join(root, m) for m in METHODS}

    def train(method):
        def run():
            handle = None
            for _ in range(steps):
                state[0], _ = step(state[0], batch)
                if method != "none":
                    handle = rg.checkpoint.save(paths[method], state[0], comm, overwrite=True,
                                                blocking=method == "blocking")
            if method == "background":
                handle.result()
        return run

    timer = Timer(device)
    one_step = lambda: state.__setitem__(0, step(state[0], batch)[0])  # noqa: E731
    one_save = lambda: rg.checkpoint.save(paths["blocking"], state[0], comm, overwrite=True)  # noqa: E731
    one_step()  # warm: the step's buffers exist, and what a save imports
    one_save()

    def peak_rise(fn):  # of this process's RSS (torch's profiler is no option: a thread writes meanwhile)
        reset_peak_rss()
        before = rss()["VmRSS"]
        out = fn()
        return rss()["VmHWM"] - before, out

    rise_step, _ = peak_rise(one_step)  # before any background save: no staging buffers yet
    def step_and_background_save():
        one_step()
        handle = rg.checkpoint.save(paths["background"], state[0], comm, overwrite=True, blocking=False)
        handle.result()
        return handle

    rise_background, handle = peak_rise(step_and_background_save)
    times = interleaved({m: train(m) for m in METHODS}, repeats, timer=timer.seconds)
    one = interleaved({"step": one_step, "save": one_save}, repeats, timer=timer.seconds)
    save_over_step = paired(one["save"], one["step"])
    if rank != 0:
        return None
    state_bytes = sum(d.data.numel() * d.data.element_size() for d in rg.pytree.leaves(
        state[0], is_leaf=lambda x: isinstance(x, rg.DBuffer)) if isinstance(d, rg.DBuffer))
    return {
        "model": model_name, "world": world, "steps": steps, "repeats": repeats, "params": sum(u.plan.numel for u in units),
        "times": times, "save_over_step": save_over_step,
        "ratios": {m: [paired(times[m], times["none"]), *median_ci([a / b for a, b in zip(times[m], times["none"])])]
                   for m in METHODS[1:]},
        "memory": {"state_bytes": state_bytes, "staged_bytes": handle.staged_bytes,
                   "peak_step": rise_step, "peak_step_background": rise_background},
    }


def markdown(r: dict) -> list[str]:
    """The run's tables: the times, and rank 0's memory."""
    med = {m: statistics.median(r["times"][m]) for m in METHODS}
    mem = r["memory"]
    lines = [f"| {r['model']}, {r['params'] / 1e6:.1f}M params, W = {r['world']}, {r['steps']} steps, a save after each "
             f"(blocking save / step: {r['save_over_step']:.2f}x) | median s | / none (95% CI) |", "|---|---|---|",
             f"| none | {med['none']:.3f} | 1 |"]
    for m in METHODS[1:]:
        ratio, lo, hi = r["ratios"][m]
        lines.append(f"| {m} | {med[m]:.3f} | {ratio:.3f}x [{lo:.3f}-{hi:.3f}] |")
    mb = 2 ** 20
    memory = ["| rank 0 | MB |", "|---|---|",
              f"| training state (shards + AdamW moments) | {mem['state_bytes'] / mb:.1f} |",
              f"| peak RSS rise over one step | {mem['peak_step'] / mb:.1f} |",
              f"| peak RSS rise over one step + a background save (staged, written, hashed) | "
              f"{mem['peak_step_background'] / mb:.1f} |",
              f"| staging copy kept between saves (`handle.staged_bytes`) | {mem['staged_bytes'] / mb:.1f} |"]
    return ["\n".join(lines), "\n".join(memory)]


def main(argv=None) -> None:
    from bench._launch import launch
    from bench.step import CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="dense")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="steps per method and repeat, a save after each")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ragged-bg-save-")
    try:
        result = launch(args.world, _bench, args.model, args.steps, args.repeats, root)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n\n".join(markdown(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
