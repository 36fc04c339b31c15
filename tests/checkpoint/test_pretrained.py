"""``rg.checkpoint.pretrained`` + ``fsdp.init``: every bad Hugging Face directory is refused with one
line naming the file and the key, before anything is loaded (and, for a mismatch, before any
collective, alike on every rank); each rank reads exactly its own element ranges."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from ragged.checkpoint import _safetensors
from ragged.checkpoint._safetensors import write_file


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).double()


def _dir(tmp_path, tensors=None, name="ckpt"):
    path = tmp_path / name
    path.mkdir()
    tensors = tensors if tensors is not None else {k: v.float() for k, v in _model().state_dict().items()}
    write_file(str(path / "model.safetensors"), tensors)
    return path


def _sharded(tmp_path):
    """Two files + index: layer 0 in a.safetensors, layer 1 in b.safetensors."""
    path = tmp_path / "sharded"
    path.mkdir()
    sd = {k: v.bfloat16() for k, v in _model().state_dict().items()}
    files = {"a.safetensors": [k for k in sd if k.startswith("0.")], "b.safetensors": [k for k in sd if k.startswith("1.")]}
    for f, keys in files.items():
        write_file(str(path / f), {k: sd[k] for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in files.items() for k in keys}}))
    return path


def _init_errors(path, m=2, **kw):
    """Every simulated rank's error text of fsdp.init from ``path`` (units of _model())."""
    units = fsdp.make_units(_model(), world_size=m, groups=["0", "1"])

    def run(comm):
        try:
            fsdp.init(units, rg.checkpoint.pretrained(path, **kw), rg.optim.adamw(1e-3), comm)
        except CheckpointMismatchError as exc:
            return str(exc)
        return None
    return rg.collectives.simulate(m, run)


def _one_line(exc_info, *parts):
    text = str(exc_info.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, text
    return text


@pytest.mark.parametrize("m", [1, 2, 3])
def test_each_rank_reads_only_its_own_ranges(tmp_path, monkeypatch, m):
    path = _sharded(tmp_path)
    reads = []
    real = _safetensors.read_range
    monkeypatch.setattr(_safetensors, "read_range", lambda p, key, e, a, b, out: (reads.append((key, a, b)),
                                                                                    real(p, key, e, a, b, out)))
    model = _model()
    units = fsdp.make_units(model, world_size=m, groups=["0", "1"])
    full = rg.collectives.simulate(m, lambda c: fsdp.export(
        units, fsdp.init(units, rg.checkpoint.pretrained(path), rg.optim.sgd(0.1), c).shards, c))[0]
    assert all(torch.equal(full[k], v.bfloat16().double()) for k, v in model.state_dict().items())
    for key, t in model.state_dict().items():  # every element read exactly once, over all ranks together
        spans = sorted((a, b) for k, a, b in reads if k == key)
        assert spans[0][0] == 0 and spans[-1][1] == t.numel() and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def test_replicated_leaves_read_whole_and_fp32_master(tmp_path):
    path = _dir(tmp_path)
    model = _model()
    units = fsdp.make_units(model, world_size=2, dtype=torch.float32,
                            specs=lambda n, t: rg.spec.Replicate() if t.dim() == 1 else None)
    full = rg.collectives.simulate(2, lambda c: fsdp.export(
        units, fsdp.init(units, rg.checkpoint.pretrained(path), rg.optim.sgd(0.1), c).shards, c, rank0_only=False))[1]
    assert all(full[k].dtype == torch.float32 and torch.equal(full[k], v.float()) for k, v in model.state_dict().items())


def test_missing_unexpected_shape_dtype_listed_alike_on_every_rank(tmp_path):
    sd = {k: v.float() for k, v in _model().state_dict().items()}
    del sd["1.bias"]
    sd["extra.weight"] = torch.zeros(2)
    sd["0.weight"] = torch.zeros(5, 7)
    sd["0.bias"] = torch.zeros(7, dtype=torch.int64)
    errors = _init_errors(_dir(tmp_path, sd))
    assert errors[0] == errors[1] and "\n" not in errors[0], errors
    for part in ("1 missing: '1.bias'", "1 unexpected: model.safetensors: 'extra.weight'",
                 "model.safetensors: '0.weight' is (5, 7), '0.weight' is (7, 5)",
                 "model.safetensors: '0.bias' is torch.int64, '0.bias' is torch.float64"):
        assert part in errors[0], errors[0]


def test_rename_maps_and_drops_keys(tmp_path):
    sd = {f"model.{k}": v.float() for k, v in _model().state_dict().items()}
    sd["model.rotary.inv_freq"] = torch.ones(3)
    path = _dir(tmp_path, sd)
    assert _init_errors(path, rename=lambda k: None if "rotary" in k else k.removeprefix("model.")) == [None, None]
    assert "4 missing" in _init_errors(path, m=1)[0]
    with pytest.raises(CheckpointCorruptError, match=re.escape("rename maps 'model.0.weight' and 'model.0.bias' both "
                                                               "to '0.weight'.")):
        rg.checkpoint.pretrained(path, rename={"model.0.bias": "0.weight", "model.0.weight": "0.weight"})


def test_truncated_file_names_file_and_key(tmp_path):
    path = _sharded(tmp_path)
    f = path / "b.safetensors"
    os.truncate(f, os.path.getsize(f) - 2)
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(path)
    _one_line(exc, "b.safetensors", "truncated", "'1.")


def test_header_that_lies_about_a_size(tmp_path):
    path = _dir(tmp_path)
    raw = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["1.weight"]["shape"] = [3, 8]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    (path / "model.safetensors").write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(path)
    _one_line(exc, "model.safetensors: '1.weight': the header says F32 [3, 8] (96 bytes) but its offsets")


def test_overlapping_offsets_and_bad_header_length(tmp_path):
    path = _dir(tmp_path)
    raw = bytearray((path / "model.safetensors").read_bytes())
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + raw[8:])
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(path)
    _one_line(exc, "model.safetensors: the header length says")


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/a.safetensors"])
def test_index_naming_a_file_outside_the_directory(tmp_path, target):
    path = _sharded(tmp_path)
    write_file(str(tmp_path / "outside.safetensors"), {"1.weight": torch.zeros(3, 7)})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["1.weight"] = target
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(path)
    _one_line(exc, "model.safetensors.index.json (for '1.weight')", repr(target), "refused")


