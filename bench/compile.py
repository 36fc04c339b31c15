"""torch.compile and the training step: ragged, unsharded and FSDP2, each eager and compiled, in one run.

Six methods train the same model (``bench/step.py``'s ``CONFIGS``) on the same batches from the
same weights, in the same processes (``bench/_launch.py``; methods from ``bench/_methods.py``):

* ``ragged`` / ``ragged+compile``: ``rg.fsdp.make_step(..., module=model)``, eager / with the
  model compiled;
* ``local`` / ``local+compile``: the unsharded model on every rank, no communication;
* ``fsdp2`` / ``fsdp2+compile``: ``fully_shard`` on every block and the root;
* with ``--compile-optimizer``, ``ragged+compile+opt``: ``ragged+compile`` with the optimizer
  update compiled too (``opt._replace(update=torch.compile(opt.update))``: the
  update is a pure function of the gradient, state and parameter shards, run after backward,
  outside the runtime; a ``jax.jit``-like path for the part of the step that is not the model).

``--compile block`` (default) compiles every block, ``torch.compile(block)`` put back in its
list, before sharding (torchtitan's ``apply_compile``); ``--compile whole`` compiles the whole
model (``model.compile()``; FSDP2: after ``fully_shard``). Compilation happens in the warm-up
steps (``--warmup``, at least 2: ragged's first call may rerun with the learnt schedule), which
are not timed; their time is shown as the compile time. The methods share the blocks' code in
one process: ragged's step binds plain tensors where torch's methods hold ``nn.Parameter``
objects, so the first of them recompiles ``Block.forward`` once, in its warm-up. A frame
compiled during the timed repeats (a recompile that would be in a step's time) is counted and
printed.

Each repeat runs one step of every method on the same batch, the order alternating between
repeats. Reported: median step time (max over ranks) with a bootstrap 95% interval, and the
paired ratios, each the median over repeats of the ratio in that repeat: the speedup from
compile of every method (eager / compiled), and **ragged's speedup over the unsharded
model's** (Done-when of issue 17: >= 0.9 on the dense model at W=2), and ragged / FSDP2 with
both compiled. The losses of eager and compiled agree to float rounding (printed).

Usage (CPU, gloo)::

    flock /tmp/ragged-bench.lock python3 bench/compile.py --model dense --world 2
    flock /tmp/ragged-bench.lock python3 bench/compile.py --model dense --world 2 --compile whole
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._measure import median_ci  # noqa: E402
from bench.step import CONFIGS, model_config  # noqa: E402

METHODS = ("ragged", "ragged+compile", "local", "local+compile", "fsdp2", "fsdp2+compile")


def _bench(rank, world, backend, opts):
    import ragged as rg
    from ragged.examples.data import SyntheticLM, rank_slice

    from bench._launch import device_for
    from bench._measure import Timer, interleaved
    from bench._methods import FSDP2Method, LocalMethod, RaggedMethod

    device = device_for(backend, rank)
    cfg = model_config(opts["cfg"])
    comm = rg.collectives.from_torch()
    kw = dict(seed=0, device=device, lr=opts["lr"], policy=opts["policy"])
    ckw = dict(kw, compile=opts["compile"], compiler=opts["compiler"])
    make = {
        "ragged": lambda: RaggedMethod(cfg, comm=comm, bind_module=True, **kw),
        "ragged+compile": lambda: RaggedMethod(cfg, comm=comm, **ckw),
        "local": lambda: LocalMethod(cfg, **kw),
        "local+compile": lambda: LocalMethod(cfg, **ckw),
        "fsdp2": lambda: FSDP2Method(cfg, **kw),
        "fsdp2+compile": lambda: FSDP2Method(cfg, **ckw),
        "ragged+compile+opt": lambda: RaggedMethod(cfg, comm=comm, optimizer=_compiled_adamw(opts), **ckw),
    }
    names = [n for n in METHODS if n.split("+")[0] in opts["methods"]]
    if opts["compile_optimizer"]:
        names.append("ragged+compile+opt")
    methods = {n: make[n]() for n in names}
    task = SyntheticLM(opts["cfg"]["vocab_size"], opts["cfg"]["max_seq_len"], seed=0)

    batches = [tuple(t.to(device) for t in rank_slice(task.batch(s, opts["batch"] * world), rank, world))
               for s in range(opts["warmup"] + opts["repeats"])]
    timer = Timer(device)
    losses, warm = {n: [] for n in names}, {n: 0.0 for n in names}
    # a method's k-th step trains on batch k: every method sees the same data in the same order
    fns = {n: (lambda n=n: losses[n].append(methods[n].step(batches[len(losses[n])]))) for n in names}
    for r in range(opts["warmup"]):  # compilation and ragged's schedule learning: timed apart, as compile time
        for n in names if r % 2 == 0 else names[::-1]:
            warm[n] += timer.seconds(fns[n])
    frames = dict(torch._dynamo.utils.counters["frames"])
    times = interleaved(fns, opts["repeats"], warmup=0, timer=timer.seconds)
    # a frame dynamo compiles in the timed repeats is a recompile (and its time would be in a step)
    recompiled = torch._dynamo.utils.counters["frames"]["total"] - frames.get("total", 0)
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    reruns = methods["ragged+compile"].metrics.get("schedule_reruns") if "ragged+compile" in methods else None
    return dict(times=times, losses=losses, warm=warm, reruns=reruns, recompiled=recompiled, graph_breaks=graph_breaks)


def _compiled_adamw(opts):
    """``rg.optim.adamw`` as ``RaggedMethod`` builds it, its update compiled."""
    import ragged as rg

    opt = rg.optim.adamw(opts["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, donate=True)
    return opt._replace(update=torch.compile(opt.update, backend=opts["compiler"]))


def _per_repeat(times, a, b):
    """Per repeat ``a / b`` (both ran in the same repeat, back to back)."""
    return [x / y for x, y in zip(times[a], times[b])]


def summarize(results) -> dict:
    r0 = results[0]
    times, out = r0["times"], {"methods": {}, "ratios": {}}
    for name, t in times.items():
        lo, hi = median_ci(t)
        out["methods"][name] = dict(median_ms=statistics.median(t) * 1e3, ci_ms=(lo * 1e3, hi * 1e3),
                                    warmup_s=max(res["warm"][name] for res in results))
    for base in ("ragged", "local", "fsdp2"):
        if base in times and base + "+compile" in times:
            out["ratios"][f"{base} speedup from compile"] = _per_repeat(times, base, base + "+compile")
    if "ragged" in times and "local" in times:
        rs, ls = out["ratios"]["ragged speedup from compile"], out["ratios"]["local speedup from compile"]
        out["ratios"]["ragged speedup / local speedup"] = [x / y for x, y in zip(rs, ls)]
    if "ragged+compile+opt" in times:
        out["ratios"]["ragged+compile+opt / ragged+compile"] = _per_repeat(times, "ragged+compile+opt", "ragged+compile")
    if "ragged" in times and "fsdp2" in times:
        out["ratios"]["ragged+compile / fsdp2+compile"] = _per_repeat(times, "ragged+compile", "fsdp2+compile")
        out["ratios"]["ragged / fsdp2"] = _per_repeat(times, "ragged", "fsdp2")
    if "ragged" in times and "local" in times:
        out["ratios"]["ragged+compile / local+compile"] = _per_repeat(times, "ragged+compile", "local+compile")
    out["loss_diff"] = {name: max(abs(x - y) for x, y in zip(r0["losses"][name.split("+")[0]], r0["losses"][name]))
                        for name in times if "+" in name}  # each compiled method against its eager one
    out["reruns"] = r0["reruns"]
    out["losses"] = r0["losses"]
    out["recompiled"] = max(res["recompiled"] for res in results)
    out["graph_breaks"] = max(res["graph_breaks"] for res in results)
    return out


def render(summary, title, console=None):
    from ragged._console import console as make_console
    from rich.table import Table

    console = console or make_console(min_width=160)
    t = Table(title=title, title_justify="left")
    for col in ("method", "step ms median [95% CI]", "warm-up s (compile)"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, m in summary["methods"].items():
        t.add_row(name, f"{m['median_ms']:,.0f} [{m['ci_ms'][0]:,.0f}, {m['ci_ms'][1]:,.0f}]", f"{m['warmup_s']:.1f}")
    console.print(t)
    r = Table(title="paired ratios (median over repeats of the ratio in each repeat) [95% CI]", title_justify="left")
    r.add_column("ratio")
    r.add_column("value", justify="right")
    for name, xs in summary["ratios"].items():
        lo, hi = median_ci(xs)
        r.add_row(name, f"{statistics.median(xs):.3f}x [{lo:.3f}, {hi:.3f}]")
    console.print(r)
    console.print("losses, eager vs compiled, max |diff| over all steps: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in summary["loss_diff"].items())
                  + f"; ragged+compile schedule reruns in its last call: {summary['reruns']}; frames dynamo compiled "
                  f"during the timed repeats (recompiles): {summary['recompiled']}; graph breaks (all methods, "
                  f"warm-up included): {summary['graph_breaks']}")


def markdown(summary, title) -> str:
    lines = [title, "", "| method | step ms median [95% CI] |", "|---|---|"]
    for name, m in summary["methods"].items():
        lines.append(f"| {name} | {m['median_ms']:,.0f} [{m['ci_ms'][0]:,.0f}, {m['ci_ms'][1]:,.0f}] |")
    lines += ["", "| paired ratio | median [95% CI] |", "|---|---|"]
    for name, xs in summary["ratios"].items():
        lo, hi = median_ci(xs)
        lines.append(f"| {name} | {statistics.median(xs):.3f}x [{lo:.3f}, {hi:.3f}] |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(CONFIGS), default="dense")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--compile", choices=("block", "whole"), default="block")
    ap.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                    help="dynamo backend (aot_eager: no code generation, for a quick check)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--policy", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--methods", nargs="+", choices=("ragged", "local", "fsdp2"), default=["ragged", "local", "fsdp2"])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--compile-optimizer", action="store_true",
                    help="also ragged+compile with the optimizer update compiled (ragged+compile+opt)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.warmup < 2:
        ap.error("--warmup must be at least 2 (compilation and ragged's schedule learning happen there)")
    from bench._launch import launch, pick_backend

    opts = dict(cfg=CONFIGS[args.model], compile=args.compile, compiler=args.compiler, repeats=args.repeats,
                warmup=args.warmup, batch=args.batch, policy=args.policy, lr=args.lr, methods=args.methods,
                compile_optimizer=args.compile_optimizer)
    backend = pick_backend(args.world, args.backend)
    print(f"== {args.model}, compile {args.compile} ({args.compiler}), {args.world} ranks ({backend}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs) ==", flush=True)
    t0 = time.perf_counter()
    results = launch(args.world, _bench, opts, backend=args.backend, threads=args.threads)
    summary = summarize(results)
    title = (f"{args.model}, W={args.world}, {args.policy}, compile {args.compile} ({args.compiler}): one training step, "
             f"{args.repeats} alternating repeats after {args.warmup} warm-up ({time.perf_counter() - t0:.0f} s in all)")
    render(summary, title)
    if args.markdown:
        print(markdown(summary, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
