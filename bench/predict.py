"""Prediction vs measurement: ``step.lower(...)`` against bench/memory.py's fake process group.

For each model, world size W and activation-checkpointing setting:

* measured: ``bench/memory.py``'s cell (one process per method, rank 1 of a W-rank fake process
  group, every allocation real): ragged's and FSDP2's live bytes at the measured step's start
  ("state") and its peak (``bench/_measure.LiveBytes``);
* predicted: the same ragged configuration (``bench/_methods.RaggedMethod``: every block and the
  rest as units, fp32, ``rg.optim.adamw(donate=True)``) built on ``rg.collectives.abstract(W,
  rank=1)`` and lowered with ``rg.predict.profile_activations`` of the same step at W = 1 (simulated
  backend, one real step first, then the profile on the measured step's batch: the model's own
  bytes do not depend on W), so nothing in the prediction is measured at W; the peak compared is
  ``peak_bytes_low`` (reduce-scatters done by the next point: the fake group's collectives return
  at once), ``peak_bytes`` (waited as late as the runtime may) is shown next to it; FSDP2's
  persistent bytes by its rule (``ragged/predict/_peers.py``). Both add the module's own buffers (HF Llama's
  rotary ``inv_freq``), which stay in the module beside the state;

``--time``: the step time instead (``bench/_predict_time.py``): ``estimate_time`` from per-unit
compute measured at W = 1 and an alpha-beta line fitted on gloo at W, against the measured gloo step
at W = 2, 4 of eight configurations of one model, with Kendall's tau of their order.

``--exact``: the persistent bytes by category and every collective (calls and bytes per kind and axis)
instead, exact against two real steps on the fake group at W (``--backend gloo``: on W real gloo ranks,
both transports), for single / multi-buffer plans, AdamW / 8-bit AdamW, FSDP / HSDP
(``bench/_predict_exact.py``).

The error columns are (predicted - measured) / measured. Usage::

    python3 bench/predict.py --models dense moe --world 8 64 256 --checkpointing on off
    python3 bench/predict.py --models tiny --world 8           # seconds
    python3 bench/predict.py --models moe --world 8 64 256 --checkpointing off on --diagnose
    python3 bench/predict.py --time --models dense --world 2 4     # step time vs gloo (bench/_predict_time.py)
    python3 bench/predict.py --exact --models tiny --world 8       # state + collectives exact (bench/_predict_exact.py)
    python3 bench/predict.py --exact --backend gloo --models tiny --world 2 4   # the same on real gloo ranks
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402


def _learn(comm, cfg, checkpoint, batch):
    """The model's own bytes at every point of the step at W = 1 (``rg.predict.profile_activations``; its schedule
    is the learnt one)."""
    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import SyntheticLM

    from bench._methods import build_model, ragged_loss
    from bench.step import model_config

    config = model_config(cfg)
    model = build_model(config, 0, torch.device("cpu"))
    units = fsdp.make_units(model, world_size=1)
    opt = rg.optim.adamw(1e-3, weight_decay=0.0, donate=True)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, ragged_loss(config, model, checkpoint), opt, comm, donate=True)
    task = SyntheticLM(cfg["vocab_size"], cfg["max_seq_len"], seed=0)
    state, _ = step(state, task.batch(0, batch))
    return rg.predict.profile_activations(step, state, task.batch(1, batch))


def _profile_at_world(rank, world, backend, opts):
    """Diagnostic only (``--diagnose``): the same profile taken on the fake process group at W itself,
    where the gathered weights are whatever the fake collectives left in the buffers."""
    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import SyntheticLM

    from bench._methods import RaggedMethod
    from bench.step import model_config

    cfg = opts["cfg"]
    method = RaggedMethod(model_config(cfg), comm=rg.collectives.from_torch(), seed=0, device=torch.device("cpu"), lr=1e-3,
                          policy="fp32", checkpoint=opts["checkpoint"])
    task = SyntheticLM(cfg["vocab_size"], cfg["max_seq_len"], seed=0)
    method.step(task.batch(0, opts["batch"]))
    return rg.predict.profile_activations(method.step_fn, method.state, task.batch(1, opts["batch"]))


def predict(model: str, world: int, checkpoint: bool, batch: int, *, at_world: bool = False) -> dict:
    """The lowering's state and peak; ``at_world``: with the profile taken on the fake group at W (a
    diagnostic: it splits the error into what the data changes and what the model misses)."""
    import ragged as rg
    from ragged import fsdp
    from ragged.predict._peers import compare

    from bench._launch import launch
    from bench.step import CONFIGS, meta_model

    cfg = CONFIGS[model]
    if at_world:
        opts = dict(cfg=cfg, checkpoint=checkpoint, batch=batch)
        activations = launch(world, _profile_at_world, opts, backend="fake", fake_rank=min(1, world - 1), timeout=1800)[0]
    else:
        (activations,) = rg.collectives.simulate(1, _learn, cfg, checkpoint, batch)
    meta = meta_model(cfg)
    units = fsdp.make_units(meta, world_size=world)
    # the module's buffers (HF Llama's rotary inv_freq) stay in the module, live beside the TrainState
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
    opt = rg.optim.adamw(1e-3, weight_decay=0.0, donate=True)
    step = fsdp.make_step(units, lambda p, b: None, opt, rg.collectives.abstract(world, rank=min(1, world - 1)),
                          donate=True)
    lowered = step.lower(activations=activations, max_ranks=max(2, world))
    mem = lowered.memory_analysis()
    unit, phase, _ = max(lowered.timeline(early=True)[0], key=lambda p: sum(p[2].values()))  # where peak_bytes_low is
    low_at = f"{unit} {phase}"
    peers = {r.system: r for r in compare(lowered)}
    return dict(state=mem.per_rank[min(1, world - 1)] + buffers, peak=mem.peak_bytes + buffers,
                peak_low=mem.peak_bytes_low + buffers, peak_at=low_at, module_buffers=buffers,
                activations=activations.saved, model_peak=activations.peak, parts=mem.peak_parts,
                fsdp2_state=peers["fsdp2"].persistent_bytes + buffers)


def _mib(n) -> str:
    return f"{n / 2**20:,.2f}"


def _err(p, m) -> str:
    return f"{(p - m) / m:+.1%} ({p - m:+,} B)" if m else "-"


COLUMNS = ("model", "AC", "W", "ragged state MiB pred / meas", "err", "ragged peak MiB pred / meas", "err",
           "peak MiB, reduce-scatters waited late", "fsdp2 state MiB rule / meas", "err",
           "model's own MiB (W=1): saved / most", "ragged peak at (pred / meas)")
DIAGNOSE = ("peak MiB, profiled at W (diagnostic)", "err")


def main(argv=None) -> int:
    from bench.memory import run_cell
    from bench.step import CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=["dense", "moe"])
    ap.add_argument("--world", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--checkpointing", nargs="+", choices=("on", "off"), default=["on", "off"])
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--diagnose", action="store_true",
                    help="also lower with the profile taken on the fake group at W (not a prediction: measured at W)")
    ap.add_argument("--time", action="store_true",
                    help="step time instead: estimate_time calibrated at W=1 and on gloo vs the measured gloo step "
                         "(bench/_predict_time.py; --world: the gloo world sizes, default 2 4)")
    ap.add_argument("--repeats", type=int, default=5, help="--time: measured steps per configuration")
    ap.add_argument("--settings", nargs="+", default=None, help="--time: configurations (default: all)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="--time: also write the results as JSON (bench/report.py record predict-time -- ...)")
    ap.add_argument("--exact", action="store_true",
                    help="state by category and collectives per kind and axis, exact vs two real steps at W on the fake "
                         "group (bench/_predict_exact.py)")
    ap.add_argument("--plans", nargs="+", choices=("single", "multi"), default=["single", "multi"], help="--exact")
    ap.add_argument("--optimizers", nargs="+", choices=("adamw", "adamw8bit"), default=["adamw", "adamw8bit"],
                    help="--exact")
    ap.add_argument("--meshes", nargs="+", choices=("fsdp", "hsdp"), default=["fsdp", "hsdp"], help="--exact")
    ap.add_argument("--backend", choices=("fake", "gloo"), default="fake",
                    help="--exact: rank 1 of a W-rank fake group (default), or W real gloo ranks, every rank compared, "
                         "in both transports (--world 2 4)")
    args = ap.parse_args(argv)
    if args.time:
        return _time(args)
    if args.exact:
        from bench._predict_exact import run

        where = "the fake process group" if args.backend == "fake" else "gloo, every rank"
        print(f"== lowering vs two real steps on {where}, torch {torch.__version__}, CPU ==", flush=True)
        results = run(args.models, args.world, args.plans, args.optimizers, args.meshes, backend=args.backend,
                      out=lambda line: print(line, flush=True))
        return 0 if all(r["exact"] for r in results) else 1
    cols = COLUMNS + (DIAGNOSE if args.diagnose else ())
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    print(f"== prediction vs fake process group, torch {torch.__version__}, CPU ==", flush=True)
    for model in args.models:
        for ac in args.checkpointing:
            for world in args.world:
                p = predict(model, world, ac == "on", args.batch)
                cell = run_cell(model, world, ac == "on", batch=args.batch, warmup=1)
                a, b = cell["ragged"]["step"], cell["fsdp2"]["step"]
                row = [model, ac, str(world), f"{_mib(p['state'])} / {_mib(a['start'])}", _err(p["state"], a["start"]),
                       f"{_mib(p['peak_low'])} / {_mib(a['peak'])}", _err(p["peak_low"], a["peak"]), _mib(p["peak"]),
                       f"{_mib(p['fsdp2_state'])} / {_mib(b['start'])}", _err(p["fsdp2_state"], b["start"]),
                       f"{_mib(p['activations'])} / {_mib(p['model_peak'])}", f"{p['peak_at']} / {a['where']}"]
                if args.diagnose:
                    d = predict(model, world, ac == "on", args.batch, at_world=True)
                    row += [_mib(d["peak_low"]), _err(d["peak_low"], a["peak"])]
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


def _time(args) -> int:
    import json

    from bench._predict_time import SETTINGS, markdown, run

    worlds = [2, 4] if args.world == [8, 64, 256] else args.world
    print(f"== step time: prediction vs gloo, torch {torch.__version__}, CPU, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS')} ==", flush=True)
    results = []
    for model in args.models:
        results.append(run(model, worlds, args.settings or list(SETTINGS), repeats=args.repeats, warmup=1,
                           batch=args.batch, sizes_mib=(1, 4, 16, 32, 64, 128), iters=9))
        print(f"\n{model}: {results[-1]['cores']} CPU cores visible\n" + "\n\n".join(markdown(results[-1])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
