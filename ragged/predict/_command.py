"""``python -m ragged plan --predict``: a bundled (or ``--shapes``) model lowered at each world size,
mesh and optimizer on an abstract comm, with ragged's per-rank memory and communication next to the
FSDP2 and ZeRO-3 rules (see [Note: lowering a step] in ``ragged/predict/_lower.py`` and [Note: peer
rules of a lowered step] in ``ragged/predict/_peers.py``), the model's activations and the
step's time, both from labelled assumptions (``ragged/predict/_model_costs.py``, ``ragged/predict/_hardware.py``).
``--sweep`` ranks the configurations that fit a memory budget (``ragged/predict/_sweep.py``)."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import time

from ragged import collectives, fsdp, optim, quant, spec
from ragged._cli import DTYPES, UsageError, unit_specs
from ragged._console import console as make_console
from ragged._models import model_units
from ragged.predict._hardware import hardware_from
from ragged.predict._lower import assumed_schedule
from ragged.predict._model_costs import step_activations, unit_costs
from ragged.predict._peers import compare
from ragged.predict._sweep import print_sweep
from ragged.predict._tables import print_predict
from ragged.quant._codec import fits_shape as quant_fits
from ragged.quant._wire import run_unit

__all__ = ["bundled_units", "step_over", "bundled_step", "predict_rows", "mesh_name", "predict_all", "run_predict"]


def bundled_units(source, world_size: int, *, dtype: str = "fp32", granularity=None, strategy: str = "dp", align=None,
                  max_buffers="auto", layers_per_unit: int = 1):
    """``fsdp.make_units`` over ``source``'s units (``ragged.models.model_units``) for a shard group of
    ``world_size`` ranks, each parameter under ``granularity`` where it applies (``unit_specs``)."""
    master = DTYPES[dtype]
    tree = collections.OrderedDict((u.name, collections.OrderedDict(u.params) if isinstance(u.params, dict) else u.params)
                                   for u in model_units(source, dtype=master, layers_per_unit=layers_per_unit))
    granularity = spec.Rows(1) if granularity is None else granularity

    def specs(path, t):  # ``granularity``: a spec, or a function of the tensor (a quantized gather's tiles)
        leaf_specs, _ = unit_specs({"x": t}, granularity(t) if callable(granularity) else granularity)
        return leaf_specs["x"] if isinstance(leaf_specs, dict) else leaf_specs

    return fsdp.make_units(tree, world_size=world_size, groups=lambda path: path[2:path.index("']")], specs=specs,
                           strategy=strategy, align=align, max_buffers=1 if strategy == "naive" else max_buffers)


# plan --predict --gather-format: DeepSeek-V3's 128 x 128 fp8 tiles, 32 x 32 int8 tiles, OCP's MXFP8
GATHER_FORMATS = {"fp8": quant.fp8(block=(128, 128)), "int8": quant.int8(block=(32, 32)), "mxfp8": quant.mxfp8(block=32)}


def where_blocks_fit(fmt):
    """``leaf -> fmt | None``: ``fmt`` for every sharded matrix its blocks tile and its granule
    holds whole (see [Note: which granules hold whole blocks] in ``ragged/quant/_wire.py``); the
    rest travels unquantized in the same collective."""
    def choose(leaf):
        if len(leaf.shape) < 2 or not quant_fits(tuple(leaf.shape), fmt):
            return None
        return fmt if leaf.granule and leaf.granule % run_unit(fmt, leaf.shape[-1]) == 0 else None

    return choose


@functools.lru_cache(maxsize=None)
def _tiles(fmt, otherwise):
    """The granularity of a tensor under a quantized gather: ``fmt``'s ``r x c`` blocks (``r > 1``) for
    every matrix they tile, ``otherwise`` elsewhere (cached: one function, so units are built once)."""
    r, c = fmt.block
    return lambda t: spec.Blocks(r, c) if r > 1 and t.dim() >= 2 and quant_fits(tuple(t.shape), fmt) else otherwise


def step_over(units, *, num_replicas: int = 1, optimizer: str = "adamw", compute_dtype: str = "bf16",
              gather_format: str = "none"):
    """A step over ``units`` on ``rg.collectives.abstract(units.world_size, num_replicas=...)`` (HSDP
    when ``num_replicas > 1``: the units are the shard group's); ``gather_format``: a key of
    ``GATHER_FORMATS`` quantizes the gather wherever the blocks fit (``"none"``: not at all)."""
    comm = collectives.abstract(units.world_size, num_replicas=num_replicas)
    opt = {"adamw": lambda: optim.adamw(1e-3), "adamw8bit": lambda: optim.adamw_8bit(1e-3),
           "muon": lambda: optim.muon(1e-3, comm=comm), "soap": lambda: optim.soap(1e-3),
           "shampoo": lambda: optim.shampoo(1e-3)}[optimizer]()
    gather = None if gather_format == "none" else where_blocks_fit(GATHER_FORMATS[gather_format])
    return fsdp.make_step(units, lambda params, batch: None, opt, comm,
                          policy=fsdp.MixedPrecision(compute_dtype=DTYPES[compute_dtype], gather_format=gather))


def bundled_step(source, world_size: int, *, num_replicas: int = 1, optimizer: str = "adamw", dtype: str = "fp32",
                 compute_dtype: str = "bf16", granularity=None, strategy: str = "dp", align=None, max_buffers="auto",
                 layers_per_unit: int = 1):
    """A step over ``source``'s units on ``rg.collectives.abstract``: ``world_size`` is the shard
    group, ``num_replicas`` HSDP's replica groups.

    Examples:
        >>> step = bundled_step("gpt-oss-120b", 1024)
        >>> len(step.units), step.units.names[:2], step.comm.world_size
        (38, ('embed', 'layers.0'), 1024)
        >>> bundled_step("gpt-oss-120b", 512, num_replicas=2).comm.num_replicas
        2
    """
    units = bundled_units(source, world_size, dtype=dtype, granularity=granularity, strategy=strategy, align=align,
                          max_buffers=max_buffers, layers_per_unit=layers_per_unit)
    return step_over(units, num_replicas=num_replicas, optimizer=optimizer, compute_dtype=compute_dtype)


def mesh_name(replicas: int) -> str:
    """``"fsdp"`` for one replica group, else ``"hsdp:R"``."""
    return "fsdp" if replicas == 1 else f"hsdp:{replicas}"


def predict_rows(step, *, activations=None, network=None, compute=None, backward_factor: float = 2.0,
                 progress=lambda line: None) -> dict:
    """Everything ``--predict`` prints for one lowered step, as plain values (``--json``): with
    ``network``, also ``lowered.estimate_time(network, compute=..., backward_factor=...)``.
    ``progress(line)`` hears each step of the work."""
    t0 = time.perf_counter()
    lowered = step.lower(activations=activations, progress=progress)
    progress("memory and collectives")
    mem, cost = lowered.memory_analysis(), lowered.cost_analysis()
    progress("the FSDP2 and ZeRO-3 rules")
    peers = compare(lowered)
    replicas = step.comm.num_replicas
    row = {
        "world_size": step.comm.world_size * replicas,
        "mesh": mesh_name(replicas),
        "shard_size": step.comm.world_size,
        "replicas": replicas,
        "units": len(step.units),
        "persistent_bytes": mem.persistent_bytes,
        "by_category": mem.by_category,
        "max_rank": mem.max_rank,
        "min_rank": mem.min_rank,
        "min_bytes": mem.min_bytes,
        "peak_bytes": mem.peak_bytes,
        "peak_at": list(mem.peak_at),
        "peak_parts": mem.peak_parts,
        "collectives": [dict(kind=c.kind, axis=c.axis, calls=c.calls, bytes=c.bytes) for c in cost.collectives],
        "systems": {r.system: dict(persistent_bytes=r.persistent_bytes, by_category=r.by_category,
                                   gather_bytes=r.gather_bytes, reduce_bytes=r.reduce_bytes,
                                   largest_gathered_bytes=r.largest_gathered_bytes) for r in peers},
        "assumed": list(dict.fromkeys(mem.assumed + cost.assumed)),
    }
    if network is not None:
        progress("step time")
        t = lowered.estimate_time(network, compute=compute, backward_factor=backward_factor)
        links = {"shard": network.shard, "replica": network.replica}
        row["time"] = {"seconds": t.seconds, "compute": t.parts["compute"], "exposed_comm": t.parts["exposed_comm"],
                       "comm": t.parts["comm"], "backward_factor": backward_factor,
                       "links": {axis: dict(alpha=link.alpha, bandwidth=link.bandwidth)
                                 for axis, link in links.items() if link is not None}}
        row["assumed"] = list(dict.fromkeys(row["assumed"] + list(t.assumed)))
    row["lower_seconds"] = time.perf_counter() - t0
    return row


def _configs(args) -> list[tuple[int, int, str, str]]:
    """``(world, replicas, optimizer, gather format)`` for every combination asked for; a mesh must
    split each world."""
    meshes = list(dict.fromkeys(args.mesh or [1]))
    for m in args.world_size:
        for r in meshes:
            if m % r:
                raise UsageError(f"--mesh hsdp:{r} does not divide --world-size {m}: HSDP's {r} replica groups must "
                                 f"split the world evenly (shard group = world / {r}); pick an R that divides every "
                                 "world size, e.g. hsdp:2")
    return [(m, r, opt, g) for m in args.world_size for r in meshes for opt in dict.fromkeys(args.optimizer)
            for g in dict.fromkeys(getattr(args, "gather_format", None) or ["none"])]


def _activation_note(args) -> str:
    ckpt = ("--checkpointing: 2·s·b·h per layer kept plus one layer's 34·s·b·h recomputed in its backward"
            if args.checkpointing else "no checkpointing: 34·s·b·h per layer (flash attention: no 5·a·s²·b term)")
    return (f"activations: ANALYTIC, ASSUMED (Korthikanti et al. 2022, arXiv:2205.05198; 16-bit, s={args.seq_len}, "
            f"b={args.batch}): {ckpt}; output layer 4·s·b·h + fp32 logits 4·s·b·v; each backward also holds "
            "4·s·b·h of gradients (see [Note: activations of a unit] in ragged/predict/_model_costs.py)")


def _compute_note(args) -> str:
    return (f"compute: forward flops = 2 x the parameters a token uses (routed experts: top-k of E; the embedding "
            f"a lookup; attention scores not counted), tokens per rank per step = --seq-len x --batch = "
            f"{args.seq_len * args.batch}; backward = {3 if args.checkpointing else 2} x forward"
            + (" (recomputation; the head, not recomputed, is over by one forward)" if args.checkpointing else "")
            + "; seconds = flops / (peak x MFU); optimizer update 0 s")


def predict_all(args) -> list[dict]:
    """One :func:`predict_rows` row per ``(world, mesh, optimizer)`` of ``args``, with the model's
    analytic activations and step time (the units of one shard group are built once)."""
    hw = hardware_from(args)
    configs = _configs(args)
    source = args.model or args.shapes
    costs = unit_costs(source, seq_len=args.seq_len, batch=args.batch, checkpointing=args.checkpointing,
                       layers_per_unit=args.layers_per_unit)
    by_name = {c.name: c for c in costs}
    compute = {c.name: hw.seconds(c.flops_per_token * args.seq_len * args.batch) for c in costs}
    units, results = {}, []
    with _progress() as say:
        for i, (world, replicas, optimizer, gather) in enumerate(configs):
            where = f"[{i + 1}/{len(configs)}] m={world} {mesh_name(replicas)} {optimizer}" + (
                f"+{gather}" if gather != "none" else "")

            def progress(line, where=where):
                say(f"{where}: {line}")

            t0 = time.perf_counter()
            shard = world // replicas
            granularity = args.granularity if gather == "none" else _tiles(GATHER_FORMATS[gather], args.granularity)
            if (shard, granularity) not in units:
                progress(f"planning {len(costs)} units over a shard group of {shard} ranks")
                units[shard, granularity] = bundled_units(source, shard, dtype=args.dtype, granularity=granularity,
                                                          strategy=args.strategy, align=args.align,
                                                          max_buffers=args.max_buffers,
                                                          layers_per_unit=args.layers_per_unit)
            step = step_over(units[shard, granularity], num_replicas=replicas, optimizer=optimizer,
                             compute_dtype=args.compute_dtype, gather_format=gather)
            build = time.perf_counter() - t0
            activations = step_activations([by_name[n] for n in step.units.names], assumed_schedule(step.units))
            row = predict_rows(step, activations=activations, network=hw.network(shard=shard, replicas=replicas),
                               compute=compute, backward_factor=3.0 if args.checkpointing else 2.0, progress=progress)
            # the lowering's lines say activations and compute were given; these notes say how (analytic, assumed)
            row["assumed"] = ([_activation_note(args), _compute_note(args)] + hw.assumed()
                              + [a for a in row["assumed"] if not a.startswith(("activations:", "compute:"))])
            if gather != "none":  # the tables show the configuration in the optimizer's column
                optimizer = f"{optimizer}+{gather}"
            row.update(model=str(source), optimizer=optimizer, dtype=args.dtype, compute_dtype=args.compute_dtype,
                       gather_format=gather, quantized_share=_quantized_share(step) if gather != "none" else 0.0,
                       seq_len=args.seq_len, batch=args.batch, checkpointing=args.checkpointing,
                       flops_per_token=sum(c.flops_per_token for c in costs), build_seconds=build)
            results.append(row)
    return results


def _quantized_share(step) -> float:
    """The share of the sharded elements the step's gather quantizes."""
    total = done = 0
    for unit, lay in zip(step.units, step.value_and_grad.layouts):
        for leaf in unit.plan.leaves:
            total += leaf.numel
            done += leaf.numel if lay.gather_formats and lay.gather_formats[leaf.index] is not None else 0
    return done / total if total else 0.0


@contextlib.contextmanager
def _progress():
    """``say(line)`` for the work's progress, on stderr (stdout stays the tables, or ``--json``): in
    a terminal one status line that changes; elsewhere (a log) one line each, as it happens."""
    err = make_console(stderr=True)
    if err.is_terminal:
        with err.status("plan --predict") as status:
            yield lambda line: status.update(f"plan --predict: {line}")
    else:
        yield lambda line: err.print(f"plan --predict: {line}", markup=False, highlight=False)


def run_predict(args, console) -> int:
    """``plan --predict`` / ``--sweep``: every configuration lowered, then printed (tables, or JSON
    on stdout with ``--json``)."""
    results = predict_all(args)
    if args.sweep:
        return print_sweep(results, args.memory, console, as_json=args.json)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_predict(results, args, console)
        for r in results:
            if r["gather_format"] != "none":
                fmt = GATHER_FORMATS[r["gather_format"]]
                console.print(f"[dim]gather: m={r['world_size']} {r['mesh']} {r['optimizer']}: {fmt!r} quantizes "
                              f"{r['quantized_share']:.1%} of the sharded elements (the matrices it tiles, planned "
                              "with its blocks); the rest travels unquantized in the same collective[/]")
    return 0
