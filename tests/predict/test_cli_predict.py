"""``python -m ragged plan --predict``: the per-rank table and its JSON, equal to lowering the same
step in Python (see ``ragged/predict/_command.py``)."""

from __future__ import annotations

import json

import pytest

from ragged.__main__ import main as cli_run
from ragged.predict._command import bundled_step
from ragged.predict._model_costs import unit_costs
from ragged.predict._peers import compare

SHAPES = {"units": [
    {"name": "embed", "kind": "embed", "params": {"emb.weight": [1000, 64]}},
    {"name": "layers.{0..3}", "kind": "layer", "params": {"qkv.weight": [192, 64], "experts.w": [8, 96, 64],
                                                          "norm.weight": [64]}},
    {"name": "head", "kind": "head", "params": {"norm.weight": [64], "lm_head.weight": [1000, 64]}},
], "config": {"num_experts_per_tok": 2}}


def run(capsys, *argv):
    code = cli_run(["plan", *argv])
    return code, capsys.readouterr().out


def test_predict_json_is_the_lowering(capsys, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(SHAPES))
    code, out = run(capsys, "--shapes", str(path), "-m", "16", "48", "--predict", "--dtype", "fp32", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["world_size"] for r in rows] == [16, 48]
    for r in rows:
        lowered = bundled_step(str(path), r["world_size"], dtype="fp32").lower()
        mem = lowered.memory_analysis()
        assert r["persistent_bytes"] == mem.persistent_bytes and r["by_category"] == mem.by_category
        peers = {p.system: p for p in compare(lowered)}
        assert r["systems"]["fsdp2"]["persistent_bytes"] == peers["fsdp2"].persistent_bytes
        # FSDP2 pads the 8 stacked experts to W rows: at W=48, 6x the experts' bytes
        assert r["systems"]["fsdp2"]["persistent_bytes"] > r["systems"]["ragged"]["persistent_bytes"]


def test_progress_goes_to_stderr_and_stdout_stays_json(capsys, tmp_path):
    """The lowering says what it is doing on stderr, one line each in a log (a rich status line in
    a terminal), so ``--json``'s stdout parses as it is."""
    cli_run(["plan", "--shapes", shapes_file(tmp_path), "-m", "16", "--predict", "--mesh", "fsdp", "hsdp:2", "--json"])
    out, err = capsys.readouterr()
    assert [r["mesh"] for r in json.loads(out)] == ["fsdp", "hsdp:2"]
    lines = err.splitlines()
    assert lines[0] == "plan --predict: [1/2] m=16 fsdp adamw: planning 6 units over a shard group of 16 ranks"
    assert "plan --predict: [1/2] m=16 fsdp adamw: rank 15's state (8 of 8 evaluated ranks)" in lines
    assert lines[-1] == "plan --predict: [2/2] m=16 hsdp:2 adamw: step time"


def test_predict_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # stdout captured (not a terminal): nothing is cut even so
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "256", "--predict", "--optimizer", "adamw8bit",
                    "--granularity", "blocks:32x32")
    assert code == 0 and "…" not in out
    assert "fsdp2" in out and "zero3" in out and "peak at" in out and "assumed: activations: ANALYTIC" in out
    assert "step time per rank" in out and "peak-tflops = 989" in out and "(ASSUMED: H100 SXM" in out


def shapes_file(tmp_path, desc=SHAPES):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(desc))
    return str(path)


def predict_json(capsys, *argv):
    code, out = run(capsys, *argv, "--json")
    assert code == 0
    return json.loads(out)


@pytest.mark.parametrize("mesh, message", [
    ("hsdp:3", "--mesh hsdp:3 does not divide --world-size 16: HSDP's 3 replica groups must split the world evenly"),
    ("hsdp:1", "argument --mesh: mesh 'hsdp:1' must be fsdp or hsdp:R with R >= 2"),
    ("tp:2", "argument --mesh: mesh 'tp:2' must be fsdp or hsdp:R"),
], ids=["not-dividing", "one-replica", "unknown"])
def test_a_bad_mesh_is_a_one_line_error(capsys, tmp_path, mesh, message):
    with pytest.raises(SystemExit) as info:
        cli_run(["plan", "--shapes", shapes_file(tmp_path), "-m", "16", "--predict", "--mesh", mesh])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and err.count("\n") == 1


