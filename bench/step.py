"""Training step, ragged vs PyTorch FSDP2, side by side in one run.

The same GPT (``ragged.examples.gpt``; ``--model hf-llama``: a Hugging Face ``LlamaForCausalLM``
of the sizes of ``dense``), the same processes, backend, batches, initial weights and dtype
policy, trained with

* ``ragged``: ``rg.fsdp.make_step`` (every block + the rest as units, ``rg.optim.adamw``) on the
  module itself, whose own weights ``fsdp.init`` released (``--keep-module`` keeps them);
* ``fsdp2``: ``fully_shard`` on every block and the root (``reshard_after_forward=True``,
  default prefetch), ``torch.optim.AdamW`` (``foreach=True``);
* ``local``: the unsharded model on every rank, no communication (the compute floor;
  ``--no-local`` drops it).

Each repeat runs one step of every method on the same batch, the order alternating between
repeats; warm-up steps are excluded. Reported: median step time (max over ranks) and its
spread, tokens/s, per-rank peak allocated tensor bytes (state kept between steps + the rise
during a step), the RSS a step adds, bytes communicated per step, host time in copies, the
ratios ragged / FSDP2, the losses of both (they train the same model on the same data, so
they agree to float rounding), and a profile of where each method's time goes. See
``bench/_measure.py`` for how each number is taken.

Usage (CPU, gloo; each under ~5 minutes on a quiet 2-core machine)::

    python3 bench/step.py --model dense --world 2 4
    python3 bench/step.py --model moe --world 2
    python3 bench/step.py --model 120m --world 2 --repeats 3
    python3 bench/step.py --model dense --world 2 --policy bf16
    python3 bench/step.py --model 120m --world 2 --repeats 3 --no-local --no-donate
    python3 bench/step.py --model hf-llama --world 2 --repeats 5   # HF LlamaForCausalLM, the sizes of "dense"
    python3 bench/step.py --model hf-llama --world 2 --lora        # fine-tuning with peft LoRA (r=8 on q/v)
    python3 bench/step.py --model moe --world 2 --auto-buffers --no-local --repeats 15   # max_buffers="auto" vs 1
    python3 bench/step.py --model dense --world 2 --nccl-shaped --no-local                # NCCL's transport beside

On a machine with >= W GPUs the same command uses NCCL, one GPU per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# model, sequence length and per-rank batch (torch-notes "FSDP2 baseline on this machine")
CONFIGS = {
    "dense": dict(vocab_size=8192, dim=512, num_layers=4, num_heads=8, ffn_dim=1408, max_seq_len=256),
    "moe": dict(vocab_size=8192, dim=512, num_layers=4, num_heads=8, ffn_dim=1408, max_seq_len=256,
                num_experts=8, moe_every=2, top_k=2),
    "120m": dict(vocab_size=16384, dim=768, num_layers=12, num_heads=12, ffn_dim=2304, max_seq_len=256),
    # FSDP2 pads heavily: 2 fused experts in every block over 4 ranks (dim 0 = 2 < W)
    "moe-few": dict(vocab_size=8192, dim=512, num_layers=4, num_heads=8, ffn_dim=1408, max_seq_len=256,
                    num_experts=2, moe_every=1, top_k=1),
    "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, ffn_dim=96, max_seq_len=32),
    "tiny-moe": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, ffn_dim=96, max_seq_len=32,
                     num_experts=4, moe_every=2, top_k=2),
    # Hugging Face LlamaForCausalLM with the sizes of "dense" (rotary instead of learned positions, untied head)
    "hf-llama": dict(hf="llama", vocab_size=8192, dim=512, num_layers=4, num_heads=8, ffn_dim=1408, max_seq_len=256),
    "tiny-hf-llama": dict(hf="llama", vocab_size=256, dim=64, num_layers=2, num_heads=4, ffn_dim=96, max_seq_len=32),
}


def model_config(cfg: dict):
    """A ``GPTConfig``, or a ``transformers`` config when ``cfg`` has ``hf`` (``ragged.examples.hf``)."""
    if "hf" in cfg:
        from ragged.examples import hf

        return hf.config(cfg["hf"], vocab_size=cfg["vocab_size"], dim=cfg["dim"], layers=cfg["num_layers"],
                         heads=cfg["num_heads"], ffn=cfg["ffn_dim"], seq=cfg["max_seq_len"])
    from ragged.examples.gpt import GPTConfig

    return GPTConfig(**cfg)


def meta_model(cfg: dict):
    """The model of ``cfg`` on ``meta`` (no memory, no init): for plans and lowering."""
    config = model_config(cfg)
    if "hf" in cfg:
        from ragged.examples import hf

        return hf.build(config, device="meta")
    from ragged.examples.gpt import GPT

    return GPT(config, device="meta")


def _bench(rank, world, backend, opts):
    import ragged as rg
    from ragged.examples.data import SyntheticLM, rank_slice

    from bench._launch import device_for
    from bench._counts import CommCounter
    from bench._measure import Timer, process_work, profile_step, ragged_labels, reset_peak_rss, rss, storage_bytes
    from bench._methods import FSDP2Method, LocalMethod, RaggedMethod

    device = device_for(backend, rank)
    cfg = model_config(opts["cfg"])
    comm = rg.collectives.from_torch()
    counter = CommCounter()
    counter.install_torch("fsdp2")
    counter.install_comm(comm, "ragged")
    kw = dict(seed=0, device=device, lr=opts["lr"], policy=opts["policy"], lora=opts.get("lora", False))
    if opts["optim"] == "adamw8bit":  # ragged: aligned 32x32 blocks; torch: per-local-shard blocks (bench/_fsdp2.py)
        from ragged import spec

        from bench._fsdp2 import PerShardAdamW8bit

        def torch_opt(params):
            return PerShardAdamW8bit(params, lr=opts["lr"], block_size=32 * 32)

        rkw = dict(optimizer=rg.optim.adamw_8bit(opts["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                                                 donate=opts.get("donate", True)),
                   specs=lambda name, t: spec.Blocks(32, 32) if t.dim() >= 2 else spec.Rows(1))
    else:
        torch_opt, rkw = None, {}
    rkw["donate"] = opts.get("donate", True)
    rkw["keep_module"] = opts.get("keep_module", False)
    ac = opts.get("checkpoint", False)
    methods = {"ragged": RaggedMethod(cfg, comm=comm, checkpoint=ac, **rkw, **kw),
               "fsdp2": FSDP2Method(cfg, optimizer=torch_opt, checkpoint=ac, **kw)}
    if opts.get("auto_buffers"):  # the same ragged step on units planned with max_buffers="auto"
        methods["ragged-auto"] = RaggedMethod(cfg, comm=comm, checkpoint=ac, max_buffers="auto", **rkw, **kw)
    if opts.get("nccl_shaped") and comm.handshake != "deferred":  # (on NCCL "ragged" is NCCL's shape already)
        # the same step over NCCL's transport: native collectives + the deferred ledger; and (bench only)
        # the same with gloo's native all-gather / reduce-scatter replaced by the header's algorithm
        from bench._raw import NativeAsP2P

        for name, shaped in (("ragged-nccl-shaped", rg.collectives.from_torch(handshake="deferred")),
                             ("ragged-nccl-shaped-p2p", NativeAsP2P())):
            counter.install_comm(shaped, name)
            methods[name] = RaggedMethod(cfg, comm=shaped, checkpoint=ac, **rkw, **kw)
    if opts["local"]:
        methods["local"] = LocalMethod(cfg, optimizer=torch_opt, **kw)
    replay = None
    if opts.get("floor"):  # the unsharded step with ragged's collectives moved beside it, raw (bench/_raw.py)
        from bench._raw import ReplayMethod

        replay = methods["local+collectives"] = ReplayMethod(comm, "ragged", counter,
                                                             beside=LocalMethod(cfg, optimizer=torch_opt, **kw))
    task = SyntheticLM(opts["cfg"]["vocab_size"], opts["cfg"]["max_seq_len"], seed=0)

    def batch(step):
        x, y = rank_slice(task.batch(step, opts["batch"] * world), rank, world)
        return x.to(device), y.to(device)

    timer = Timer(device)
    names = list(methods)
    times = {n: [] for n in names}
    work = {n: [] for n in names}  # (CPU seconds, minor page faults) of this rank's process per step
    rss_rise = {n: [] for n in names}
    losses = {n: [] for n in names}
    comm_bytes = {}
    total = opts["warmup"] + opts["repeats"]
    for r in range(total):
        b = batch(r)
        counter.reset()
        for name in names if r % 2 == 0 else names[::-1]:
            m = methods[name]
            counter.active = name
            before = rss()
            reset_peak_rss()
            used = process_work()
            dt, loss = timer(lambda: m.step(b))
            used = [x - y for x, y in zip(process_work(), used)]
            after = rss()
            counter.active = None
            if replay is not None and name == "ragged":
                replay.recorded()
            losses[name].append(loss)
            if r >= opts["warmup"]:
                times[name].append(dt)
                work[name].append(used)
                if before and after:
                    rss_rise[name].append(after["VmHWM"] - before["VmRSS"])
        for name in names:
            comm_bytes[name] = counter.per(name)
        if rank == 0 and opts["verbose"]:
            print(f"  repeat {r}{' (warm-up)' if r < opts['warmup'] else ''}: "
                  + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" if r >= opts["warmup"] else n for n in names),
                  flush=True)
    # one profiled step per method (not timed): memory rise, labelled ranges, copy ops
    prof = {}
    b = batch(total)
    for name in names:
        m = methods[name]
        state = storage_bytes(m.state_tensors())
        torch.distributed.barrier()
        with ragged_labels():
            peak, ranges, copies, where, reserved = profile_step(lambda: m.step(b), device=device)
        prof[name] = dict(state_bytes=state, step_rise_bytes=peak, ranges=ranges, copies=copies, peak_where=where,
                          opt_bytes=m.optimizer_state_bytes(), reserved_rise_bytes=reserved)
    extra = {"ragged_transport": comm.handshake}  # "deferred" (NCCL's shape) on NCCL, "header" on gloo
    if "ragged" in methods:
        units = methods["ragged"].units
        extra["ragged_padding"] = sum(u.plan.padding for u in units)
        extra["numel"] = sum(u.plan.numel for u in units)
        extra["num_gathers"] = methods["ragged"].metrics.get("num_gathers")
        if opts.get("lora"):  # what a step must move and keep for the adapters alone (see lora_text)
            trained = [u.trainable_plan for u in units if u.trainable_plan is not None]
            itemsize = trained[0].dtype.itemsize
            extra["lora"] = dict(
                adapter_numel=sum(p.numel for p in trained), adapter_padding=sum(p.padding for p in trained),
                reduce_scatter_bytes=sum(p.buffer_numel for p in trained) * itemsize,
                moment_bytes=2 * sum(p.shard_size for p in trained) * itemsize,
                frozen_numel=sum(u.plan.numel for u in units) - sum(p.numel for p in trained))
    if "ragged-auto" in methods:
        units = methods["ragged-auto"].units
        extra["auto_padding"] = sum(u.plan.padding for u in units)
        extra["auto_buffers"] = [u.plan.num_buffers for u in units]
    return dict(times=times, work=work, rss_rise=rss_rise, losses=losses, comm=comm_bytes, prof=prof, extra=extra)


def _fmt_work(x, scale):
    return "-" if x is None else f"{x * scale:,.0f}"


def _fmt_mib(n):
    return f"{n / 2**20:,.1f}"


_RAGGED_COPY_LABELS = ("ragged::grad_copy_in", "ragged::all_gather_start")


def _copy_ms(p, name):
    """Host ms in copies made for communication: FSDP2's copy-in / copy-out ops; ragged's
    gradient copy into the flat buffer and the own-chunk copy of the all-gather."""
    c = p["copies"]
    if name == "fsdp2":
        return sum(v for k, v in c.items() if k.startswith("fsdp::"))
    if name == "ragged":
        return sum(v for k, v in c.items() if k.split(" @ ")[1] in _RAGGED_COPY_LABELS)
    return 0.0


def summarize(model: str, world: int, results, opts) -> dict:
    """Per-method numbers (max over ranks for memory and time, rank 0 for bytes and profile)."""
    r0 = results[0]
    out = {"model": model, "world": world, "policy": opts["policy"],
           "optim": opts["optim"] + ("" if opts.get("donate", True) else " (ragged functional, no donate)")
           + (" (ragged keeps the module's weights)" if opts.get("keep_module") else "")
           + (" + activation checkpointing" if opts.get("checkpoint") else "")
           + (" + LoRA (peft r=8 q/v)" if opts.get("lora") else ""), "tokens_per_step": opts["batch"] * world *
           CONFIGS[model]["max_seq_len"], "methods": {}, "extra": r0["extra"]}
    for name in r0["times"]:
        t = r0["times"][name]
        med = statistics.median(t)
        peak = max(res["prof"][name]["state_bytes"] + res["prof"][name]["step_rise_bytes"] for res in results)
        state = max(res["prof"][name]["state_bytes"] for res in results)
        opt_bytes = max(res["prof"][name]["opt_bytes"] for res in results)
        rise = [max(res["rss_rise"][name]) for res in results if res["rss_rise"][name]]
        reserved = [res["prof"][name]["state_bytes"] + res["prof"][name]["reserved_rise_bytes"] for res in results
                    if res["prof"][name].get("reserved_rise_bytes") is not None]
        cpu = [statistics.median(w[0] for w in res["work"][name]) for res in results if res.get("work")]
        faults = [statistics.median(w[1] for w in res["work"][name]) for res in results if res.get("work")]
        gloo = [statistics.median(w[2] for w in res["work"][name]) for res in results if res.get("work")
                and all(len(w) > 2 for w in res["work"][name])]
        out["methods"][name] = dict(
            median_s=med, min_s=min(t), max_s=max(t), times=t, tokens_per_s=out["tokens_per_step"] / med,
            cpu_s=max(cpu) if cpu else None, page_faults=max(faults) if faults else None,
            gloo_cpu_s=max(gloo) if gloo else None,
            peak_bytes=peak, state_bytes=state, opt_bytes=opt_bytes, rss_rise_bytes=max(rise) if rise else None,
            reserved_peak_bytes=max(reserved) if reserved else None,
            comm=r0["comm"].get(name, {}), copies_ms=_copy_ms(r0["prof"][name], name),
            ranges=r0["prof"][name]["ranges"], peak_where=r0["prof"][name].get("peak_where", ""), copies=r0["prof"][name]["copies"], losses=r0["losses"][name],
        )
    return out


def lora_text(summary) -> str:
    """``--lora``: ragged's reduce-scatter bytes and optimizer state against what the adapters
    alone need (their trainable plans: elements + padding), exact or not."""
    lo, m = summary["extra"].get("lora"), summary["methods"].get("ragged")
    if not lo or not m:
        return ""
    rs, opt = m["comm"].get("reduce_scatter", 0), m["opt_bytes"]
    return (f"LoRA: {lo['adapter_numel']:,} adapter elements (+ {lo['adapter_padding']:,} padding) train, "
            f"{lo['frozen_numel']:,} base elements frozen; ragged reduce-scatters {rs:,} B/step "
            f"({'==' if rs == lo['reduce_scatter_bytes'] else '!='} adapters + padding {lo['reduce_scatter_bytes']:,} B), "
            f"optimizer state {opt:,} B/rank ({'==' if opt - lo['moment_bytes'] <= 16 else '!='} 2 moments x this rank's "
            f"adapter share {lo['moment_bytes']:,} B + the step count)")


def _ci(summary, a, b) -> str:
    """Bootstrap 95% CI of the paired median ratio a/b (seeded: the same numbers every time)."""
    from bench._measure import median_ci

    ta, tb = summary["methods"][a]["times"], summary["methods"][b]["times"]
    ratios = [x / y for x, y in zip(ta, tb)]
    if len(ratios) < 3:
        return ""
    lo, hi = median_ci(ratios)
    return f"[95% CI {lo:.3f}-{hi:.3f}]"


def ratios_text(summary) -> str:
    """The step-time ratios a reader wants: ragged / FSDP2 paired (with its bootstrap CI) and, with
    the unsharded method, ragged / local on medians and paired."""
    ms = summary["methods"]
    text = (f"paired step-time ratio (median over repeats of ragged/fsdp2 in the same repeat): "
            f"{paired_ratio(summary):.3f}x {_ci(summary, 'ragged', 'fsdp2')}")
    if "local" in ms:
        text += (f"; ragged / unsharded: {ms['ragged']['median_s'] / ms['local']['median_s']:.3f}x on medians, "
                 f"{paired_ratio(summary, 'ragged', 'local'):.3f}x paired {_ci(summary, 'ragged', 'local')}")
        if ms["ragged"].get("cpu_s") and ms["local"].get("cpu_s"):
            text += f", CPU time {ms['ragged']['cpu_s'] / ms['local']['cpu_s']:.3f}x"
    text += floor_text(summary)
    return text


def floor_text(summary) -> str:
    """``--floor``: ragged against the unsharded step with ragged's collectives moved beside it, raw."""
    ms = summary["methods"]
    if "local+collectives" not in ms:
        return ""
    text = (f"; ragged / (unsharded + ragged's collectives beside it, raw): "
            f"{paired_ratio(summary, 'ragged', 'local+collectives'):.3f}x paired {_ci(summary, 'ragged', 'local+collectives')}")
    if "local" in ms:
        text += (f"; (unsharded + collectives) / unsharded: {paired_ratio(summary, 'local+collectives', 'local'):.3f}x "
                 f"{_ci(summary, 'local+collectives', 'local')}")
        a, b = ms["local+collectives"], ms["local"]
        if a.get("cpu_s") is not None and b.get("cpu_s") is not None:
            text += f", the collectives' CPU {max(a['cpu_s'] - b['cpu_s'], 0) * 1e3:,.0f} ms per rank"
    return text


