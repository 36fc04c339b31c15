"""What ``fsdp.init``'s equal-values check costs: init with the check, without it, and with
``broadcast_from=0`` instead, side by side in one run.

Every rank builds the same model (``torch.manual_seed(0)``, the ``--model`` of ``bench/step.py``),
makes the units (fp32) and, per repeat, runs ``fsdp.init(units, model, rg.optim.sgd(0.1), comm,
release_module=False)`` three ways, the order rotating between repeats: ``checked`` (the default:
each rank hashes its values and the ranks agree on the hash, see [Note: ranks start from the same
values] in ``ragged/fsdp/_equal_start.py``), ``unchecked`` (the check replaced by a no-op: the cost
of sharding alone) and ``broadcast`` (``broadcast_from=0``: no check, each unit reduce-scattered
from rank 0). Reported: the median over repeats of the slowest rank's time, and each against
``unchecked``.

Usage (CPU, gloo; about a minute)::

    OMP_NUM_THREADS=1 python3 bench/init_check.py --model 120m --world 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WAYS = ("checked", "unchecked", "broadcast")


def _bench(rank, world, backend, model_name, repeats):
    import torch

    import ragged as rg
    from ragged import fsdp
    from ragged.fsdp import _state

    from bench._launch import device_for
    from bench._methods import build_model
    from bench.step import CONFIGS, model_config

    model = build_model(model_config(CONFIGS[model_name]), 0, device_for(backend, rank))
    comm = rg.collectives.from_torch()
    units = fsdp.make_units(model, world_size=world, dtype=torch.float32)
    checked = _state.check_equal

    def init(way):
        _state.check_equal = checked if way == "checked" else (lambda items, comm: None)
        try:
            kw = {"broadcast_from": 0} if way == "broadcast" else {}
            comm.barrier()
            start = time.perf_counter()
            state = fsdp.init(units, model, rg.optim.sgd(0.1), comm, release_module=False, **kw)
            comm.barrier()
            return time.perf_counter() - start, state
        finally:
            _state.check_equal = checked

    init("checked")  # warm-up (first plan agreement, allocator)
    times = {w: [] for w in WAYS}
    for r in range(repeats):
        for way in WAYS[r % 3:] + WAYS[: r % 3]:
            seconds, _ = init(way)
            times[way].append(seconds)
    return times, sum(p.numel() for p in model.parameters())


def main(argv=None) -> None:
    from bench._launch import launch
    from bench.step import CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="120m")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    out = launch(args.world, _bench, args.model, args.repeats)
    numel = out[0][1]
    slowest = {w: [max(t[0][w][i] for t in out) for i in range(args.repeats)] for w in WAYS}
    base = statistics.median(slowest["unchecked"])
    print(f"fsdp.init of {args.model} ({numel / 1e6:.1f}M parameters, fp32) on {args.world} gloo ranks, "
          f"{args.repeats} repeats, median of the slowest rank")
    print("| init | seconds | minus unchecked | ratio to unchecked |")
    print("|---|---:|---:|---:|")
    for w in WAYS:
        med = statistics.median(slowest[w])
        print(f"| {w} | {med:.3f} | {med - base:+.3f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