def test_hsdp_holds_the_state_of_fsdp_at_its_shard_group(capsys, tmp_path):
    rows = predict_json(capsys, "--shapes", shapes_file(tmp_path), "-m", "16", "32", "--predict",
                        "--mesh", "fsdp", "hsdp:2")
    by = {(r["world_size"], r["mesh"]): r for r in rows}
    assert sorted(by) == [(16, "fsdp"), (16, "hsdp:2"), (32, "fsdp"), (32, "hsdp:2")]
    fsdp16, hsdp32 = by[16, "fsdp"], by[32, "hsdp:2"]
    assert (hsdp32["shard_size"], hsdp32["replicas"]) == (16, 2)
    # the same units (shard group 16): the same persistent state, category by category, and nothing else
    assert hsdp32["by_category"] == fsdp16["by_category"] and hsdp32["persistent_bytes"] == fsdp16["persistent_bytes"]
    assert hsdp32["persistent_bytes"] > by[32, "fsdp"]["persistent_bytes"]
    # the same shard-axis collectives, plus all-reduces over the replica axis
    on = lambda r, axis: [c for c in r["collectives"] if c["axis"] == axis]  # noqa: E731
    assert on(hsdp32, "shard") == on(fsdp16, "shard") and not on(fsdp16, "replica")
    assert [c["kind"] for c in on(hsdp32, "replica")] == ["all_reduce"]
    assert hsdp32["time"]["links"]["shard"] == fsdp16["time"]["links"]["shard"] and "replica" in hsdp32["time"]["links"]


