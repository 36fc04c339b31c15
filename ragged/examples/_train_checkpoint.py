"""The ``train`` job's checkpoints: ``--checkpoint-dir DIR --checkpoint-every N [--keep K]``.

[Note: the main job's checkpoints]
``DIR`` holds one :func:`rg.checkpoint.save <ragged.checkpoint.save>` directory per checkpoint,
``step-<steps done, 8 digits>``, and ``history.jsonl``, rank 0's record of every step (a line
each, appended as the steps run; the last line of a step wins, so steps a killed run took after
its last checkpoint, and took again after the resume, count once). A checkpoint holds:

* ``train``: the step's state, every unit's shards and the optimizer state over them (bound where
  an optimizer keeps compact per-rank state, see ``_checkpointable``), which loads at any world
  size;
* ``step`` (steps done) and ``samples`` (global sequences consumed): the data position. A batch
  is a pure function of ``(seed, step)`` over the *global* batch, which each rank slices, so
  where a run resumes never depends on its world size or its rank;
* ``rng``: torch's global RNG state (seeded alike on every rank), ``job``: the options that fix
  the model and the optimizer (JSON), which a resume must match, and ``chunks`` (``--chunks``, 0
  without): a resume with the same chunks at a world size they serve continues the run's numbers
  to the bit (docs/invariance.md).

Saving: after every N-th step and after the last, ``save(..., blocking=False)``: the step goes
on while the files are written. The call first publishes the save before it (see [Note: a save
in the background] in ``ragged/checkpoint/_background.py``), then rank 0 deletes all but the
newest K published checkpoints and the unpublished leftovers of killed runs. The last save is
waited for (``result()``) before the job reports.

Resuming: the newest checkpoint that loads; one that does not (a corrupt file, a checkpoint of
another model) is reported and the one before it tried. ``load`` raises on every rank alike (its
rounds agree), so every rank takes the same branch. ``--steps`` stays the total: the job runs
the steps after the checkpoint's. The parent refuses, before any rank starts, a ``DIR`` that is
a file, ``--checkpoint-every`` or ``--keep`` without ``DIR``, a newest checkpoint of another
model, and one that already has ``--steps`` steps.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

import ragged as rg
from ragged._cli import UsageError
from ragged import fsdp
from ragged.checkpoint._save import retire
from ragged.examples._recipe import muon_matrices, no_decay_types

__all__ = ["check_checkpoint_args", "Checkpoints", "published", "MODEL_OPTIONS", "KEEP"]

KEEP = 2
MODEL_OPTIONS = ("hf", "layers", "dim", "heads", "ffn", "vocab", "seq", "moe", "experts", "top_k", "optimizer",
                 "precondition_block")
HISTORY = "history.jsonl"
_STEP = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^\.step-(\d{8})\.(?:tmp|old)-")


def _job(args) -> dict:
    """The options that fix the model and its optimizer state (``--from-pretrained``: its config)."""
    job = {k: getattr(args, k) for k in MODEL_OPTIONS}
    if args.from_pretrained:
        with open(os.path.join(args.from_pretrained, "config.json")) as f:
            job["config"] = json.load(f)
    return job


def published(directory: str) -> list[tuple[int, str]]:
    """``[(steps, path)]`` of the checkpoints in ``directory``, newest first."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in os.listdir(directory) if (m := _STEP.match(n))]
    return sorted(found, reverse=True)


def check_checkpoint_args(args) -> None:
    """The checkpoint options, in the parent (see [Note: the main job's checkpoints]); ``DIR``
    itself was checked to be a directory or creatable."""
    if not args.checkpoint_dir:
        raise UsageError("--checkpoint-every and --keep apply to --checkpoint-dir DIR: add it (or drop them).")
    if args.checkpoint_every is None:
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} needs --checkpoint-every N: save after every "
                         "N-th step (and after the last).")
    args.keep = KEEP if args.keep is None else args.keep
    for steps, path in published(args.checkpoint_dir):
        try:
            entries = rg.checkpoint.read_manifest(path)["entries"]
            saved = json.loads(entries["['job']"]["value"])
        except (rg.checkpoint.CheckpointError, KeyError, ValueError):
            continue  # the ranks report it and take the one before
        mine = json.loads(json.dumps(_job(args)))
        if saved != mine:
            diff = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)} there, {mine.get(k)} here"
                             for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k))
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir}: {os.path.basename(path)} is a checkpoint of "
                             f"another model ({diff}); resume with the same options, or use another --checkpoint-dir.")
        if steps >= args.steps:
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir}: {os.path.basename(path)} has done {steps} "
                             f"steps, and --steps {args.steps} asks for no more (--steps is the total); raise "
                             "--steps to go on, or use another --checkpoint-dir.")
        return


