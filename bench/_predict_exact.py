"""``bench/predict.py --exact``: ``step.lower()`` on an abstract comm against real steps on torch's fake
process group, to the byte.

Every cell is one (model, plan, optimizer, mesh, W):

* measured: a fresh process joins a W-rank fake process group as rank 1 (``bench/_launch.py``;
  collectives move no data, every allocation is real), builds ``bench/_methods.RaggedMethod`` (every
  block and the rest as units, fp32, ``donate=True``) over NCCL's transport
  (``from_torch(handshake="deferred")``; HSDP: a ``(2, W/2)`` DeviceMesh, rank 1
  is shard rank 1 of replica 0), runs two steps on one sequence of the model's length (the first
  learns the collective schedule) and counts every collective of the second at two boundaries
  (``bench/_counts.CommCounter``): ragged's ``Collectives`` object and torch's process groups; the
  unique storages of its ``TrainState``, by category, after it;
* predicted: the same configuration built on ``rg.collectives.abstract(W or W/2, rank=1,
  num_replicas=1 or 2, handshake="deferred")`` over the ``meta`` model, ``step.lower()`` with the
  schedule one step learnt at W = 1 (simulated backend): nothing measured at W enters it.

Exact means equal: every category's bytes, every (kind, axis)'s calls and bytes at the ``Collectives``
boundary. torch's count is compared with ragged's and every difference is named: the fake group is
not NCCL, so a multi-buffer plan's coalesced call is one torch call per buffer (NCCL: one coalesced
launch); and the deferred ledger's own check (an all-reduce of two int64 every ``verify_every`` = 64
recorded calls, issued beside ragged's calls, see ``ragged/collectives/_ledger.py``).

``backend="gloo"`` (W = 2, 4): the same cells on W real gloo processes, every rank measured and compared
with the lowering at its rank, in both transports: NCCL's shape (above) and gloo's default (per-call
headers over checked send / recv and all-to-all: the lowering's count is the ``Collectives`` boundary's;
at torch's boundary those paths' messages are shown, not compared, since they are the transport's
algorithm and not the step's collectives).
"""

from __future__ import annotations

import torch

# plan: max_buffers; optimizer: (8-bit specs: Blocks for matrices, as bench/step.py's --optim adamw8bit)
PLANS = {"single": 1, "multi": "auto"}
OPTIMIZERS = ("adamw", "adamw8bit")
MESHES = ("fsdp", "hsdp")
TRANSPORTS = {"nccl-shaped": dict(handshake="deferred"), "gloo-default": dict(handshake="header")}
LEDGER_EVERY = 64  # from_torch's verify_every default: the ledger checks itself every 64 recorded calls
SEQUENCES = 1  # per rank and step: activations enter none of the compared numbers


def _optimizer(name: str):
    """``(optimizer, specs)`` of a cell (the bench's: ``bench/_methods.RaggedMethod`` / ``bench/step.py``)."""
    import ragged as rg
    from ragged import spec

    if name == "adamw8bit":
        return (rg.optim.adamw_8bit(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, donate=True),
                lambda path, t: spec.Blocks(32, 32) if t.dim() >= 2 else spec.Rows(1))
    return rg.optim.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, donate=True), None


def _method(model: str, comm, plan: str = "single", optimizer: str = "adamw"):
    from bench._methods import RaggedMethod
    from bench.step import CONFIGS, model_config

    opt, specs = _optimizer(optimizer)
    return RaggedMethod(model_config(CONFIGS[model]), comm=comm, seed=0, device=torch.device("cpu"), lr=1e-3,
                        policy="fp32", optimizer=opt, specs=specs, max_buffers=PLANS[plan])


def _batch(model: str, step: int):
    from ragged.examples.data import SyntheticLM
    from bench.step import CONFIGS

    cfg = CONFIGS[model]
    return SyntheticLM(cfg["vocab_size"], cfg["max_seq_len"], seed=0).batch(step, SEQUENCES)


def learn_schedule(model: str):
    """The collective schedule one step of ``model`` learns at W = 1 (it does not depend on W)."""
    import ragged as rg

    def one_step(comm):
        method = _method(model, comm)
        method.step(_batch(model, 0))
        return method.step_fn.value_and_grad.memo.schedule

    return rg.collectives.simulate(1, one_step)[0]