def test_symlinked_file_is_refused(tmp_path):
    path = _sharded(tmp_path)
    shutil.move(path / "b.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", path / "b.safetensors")
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(path)
    _one_line(exc, "'b.safetensors' is a symlink")


def test_index_and_headers_disagree(tmp_path):
    path = _sharded(tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["1.weight"] = "a.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(path)
    _one_line(exc, "b.safetensors: '1.weight' is in this file but model.safetensors.index.json maps it to 'a.safetensors'")


def test_index_naming_a_missing_file(tmp_path):
    path = _sharded(tmp_path)
    os.remove(path / "b.safetensors")
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(path)
    _one_line(exc, "model.safetensors.index.json: maps '1.", "to 'b.safetensors', which is not in the directory")


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointCorruptError) as exc:
        rg.checkpoint.pretrained(tmp_path)
    _one_line(exc, "['pytorch_model.bin'] are pickle checkpoints, which are refused")


def test_file_truncated_after_the_header_was_read(tmp_path):
    path = _dir(tmp_path)
    weights = rg.checkpoint.pretrained(path)
    os.truncate(path / "model.safetensors", os.path.getsize(path / "model.safetensors") - 4)
    with pytest.raises(CheckpointCorruptError, match=re.escape("model.safetensors: '1.bias': the file ended after")):
        weights["1.bias"].read()  # the last tensor in the file


def test_frozen_leaves_load_and_get_no_optimizer_state(tmp_path):
    path = _sharded(tmp_path)
    model = _model()
    model[0].requires_grad_(False)
    units = fsdp.make_units(model, world_size=2, groups=["0", "1"])

    def run(comm):
        state = fsdp.init(units, rg.checkpoint.pretrained(path), rg.optim.adamw(1e-3), comm)
        moments = [d.plan for d in rg.pytree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, rg.DBuffer))
                   if isinstance(d, rg.DBuffer)]
        return fsdp.export(units, state.shards, comm, rank0_only=False), moments
    full, moments = rg.collectives.simulate(2, run)[0]
    assert moments and all(plan == units["1"].plan for plan in moments)  # frozen unit "0": no optimizer state
    assert all(torch.equal(full[k], v.bfloat16().double()) for k, v in model.state_dict().items())