class Checkpoints:
    """The job's checkpoints on one rank (see [Note: the main job's checkpoints]).

    Args:
        args: the job's options.
        comm: the ranks' comm.
        bind: ``(bind, unbind)``: the train state as ``rg.checkpoint`` saves it, and back.
        say: prints a line (rank 0), or ``None``.
    """

    def __init__(self, args, comm, bind, say):
        self.args, self.comm, self.say = args, comm, say
        self.bind, self.unbind = bind
        self.dir = args.checkpoint_dir
        self.job = json.dumps(_job(args), sort_keys=True)
        self.pending = None  # (steps, SaveHandle) of the save in flight
        self.good = 0  # the newest checkpoint this run published or resumed from
        self.resumed: dict | None = None
        if comm.rank == 0:
            os.makedirs(self.dir, exist_ok=True)

    @classmethod
    def for_job(cls, args, comm, units, model) -> "Checkpoints":
        """The checkpoints of a job with ``--checkpoint-dir``; rank 0 says what it resumed from."""
        return cls(args, comm, _checkpointable(args, units, no_decay_types(model)), print if comm.rank == 0 else None)

    def _tree(self, state, done: int) -> dict:
        return {"train": self.bind(state), "step": done, "samples": done * self.args.batch,
                "rng": torch.get_rng_state(), "job": self.job, "chunks": self.args.chunks or 0}

    def resume(self, state):
        """``(state, steps done, the records of those steps)``: from the newest checkpoint that
        loads, else the state as given, 0 and none."""
        # rank 0's listing: every rank tries the same checkpoints in the same order, whatever it sees
        for steps, path in self.comm.all_gather_object(published(self.dir))[0]:
            try:
                got = rg.checkpoint.load(path, self._tree(state, 0), self.comm)
            except rg.checkpoint.CheckpointError as err:  # on every rank alike
                self._say(f"checkpoint {path} does not load, the one before it is tried: {str(err).splitlines()[0]}")
                continue
            if got["job"] != self.job:
                self._say(f"checkpoint {path} is of another model (job {got['job']}), the one before it is tried")
                continue
            torch.set_rng_state(got["rng"])
            self.good = steps
            saved = rg.checkpoint.read_manifest(path)["world_size"]
            self.resumed = {"from": path, "step": got["step"], "saved_world_size": saved,
                            "world_size": self.comm.world_size, "saved_chunks": got["chunks"]}
            self._say(f"resumed from {path}: step {got['step']} of {self.args.steps}, saved at world size {saved}, "
                      f"now {self.comm.world_size}")
            return self.unbind(got["train"]), got["step"], self._records(got["step"])
        return state, 0, []

    def _records(self, upto: int) -> list[dict]:
        by_step = {}
        path = os.path.join(self.dir, HISTORY)
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:  # a line cut by a kill
                        continue
                    if rec.get("step", upto) < upto:
                        by_step[rec["step"]] = dict(rec, earlier_run=True)
        return [by_step[s] for s in sorted(by_step)]

    def after(self, done: int, state, rec: dict) -> None:
        """After step ``done`` (1-based): the record, and a save every N-th step and after the last."""
        if self.comm.rank == 0:
            with open(os.path.join(self.dir, HISTORY), "a") as f:
                f.write(json.dumps(rec) + "\n")
                if done % self.args.checkpoint_every == 0 or done == self.args.steps:
                    f.flush()
                    os.fsync(f.fileno())  # a checkpoint's steps are on disk before it can be published
        if done % self.args.checkpoint_every == 0 or done == self.args.steps:
            path = os.path.join(self.dir, f"step-{done:08d}")
            # overwrite: a checkpoint there is newer than the one this run resumed from, so it did not load
            handle = rg.checkpoint.save(path, self._tree(state, done), self.comm, overwrite=True, blocking=False)
            if self.pending is not None:  # that call published it
                self.good = self.pending[0]
            self.pending = (done, handle)
            self._prune(in_flight=done)

    def close(self) -> None:
        """Publishes the last save (every rank) and prunes."""
        if self.pending is not None:
            self.pending[1].result()
            self.good, self.pending = self.pending[0], None
            self._prune(in_flight=None)

    def _prune(self, in_flight: int | None) -> None:
        """Rank 0: of the checkpoints up to the newest this run published (or resumed from), all
        but the newest K go (newer ones did not load: each is replaced when the run gets there),
        and so do the leftovers of unpublished saves but the one in flight."""
        if self.comm.rank != 0:
            return
        for _, path in [(n, p) for n, p in published(self.dir) if n <= self.good][self.args.keep:]:
            retire(path)  # its manifest first: never a half-deleted directory that looks like a checkpoint
        for name in os.listdir(self.dir):
            m = _LEFTOVER.match(name)
            if m and int(m.group(1)) != in_flight:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line, flush=True)


def _checkpointable(args, units, no_decay: tuple[type, ...]):
    """``(bind, unbind)``: the job's ``TrainState`` as ``rg.checkpoint`` saves it (the compact
    AdamW group, 8-bit AdamW's blocks and Muon's AdamW part bound, see docs/checkpointing.md), and
    back."""
    groups = units.param_groups({no_decay: "no_decay"}, default="decay")  # as _recipe.optimizer's

    def bind(state):
        opt = state.opt_state
        if args.optimizer in ("adamw", "adamw_8bit", "soap", "shampoo"):
            opt = rg.checkpoint.bind_packed(opt, groups, ("no_decay",))
        if args.optimizer == "adamw_8bit":
            opt = rg.checkpoint.bind_quant8(opt, fsdp.trainable_shards(units, state.shards))
        if args.optimizer == "muon":
            opt = rg.checkpoint.bind_muon(opt, muon_filter=muon_matrices)
        return state._replace(opt_state=opt)

    return bind, rg.checkpoint.unbind
