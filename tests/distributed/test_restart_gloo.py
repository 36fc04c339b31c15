"""Jobs that survive a killed worker under ``torchrun --max-restarts``: the restarted ranks
initialise and finish (see [Note: restarts and the rendezvous store] in
``ragged/collectives/_rendezvous.py``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_user_script_restarts_and_resumes_after_a_worker_is_killed_in_a_background_save(tmp_path):
    run = _torchrun(os.path.join(HERE, "_restart_job.py"), str(tmp_path))
    assert run.returncode == 0, run.stderr[-4000:]
    w, target = torch.zeros(8, 4, dtype=torch.float64), torch.linspace(-1, 1, 32, dtype=torch.float64).view(8, 4)
    for _ in range(6):  # the job, uninterrupted, in one process
        w = w - 0.25 * (2 * (w - target))
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["attempt"] == 1 and got["resumed_from"] == {"header": 2, "deferred": 2}  # the 3rd was in flight
        assert got["w"] == {"header": w.flatten().tolist(), "deferred": w.flatten().tolist()}


TINY = ["--layers", "1", "--dim", "16", "--heads", "2", "--ffn", "32", "--vocab", "32", "--seq", "8", "--batch", "4",
        "--warmup", "1", "--lr", "3e-2", "--steps", "12", "--checkpoint-every", "3", "--quiet"]


def _workers(pid: int) -> dict[int, int]:
    """``{rank: pid}`` of torchrun's worker processes."""
    out = {}
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for child in children:
        try:
            with open(f"/proc/{child}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except FileNotFoundError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = child
    return out


def _losses(directory) -> dict[int, list[float]]:
    """Every loss ``history.jsonl`` recorded, by step (a step taken again after a resume: twice)."""
    out: dict[int, list[float]] = {}
    for line in (directory / "history.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], []).append(rec["loss"])
    return out


@pytest.mark.slow
def test_the_cli_restarts_resumes_and_continues_on_other_world_sizes(tmp_path):
    """``python -m ragged train --chunks 4`` under torchrun: rank 1 killed mid-run (SIGKILL, from
    outside); the restarted group resumes from the newest checkpoint, the steps it takes again give
    the very losses they gave before the kill, and the job finishes; its summary names the world
    sizes that give the same numbers. Its checkpoint then resumes at 4 ranks with ``--chunks 4``,
    giving the uninterrupted run's losses to the bit, and at 1 rank without it, to float tolerance;
    each summary says which."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.1", "-m", "ragged", "train", *TINY, "--chunks", "4", "--checkpoint-dir", str(ckpt),
           "--json", str(tmp_path / "run.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "step-00000003").exists():  # published by the save after step 6: the run is past it
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.01)
        os.kill(_workers(proc.pid)[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    resumed = re.search(r"resumed from \S+: step (\d+) of 12, saved at world size 2, now 2", out)
    assert resumed, out[-4000:]
    losses = _losses(ckpt)
    again = [s for s, v in losses.items() if len(v) > 1]
    assert sorted(losses) == list(range(12)) and again and min(again) == int(resumed.group(1))
    assert all(len(set(v)) == 1 for v in losses.values())  # taken again after the resume: the same bits
    run = json.loads((tmp_path / "run.json").read_text())
    history = run["history"]
    assert [h["loss"] for h in history] == [v[0] for _, v in sorted(losses.items())]
    assert run["summary"]["same_numbers_at"] == [1, 2, 4] and "--nproc-per-node 1, 2, 4 (--chunks 4)" in out

    for world, chunks in ((4, ["--chunks", "4"]), (1, [])):  # the checkpoint after step 9, on other ranks
        other = tmp_path / f"w{world}"
        other.mkdir()
        shutil.copytree(ckpt / "step-00000009", other / "step-00000009")
        shutil.copy(ckpt / "history.jsonl", other)
        run = subprocess.run([sys.executable, "-m", "ragged", "train", "--nproc-per-node", str(world), *TINY, *chunks,
                              "--checkpoint-dir", str(other), "--json", str(other / "run.json")],
                             capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert f"resumed from {other / 'step-00000009'}: step 9 of 12, saved at world size 2, now {world}" in run.stdout
        got = json.loads((other / "run.json").read_text())
        said = got["summary"]["resumed"]["losses"]
        mine = [h["loss"] for h in got["history"]]
        assert mine[:9] == [h["loss"] for h in history[:9]]  # the steps before the checkpoint, from its history
        if chunks:
            assert said.startswith("bit-identical") and mine[9:] == [h["loss"] for h in history[9:]], said
        else:
            assert "to float tolerance" in said and "saved with --chunks 4" in said, said
            torch.testing.assert_close(mine[9:], [h["loss"] for h in history[9:]], rtol=1e-5, atol=1e-6)
