"""A user's own script, run by ``test_restart_gloo.py`` under ``torchrun --nproc-per-node 2
--max-restarts 1``: rank 1 of the first attempt kills itself (SIGKILL) mid-run; torchrun restarts
the group, whose ranks must initialise and finish. Both transports at once, each on a group of its
own (gloo's default on the default group, NCCL's shape on a second group of the same ranks): what
breaks a restart is left per group, so one run tests both.

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
import time

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
late = attempt > 0 and os.environ["RANK"] == "1"


def new_group(make):
    if late:
        time.sleep(1.0)
    return make()


new_group(lambda: dist.init_process_group("gloo"))
import ragged as rg  # noqa: E402
from ragged.collectives._ledger import POLL_SECONDS  # noqa: E402

header = rg.collectives.from_torch(handshake="header")
deferred = rg.collectives.from_torch(new_group(lambda: dist.new_group([0, 1])), handshake="deferred")
plan = rg.make_plan({"w": torch.empty(8, 4)}, world_size=2)
sums = []
for step in range(6):
    for comm in (header, deferred):
        full = rg.gather(rg.shard(plan, {"w": torch.full((8, 4), float(step))}, comm), comm)
        sums.append(float(full["w"].sum()))
    if attempt == 0 and step == 3 and header.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt and step == 4:
        time.sleep(1.5 * POLL_SECONDS)
with open(os.path.join(sys.argv[1], f"rank{header.rank}.json"), "w") as f:
    json.dump({"attempt": attempt, "sums": sums}, f)
header.barrier()
dist.destroy_process_group()
