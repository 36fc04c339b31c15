"""One rank's peak memory at large world sizes: ragged vs FSDP2, on torch's fake process group.

For each model, world size W and activation-checkpointing setting, two fresh processes (one per
method, ``bench/_launch.py`` with ``backend="fake"``) each join a W-rank fake process group as
rank 1 (``FakeStore``; collectives return at once and move no data, every allocation is real),
build the method, run ``--warmup`` steps and one measured step on the same per-rank batch:

* ``ragged``: ``rg.fsdp.make_step`` (every block + the rest as units, ``rg.optim.adamw`` with
  ``donate=True``; ``examples.gpt.loss_fn(checkpoint=True)`` with checkpointing);
* ``fsdp2``: ``fully_shard`` on every block and the root, ``torch.optim.AdamW`` (foreach);
  with checkpointing ``torch.distributed._composable.checkpoint`` on every block (applied before
  ``fully_shard``, as FSDP2 documents).

Both are ``bench/_methods.py`` (the methods of ``bench/step.py``), fp32, the same model.

How memory is measured (``bench/_measure.LiveBytes``, the same for both): on CPU, torch's
profiler with ``profile_memory=True`` runs from before the method is constructed to the end;
it reports every allocation and free of the CPU allocator (the tensor storages: parameters,
shards, gradients, optimizer state, activations, communication buffers, storage brought back by
``resize_``; not Python objects). Their running sum is the bytes the method has live at each
moment, caches and buffers it keeps outside its state included, so "peak" is absolute: the
largest live total during the measured step. "state" is the live total when the measured step
starts (what the method keeps between steps). RSS would be too coarse (glibc keeps freed memory
and maps lazily). On CUDA the same code reads ``torch.cuda.max_memory_allocated`` (and
``max_memory_reserved``: the caching allocator's reserve) over the step instead (not run here:
no GPU in this session).

The fake group's collectives leave their outputs as allocated (garbage values): memory does not
depend on values, except the MoE routing (which tokens go to which expert); its total work is
fixed (tokens x top_k), so MoE peaks can move by a few MiB between runs. Also printed per row:
the largest unit's gathered bytes (ragged: ``m * S_unit`` elements; FSDP2: the padded block),
the bytes of activations saved for backward by the unsharded model on the same batch (unique
storages seen by ``saved_tensors_hooks``, parameters excluded), and where the peak was reached.

Usage (CPU; the full sweep is long: one process per cell)::

    python3 bench/memory.py --models 120m moe-few --world 8 64 256 --checkpointing on
    python3 bench/memory.py --models dense moe --world 8 64 256 --checkpointing on off
    python3 bench/memory.py --models tiny --world 8 --warmup 1        # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines (inherited by the workers)

import torch  # noqa: E402

METHODS = ("ragged", "fsdp2")

# --units split: the rest of the model (embeddings, final norm, head) as two units in both methods,
# embeddings apart from norm + head, instead of one "rest" unit / FSDP2 root group
SPLIT_FSDP2 = (("tok_emb", "pos_emb"), ("norm", "head"))


def split_rest(name: str) -> str:
    """ragged's unit of parameter ``name`` with ``--units split``."""
    if name.startswith("blocks."):
        return ".".join(name.split(".")[:2])
    return "embed" if name.startswith(("tok_emb.", "pos_emb.")) else "head"