def paired_ratio(summary, a="ragged", b="fsdp2") -> float:
    """Median over repeats of a's time / b's time in the same repeat (both ran back to back,
    so slow phases of a shared machine hit both): steadier than the ratio of medians."""
    from bench._measure import paired

    return paired(summary["methods"][a]["times"], summary["methods"][b]["times"])


def render(summary, console=None):
    from ragged._console import console as make_console
    from rich.table import Table

    console = console or make_console(min_width=150)
    ms = summary["methods"]
    t = Table(title=f"{summary['model']}{'' if 'hf-' in summary['model'] else ' GPT'}, W={summary['world']}, {summary['policy']}, {summary['optim']}: one training step "
                    f"(median of {len(next(iter(ms.values()))['times'])} alternating repeats)", title_justify="left")
    reserved = any(m.get("reserved_peak_bytes") is not None for m in ms.values())
    cols = ("method", "step ms (min-max)", "tokens/s", "peak alloc MiB/rank", "(state + step rise)", "optim state MiB",
            "RSS rise MiB", "all-gather MiB", "reduce-scatter MiB", "copies ms", "CPU ms/step", "of it gloo's threads",
            "page faults/step")
    for col in cols + (("peak reserved MiB/rank",) if reserved else ()):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, m in ms.items():
        c = m["comm"]
        t.add_row(name, f"{m['median_s'] * 1e3:,.0f} ({m['min_s'] * 1e3:,.0f}-{m['max_s'] * 1e3:,.0f})",
                  f"{m['tokens_per_s']:,.0f}", _fmt_mib(m["peak_bytes"]),
                  f"{_fmt_mib(m['state_bytes'])} + {_fmt_mib(m['peak_bytes'] - m['state_bytes'])}", _fmt_mib(m["opt_bytes"]),
                  _fmt_mib(m["rss_rise_bytes"]) if m["rss_rise_bytes"] is not None else "-",
                  _fmt_mib(c.get("all_gather", 0)), _fmt_mib(c.get("reduce_scatter", 0)), f"{m['copies_ms']:,.1f}",
                  _fmt_work(m.get("cpu_s"), 1e3), _fmt_work(m.get("gloo_cpu_s"), 1e3), _fmt_work(m.get("page_faults"), 1),
                  *((_fmt_mib(m["reserved_peak_bytes"]) if m.get("reserved_peak_bytes") is not None else "-",) if reserved else ()))
    if "ragged" in ms and "fsdp2" in ms:
        a, b = ms["ragged"], ms["fsdp2"]

        def ratio(x, y):
            return f"{x / y:.2f}x" if y else "-"

        t.add_row("[bold]ragged / fsdp2", ratio(a["median_s"], b["median_s"]), ratio(a["tokens_per_s"], b["tokens_per_s"]),
                  ratio(a["peak_bytes"], b["peak_bytes"]), "", ratio(a["opt_bytes"], b["opt_bytes"]),
                  ratio(a["rss_rise_bytes"] or 0, b["rss_rise_bytes"] or 0),
                  ratio(a["comm"].get("all_gather", 0), b["comm"].get("all_gather", 0)),
                  ratio(a["comm"].get("reduce_scatter", 0), b["comm"].get("reduce_scatter", 0)),
                  ratio(a["copies_ms"], b["copies_ms"]), ratio(a.get("cpu_s") or 0, b.get("cpu_s") or 0),
                  ratio(a.get("gloo_cpu_s") or 0, b.get("gloo_cpu_s") or 0),
                  ratio(a.get("page_faults") or 0, b.get("page_faults") or 0),
                  *((ratio(a.get("reserved_peak_bytes") or 0, b.get("reserved_peak_bytes") or 0),) if reserved else ()))
        diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        t.caption = (f"{ratios_text(summary)}\n" + (f"{lora_text(summary)}\n" if lora_text(summary) else "") +
                     f"losses ragged vs fsdp2 over {len(a['losses'])} steps: max |diff| = {diff:.2e} "
                     f"(last {a['losses'][-1]:.4f} vs {b['losses'][-1]:.4f}); ragged padding "
                     f"{summary['extra'].get('ragged_padding', 0):,} of {summary['extra'].get('numel', 0):,} elements")
        if "ragged-auto" in ms:
            t.caption += (f"\npaired step-time ratio ragged-auto/ragged (units planned with max_buffers='auto': buffers "
                          f"per unit {summary['extra'].get('auto_buffers')}, padding "
                          f"{summary['extra'].get('auto_padding', 0):,}): {paired_ratio(summary, 'ragged-auto', 'ragged'):.3f}x"
                          f" {_ci(summary, 'ragged-auto', 'ragged')}; ragged-auto/fsdp2: "
                          f"{paired_ratio(summary, 'ragged-auto', 'fsdp2'):.2f}x")
        if "ragged-nccl-shaped" in ms:
            t.caption += f"\n{nccl_shaped_text(summary, bold='')}"
    console.print(t)
    for name, m in ms.items():
        if m.get("peak_where"):
            console.print(f"  {name}: allocated-bytes peak (rank 0) reached in {m['peak_where']}")
    # where the time goes (profiled step, host time, rank 0)
    p = Table(title="where the time goes: one profiled step (rank 0, host ms; profiler overhead included): "
                    "exclusive time of labelled ranges, then copy / reduction ops by the range they run in",
              title_justify="left")
    p.add_column("range / op @ range")
    for name in ms:
        p.add_column(name, justify="right")
    for field in ("ranges", "copies"):
        keys = sorted({k for m in ms.values() for k in m[field]})
        for k in keys:
            p.add_row(k, *[f"{m[field][k]:,.1f}" if k in m[field] else "" for m in ms.values()],
                      end_section=k == keys[-1])
    console.print(p)


