"""The main job end to end: ``python -m ragged train`` starts 2 gloo ranks, trains a tiny GPT
(dense and MoE) and writes its metrics; the loss falls."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("extra", [[], ["--moe", "--micro-batches", "2", "--compute-dtype", "bf16"]],
                         ids=["dense", "moe-accum-bf16"])
def test_train_subcommand_runs_and_loss_falls(tmp_path, extra):
    out = tmp_path / "metrics.json"
    cmd = [sys.executable, "-m", "ragged", "train", "--nproc-per-node", "2", "--steps", "12", "--warmup", "2",
           "--layers", "2", "--dim", "32", "--ffn", "64", "--vocab", "64", "--seq", "32", "--batch", "8",
           "--lr", "1e-2", "--quiet", "--json", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FSDP units over 2 ranks" in proc.stdout and "summary" in proc.stdout
    data = json.loads(out.read_text())
    summary, history = data["summary"], data["history"]
    assert summary["world_size"] == 2 and len(history) == 12
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    assert summary["peak_gathered_bytes"] < summary["model_bytes"]
