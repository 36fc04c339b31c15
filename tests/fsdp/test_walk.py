"""[Note: the walk of one step] (``ragged/fsdp/_step.py``) against a traced step.

``state`` is followed from ``Step.__call__``: every call from a ragged frame into a function of
the step's package (``ragged/fsdp/``) that receives the state or a part of it (an argument that
is or holds a DBuffer: shards, gradients, parameters, updates, optimizer state) moves the reader
into that function's file, and its return back to the caller's. A function is read once (its
later calls do not move the reader); callbacks that torch or the loss make into the runtime
(the interceptors, gradient hooks) are not followed: they are the runtime's, not the state's
path. A *stay* is a run of the walk in one file.
"""

from __future__ import annotations

import copy
import os
import re
import sys

import torch

import ragged as rg
from ragged import fsdp
from ragged._dbuffer import DBuffer
from ragged.examples.gpt import GPT, GPTConfig, loss_fn

ROOT = os.path.dirname(rg.__file__)
STEP = os.path.join("fsdp", "_step.py")


def _holds_state(x, depth: int = 3) -> bool:
    if isinstance(x, DBuffer):
        return True
    if depth and isinstance(x, dict):
        return any(_holds_state(v, depth - 1) for v in list(x.values())[:64])
    if depth and isinstance(x, (list, tuple)):
        return any(_holds_state(v, depth - 1) for v in list(x)[:64])
    return False


def _rel(frame) -> str:
    return os.path.relpath(frame.f_code.co_filename, ROOT)


def _on_the_walk(frame) -> bool:
    """Every frame from ``frame`` up to ``Step.__call__`` is ragged's (not a callback)."""
    while frame is not None:
        if not frame.f_code.co_filename.startswith(ROOT):
            return False
        if frame.f_code.co_name == "__call__" and _rel(frame) == STEP:
            return True
        frame = frame.f_back
    return False


def _receives_state(frame) -> bool:
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return any(_holds_state(frame.f_locals.get(a)) for a in names if a != "self")


def walk(step, state, batch, package: str = "fsdp" + os.sep) -> list[str]:
    """The stays (files, in order) of ``state`` through ``step(state, batch)``."""
    events, stays = [], []

    def profile(frame, event, arg):
        if event not in ("call", "return") or not _rel(frame).startswith(package):
            return
        if event == "call" and not (_on_the_walk(frame) and (_receives_state(frame) or _rel(frame) == STEP)):
            return
        events.append((event, _rel(frame), frame.f_code.co_name, id(frame)))

    sys.setprofile(profile)
    try:
        step(state, batch)
    finally:
        sys.setprofile(None)
    opened, read, stack, skip = set(), set(), [], None
    for event, path, name, fid in events:
        if event == "call":
            opened.add(fid)
            if skip is None and (path, name) in read:
                skip = fid  # read before: its calls are not followed again
            elif skip is None:
                read.add((path, name))
                stack.append(path)
        elif fid in opened:
            opened.discard(fid)
            if skip == fid:
                skip = None
            elif skip is None:
                stack.pop()
        else:
            continue
        here = stack[-1] if stack else None
        if skip is None and here is not None and (not stays or stays[-1] != here):
            stays.append(here)
    return stays


def _model(frozen: str | None = None):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=48))
    for name, p in model.named_parameters():
        p.requires_grad_(frozen is None or frozen not in name)
    return model


def _traced(comm, model, optimizer):
    model = copy.deepcopy(model)  # one module object per simulated rank
    units = fsdp.make_units(model, world_size=comm.world_size)
    step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), optimizer, comm)
    state = fsdp.init(units, model, optimizer, comm)
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    state, _ = step(state, batch)  # the first call learns the schedule
    return walk(step, state, batch)


def _noted_walk() -> list[str]:
    text = open(os.path.join(ROOT, STEP), encoding="utf-8").read()
    note = text[text.index("[Note: the walk of one step]"):]
    chain = note[: note.index("(back to a file")]
    return [os.path.join("fsdp", f) for f in re.findall(r"``(_\w+\.py)``", chain[chain.index("four files"):])]


def test_the_walk_of_one_step_is_the_one_its_note_writes():
    stays = rg.collectives.simulate(1, _traced, _model(), rg.optim.adamw(1e-3))[0]
    assert stays == _noted_walk(), stays
    files = set(stays)
    assert len(files) <= 8 and len(stays) - len(files) <= 6, stays


def test_frozen_leaves_and_donation_take_the_same_walk():
    """A partly frozen model (the embedding) under a donating optimizer, on two ranks."""
    stays = rg.collectives.simulate(2, _traced, _model("tok"), rg.optim.adamw(1e-3, donate=True))[0]
    assert stays == _noted_walk(), stays
