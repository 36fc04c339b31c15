"""The lifecycle with Hugging Face models (tiny configs, random init, nothing downloaded, float64):
build on meta, ``fsdp.init``, train, ``fsdp.export``, ``save_pretrained`` / ``from_pretrained``;
and ``python -m ragged train --hf``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.examples import hf
from tests.fsdp._lifecycle_cases import HF_KINDS as KINDS
from tests.fsdp._lifecycle_cases import assert_state_dicts_equal, batches, exported_init, hf_reference_train, hf_train
from tests.fsdp._lifecycle_cases import hf_config as _config
from tests.fsdp._lifecycle_cases import hf_meta as _meta

# a test dependency (pyproject [test]); a machine without it (scripts/gpu_check.sh's) still collects the suite
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pyproject [test] has it)")

simulate = rg.collectives.simulate
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_meta_init_is_equal_at_every_world_size_and_real(name):
    w1 = simulate(1, lambda c: exported_init(c, _meta(name)))[0]
    model = _meta(name)
    w2 = simulate(2, lambda c: exported_init(c, model))
    assert w2[0] is not None and w2[1] is not None
    for r in range(2):
        assert_state_dicts_equal(w2[r], w1)
    assert ("lm_head.weight" in w1) and ((w1["lm_head.weight"] is w1["model.embed_tokens.weight"]) == KINDS[name][1])
    # HF's own init: N(0, initializer_range) matrices, unit norms; the rotary buffers computed, not garbage
    std = _config(name).initializer_range
    assert abs(float(w1["model.layers.0.self_attn.q_proj.weight"].std()) - std) < 0.3 * std
    assert torch.equal(w1["model.norm.weight"], torch.ones(32, dtype=torch.float64))
    reference = hf.build(_config(name), device="cpu", dtype=torch.float64)
    for n, b in model.named_buffers():
        assert not b.is_meta and torch.equal(b, dict(reference.named_buffers())[n]), n
    assert all(isinstance(p, fsdp.Placeholder) for p in model.parameters())


def test_init_from_module_dict_and_state_dict_equal():
    torch.manual_seed(0)
    model = hf.build(_config("llama-tied"), device="cpu", dtype=torch.float64)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    units = fsdp.make_units(model, world_size=2)

    def run(comm, params):
        state = fsdp.init(units, params, rg.optim.sgd(0.1), comm)
        return {k: v.data.clone() for k, v in state.shards.items()}

    by_dict = simulate(2, run, dict(model.named_parameters()))
    by_sd = simulate(2, run, model.state_dict())
    by_module = simulate(2, run, model)
    for r in range(2):
        for u in units.names:
            assert torch.equal(by_dict[r][u], by_sd[r][u]) and torch.equal(by_dict[r][u], by_module[r][u])
    # the module keeps placeholders; what only reads metadata works
    assert isinstance(model.lm_head.weight, fsdp.Placeholder) and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.float64 and model.num_parameters() == sum(v.numel() for k, v in sd.items()
                                                                          if k != "lm_head.weight")
    assert fsdp.make_units(model, world_size=2) == units
    with pytest.raises(fsdp.ShardedParameterError, match="'model.embed_tokens.weight' is sharded by rg.fsdp.init"):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_export_round_trips_strict_and_through_save_pretrained(name, tmp_path):
    model = _meta(name)
    full = simulate(2, lambda c: exported_init(c, model, rank0_only=True))[0]
    keep = {k: v.clone() for k, v in full.items()}
    fresh = hf.build(_config(name), device="cpu", dtype=torch.float64)
    assert str(fresh.load_state_dict(full, strict=True)) == "<All keys matched successfully>"
    x = torch.randint(0, 64, (2, 8))
    expected = hf.loss_fn(model)(full, (x, x))
    assert torch.equal(hf.loss_fn(fresh)(dict(fresh.named_parameters()), (x, x)), expected)

    model.save_pretrained(tmp_path, state_dict=dict(full))  # a copy: save_pretrained pops what it writes
    assert (tmp_path / "model.safetensors").exists()
    extra = {"experts_implementation": "eager"} if name == "mixtral" else {}  # a run-time option, not saved
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float64,
                                                                 **extra)
    got = reloaded.state_dict()
    assert sorted(got) == sorted(keep)
    assert all(torch.equal(got[k], keep[k]) for k in keep)
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == KINDS[name][1]
    assert torch.equal(hf.loss_fn(reloaded)(dict(reloaded.named_parameters()), (x, x)), expected)

    model.load_state_dict(full, assign=True)  # the released module itself gets real weights back
    model.tie_weights()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == KINDS[name][1]
    assert torch.equal(model(x, use_cache=False).logits, reloaded(x, use_cache=False).logits)


@pytest.mark.parametrize("name", ["llama-tied", "mixtral"])
def test_meta_built_model_trains_like_torch_adamw(name):
    data = batches(3)
    initial = simulate(1, lambda c: exported_init(c, _meta(name)))[0]
    ref = hf_reference_train(name, initial, 3, data)
    for got in simulate(2, hf_train, name, 3, data):
        assert list(got) == list(ref)
        worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert worst < 1e-10, worst
    moved = max((ref[k] - initial[k]).abs().max().item() for k in ref)
    assert moved > 1e-3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_train_hf_subcommand_runs_the_whole_path(tmp_path, kind):
    out, saved = tmp_path / "metrics.json", tmp_path / "saved"
    cmd = [sys.executable, "-m", "ragged", "train", "--hf", kind, "--nproc-per-node", "2", "--steps", "6",
           "--warmup", "1", "--layers", "2", "--dim", "32", "--ffn", "64", "--vocab", "64", "--seq", "32",
           *(["--experts", "4"] if kind == "mixtral" else []), "--batch", "8", "--lr", "1e-2", "--quiet", "--json",
           str(out),
           "--save-pretrained", str(saved)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    summary, history = data["summary"], data["history"]
    assert summary["world_size"] == 2 and len(history) == 6 and "built on meta" in proc.stdout
    # the GPT path's summary and verdict, and where it saved, --quiet or not
    assert "summary (rank 0)" in proc.stdout and summary["verdict"] in proc.stdout and "verdict: not judged" in proc.stdout
    assert f"save_pretrained -> {saved}: " in proc.stdout and "train step" not in proc.stdout
    assert history[-1]["loss"] < history[0]["loss"]
    assert summary["reload_max_diff"] == 0.0 and "model.safetensors.index.json" in summary["saved_files"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, local_files_only=True)
    assert type(reloaded).__name__ == {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}[kind]


@pytest.mark.distributed
@pytest.mark.slow
def test_train_hf_from_pretrained_starts_from_the_saved_weights(tmp_path):
    from ragged.examples.data import SyntheticLM, rank_slice
    from tests.checkpoint._hf_dirs import build

    src, out, saved = tmp_path / "src", tmp_path / "metrics.json", tmp_path / "saved"
    build("llama", torch.float32).save_pretrained(src, max_shard_size="8KB")  # transformers' own files
    cmd = [sys.executable, "-m", "ragged", "train", "--hf", "llama", "--from-pretrained", str(src), "--nproc-per-node",
           "2", "--steps", "1", "--seq", "16", "--batch", "4", "--quiet", "--json", str(out), "--save-pretrained",
           str(saved)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokens, targets = SyntheticLM(64, 16, seed=1).batch(0, 4)
    with torch.no_grad():
        ref = sum(torch.nn.functional.cross_entropy(model(input_ids=t).logits.flatten(0, 1), y.flatten())
                  for t, y in (rank_slice((tokens, targets), r, 2) for r in range(2))) / 2
    assert abs(summary["first_loss"] - ref.item()) < 1e-5, (summary["first_loss"], ref.item())
    assert summary["reload_max_diff"] == 0.0 and len([f for f in summary["saved_files"] if f.endswith(".safetensors")]) == 3
