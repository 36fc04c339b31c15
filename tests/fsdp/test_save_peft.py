"""``fsdp.save_pretrained`` never drops what was trained (2 simulated ranks, tiny float64 Llama
with peft LoRA, nothing downloaded): a PeftModel is written as peft's adapter directory
(``PeftModel.from_pretrained`` gives the trained model's outputs; the files equal peft's own
save) or, with ``merged=True``, as the base model equal to ``merge_and_unload()``; a name the
architecture does not have, a trained parameter the adapter format would drop and what ragged
cannot merge are refused on every rank before anything is written."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import ragged as rg
from ragged import fsdp

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=32)
TOKENS = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(5))


def _base(**cfg):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG, **cfg)).to(torch.float64)


def _lora(cfg=None, **kw):
    kw = {"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": "gaussian", **kw}
    torch.manual_seed(1)
    return peft.get_peft_model(_base(**(cfg or {})), peft.LoraConfig(**kw))


def _train_and_save(comm, model, path, **save_kw):
    """One AdamW step on this rank's rows, then save_pretrained; ``(full trained state, error)``."""
    model = copy.deepcopy(model)  # simulated ranks: one module each
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = rg.optim.adamw(1e-2)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, lambda p, t: model(input_ids=t, labels=t).loss, opt, comm, module=model)
    state, _ = step(state, TOKENS[2 * comm.rank: 2 * comm.rank + 2])
    full = fsdp.export(units, state.shards, comm, module=model, rank0_only=False, device="cpu")
    try:
        fsdp.save_pretrained(units, state.shards, comm, path, module=model, **save_kw)
    except rg.RaggedError as e:
        return full, (type(e), str(e))
    return full, None


def _trained(full, cfg=None, **kw):
    ref = _lora(cfg, **kw)
    ref.load_state_dict(full, strict=True)
    return ref.eval()


def test_a_peft_model_is_saved_as_peft_s_adapter_directory(tmp_path):
    from safetensors.torch import load_file

    (full, err), _ = rg.collectives.simulate(2, _train_and_save, _lora(), str(tmp_path / "ours"))
    assert err is None, err
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "ours"))
    assert not os.path.exists(tmp_path / "ours" / "config.json")
    ref = _trained(full)
    ref.save_pretrained(tmp_path / "peft")  # peft's own save of the same trained model
    ours, theirs = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(
        tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    def read(d):  # peft keeps target_modules in a set: its order in the file follows the process's string hashes
        config = json.loads((tmp_path / d / "adapter_config.json").read_text())
        return {**config, "target_modules": sorted(config["target_modules"])}

    assert read("ours") == read("peft")
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "ours").eval()
    assert torch.equal(loaded(input_ids=TOKENS).logits, ref(input_ids=TOKENS).logits)
    assert not torch.equal(loaded(input_ids=TOKENS).logits, _base()(input_ids=TOKENS).logits)


@pytest.mark.parametrize("cfg, kw", [({}, {}), ({"attention_bias": True}, {"lora_bias": True, "init_lora_weights": True})],
                         ids=["lora", "lora-bias"])
def test_merged_equals_merge_and_unload_and_loads_with_transformers(tmp_path, cfg, kw):
    lora = _lora(cfg, target_modules=["q_proj", "v_proj", "o_proj"], **kw)
    (full, err), _ = rg.collectives.simulate(2, _train_and_save, lora, str(tmp_path), merged=True)
    assert err is None, err
    want = _trained(full, cfg, target_modules=["q_proj", "v_proj", "o_proj"], **kw).merge_and_unload().state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True,
                                                            dtype=torch.float64).state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    base = _base(**cfg).state_dict()
    changed = [k for k in base if not torch.equal(got[k], base[k])]
    assert "model.layers.0.self_attn.o_proj.weight" in changed and ("model.layers.1.self_attn.v_proj.bias" in changed
                                                                    or not kw)


def _refusal(tmp_path, model, **save_kw):
    out = rg.collectives.simulate(2, _train_and_save, model, str(tmp_path / "out"), **save_kw)
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")  # nothing written
    (kind0, msg0), (kind1, msg1) = (err for _, err in out)
    assert kind0 is kind1 and msg0 == msg1 and issubclass(kind0, rg.RaggedValueError)  # every rank, the same error
    return msg0


def test_a_trained_parameter_the_adapter_format_drops_is_refused(tmp_path):
    lora = _lora()
    lora.base_model.model.model.norm.weight.requires_grad_(True)  # unfrozen by hand: peft would not save it
    msg = _refusal(tmp_path, lora)
    assert "'base_model.model.model.norm.weight'" in msg and "merged=True" in msg and "trainable_only=True" in msg


def test_a_name_the_architecture_does_not_have_is_refused(tmp_path):
    lora = _lora()
    msg = _refusal(tmp_path, lora.get_base_model())  # the base, with peft's layers inside it
    assert "LlamaForCausalLM" in msg and "has no weight 'model.layers.0.self_attn.q_proj.base_layer.weight'" in msg
    assert "module=peft_model" in msg


@pytest.mark.parametrize("case", ["dora", "modules_to_save", "lora-bias-without-bias", "not-peft"])
def test_what_merged_cannot_merge_is_refused(tmp_path, case):
    model = {"dora": lambda: _lora(use_dora=True), "modules_to_save": lambda: _lora(modules_to_save=["lm_head"]),
             "lora-bias-without-bias": lambda: _lora(lora_bias=True, init_lora_weights=True), "not-peft": _base}[case]()
    msg = _refusal(tmp_path, model, merged=True)
    assert {"dora": "DoraLinearVariant", "modules_to_save": "modules_to_save", "not-peft": "drop merged=True",
            "lora-bias-without-bias": "base layer has no bias"}[case] in msg
