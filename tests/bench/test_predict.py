"""bench/predict.py: the lowering's persistent bytes equal the fake process group's measured state,
to the byte (tiny model, W=8; the peak's error is reported by the bench, not asserted)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_predicted_state_is_the_measured_state_on_the_fake_process_group():
    from bench.memory import run_cell
    from bench.predict import predict

    p = predict("tiny", 8, False, 2)
    cell = run_cell("tiny", 8, False, batch=2, warmup=1, timeout=600)
    assert p["state"] == cell["ragged"]["step"]["start"]
    assert p["activations"] > 0 and p["peak"] > p["state"]
