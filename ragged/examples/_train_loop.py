"""The loop both of the ``train`` job's models run (the example GPT and ``--hf``): rank 0 announces
the run, every rank takes the steps (rank 0 shows progress), then the summary and the verdict of
:meth:`ragged.examples.data.SyntheticLM.verdict`, which rank 0 prints (and writes with ``--json``).
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.distributed as dist

from ragged.examples._train_report import Progress, print_summary, rss_mb
from ragged.examples.data import rank_slice
from ragged.fsdp import local_chunks
from ragged.fsdp._chunks import served_world_sizes

__all__ = ["announce", "job_checkpoints", "run_steps", "summarize", "resumed", "finish"]


def announce(console, args, what: str, units, task) -> None:
    """Rank 0's first lines: the run (``what``: the model), its units and the task."""
    n_params = sum(u.plan.numel for u in units)
    console.print(f"[bold]ragged FSDP[/] · {dist.get_world_size()} ranks ({dist.get_backend()}) · {what} "
                  f"{n_params / 1e6:.2f}M params · optimizer {args.optimizer} · compute {args.compute_dtype} · "
                  f"micro-batches {args.micro_batches}" + (f" · chunks {args.chunks}" if args.chunks else "")
                  + "".join(f" · {what} {name}" for what, name in (("gather", args.gather_format),
                                                                  ("reduce", args.reduce_format)) if name != "none"))
    console.print(units)
    console.print(f"task: Markov(vocab {task.vocab_size}, branching {task.branching}) then copy; loss starts near "
                  f"ln(vocab) = {math.log(task.vocab_size):.2f}; below {task.no_copy_floor:.2f} the model copies "
                  f"(learnt); a perfect model reaches {task.floor:.2f}")


def job_checkpoints(args, comm, units, model):
    """The job's ``_train_checkpoint.Checkpoints``, or ``None`` without ``--checkpoint-dir``."""
    if not args.checkpoint_dir:
        return None
    # ragged.checkpoint imports torch.distributed.checkpoint (1.5 s a process): only for a job that saves
    from ragged.examples._train_checkpoint import Checkpoints

    return Checkpoints.for_job(args, comm, units, model)


def run_steps(args, step, state, task, device, console, checkpoints=None):
    """``args.steps`` steps on this rank's rows of the task's batches; returns ``(state, history,
    seconds)`` (one record per step; the loop's wall time). ``console``: rank 0's, for progress
    (None on the other ranks). ``checkpoints`` (a ``_train_checkpoint.Checkpoints``): resume from
    its newest checkpoint (the steps before it are its history's records), save as it says."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # torch's global RNG alike on every rank (a checkpoint saves it)
    start, history, tokens_per_step = 0, [], args.batch * args.seq
    if checkpoints is not None:
        state, start, history = checkpoints.resume(state)
    progress = Progress(console, args.steps, args.log_every, args.quiet, start) if console is not None else None
    t_start = time.perf_counter()
    try:
        for s in range(start, args.steps):
            batch = task.batch(s, args.batch)
            batch = local_chunks(batch, args.chunks, step.comm) if args.chunks else rank_slice(batch, rank, world)
            batch = tuple(x.to(device) for x in batch)
            t0 = time.perf_counter()
            state, m = step(state, batch)
            dt = time.perf_counter() - t0
            rec = {"step": s, "loss": m["loss"], "step_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "peak_gathered_bytes": m["peak_gathered_bytes"], "model_bytes": m["model_bytes"],
                   "largest_unit_bytes": m["largest_unit_bytes"], "num_gathers": m["num_gathers"],
                   "rss_mb": rss_mb()}
            history.append(rec)
            if checkpoints is not None:
                checkpoints.after(s + 1, state, rec)
            if progress is not None:
                progress.update(s, rec)
    finally:
        if progress is not None:
            progress.stop()
    if checkpoints is not None:
        checkpoints.close()
    return state, history, time.perf_counter() - t_start


def summarize(args, history, seconds: float, task, units, **extra) -> dict:
    """The run's summary (every rank): losses, the verdict (``"verdict"``, ``"exit_status"``: 1
    when the loss did not fall), speed (``seconds``: the loop's) and memory, and ``extra``."""
    ran = [h for h in history if not h.get("earlier_run")]  # this run's steps (a resumed run: after its checkpoint)
    steady = ran[min(3, len(ran) - 1):]
    verdict = task.verdict([h["loss"] for h in history], min_steps=args.warmup + 10)
    return {
        **extra, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "params": sum(u.plan.numel for u in units), "steps": args.steps,
        "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
        "min_loss": min(h["loss"] for h in history), "ln_vocab": math.log(task.vocab_size), "floor": task.floor,
        "no_copy_floor": task.no_copy_floor, "learnt": verdict.learnt, "verdict": verdict.line,
        "exit_status": 0 if verdict.ok else 1,
        "median_step_s": sorted(h["step_s"] for h in steady)[len(steady) // 2],
        "tokens_per_s": args.batch * args.seq * len(ran) / seconds,
        "peak_gathered_bytes": max(h["peak_gathered_bytes"] for h in ran),
        "largest_unit_bytes": history[-1]["largest_unit_bytes"], "model_bytes": history[-1]["model_bytes"],
        "max_rss_mb": rss_mb(), "args": vars(args) | {"func": None},
        # --chunks: the world sizes whose every step gives these numbers, to the bit (docs/invariance.md)
        "same_numbers_at": list(served_world_sizes(args.chunks)) if args.chunks else None,
    }


def resumed(checkpoints, chunks: int | None = None) -> dict:
    """The summary's ``"resumed"`` (``{}`` for a run that resumed from nothing): where from, which
    step, at which world size, and how its losses compare with a run that was never stopped
    (``chunks``: ``--chunks``, whose world sizes give the same numbers)."""
    got = checkpoints.resumed if checkpoints is not None else None
    if got is None:
        return {}
    saved, now, chunks = got["saved_world_size"], got["world_size"], chunks or 0
    if got["saved_chunks"] != chunks:
        losses = (f"equal to an uninterrupted run's to float tolerance: it was saved with --chunks "
                  f"{got['saved_chunks'] or 'none'}, this run has {chunks or 'none'}")
    elif saved == now:
        losses = "bit-identical to an uninterrupted run (same world size)"
    elif chunks and {saved, now} <= set(served_world_sizes(chunks)):
        losses = (f"bit-identical to an uninterrupted run (--chunks {chunks} gives the same numbers at {saved} and "
                  f"{now} ranks)")
    else:
        losses = (f"equal to an uninterrupted run's to float tolerance: {now} ranks sum the gradients in another "
                  f"order than {saved}")
    return {"resumed": dict(got, losses=losses)}


def finish(console, args, summary: dict, history) -> None:
    """Rank 0's last lines: the summary table, ``--json``'s file, the verdict line."""
    print_summary(console, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "history": history}, f, indent=1, default=str)
    print(summary["verdict"], flush=True)