def _measure(rank, world, backend, cell):
    """In a launched process (rank 1 of the fake group, or a gloo rank): two steps, the second counted."""
    import torch.distributed as dist

    import ragged as rg
    from bench._counts import CommCounter, storage_by_category

    mesh = None
    if cell["mesh"] == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    comm = rg.collectives.from_torch(mesh, **TRANSPORTS[cell["transport"]], verify_every=cell["verify_every"])
    method = _method(cell["model"], comm, cell["plan"], cell["optimizer"])
    ragged, torch_ = CommCounter(), CommCounter()
    ragged.install_comm(comm, "step")
    torch_.install_torch("step", axes={comm.group or dist.group.WORLD: "shard", comm.replica_group: "replica"})
    ledger = comm._ledger  # none under gloo's header transport
    for s in range(2):
        before = list(ledger.calls) if ledger is not None else []
        ragged.active = torch_.active = "step" if s == 1 else None
        method.step(_batch(cell["model"], s))
    ragged.active = torch_.active = None
    # the ledger's own checks in the counted step: one each time its record count reached a multiple of verify_every
    every = cell["verify_every"]
    checks = {axis: calls // every - b // every
              for axis, calls, b in zip(("shard", "replica")[: 1 + (comm.replica_group is not None)], ledger.calls, before)
              } if ledger is not None else {}
    return dict(rank=(comm.replica_rank, comm.rank), shard_size=comm.world_size, state=storage_by_category(method.state),
                calls=ragged.records("step"), parts=ragged.parts_of("step"),
                objects=ragged.calls[("step", "object", "mesh")], torch=torch_.records("step"), ledger_checks=checks,
                schedule=method.step_fn.value_and_grad.memo.schedule)


