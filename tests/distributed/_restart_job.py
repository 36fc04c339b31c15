"""A user's own training script, run by ``test_restart_gloo.py`` under ``torchrun --nproc-per-node 2
--max-restarts 1``: two small jobs (gloo's default transport on the default group, NCCL's shape on
a second group of the same ranks: what breaks a restart is left per group, so one run tests both)
checkpoint every step in the background and resume from their newest checkpoint. Rank 1 of the
first attempt is killed (SIGKILL) while its thread writes a checkpoint; torchrun restarts the
group, whose ranks must initialise, resume and finish.

Two stale things in torchrun's store (kept by every attempt, see [Note: restarts and the
rendezvous store] in ``ragged/collectives/_rendezvous.py``) broke the restart; the script makes
each show every time instead of by chance: rank 1 of a restarted attempt reaches each group's
creation a second late (as a slow import does), so rank 0 reads its old address; and the restarted
attempt outlives the deferred ledger's poll period, so its watcher would see a poison left behind.
"""

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

STEPS, KILLED_AT = 6, 3
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
late = attempt > 0 and os.environ["RANK"] == "1"


def new_group(make):
    if late:
        time.sleep(1.0)
    return make()


new_group(lambda: dist.init_process_group("gloo"))
import ragged as rg  # noqa: E402
from ragged.checkpoint import _dcp  # noqa: E402
from ragged.collectives._ledger import POLL_SECONDS  # noqa: E402

out = sys.argv[1]
comms = {"header": rg.collectives.from_torch(handshake="header"),
         "deferred": rg.collectives.from_torch(new_group(lambda: dist.new_group([0, 1])), handshake="deferred")}
plan = rg.make_plan({"w": torch.empty(8, 4, dtype=torch.float64)}, world_size=2)
target = torch.linspace(-1, 1, 32, dtype=torch.float64).view(8, 4)


def newest(name):
    steps = sorted(int(n) for n in os.listdir(os.path.join(out, name)) if n.isdigit()) if os.path.isdir(os.path.join(out, name)) else []
    return steps[-1] if steps else 0


jobs = {}
for name, comm in comms.items():  # resume from the newest checkpoint
    start = newest(name)
    w = rg.shard(plan, {"w": torch.zeros(8, 4, dtype=torch.float64)}, comm)
    if start:
        w = rg.checkpoint.load(os.path.join(out, name, str(start)), {"w": w, "step": 0}, comm)["w"]
    jobs[name] = (w, start)


def kill_rank_1(step):  # rank 1's writing thread, once its files of the header job's 3rd checkpoint are written
    writing = threading.current_thread().name  # "ragged-save <path> rank <r>": another save's thread may still write
    if step == "written" and os.path.join(out, "header", str(KILLED_AT)) + " " in writing and attempt == 0 \
            and comms["header"].rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


_dcp.FAULT = kill_rank_1
first = min(start for _, start in jobs.values())
for step in range(first + 1, STEPS + 1):
    for name, comm in comms.items():
        w, start = jobs[name]
        if step <= start:
            continue
        full = rg.gather(w, comm)["w"]
        grad = rg.reduce_scatter(plan, {"w": 2 * (full - target)}, comm, op="mean")
        w = w.replace(data=w.data - 0.25 * grad.data)
        handle = rg.checkpoint.save(os.path.join(out, name, str(step)), {"w": w, "step": step}, comm, blocking=False)
        jobs[name] = (w, start)
        if (name, step) == ("header", KILLED_AT) and comm.rank == 1 and attempt == 0:
            time.sleep(60)  # killed by its thread, while rank 0 waits in the deferred job's next collective
    if attempt and step == STEPS - 1:
        time.sleep(1.5 * POLL_SECONDS)  # a stale poison would reach the deferred comm's watcher by now
handle.result()
with open(os.path.join(out, f"rank{comms['header'].rank}.json"), "w") as f:
    json.dump({"attempt": attempt, "resumed_from": {k: s for k, (_, s) in jobs.items()},
               "w": {k: rg.gather(w, comms[k])["w"].flatten().tolist() for k, (w, _) in jobs.items()}}, f)
comms["header"].barrier()
dist.destroy_process_group()
