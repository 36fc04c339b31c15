"""bench/memory.py: the fake-process-group memory harness runs, and its live-bytes counter counts.

No figure is asserted about ragged or FSDP2 (memory claims live in the bench output).
"""

from __future__ import annotations

import pytest
import torch


def test_live_bytes_counts_allocations_and_frees():
    from bench._measure import LiveBytes

    with LiveBytes(torch.device("cpu")) as live:
        keep = torch.zeros(1000)
        with live.window("step"):
            tmp = torch.ones(3000)
            tmp2 = torch.ones(500)
            del tmp
        with live.window("after"):
            pass
    r = live.result("step")
    assert (r["start"], r["peak"], r["end"]) == (4000, 18000, 6000)
    assert live.result("after")["start"] == 6000
    del keep, tmp2


@pytest.mark.slow
def test_memory_bench_runs_on_the_fake_process_group():
    """Tiny model, W=8, activation checkpointing: each method in its own fake-group process."""
    from bench.memory import row, run_cell

    cell = run_cell("tiny", 8, True, batch=2, warmup=1, timeout=600)
    for name in ("ragged", "fsdp2"):
        step = cell[name]["step"]
        assert cell[name]["world"] == 8
        assert step["peak"] > step["start"] > 0
    assert cell["ragged"]["saved_activation_bytes"] > 0
    assert row("tiny", True, cell)[:3] == ["tiny", "on", "8"]
