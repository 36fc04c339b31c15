"""A state holding every kind of checkpoint entry, and the checkpoint of it that ragged wrote
before the entry-kind protocol, manifest checksums and the safe metadata reader existed
(``tests/checkpoint/data/legacy_w2``, saved on 2 simulated ranks by main at d6e41f8).

The fixture must keep loading: it is how a checkpoint written by an older ragged reads in this
one. It was written with::

    git archive d6e41f8 | tar -x -C /tmp/old && cp tests/checkpoint/_legacy.py /tmp/old/tests/checkpoint/
    cd /tmp/old && PYTHONPATH=/tmp/old python -m tests.checkpoint._legacy <repo>/tests/checkpoint/data/legacy_w2

Only the public API of that version is used here, so the same function builds the like-states
the test loads into.
"""

from __future__ import annotations

import os
import sys

import torch

import ragged as rg
from ragged import spec

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "legacy_w2")
MIN_SIZE = 32
SPECS = {"w1": spec.Blocks(2, 16), "b1": None, "w2": spec.Elements(32), "b2": spec.Replicate()}
SCALARS = {"step": 7, "lr": 0.25, "name": "run-7", "done": False, "nothing": None}


def model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(6, 16, generator=g),
        "b1": torch.randn(16, generator=g),
        "w2": torch.randn(16, 3, generator=g),
        "b2": torch.randn(3, generator=g),
    }


def legacy_state(comm, seed: int = 0):
    """Every entry kind: DBuffers, AdamW state (tensor count + DBuffers), bound 8-bit moments,
    bound Muon state (packed DBuffers), a PerRank tensor, a plain tensor, a plan, scalars (NaN
    included). Optimizer states after two updates with fixed gradients."""
    params = model(seed)
    plan = rg.make_plan(params, SPECS, world_size=comm.world_size)
    local = rg.shard(plan, params, comm)
    grads = [rg.shard(plan, model(seed + 10 + i), comm) for i in range(2)]
    opts = {
        "adamw": rg.optim.adamw(1e-2, weight_decay=0.1),
        "adam8": rg.optim.adamw_8bit(1e-2, min_size=MIN_SIZE),
        "muon": rg.optim.muon(1e-2, comm=comm),
    }
    states = {}
    for name, opt in opts.items():
        s = opt.init(local)
        for g in grads:
            _, s = opt.update(g, s, local)
        states[name] = s
    gen = torch.Generator().manual_seed(100 + seed)
    return {
        "params": local,
        "adamw": states["adamw"],
        "adam8": rg.checkpoint.bind_quant8(states["adam8"], local, min_size=MIN_SIZE),
        "muon": rg.checkpoint.bind_muon(states["muon"]),
        "rng": rg.checkpoint.PerRank(torch.arange(4) + 10 * comm.rank + seed),
        "table": torch.randn(2, 3, generator=gen, dtype=torch.float64),
        "plan": plan,
        "loss": float("nan"),
        **SCALARS,
    }


if __name__ == "__main__":
    rg.collectives.simulate(2, lambda comm: rg.checkpoint.save(sys.argv[1], legacy_state(comm), comm))
