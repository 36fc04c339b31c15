"""Optimizer state memory, Muon load balance and optimizer step time, side by side.

Sections (all in one run, each a rich table):

state   Bytes of optimizer state per parameter for one FSDP unit of each bundled model (meta
        tensors: nothing is allocated), fp32 master shards at world size m:
        ``rg.optim.adamw`` (fp32 moments) vs ``rg.optim.adamw_8bit`` (uint8 codes + one fp32
        absmax per block; ``Blocks(32, 32)`` on matrices, ``Elements(256)`` on large vectors,
        fp32 moments for the rest). Also counts the padding the fp32 state carries.
muon    Newton-Schulz work per rank (every 2-D matrix and every expert matrix of 3-D fused
        experts; embeddings and heads included, as the default filter does): max / mean / min
        flops over ranks and the largest single matrix (balanced means max - min <= one
        matrix), for owners balanced within one unit and jointly over the whole model.
step    Wall time of one optimizer step on one process (torch.set_num_threads(1)) over the same
        fp32 parameters (four decoder layers of ``--hidden``: 12.6M parameters at 512, 28 leaves;
        ``Blocks(32, 32)`` on the matrices): ``rg.optim.adamw`` on a DBuffer, ``torch.optim.AdamW``
        foreach, fused and for-loop on the per-leaf tensors, ``torch.optim.AdamW`` foreach on one
        flat tensor, and ``rg.optim.adamw_8bit`` on the DBuffer (functional and ``donate=True``,
        in place as torch's). Each of ours includes ``apply_updates``. Every method runs twice
        before the timed rounds; the donated ones refill the gradient buffer before each step (a
        backward's work, for torch's optimizer too), timed apart and not counted. Median of
        --iters, interleaved, and the paired ratios (median over rounds of method / torch's
        foreach or fused AdamW in the same round, with a bootstrap 95% interval), and the minor
        page faults of each step (fresh memory paged in: torch's foreach step allocates its
        temporaries each time, and in this process glibc returns them between steps; run with
        ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set high to keep them).
        ``--device cuda``: the same on the GPU (synchronized); ``--only-8bit``: only torch's
        foreach and fused AdamW and the donated 8-bit update (in place, as torch's: no fresh
        memory per step in any of the three); ``--json FILE``: the rows, every round's time and
        the command (``bench/report.py`` renders them).

precond-step, precond-balance   SOAP and Shampoo: see ``bench/_precond.py``.

Run:  python3 bench/optim.py [--sections state muon step] [--world-size 8] [--iters 7]
      python3 bench/report.py record optim-step -- python3 bench/optim.py --sections step --only-8bit --iters 21
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from ragged._console import console as make_console  # noqa: E402
from rich.table import Table  # noqa: E402

import ragged as rg  # noqa: E402
from ragged import spec  # noqa: E402
from ragged._dbuffer import DBuffer  # noqa: E402

from bench._measure import Timer, interleaved, median_ci, process_work  # noqa: E402


def specs_for(params):
    def one(p):
        if p.ndim == 2 or (p.ndim >= 3 and p.shape[-2] % 32 == 0):
            return spec.Blocks(32, 32)
        if p.ndim == 1 and p.numel() >= 4096:
            return spec.Elements(256)
        return spec.Rows(1)

    return {k: one(v) for k, v in params.items()}


def meta_dbuffer(plan, rank):
    return DBuffer(
        data=torch.empty(plan.shard_size, device="meta"),
        replicated=torch.empty(plan.replicated_numel, device="meta"),
        plan=plan,
        rank=rank,
    )


def pick_units():
    from ragged.models import MODELS, model_units

    out = []
    for name in MODELS:
        units = model_units(name, dtype=torch.float32)
        kinds = {}
        for u in units:
            kinds.setdefault(u.kind, u)
        for kind, u in kinds.items():
            if kind in ("layer", "moe_layer", "dense_layer"):
                out.append((f"{name} {u.name} ({kind})", u.params))
    return out


def section_state(console, m):
    table = Table(title=f"optimizer state per parameter (fp32 master, world size {m}, one unit; meta tensors)")
    for col in ("unit", "params", "adamw B/param", "adamw_8bit B/param", "of which scales", "fp32-state leaves", "ratio"):
        table.add_column(col, justify="right" if col != "unit" else "left")
    for label, params in pick_units():
        plan = rg.make_plan(params, specs_for(params), world_size=m, dtype=torch.float32)
        n = plan.numel + plan.replicated_numel
        fp32 = q8 = scales = 0
        for r in range(m):
            d = meta_dbuffer(plan, r)
            fp32 += rg.optim.state_nbytes(rg.optim.adamw(1e-3).init(d))
            st = rg.optim.adamw_8bit(1e-3).init(d)
            q8 += rg.optim.state_nbytes(st)
            mom = st[0].moments
            scales += (mom.mu_scales.numel() + mom.nu_scales.numel()) * 4
        small = sum(1 for l in plan.leaves if l.numel < 4096 or isinstance(l.granularity, spec.Rows)) + len(plan.replicated)
        table.add_row(label, f"{n / 1e6:.1f}M", f"{fp32 / n:.3f}", f"{q8 / n:.3f}", f"{scales / n:.4f}",
                      f"{small}/{plan.num_leaves}", f"{fp32 / q8:.2f}x")
    console.print(table)


def section_muon(console, m_list):
    from ragged.models import MODELS, model_units

    table = Table(title="Newton-Schulz load per rank (distributed Muon owners, LPT; 2-D matrices and every expert matrix)")
    for col in ("owners balanced over", "m", "matrices", "max TFLOP", "mean", "min", "max/mean", "largest matrix",
                "max-min <= largest"):
        table.add_column(col, justify="right" if col != "owners balanced over" else "left")

    def row(label, plans, m):
        load = rg.optim.muon_load(plans)
        f = load["flops"]
        big = max(u.cost for u in load["assignments"])
        mean = statistics.mean(f)
        table.add_row(label, str(m), str(len(load["assignments"])), f"{max(f) / 1e12:.1f}", f"{mean / 1e12:.1f}",
                      f"{min(f) / 1e12:.1f}", f"{max(f) / mean:.3f}", f"{big / 1e12:.1f}", str(max(f) - min(f) <= big))

    for name in MODELS:
        units = model_units(name, dtype=torch.float32)
        for m in m_list:
            plans = [rg.make_plan(u.params, specs_for(u.params), world_size=m, dtype=torch.float32) for u in units]
            layer = next(p for p, u in zip(plans, units) if "layer" in u.kind)
            row(f"{name}: one unit ({units[plans.index(layer)].name})", layer, m)
            row(f"{name}: whole model ({len(units)} units)", plans, m)
    console.print(table)


STEP, REFILL = "step", "refill"  # the timed phases of a donated method


def section_step(console, iters, hidden, device="cpu", only_8bit=False):
    torch.set_num_threads(1)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    h, f = hidden, int(hidden * 8 / 3) // 64 * 64
    params = {}
    for i in range(4):
        for name, shape in (("qkv", (3 * h, h)), ("proj", (h, h)), ("w1", (f, h)), ("w3", (f, h)), ("w2", (h, f)),
                            ("n1", (h,)), ("n2", (h,))):
            params[f"l{i}.{name}"] = torch.randn(*shape, generator=g).to(dev)
    grads = {k: torch.randn(v.shape, generator=g).to(dev) for k, v in params.items()}
    plan = rg.make_plan(params, specs_for(params), world_size=1, dtype=torch.float32)
    buf = torch.zeros(plan.shard_size, device=dev)
    gbuf = torch.zeros(plan.shard_size, device=dev)
    for leaf in plan.leaves:
        buf[leaf.offset : leaf.stop] = params[leaf.path[2:-2]].reshape(-1)
        gbuf[leaf.offset : leaf.stop] = grads[leaf.path[2:-2]].reshape(-1)
    local = DBuffer(data=buf, replicated=torch.zeros(0, device=dev), plan=plan, rank=0)
    gsh = DBuffer(data=gbuf, replicated=torch.zeros(0, device=dev), plan=plan, rank=0)
    n = plan.numel

    def ours(make, donate=False):
        opt = make()
        p0 = local.replace(data=local.data.clone())
        box = {"p": p0, "s": opt.init(p0), "g": gsh.replace(data=gsh.data.clone())}

        def step():
            g = box["g"]
            if donate:  # the update overwrote the gradients: refill them, as the next backward
                g.data.copy_(gsh.data)  # would (for torch's optimizer too), timed apart
                yield REFILL
            u, box["s"] = opt.update(g, box["s"], box["p"])
            box["p"] = rg.apply_updates(box["p"], u, donate=donate)
            yield STEP

        return step

    def torch_opt(flat, **kw):
        if flat:
            ps = [buf.clone().requires_grad_(True)]
            ps[0].grad = gbuf.clone()
        else:
            ps = [p.clone().requires_grad_(True) for p in params.values()]
            for p, gr in zip(ps, grads.values()):
                p.grad = gr.clone()
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **kw)
        return opt.step

    q8 = lambda donate: ours(lambda: rg.optim.adamw_8bit(1e-3, weight_decay=0.1, donate=donate), donate)  # noqa: E731
    methods = {"torch AdamW foreach (per-leaf)": torch_opt(False, foreach=True),
               "torch AdamW fused (per-leaf)": torch_opt(False, fused=True)}
    if not only_8bit:
        methods.update({
            "rg.optim.adamw (DBuffer, functional)": ours(lambda: rg.optim.adamw(1e-3, weight_decay=0.1)),
            "rg.optim.adamw (DBuffer, donate=True)": ours(
                lambda: rg.optim.adamw(1e-3, weight_decay=0.1, donate=True), True),
            "unfused chain(scale_by_adam, add_decayed_weights, lr)": ours(lambda: rg.optim.chain(
                rg.optim.scale_by_adam(), rg.optim.add_decayed_weights(0.1), rg.optim.scale_by_learning_rate(1e-3))),
            "torch AdamW for-loop (per-leaf)": torch_opt(False, foreach=False),
            "torch AdamW foreach (one flat tensor)": torch_opt(True, foreach=True),
        })
    if not only_8bit:  # its fresh memory each step (page faults) would weigh on its neighbours' times
        methods["rg.optim.adamw_8bit (functional)"] = q8(False)
    methods["rg.optim.adamw_8bit (donate=True)"] = q8(True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    faults = {k: [] for k in methods}  # minor page faults of each step: fresh memory paged in

    def timed(name, fn):
        def run():
            f0 = process_work()[1]
            out = fn()
            if out is None:
                sync()
                faults[name].append(process_work()[1] - f0)
                yield STEP
                return
            for phase in out:
                sync()
                if phase == STEP:
                    faults[name].append(process_work()[1] - f0)
                yield phase
                f0 = process_work()[1]

        return run

    times = interleaved({k: timed(k, v) for k, v in methods.items()}, iters, warmup=2)  # warm-up: allocation
    times = {k[: -len(STEP) - 1] if k.endswith(" " + STEP) else k: ts for k, ts in times.items()
             if not k.endswith(" " + REFILL)}
    title = (f"one AdamW step, {n / 1e6:.1f}M fp32 params, {len(params)} leaves, {dev.type}, 1 thread (median of "
             f"{iters}, interleaved; paired: median over rounds of method / torch's AdamW in the same round, "
             "bootstrap 95% interval in brackets)")
    table = Table(title=title)
    for col in ("method", "ms", "paired vs torch foreach", "paired vs torch fused", "page faults / step"):
        table.add_column(col, justify="left" if col == "method" else "right")
    refs = {"foreach": times["torch AdamW foreach (per-leaf)"], "fused": times["torch AdamW fused (per-leaf)"]}
    rows = []
    for k, ts in times.items():
        row = {"method": k, "ms": statistics.median(ts) * 1e3, "seconds": ts,
               "page_faults": statistics.median(faults[k][-iters:])}
        cells = []
        for ref, ref_ts in refs.items():
            ratios = [a / b for a, b in zip(ts, ref_ts)]
            row[f"paired_{ref}"], row[f"ci_{ref}"] = statistics.median(ratios), median_ci(ratios)
            cells.append(f"{row[f'paired_{ref}']:.2f}x [{row[f'ci_{ref}'][0]:.2f}-{row[f'ci_{ref}'][1]:.2f}]")
        rows.append(row)
        table.add_row(k, f"{row['ms']:.1f}", *cells, f"{row['page_faults']:,.0f}")
    console.print(table)
    return {"section": "step", "device": dev.type, "numel": n, "leaves": len(params), "iters": iters,
            "torch": torch.__version__, "rows": rows}


def _muon_worker(rank, m, backend, iters, size):
    """One rank of ``section_muon_gloo`` (started by ``bench/_launch.py``)."""
    comm = rg.collectives.from_torch()
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(size * (1 + i % 3) // 2, size, generator=g) for i in range(12)}
    params["experts"] = torch.randn(8, size // 2, size, generator=g)
    plan = rg.make_plan(params, world_size=m)
    local = rg.shard(plan, params, comm)
    grads = rg.shard(plan, rg.pytree.map(lambda p: torch.randn(p.shape, generator=g), params), comm)

    def muon_step(num_waves):
        opt = rg.optim.scale_by_muon(comm=comm, num_waves=num_waves)
        state = opt.init(local)
        return lambda: opt.update(grads, state)

    def replicated_ns():
        # baseline: all-gather the whole update, every rank runs Newton-Schulz on every matrix
        full = torch.empty(plan.buffer_numel)

        def step():
            comm.all_gather_into(full, grads.data)
            for leaf in plan.leaves:
                x = full[leaf.offset : leaf.stop]
                rows, cols = leaf.shape[-2], leaf.shape[-1]
                for e in range(leaf.numel // (rows * cols)):
                    rg.optim.newton_schulz(x[e * rows * cols : (e + 1) * rows * cols].view(rows, cols))

        return step

    methods = {"muon, owners, 1 wave (no overlap)": muon_step(1), "muon, owners, 4 waves (overlap)": muon_step(4),
               "muon, owners, 8 waves (overlap)": muon_step(8), "replicated NS (all-gather, NS everywhere)": replicated_ns()}
    times = interleaved(methods, iters, timer=Timer(comm.device).seconds)  # max over ranks
    load = rg.optim.muon_load(plan)
    return times, load["flops"], len(load["assignments"]), plan.numel


def section_muon_gloo(console, m, iters, size):
    from bench._launch import launch

    times, flops, units, numel = launch(m, _muon_worker, iters, size, backend="gloo", timeout=900)[0]
    table = Table(title=f"Muon direction on {m} gloo ranks: {units} matrices, {numel / 1e6:.1f}M params, 1 thread/rank "
                        f"(max over ranks, median of {iters}); NS GFLOP per rank {[round(f / 1e9, 1) for f in flops]}")
    table.add_column("method")
    table.add_column("ms", justify="right")
    table.add_column("vs 1 wave", justify="right")
    base = statistics.median(times["muon, owners, 1 wave (no overlap)"])
    for k, ts in times.items():
        t = statistics.median(ts)
        table.add_row(k, f"{t * 1e3:.0f}", f"{t / base:.2f}x")
    console.print(table)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["state", "muon", "step", "muon-gloo"],
                    choices=["state", "muon", "step", "muon-gloo", "precond-step", "precond-balance"])
    ap.add_argument("--block", type=int, default=128, help="precond sections: the b of Blocks(b, b)")
    ap.add_argument("--models", nargs="+", default=["dense", "moe"], help="precond-balance: bench/step.py models")
    ap.add_argument("--balance-world-sizes", type=int, nargs="+", default=[2, 4], help="precond-balance: W")
    ap.add_argument("--gloo-world-size", type=int, default=2)
    ap.add_argument("--muon-size", type=int, default=256)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--muon-world-sizes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--device", default="cpu", help="step section: where the parameters live (cpu, cuda)")
    ap.add_argument("--only-8bit", action="store_true",
                    help="step section: only torch's foreach and fused AdamW and the donated 8-bit update")
    ap.add_argument("--json", default=None, help="step / precond sections: write their rows (every timed round) to this "
                                                 "JSON file")
    args = ap.parse_args()
    console = make_console(min_width=150)
    if "state" in args.sections:
        section_state(console, args.world_size)
    if "muon" in args.sections:
        section_muon(console, args.muon_world_sizes)
    if "step" in args.sections:
        out = section_step(console, args.iters, args.hidden, args.device, args.only_8bit)
        if args.json:
            out["command"] = " ".join(["python3", *sys.argv])
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if "muon-gloo" in args.sections:
        section_muon_gloo(console, args.gloo_world_size, args.iters, args.muon_size)
    precond = []
    if "precond-step" in args.sections:
        from bench._precond import section_step as precond_step

        precond.append(precond_step(console, args.iters, args.hidden, args.block))
    if "precond-balance" in args.sections:
        from bench._precond import section_balance

        precond.append(section_balance(console, args.models, args.balance_world_sizes, args.block, args.iters))
    if precond and args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python3", *sys.argv]), "sections": precond}, f, indent=1)


if __name__ == "__main__":
    main()