def _saved_activation_bytes(cfg, model, batch, checkpoint: bool) -> int:
    """Unique storage bytes saved for backward by one forward of the unsharded ``model``
    (parameters excluded), at the end of the forward."""
    from bench._methods import ragged_loss

    params = dict(model.named_parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params.values()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_storages and s.nbytes():
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ragged_loss(cfg, model, checkpoint)(params, batch)
    del loss
    return sum(saved.values())


def _measure(rank, world, backend, opts):
    """Runs in the launched process: builds one method on the fake group, measures its steps."""
    import ragged as rg
    from ragged.examples.data import SyntheticLM

    from bench._launch import device_for
    from bench._measure import LiveBytes, ragged_labels
    from bench._methods import FSDP2Method, RaggedMethod, build_model
    from bench.step import model_config

    device = device_for(backend, rank)
    cfg = model_config(opts["cfg"])
    task = SyntheticLM(opts["cfg"]["vocab_size"], opts["cfg"]["max_seq_len"], seed=0)

    def batch(step):
        x, y = task.batch(step, opts["batch"])
        return x.to(device), y.to(device)

    kw = dict(seed=0, device=device, lr=1e-3, policy="fp32", checkpoint=opts["checkpoint"])
    split = opts.get("units") == "split"
    extra = {}
    with contextlib.ExitStack() as stack:
        try:  # labels around ragged's step internals, where the step runtime still has them
            stack.enter_context(ragged_labels())
        except AttributeError:
            pass
        live = stack.enter_context(LiveBytes(device))
        with live.window("build"):
            if opts["method"] == "ragged":
                method = RaggedMethod(cfg, comm=rg.collectives.from_torch(), groups=split_rest if split else None, **kw)
            else:
                method = FSDP2Method(cfg, groups=SPLIT_FSDP2 if split else (), **kw)
        for s in range(opts["warmup"]):
            with live.window(f"warmup {s}"):
                method.step(batch(s))
        with live.window("step"):
            method.step(batch(opts["warmup"]))
    if opts["method"] == "ragged":
        extra = dict(units=len(method.units), padding=sum(u.plan.padding for u in method.units))
    out = dict(method=opts["method"], world=world, device=str(device), **extra,
               **{name: live.result(name) for name in ["build", "step"] + [f"warmup {s}" for s in range(opts["warmup"])]})
    out["live_at_peak"] = live.live_at_peak("step", top=8) if device.type == "cpu" else []
    if opts["method"] == "ragged":  # once per (model, checkpointing): the activations the model saves
        out["saved_activation_bytes"] = _saved_activation_bytes(cfg, build_model(cfg, 0, device), batch(0), opts["checkpoint"])
    return out


def unit_bytes(model: str, world: int, split: bool = False) -> dict[str, tuple[int, int]]:
    """Gathered bytes of the largest non-block unit and of the largest block, per method (from shapes
    only: ragged's plans, FSDP2's dim-0 padding to a multiple of W per parameter)."""
    import math

    from ragged import fsdp

    from bench.step import CONFIGS, meta_model

    meta = meta_model(CONFIGS[model])
    units = fsdp.make_units(meta, world_size=world, groups=split_rest if split else None)
    size = {n: units[n].plan.buffer_numel * units[n].plan.dtype.itemsize for n in units.names}
    padded: dict[str, int] = {}
    prefix = "model.layers." if "hf" in CONFIGS[model] else "blocks."  # a block's parameters: prefix + index
    for name, p in meta.named_parameters():
        key = prefix + name[len(prefix):].split(".")[0] if name.startswith(prefix) else (split_rest(name) if split else "rest")
        d0 = p.shape[0] if p.dim() else 1
        padded[key] = padded.get(key, 0) + -(-d0 // world) * world * math.prod(p.shape[1:]) * p.element_size()

    def pick(sizes):
        blocks = [v for k, v in sizes.items() if k.startswith(prefix)]
        return max(v for k, v in sizes.items() if not k.startswith(prefix)), max(blocks)

    return {"ragged": pick(size), "fsdp2": pick(padded)}


def run_cell(model: str, world: int, checkpoint: bool, *, batch: int, warmup: int, units: str = "default", rank: int = 1,
             timeout=1800.0):
    """``{method: result}`` of one (model, W, checkpointing) cell, each method in its own process."""
    from bench._launch import launch
    from bench.step import CONFIGS

    out = {}
    for method in METHODS:
        opts = dict(cfg=CONFIGS[model], method=method, checkpoint=checkpoint, batch=batch, warmup=warmup, units=units)
        out[method] = launch(world, _measure, opts, backend="fake", fake_rank=min(rank, world - 1), timeout=timeout)[0]
    return out


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}"


COLUMNS = ("model", "AC", "W", "ragged peak MiB", "fsdp2 peak MiB", "ragged / fsdp2", "ragged state + rise",
           "fsdp2 state + rise", "rest / largest block MiB, ragged", "same, fsdp2", "saved activations MiB",
           "peak reserved MiB, ragged / fsdp2 (CUDA)", "ragged peak at", "fsdp2 peak at")


def row(model: str, checkpoint: bool, cell: dict, units: str = "default") -> list[str]:
    a, b = cell["ragged"], cell["fsdp2"]
    sa, sb = a["step"], b["step"]
    ub = unit_bytes(model, a["world"], units == "split")
    return [model, "on" if checkpoint else "off", str(a["world"]), _mib(sa["peak"]), _mib(sb["peak"]),
            f"{sa['peak'] / sb['peak']:.2f}x", f"{_mib(sa['start'])} + {_mib(sa['peak'] - sa['start'])}",
            f"{_mib(sb['start'])} + {_mib(sb['peak'] - sb['start'])}",
            " / ".join(_mib(x) for x in ub["ragged"]), " / ".join(_mib(x) for x in ub["fsdp2"]),
            _mib(a["saved_activation_bytes"]), _reserved(sa, sb), sa["where"], sb["where"]]


def _reserved(sa, sb) -> str:
    """The caching allocator's peak reserve of each method's process (CUDA only)."""
    if sa.get("reserved_peak") is None or sb.get("reserved_peak") is None:
        return "-"
    return f"{_mib(sa['reserved_peak'])} / {_mib(sb['reserved_peak'])} ({sa['reserved_peak'] / sb['reserved_peak']:.2f}x)"


def render(rows, console=None):
    from ragged._console import console as make_console
    from rich.table import Table

    console = console or make_console(min_width=200)
    t = Table(title="one rank's peak allocated memory during a training step, fake process group "
                    "(live tensor bytes from construction on; state = live at the step's start)", title_justify="left")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("model", "ragged peak at", "fsdp2 peak at") else "right")
    for r in rows:
        t.add_row(*r)
    console.print(t)