def test_flops_of_a_shapes_file_are_the_hand_count(capsys, tmp_path):
    path = shapes_file(tmp_path)
    layer = 2 * (192 * 64 + 8 * 96 * 64 * 2 // 8 + 64)  # qkv, 2 of the 8 stacked experts, the norm: 2 flops each
    head = 2 * (64 + 1000 * 64)
    costs = unit_costs(path, seq_len=128, batch=2)
    assert [(c.name, c.flops_per_token) for c in costs] == [("embed", 0)] + [(f"layers.{i}", layer) for i in range(4)] \
        + [("head", head)]
    (row,) = predict_json(capsys, "--shapes", path, "-m", "16", "--predict", "--seq-len", "128", "--batch", "2",
                          "--peak-tflops", "1", "--mfu", "0.5")
    assert row["flops_per_token"] == 4 * layer + head
    # forward + backward (2x) of every token, at 1 TFLOP/s x 0.5
    assert row["time"]["compute"] == pytest.approx(3 * (4 * layer + head) * 256 / 0.5e12)
    assert row["time"]["seconds"] >= row["time"]["compute"]


def test_checkpointing_lowers_the_peak_by_the_hand_count(capsys, tmp_path):
    path = shapes_file(tmp_path)
    common = ("--shapes", path, "-m", "16", "--predict", "--seq-len", "128", "--batch", "2")
    (plain,) = predict_json(capsys, *common)
    (ckpt,) = predict_json(capsys, *common, "--checkpointing")
    sbh, sbv = 256 * 64, 256 * 1000
    head = 4 * sbh + 4 * sbv  # final norm and projection inputs, fp32 logits (Korthikanti et al. 2022)
    # the peak is in the head's backward: every layer's saved bytes, the head's, and the logits' gradient
    assert plain["peak_at"] == ckpt["peak_at"] == ["head", "backward segment 5, gradients in"]
    assert plain["peak_parts"]["activations"] == 4 * 34 * sbh + head + 4 * sbv
    assert ckpt["peak_parts"]["activations"] == 4 * 2 * sbh + head + 4 * sbv
    assert plain["peak_bytes"] - ckpt["peak_bytes"] == 4 * 32 * sbh
    assert ckpt["time"]["compute"] == pytest.approx(plain["time"]["compute"] * 4 / 3)  # backward recomputes forward


def test_sweep_drops_what_does_not_fit_and_orders_the_rest_by_time(capsys):
    out = predict_json(capsys, "--model", "gpt-oss-120b", "-m", "1024", "--mesh", "fsdp", "hsdp:2", "hsdp:128",
                       "--sweep", "--memory", "80")
    assert out["budget_bytes"] == 80 * 2**30
    # hsdp:128 at 1024 is a shard group of 8: each rank holds 1/8 of 117B parameters' state
    assert [(r["mesh"], r["peak_bytes"] > 80 * 2**30) for r in out["dropped"]] == [("hsdp:128", True)]
    ranked = out["ranked"]
    assert sorted(r["mesh"] for r in ranked) == ["fsdp", "hsdp:2"]
    assert all(r["peak_bytes"] <= 80 * 2**30 for r in ranked)
    assert [r["time"]["seconds"] for r in ranked] == sorted(r["time"]["seconds"] for r in ranked)


def test_routed_experts_without_experts_per_token_is_a_one_line_error(capsys, tmp_path):
    desc = dict(SHAPES)
    desc.pop("config")
    with pytest.raises(SystemExit) as info:
        cli_run(["plan", "--shapes", shapes_file(tmp_path, desc), "-m", "16", "--predict"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "no config.num_experts_per_tok" in err and err.count("\n") == 1


def test_sweep_and_memory_go_together(capsys):
    for argv, message in ((["--sweep"], "--sweep needs --memory GIB"), (["--memory", "80"], "applies to --sweep only")):
        with pytest.raises(SystemExit):
            cli_run(["plan", "--model", "gpt-oss-120b", "-m", "1024", *argv])
        assert message in capsys.readouterr().err


def test_predict_muon_is_the_lowering_with_its_owner_exchange(capsys, tmp_path):
    """``--optimizer muon``: Muon's state (momentum on the shard, AdamW's over the other elements) and its
    owner exchange (all-to-alls) in the table, equal to lowering the same step in Python."""
    path = shapes_file(tmp_path)
    (row,) = predict_json(capsys, "--shapes", path, "-m", "48", "--predict", "--dtype", "fp32", "--optimizer", "muon")
    lowered = bundled_step(path, 48, dtype="fp32", optimizer="muon").lower()
    assert row["persistent_bytes"] == lowered.memory_analysis().persistent_bytes
    assert any(k.startswith("optimizer.") and "momentum" in k for k in row["by_category"]), row["by_category"]
    exchange = lowered.cost_analysis().get("all_to_all")
    assert exchange.calls > 0 and exchange.bytes > 0
    assert [c for c in row["collectives"] if c["kind"] == "all_to_all"][0]["bytes"] == exchange.bytes


def test_predict_soap_and_shampoo_count_each_blocks_factors(capsys, tmp_path):
    """``--optimizer soap shampoo`` on 32 x 32 blocks: each block's two statistics and two bases (roots)
    of 32 x 32, as many elements as the block itself, equal to lowering the same step in Python."""
    from ragged import spec

    path = shapes_file(tmp_path)
    rows = predict_json(capsys, "--shapes", path, "-m", "16", "--predict", "--dtype", "fp32",
                        "--optimizer", "soap", "shampoo", "--granularity", "blocks:32x32")
    for row, factors in zip(rows, (("left_basis", "right_basis"), ("left_root", "right_root"))):
        cat = row["by_category"]
        lowered = bundled_step(path, 16, dtype="fp32", optimizer=row["optimizer"], granularity=spec.Blocks(32, 32)).lower()
        assert row["persistent_bytes"] == lowered.memory_analysis().persistent_bytes
        per_factor = {cat[f"optimizer.{k}"] for k in ("left_stats", "right_stats") + factors}
        assert len(per_factor) == 1 and per_factor.pop() > 0
        assert not [c for c in row["collectives"] if c["kind"] == "all_to_all"]  # no exchange, unlike Muon's


def test_predict_with_a_quantized_gather_is_the_lowering(capsys, tmp_path):
    from ragged import spec
    from ragged.predict._command import GATHER_FORMATS, _tiles, bundled_units, step_over

    path = shapes_file(tmp_path)
    rows = predict_json(capsys, "--shapes", path, "-m", "16", "--predict", "--dtype", "fp32",
                        "--gather-format", "none", "mxfp8", "int8")
    assert [r["gather_format"] for r in rows] == ["none", "mxfp8", "int8"]
    plain, mx, i8 = ({c["kind"]: c["bytes"] for c in r["collectives"]} for r in rows)
    # mxfp8 plans rows:1 as before and moves a code byte per element (+ 1/32 for scales) instead of bf16's 2
    assert 0.5 < mx["all_gather"] / plain["all_gather"] < 0.53
    assert rows[1]["quantized_share"] > 0.9 and rows[0]["quantized_share"] == 0.0
    assert rows[1]["time"]["comm"]["all_gather"] < rows[0]["time"]["comm"]["all_gather"]  # the time follows the bytes
    tiles = _tiles(GATHER_FORMATS["int8"], spec.Rows(1))  # 32 x 32 tiles where they fit (not the 1000-row vocab)
    lowered = step_over(bundled_units(path, 16, dtype="fp32", granularity=tiles), gather_format="int8").lower()
    assert {c.kind: c.bytes for c in lowered.cost_analysis().collectives}["all_gather"] == i8["all_gather"]