def markdown(summary) -> str:
    """The step table as GitHub markdown (for the README)."""
    ms = summary["methods"]
    reserved = any(m.get("reserved_peak_bytes") is not None for m in ms.values())
    head = ("| method | step ms median (min-max) | tokens/s | peak alloc MiB/rank (state + step rise) | "
            "optim state MiB | RSS rise MiB | all-gather MiB | reduce-scatter MiB | copies ms |"
            + (" peak reserved MiB/rank |" if reserved else ""))
    lines = [f"{summary['model']}, W={summary['world']}, {summary['policy']}, {summary['optim']}, "
             f"{len(next(iter(ms.values()))['times'])} repeats:", "", head, "|" + "---|" * (9 + reserved)]
    for name, m in ms.items():
        c = m["comm"]
        rss_mib = _fmt_mib(m["rss_rise_bytes"]) if m["rss_rise_bytes"] is not None else "-"
        res = m.get("reserved_peak_bytes")
        lines.append(
            f"| {name} | {m['median_s'] * 1e3:,.0f} ({m['min_s'] * 1e3:,.0f}-{m['max_s'] * 1e3:,.0f}) | "
            f"{m['tokens_per_s']:,.0f} | {_fmt_mib(m['peak_bytes'])} ({_fmt_mib(m['state_bytes'])} + "
            f"{_fmt_mib(m['peak_bytes'] - m['state_bytes'])}) | {_fmt_mib(m['opt_bytes'])} | {rss_mib} | "
            f"{_fmt_mib(c.get('all_gather', 0))} | {_fmt_mib(c.get('reduce_scatter', 0))} | {m['copies_ms']:,.0f} |"
            + ((f" {_fmt_mib(res)} |" if res is not None else " - |") if reserved else ""))
    if "ragged" in ms and "fsdp2" in ms:
        a, b = ms["ragged"], ms["fsdp2"]

        def r(x, y):
            return f"{x / y:.2f}x" if y else "-"

        lines.append(
            f"| **ragged / fsdp2** | **{r(a['median_s'], b['median_s'])}** | {r(a['tokens_per_s'], b['tokens_per_s'])} | "
            f"**{r(a['peak_bytes'], b['peak_bytes'])}** | {r(a['opt_bytes'], b['opt_bytes'])} | "
            f"{r(a['rss_rise_bytes'] or 0, b['rss_rise_bytes'] or 0)} | "
            f"{r(a['comm'].get('all_gather', 0), b['comm'].get('all_gather', 0))} | "
            f"{r(a['comm'].get('reduce_scatter', 0), b['comm'].get('reduce_scatter', 0))} | "
            f"{r(a['copies_ms'], b['copies_ms'])} |"
            + (f" {r(a.get('reserved_peak_bytes') or 0, b.get('reserved_peak_bytes') or 0)} |" if reserved else ""))
        lines.append(f"\n{ratios_text(summary)}")
        if lora_text(summary):
            lines.append(lora_text(summary))
        if "ragged-auto" in ms:
            lines.append(f"Paired ragged-auto/ragged: **{paired_ratio(summary, 'ragged-auto', 'ragged'):.3f}x** "
                         f"{_ci(summary, 'ragged-auto', 'ragged')} (buffers per unit {summary['extra'].get('auto_buffers')}).")
        if "ragged-nccl-shaped" in ms:
            lines.append(nccl_shaped_text(summary))
    return "\n".join(lines)


