"""Jobs that survive a killed worker under ``torchrun --max-restarts``: the restarted ranks
initialise and finish (see [Note: restarts and the rendezvous store] in
``ragged/collectives/_rendezvous.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_user_script_restarts_after_a_worker_is_killed(tmp_path):
    run = _torchrun(os.path.join(HERE, "_restart_job.py"), str(tmp_path))
    assert run.returncode == 0, run.stderr[-4000:]
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got == {"attempt": 1, "sums": [32.0 * s for s in range(6) for _ in range(2)]}
