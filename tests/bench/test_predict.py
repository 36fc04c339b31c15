"""bench/predict.py: the lowering's persistent bytes equal the fake process group's measured state,
to the byte, and its peak (with the model's own bytes profiled at W=1) is within 3% of the measured
peak (tiny model, W=8)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_predicted_state_is_the_measured_state_on_the_fake_process_group():
    from bench.memory import run_cell
    from bench.predict import predict

    p = predict("tiny", 8, False, 2)
    cell = run_cell("tiny", 8, False, batch=2, warmup=1, timeout=600)
    assert p["state"] == cell["ragged"]["step"]["start"]
    assert p["activations"] > 0 and p["peak"] >= p["peak_low"] > p["state"]
    assert abs(p["peak_low"] - cell["ragged"]["step"]["peak"]) < 0.03 * cell["ragged"]["step"]["peak"]