def profile_markdown(summary) -> str | None:
    """Where each method's time goes, as the console's profile table prints it: the CPU per step (every
    thread; of it gloo's own threads; rank max, median over repeats), the page faults per step, then
    the exclusive host ms of every labelled range in one profiled step on rank 0 (profiler overhead
    included; the rest of a method's step is its model's compute, and for ragged the interception)."""
    ms = summary["methods"]
    if all(m.get("gloo_cpu_s") is None for m in ms.values()):  # a run from before the CPU was split
        return None
    names = list(ms)
    lines = [f"Where the time goes, {summary['model']}, W={summary['world']}:", "", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
             "| CPU ms/step, rank max (of it gloo's threads) | " + " | ".join(
                 f"{_fmt_work(m.get('cpu_s'), 1e3)} ({_fmt_work(m.get('gloo_cpu_s'), 1e3)})" for m in ms.values()) + " |",
             "| page faults/step | " + " | ".join(_fmt_work(m.get("page_faults"), 1) for m in ms.values()) + " |"]
    for key in sorted({k for m in ms.values() for k in m["ranges"]}):
        lines.append(f"| {key} (rank 0, host ms) | " + " | ".join(f"{m['ranges'][key]:,.1f}" if key in m["ranges"] else ""
                                                           for m in ms.values()) + " |")
    return "\n".join(lines)