def markdown(rows) -> str:
    cuda = any(r[11] != "-" for r in rows)
    keep = [k for k in range(12) if k < 11 or cuda]  # the reserve column only where it was measured
    lines = ["| " + " | ".join(COLUMNS[k] for k in keep) + " |", "|" + "---|" * len(keep)]
    for r in rows:
        lines.append("| " + " | ".join(r[k] for k in keep) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from bench.step import CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=["120m", "moe-few"])
    ap.add_argument("--world", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--checkpointing", nargs="+", choices=("on", "off"), default=["on"],
                    help="activation checkpointing of every block in both methods")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--warmup", type=int, default=1, help="steps before the measured one (the optimizer state appears in the first)")
    ap.add_argument("--units", choices=("default", "split"), default="default",
                    help="split: embeddings and final norm + head as two units / fully_shard groups in both methods "
                         "(default: one 'rest' unit, FSDP2's root)")
    ap.add_argument("--json", default=None, help="append every cell to this JSON-lines file")
    ap.add_argument("--from-json", default=None, metavar="JSONL", help="do not run: render the cells saved with --json")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="print what is live at each peak (CPU), by allocation site")
    args = ap.parse_args(argv)
    print(f"== fake process group, torch {torch.__version__}, {'CUDA' if torch.cuda.is_available() else 'CPU'} ==",
          flush=True)
    rows, notes = [], []

    def add(model, ac, cell, units):
        rows.append(row(model, ac, cell, units))
        print("  " + " | ".join(rows[-1][:6]), flush=True)
        for name in METHODS if args.breakdown else ():
            notes.append(f"{model}, AC {'on' if ac else 'off'}, W={cell[name]['world']}, {name}: live at the peak, "
                         "by where it was allocated")
            notes.extend(f"    {_mib(b):>8} MiB  x{n:<4} {site}" for b, n, site in cell[name]["live_at_peak"])

    if args.from_json:
        with open(args.from_json) as f:
            for line in f:
                cell = json.loads(line)
                add(cell["model"], cell["checkpointing"], cell, cell.get("units", "default"))
    for model in args.models if not args.from_json else ():
        for ac in args.checkpointing:
            for world in args.world:
                cell = run_cell(model, world, ac == "on", batch=args.batch, warmup=args.warmup, units=args.units)
                add(model, ac == "on", cell, args.units)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(dict(model=model, checkpointing=ac == "on", units=args.units, **cell)) + "\n")
    render(rows)
    print("\n".join(notes))
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
