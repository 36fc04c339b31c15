"""`python -m ragged plan` (in-process through main(), plus one real subprocess)."""

import json
import subprocess
import sys

import pytest

from ragged.__main__ import main


def run(capsys, *argv):
    code = main(["plan", *argv, "--width", "200"])
    return code, capsys.readouterr().out


def test_plan_prints_a_table_per_unit_kind_and_the_whole_model(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "64", "256")
    assert code == 0
    for title in ("embed x1", "moe_layer x36", "head x1", "whole model"):
        assert title in out
    for col in ("ragged", "fsdp2", "fsdp1", "zero3", "megatron", "planner time"):
        assert col in out


def test_coarse_granules_are_explained_with_numbers(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "1024", "-g", "rows:128")
    assert code == 0
    assert "warning: moe_layer at m=1024 with rows:128" in out
    assert "longer than 2*S" in out and "multiple of the lcm of their granules" in out
    assert "order-free lower bound" in out
    assert "shard group 512 (2 replicas):" in out and "layers per unit at m=1024 2:" in out
    assert "granularity rows:1 at m=1024:" in out


def test_blocks_fall_back_where_tiles_cannot_apply(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "64", "-g", "blocks:128x128")
    assert code == 0
    assert "whole matrices Rows(2880)" in out and "1-D leaves use Rows(1)" in out


def test_user_shapes(capsys, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"units": [{"name": "layers.{0..3}", "kind": "block", "params": {"w": [64, 32], "b": [32]}}]}))
    code, out = run(capsys, "--shapes", str(path), "-m", "8", "--strategy", "exact")
    assert code == 0 and "block x4" in out


def test_world_size_ranges(capsys):
    code, out = run(capsys, "--model", "llama3-70b", "-m", "8..32", "64")
    assert code == 0
    table = out[out.index("whole model"):]
    rows = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]
    assert rows == ["8", "16", "32", "64"]


def test_bad_inputs_exit_non_zero(capsys):
    assert run(capsys, "--shapes", "/no/such.json", "-m", "8")[0] == 2
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "llama3-70b", "-m", "8", "-g", "rows:x"])
    assert info.value.code == 2
    assert "not one of rows:N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama3-70b", "-m", "0"])
    assert "must be a positive int" in capsys.readouterr().err


@pytest.mark.slow
def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "ragged", "plan", "--model", "llama3-70b", "-m", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "layer x80" in out.stdout