def nccl_shape_method(summary) -> str | None:
    """The method that ran ragged in NCCL's shape: ``ragged`` itself where its comm's transport is
    ``"deferred"`` (NCCL), else ``ragged-nccl-shaped`` (``--nccl-shaped`` on gloo), else ``None``."""
    ms = summary["methods"]
    if summary.get("extra", {}).get("ragged_transport") == "deferred" and "ragged" in ms:
        return "ragged"
    return "ragged-nccl-shaped" if "ragged-nccl-shaped" in ms else None


def nccl_shape_line(summary) -> str:
    """One line: NCCL's shape against FSDP2 in this run (step time paired, with its CI, and peak
    memory), or why there is none (``scripts/gpu_report.py`` puts it first)."""
    name, ms = nccl_shape_method(summary), summary["methods"]
    where = f"{summary['model']}, W={summary['world']}, {summary['policy']}, {summary.get('backend', '?')}"
    if name is None or "fsdp2" not in ms:
        return f"NCCL's shape against FSDP2 ({where}): not run (no deferred transport or no FSDP2 in this run)."
    a, b = ms[name], ms["fsdp2"]
    return (f"NCCL's shape ({name}: native collectives + the deferred ledger) against FSDP2 ({where}): step time "
            f"{paired_ratio(summary, name, 'fsdp2'):.3f}x paired {_ci(summary, name, 'fsdp2')}, "
            f"{a['median_s'] * 1e3:,.1f} vs {b['median_s'] * 1e3:,.1f} ms; peak allocated "
            f"{a['peak_bytes'] / b['peak_bytes']:.2f}x ({_fmt_mib(a['peak_bytes'])} vs {_fmt_mib(b['peak_bytes'])} MiB/rank)"
            + (f", peak reserved {a['reserved_peak_bytes'] / b['reserved_peak_bytes']:.2f}x"
               if a.get("reserved_peak_bytes") and b.get("reserved_peak_bytes") else "") + ".")


