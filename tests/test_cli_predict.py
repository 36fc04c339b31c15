"""``python -m ragged plan --predict``: the per-rank table and its JSON, equal to lowering the same
step in Python (see ``ragged/_cli_predict.py``)."""

from __future__ import annotations

import json

from ragged._cli import run as cli_run
from ragged._cli_predict import bundled_step
from ragged.fsdp._lower_peers import compare

SHAPES = {"units": [
    {"name": "embed", "kind": "embed", "params": {"emb.weight": [1000, 64]}},
    {"name": "layers.{0..3}", "kind": "layer", "params": {"qkv.weight": [192, 64], "experts.w": [8, 96, 64],
                                                          "norm.weight": [64]}},
    {"name": "head", "kind": "head", "params": {"norm.weight": [64], "lm_head.weight": [1000, 64]}},
]}


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


def test_predict_table(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "256", "--predict", "--optimizer", "adamw8bit",
                    "--granularity", "blocks:32x32", "--width", "220")
    assert code == 0
    assert "fsdp2" in out and "zero3" in out and "peak at" in out and "assumed: activations" in out
