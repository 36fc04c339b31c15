"""bench/predict.py: the lowering's persistent bytes equal the fake process group's measured state,
to the byte, and its peak (with the model's own bytes profiled at W=1) is within 3% of the measured
peak (tiny model, W=8)."""

from __future__ import annotations

import math

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


def test_time_fit_tau_and_prediction_from_pieces():
    """``--time``'s arithmetic without timing anything: the least-squares line recovers a known link,
    Kendall's tau of known orders, and a prediction from given W=1 pieces (no overlap never faster)."""
    from bench._predict_time import SETTINGS, cpu_share, fit, kendall_tau, markdown, predict
    from bench.step import CONFIGS
    from ragged.predict import Link

    alpha, bw = fit([(b, 2e-3 + 0.5 * b / 1e9, 0.0) for b in (2**20, 2**24, 2**25)], 2)  # (W-1)/W = 1/2
    assert cpu_share([(1, 2.0, 1.0), (2, 6.0, 2.0)]) == pytest.approx(3 / 8)  # time-weighted
    assert alpha == pytest.approx(2e-3) and bw == pytest.approx(1e9)
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0 and kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(2 / 3)
    assert math.isnan(kendall_tau([1], [1]))  # one configuration (--settings default): no pair to order
    pieces = {"blocks.0": 1e-3, "blocks.1": 1e-3, "loss": 3e-3, "update": 1e-3, "step": 1e-2}
    link = Link(alpha=1e-4, bandwidth=1e8)
    for name in SETTINGS:
        a = predict(CONFIGS["tiny"], name, 2, pieces, None, link, share=1.0, overlap=True)
        b = predict(CONFIGS["tiny"], name, 2, pieces, None, link, share=1.0, overlap=False)
        assert a.parts["compute"] == pytest.approx(1e-2 - 1e-3 + 1e-3 / 2)  # forward + backward at W=1, the update / W
        assert b.seconds >= a.seconds - 1e-12
    four = predict(CONFIGS["tiny"], "default", 4, pieces, None, link, share=2.0, overlap=True)
    assert four.parts["compute"] == pytest.approx(2 * (1e-2 - 1e-3 + 1e-3 / 4))  # compute at W twice as slow
    # the W=1 collectives' local copies leave the compute wherever they ran (the link prices them at W)
    copies = dict(pieces, **{"collective": 2e-3, "collective:loss": 5e-4, "collective:blocks.0": 2e-4})
    c = predict(CONFIGS["tiny"], "default", 2, copies, None, link, share=1.0, overlap=False)
    assert c.parts["compute"] == pytest.approx(1e-2 - 1e-3 - 2e-3 + 1e-3 / 2)
    # the tables of --time (and of docs/performance.md) from a run's plain values
    result = {"model": "tiny", "skipped": [], "links": [], "rows": [
        {"configuration": n, "world": 2, "measured": [m, m], "cpu": m, "predicted": [m * 1.1, m * 1.2, m * (3 - 2 * k)],
         "compute": m, "comm": 0.0} for k, (n, m) in enumerate([("a", 1.0), ("b", 2.0)])]}
    tau = markdown(result)[-1].splitlines()[-1]
    assert tau == "| 2 | 1.00 | 1.00 | -1.00 | 2/2 / 0/2 / 1/2 | a < b |"
    hf = {k.replace("blocks.", "model.layers."): v for k, v in copies.items()}
    for name in ("default", "2 blocks per unit"):
        h = predict(CONFIGS["tiny-hf-llama"], name, 2, hf, None, link, share=1.0, overlap=False)
        assert h.parts["compute"] == pytest.approx(c.parts["compute"])


def test_exact_mode_lowering_equals_two_real_steps_on_the_fake_process_group():
    """``bench/predict.py --exact`` on the tiny model at W=8, HSDP (2 x 4), multi-buffer plans, AdamW and
    8-bit AdamW: the lowering on an abstract comm equals the measured state by category and every
    collective (kind, axis), and torch's count differs from ragged's only where named (one torch call
    per buffer of a coalesced call; the deferred ledger's own checks, put in the counted step by a
    short ``verify_every``)."""
    from bench._predict_exact import run

    lines = []
    results = run(["tiny"], [8], plans=("multi",), optimizers=("adamw", "adamw8bit"), meshes=("hsdp",), verify_every=4,
                  out=lines.append)
    assert [r["lowered"] for r in results] == ["exact", "exact"], lines
    assert not any(r["torch"].startswith("UNEXPLAINED") for r in results), lines
    assert all("all_reduce shard (ledger check" in r["torch"] and "all_reduce replica (ledger" in r["torch"]
               for r in results), lines
    adamw, quant = results
    assert ("all_reduce", "replica") in adamw["calls"] and "per buffer" in adamw["torch"]
    assert {"optimizer.mu_codes", "optimizer.mu_scales"} <= set(quant["state"])
    assert lines[-1].startswith("\n2 of 2 cells exact")


def test_exact_mode_on_real_gloo_ranks_compares_every_rank_in_both_transports():
    """``bench/predict.py --exact --backend gloo``: two real gloo ranks, each rank's state and collectives
    equal the lowering at its rank, in NCCL's transport (torch's count named against ragged's) and in
    gloo's default (its header paths' point-to-point messages shown)."""
    from bench._predict_exact import run

    lines = []
    results = run(["tiny"], [2], plans=("multi",), optimizers=("adamw",), meshes=("fsdp",), backend="gloo",
                  out=lines.append)
    assert [(r["transport"], r["lowered"]) for r in results] == [("nccl-shaped", "exact, all 2 ranks"),
                                                                ("gloo-default", "exact, all 2 ranks")], lines
    nccl, gloo = results
    assert "per buffer" in nccl["torch"] and not nccl["torch"].startswith("UNEXPLAINED"), lines
    assert gloo["torch"].startswith("header paths: shard") and "sends" in gloo["torch"], lines
    assert nccl["calls"][("all_reduce", "shard")][1] == gloo["calls"][("all_reduce", "shard")][1] + 16  # 4 int64 vs 2