def nccl_shaped_text(summary, bold="**") -> str:
    """The paired ratios of the step over NCCL's transport (``--nccl-shaped``), and (gloo) what of
    its cost is ragged's deferred path and what is gloo's native collectives: the same deferred
    step with the header transport's algorithm in place of gloo's native ops (``bench/_raw.py``)."""
    ms = summary["methods"]
    text = (f"Paired ragged-nccl-shaped/ragged (native collectives + the deferred ledger, on {summary.get('backend', '?')}): "
            f"{bold}{paired_ratio(summary, 'ragged-nccl-shaped', 'ragged'):.3f}x{bold} {_ci(summary, 'ragged-nccl-shaped', 'ragged')}; "
            f"ragged-nccl-shaped/fsdp2: {paired_ratio(summary, 'ragged-nccl-shaped', 'fsdp2'):.3f}x "
            f"{_ci(summary, 'ragged-nccl-shaped', 'fsdp2')}.")
    if "ragged-nccl-shaped-p2p" in ms:
        def cpu(name):
            m = ms[name]
            return (f"{m['cpu_s'] * 1e3:,.0f} ms (gloo's threads {m['gloo_cpu_s'] * 1e3:,.0f})"
                    if m.get("cpu_s") is not None and m.get("gloo_cpu_s") is not None else "-")

        text += (f" Split: the deferred path with the header's algorithm in place of gloo's native ops / ragged: "
                 f"{bold}{paired_ratio(summary, 'ragged-nccl-shaped-p2p', 'ragged'):.3f}x{bold} "
                 f"{_ci(summary, 'ragged-nccl-shaped-p2p', 'ragged')} (ragged's own); ragged-nccl-shaped / that: "
                 f"{paired_ratio(summary, 'ragged-nccl-shaped', 'ragged-nccl-shaped-p2p'):.3f}x "
                 f"{_ci(summary, 'ragged-nccl-shaped', 'ragged-nccl-shaped-p2p')} (gloo's native collectives). CPU per step "
                 f"(rank max): ragged {cpu('ragged')}, native {cpu('ragged-nccl-shaped')}, header's algorithm "
                 f"{cpu('ragged-nccl-shaped-p2p')}.")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(CONFIGS), default="dense")
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--policy", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--optim", choices=("adamw", "adamw8bit"), default="adamw",
                    help="adamw8bit: rg.optim.adamw_8bit on Blocks(32, 32) vs FSDP2 + per-local-shard 8-bit AdamW")
    ap.add_argument("--no-donate", dest="donate", action="store_false",
                    help="ragged purely functional: new shards and moments every step (default: make_step(donate=True) "
                         "and rg.optim.adamw(donate=True) update them in place, as torch.optim.AdamW does)")
    ap.add_argument("--keep-module", action="store_true",
                    help="ragged: fsdp.init(..., release_module=False) keeps the module's own weights (one more model copy "
                         "per rank, counted in its state); default: released, placeholders left")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lora", action="store_true",
                    help="fine-tune with peft's LoRA (r=8 on q/v, the base frozen) in every method (HF models only)")
    ap.add_argument("--no-local", dest="local", action="store_false", help="skip the unsharded reference")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute every block in backward, in both: ragged through examples.gpt.loss_fn(checkpoint=True), "
                         "FSDP2 through torch.distributed._composable.checkpoint on every block")
    ap.add_argument("--auto-buffers", action="store_true",
                    help="also time ragged with units planned by make_units(max_buffers='auto') (method ragged-auto), "
                         "paired against the single-buffer ragged in the same repeats")
    ap.add_argument("--nccl-shaped", action="store_true",
                    help="also time ragged over NCCL's transport (from_torch(handshake='deferred'): native collectives + "
                         "the deferred ledger; method ragged-nccl-shaped) and, on gloo, the same with gloo's native "
                         "all-gather / reduce-scatter replaced by the header transport's algorithm (bench/_raw.py "
                         "NativeAsP2P; method ragged-nccl-shaped-p2p), paired in the same repeats")
    ap.add_argument("--floor", action="store_true",
                    help="also time the unsharded step with ragged's collectives moved beside it (method local+collectives: "
                         "every all-gather, reduce-scatter and all-reduce of ragged's previous step, replayed through the "
                         "fastest raw paths on a thread of their own; bench/_raw.py ReplayMethod): a floor under ragged "
                         "on cores that all compute; implies --warmup 2")
    ap.add_argument("--backend", default=None, help="gloo or nccl (default: nccl iff enough GPUs)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--exact-rss", action="store_true",
                    help="make glibc return freed tensors to the OS (RSS follows live tensors; slows allocation)")
    ap.add_argument("--json", default=None, help="append the summaries to this JSON-lines file")
    ap.add_argument("--from-json", default=None, metavar="JSONL",
                    help="do not run: render the summaries saved with --json (tables and markdown)")
    ap.add_argument("--markdown", action="store_true", help="also print the step table as markdown")
    ap.add_argument("-q", "--quiet", dest="verbose", action="store_false")
    args = ap.parse_args(argv)
    from bench._launch import launch, pick_backend

    if args.from_json:
        if not os.path.isfile(args.from_json):
            ap.error(f"--from-json {args.from_json}: no such file ({os.path.abspath(args.from_json)}); --json wrote it "
                     "relative to the directory that run started in, and printed its absolute path at the end")
        with open(args.from_json) as f:
            for line in f:
                summary = json.loads(line)
                render(summary)
                print(markdown(summary) + "\n")
        return 0

    # --floor replays ragged's previous step: the first call learns its schedule (more gathers), so
    # the replay's timed repeats start once a steady step was recorded before each
    opts = dict(cfg=CONFIGS[args.model], repeats=args.repeats, warmup=max(args.warmup, 2) if args.floor else args.warmup,
                batch=args.batch,
                policy=args.policy, lr=args.lr, optim=args.optim, donate=args.donate, local=args.local, verbose=args.verbose,
                keep_module=args.keep_module,
                checkpoint=args.activation_checkpointing, auto_buffers=args.auto_buffers, lora=args.lora,
                nccl_shaped=args.nccl_shaped, floor=args.floor)
    for world in args.world:
        backend = pick_backend(world, args.backend)
        print(f"== {args.model} on {world} ranks ({backend}, torch {torch.__version__}, {os.cpu_count()} CPUs) ==",
              flush=True)
        results = launch(world, _bench, opts, backend=args.backend, threads=args.threads, exact_rss=args.exact_rss)
        summary = summarize(args.model, world, results, opts)
        summary["backend"] = backend
        render(summary)
        if args.markdown:
            print(markdown(summary))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(summary) + "\n")
    if args.json:
        print(f"summaries appended to {os.path.abspath(args.json)}; from any directory: "
              f"python3 {os.path.abspath(__file__)} --from-json {os.path.abspath(args.json)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