def predict(cell: dict, world: int, schedule, rank: int = 1) -> dict:
    """The lowering of ``cell`` at ``world`` ranks on an abstract comm (shard rank ``rank``'s view)."""
    import ragged as rg
    from ragged import fsdp
    from bench.step import CONFIGS, meta_model

    shard, replicas = (world // 2, 2) if cell["mesh"] == "hsdp" else (world, 1)
    opt, specs = _optimizer(cell["optimizer"])
    units = fsdp.make_units(meta_model(CONFIGS[cell["model"]]), world_size=shard, specs=specs,
                            max_buffers=PLANS[cell["plan"]])
    comm = rg.collectives.abstract(shard, rank=rank, num_replicas=replicas,
                                   handshake=TRANSPORTS[cell["transport"]]["handshake"])
    lowered = fsdp.make_step(units, lambda p, b: None, opt, comm, donate=True).lower(schedule=schedule,
                                                                                      max_ranks=max(2, shard))
    cost = lowered.cost_analysis()
    return dict(state={k: v for k, v in lowered.state_bytes[rank].items() if v}, objects=cost.objects,
                calls={(c.kind, c.axis): (c.calls, c.bytes) for c in cost.collectives})


def _diff(pred: dict, meas: dict, name=str) -> list[str]:
    return [f"{name(k)} pred {pred.get(k)} / meas {meas.get(k)}" for k in sorted(set(pred) | set(meas), key=str)
            if pred.get(k) != meas.get(k)]


def torch_vs_ragged(m: dict, transport: str = "nccl-shaped") -> str:
    """How torch's count differs from ragged's, each difference named; ``UNEXPLAINED ...`` otherwise
    (gloo's default transport: its point-to-point messages, shown)."""
    if transport == "gloo-default":
        return "header paths: " + "; ".join(f"{axis} {c} {kind}s / {b:,} B" for (kind, axis), (c, b) in sorted(m["torch"].items()))
    expected = {}
    for key, (calls, nbytes) in m["calls"].items():
        if key[1] == "shard" and m["shard_size"] == 1:
            continue  # a shard group of one rank: ragged copies locally, no torch call
        extra = m["ledger_checks"].get(key[1], 0) if key[0] == "all_reduce" else 0
        expected[key] = (m["parts"][key] + extra, nbytes + 16 * extra)
    bad = _diff(expected, m["torch"], lambda k: "/".join(k))
    if bad:
        return "UNEXPLAINED: " + "; ".join(bad)
    notes = [f"+{m['parts'][k] - c} {k[0]} (per buffer)" for k, (c, _) in sorted(m["calls"].items())
             if m["parts"][k] > c and k in expected]
    notes += [f"+{n} all_reduce {axis} (ledger check, 16 B)" for axis, n in m["ledger_checks"].items() if n]
    if m["shard_size"] == 1:
        notes.append("shard group of 1: its calls are local copies, no torch call")
    return "1:1" if not notes else "; ".join(notes)


def compare(cell: dict, world: int, schedule, measured: dict, rank: tuple[int, int] = (0, 1)) -> dict:
    """One table row's values: what was measured at ``rank`` (replica, shard rank), and whether the lowering
    equals it."""
    p = predict(cell, world, schedule, rank[1])
    bad = _diff(p["state"], measured["state"]) + _diff(p["calls"], measured["calls"], lambda k: "/".join(k))
    if p["objects"] != measured["objects"]:
        bad.append(f"all_gather_object pred {p['objects']} / meas {measured['objects']}")
    if measured["schedule"] != schedule:
        bad.append("the run at W learnt another schedule than W = 1")
    if tuple(measured["rank"]) != tuple(rank):
        bad.append(f"measured (replica, rank) {measured['rank']}, not {rank}")
    return dict(exact=not bad, lowered="exact" if not bad else "MISMATCH: " + "; ".join(bad),
                torch=torch_vs_ragged(measured, cell["transport"]), **{k: measured[k] for k in ("state", "calls")})


COLUMNS = ("model", "plan", "optimizer", "mesh", "W", "backend: transport", "state B (categories)",
           "all_gather calls / B", "reduce_scatter calls / B", "all_reduce calls / B: shard; replica",
           "lowered vs measured", "torch boundary vs ragged")


def row(cell: dict, world: int, r: dict) -> str:
    def cb(kind, axis="shard"):
        c, b = r["calls"].get((kind, axis), (0, 0))
        return f"{c} / {b:,}"

    ar = cb("all_reduce") + ("; " + cb("all_reduce", "replica") if cell["mesh"] == "hsdp" else "")
    state = f"{sum(r['state'].values()):,} ({len(r['state'])})"
    return "| " + " | ".join([cell["model"], cell["plan"], cell["optimizer"], cell["mesh"], str(world),
                              f"{cell['backend']}: {cell['transport']}", state, cb("all_gather"), cb("reduce_scatter"),
                              ar, r["lowered"], r["torch"]]) + " |"


def measure_and_compare(cell: dict, world: int, schedule, *, verify_every: int, timeout: float) -> dict:
    """One cell: measured (rank 1 of the fake group, or every gloo rank) and compared with the lowering.
    The row shows rank 1's numbers; on gloo it is exact only when every rank is."""
    from bench._launch import launch

    fake = cell["backend"] == "fake"
    measured = launch(world, _measure, dict(cell, verify_every=verify_every), backend=cell["backend"],
                      fake_rank=1, timeout=timeout)
    shard = world // 2 if cell["mesh"] == "hsdp" else world
    ranks = [(0, 1)] if fake else [divmod(r, shard) for r in range(world)]
    results = [compare(cell, world, schedule, m, rank) for m, rank in zip(measured, ranks)]
    shown = results[0] if fake else results[1]
    wrong = [f"rank {r}: {res['lowered']}" for r, res in zip(range(world), results) if not res["exact"]]
    if fake or not wrong:
        lowered = shown["lowered"] if fake else f"exact, all {world} ranks"
    else:
        lowered = "; ".join(wrong)
    return dict(shown, exact=not wrong, lowered=lowered)


def run(models, worlds, plans=tuple(PLANS), optimizers=OPTIMIZERS, meshes=MESHES, *, backend="fake", transports=None,
        verify_every=LEDGER_EVERY, timeout=1800.0, out=print):
    """Every cell, fresh processes each; prints the table's rows as they come. Returns the rows' results.
    ``backend``: ``"fake"`` (rank 1 of a W-rank fake group) or ``"gloo"`` (W real ranks, each compared);
    ``transports``: default NCCL's shape on the fake group, both on gloo. ``verify_every``: the
    transport's (a smaller one puts the ledger's own checks in the counted step)."""
    transports = transports or (["nccl-shaped"] if backend == "fake" else list(TRANSPORTS))
    out("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    results = []
    for model in models:
        schedule = learn_schedule(model)
        for world in worlds:
            for mesh in meshes:
                for transport in transports:
                    for plan in plans:
                        for optimizer in optimizers:
                            cell = dict(model=model, plan=plan, optimizer=optimizer, mesh=mesh, backend=backend,
                                        transport=transport)
                            res = measure_and_compare(cell, world, schedule, verify_every=verify_every, timeout=timeout)
                            results.append(dict(cell, world=world, **res))
                            out(row(cell, world, results[-1]))
    exact = sum(r["exact"] for r in results)
    out(f"\n{exact} of {len(results)} cells exact (state by category; collectives by kind and axis)")
    return results
