"""Backward through ``rg.gather``: leaf views by ``split_with_sizes`` vs one slice per leaf.

``rg.gather`` returns every leaf as a view of ONE flat buffer, and its backward reduce-scatters
that buffer's gradient. How the leaf views are made decides what autograd does on the way back:
a slice per leaf (``buffer[a:b].view(shape)``) makes each leaf's ``SliceBackward`` allocate a
zero-filled gradient of the WHOLE buffer, which autograd then sums, so backward is
O(leaves x buffer); ``split_with_sizes`` (what ``rg.unflatten`` does under autograd, see the
Note "leaf views of a flat buffer" in ragged/_dbuffer.py) has one backward that concatenates
the leaves' gradients once.

Same process, same data, alternating: a GPT block (hidden h, fp32) whose matrices are cut into
``--chunks`` row blocks each (more leaves, same bytes), gathered on a 1-rank simulated comm;
loss = sum(leaf * random weight). Reported: median forward and backward ms, and the ratio of
the slice-per-leaf backward to ragged's.

Run:  OMP_NUM_THREADS=1 python3 bench/autograd.py [--hidden 512] [--chunks 1 4 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ragged as rg  # noqa: E402
from bench._measure import interleaved  # noqa: E402
from bench.collectives import block_params  # noqa: E402


def slice_views(plan, buffer):
    """The reference: one slice + view per leaf (what unflatten did before split_with_sizes)."""
    leaves = [None] * plan.num_leaves
    for leaf in plan.leaves:
        leaves[leaf.index] = buffer[leaf.offset : leaf.stop].view(leaf.shape)
    return rg.pytree.unflatten(plan.treedef, leaves)


def measure(hidden: int, chunks: int, repeats: int) -> dict:
    block = block_params(hidden, int(hidden * 2.75), torch.float32)
    params = {f"{k}.{i}": part for k, v in block.items() for i, part in enumerate(v.chunk(chunks))}
    plan = rg.make_plan(params, world_size=1)
    weights = {k: torch.randn_like(v) for k, v in params.items()}

    def run(comm):
        d = rg.shard(plan, params, comm)
        d = d.replace(data=d.data.requires_grad_())
        ways = {
            "rg.gather (split_with_sizes views)": lambda: rg.gather(d, comm),
            "slice + view per leaf": lambda: slice_views(plan, rg.gather_start(d, comm).buffer),
        }
        grads = {}

        def timed(name):
            def run():  # two phases for bench._measure.interleaved
                full = ways[name]()
                loss = sum((full[k] * weights[k]).sum() for k in weights)
                yield "forward"
                loss.backward()
                yield "backward"
                grads[name] = d.data.grad.clone()
                d.data.grad = None
            return run

        t = interleaved({name: timed(name) for name in ways}, repeats, warmup=0)
        a, b = grads.values()
        assert torch.equal(a, b), "both ways must give the same gradient"
        return {name: (t[f"{name} forward"], t[f"{name} backward"]) for name in ways}

    times = rg.collectives.simulate(1, run)[0]
    return {"leaves": len(params), "numel": plan.buffer_numel, "times": times}


def main(argv=None):
    from ragged._console import console as make_console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    table = Table(title=f"backward through rg.gather, GPT block hidden={args.hidden} (fp32), median of {args.repeats}")
    for col in ("leaves", "elements", "leaf views", "forward ms", "backward ms", "backward vs rg"):
        table.add_column(col, justify="left" if col == "leaf views" else "right")
    for chunks in args.chunks:
        r = measure(args.hidden, chunks, args.repeats)
        ref = statistics.median(r["times"]["rg.gather (split_with_sizes views)"][1])
        for name, (fwd, bwd) in r["times"].items():
            table.add_row(str(r["leaves"]), f"{r['numel']:,}", name, f"{statistics.median(fwd) * 1e3:.1f}",
                          f"{statistics.median(bwd) * 1e3:.1f}", f"{statistics.median(bwd) / ref:.2f}x")
    make_console(min_width=160).print(table)


if __name__ == "__main__":
    main()
