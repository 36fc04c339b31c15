"""The model lifecycle on 2 real gloo ranks (float64): init from a module, a dict or a state dict;
placeholders; a Hugging Face model built on meta equals the one-rank build; trained, it equals
single-process ``torch.optim.AdamW``; ``export`` to rank 0 and ``save_pretrained`` round-trip."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import fsdp
from tests.distributed._harness import comm, workers_fixture
from tests.fsdp._lifecycle_cases import (assert_state_dicts_equal, batches, exported_init, hf_meta, hf_reference_train,
                                         hf_train, tiny)

pytestmark = pytest.mark.distributed

workers2 = workers_fixture(2)


def _init_forms():
    c = comm()
    out = {}
    for form in ("dict", "state_dict", "module"):
        model = tiny()
        params = {"dict": lambda: dict(model.named_parameters()), "state_dict": model.state_dict,
                  "module": lambda: model}[form]()
        units = fsdp.make_units(model, world_size=c.world_size)
        state = fsdp.init(units, params, rg.optim.sgd(0.1), c)
        out[form] = {k: v.data.clone() for k, v in state.shards.items()}
        out[form + ":placeholders"] = all(isinstance(p, fsdp.Placeholder) for p in model.parameters())
    return out


def test_init_from_module_dict_and_state_dict_on_gloo(workers2):
    for r, out in enumerate(workers2.run(_init_forms)):
        for u, data in out["dict"].items():
            assert torch.equal(out["state_dict"][u], data) and torch.equal(out["module"][u], data), (r, u)
        assert out["module:placeholders"] and not out["dict:placeholders"] and not out["state_dict:placeholders"]


def _meta_init(name):
    return exported_init(comm(), hf_meta(name), rank0_only=False)


@pytest.mark.parametrize("name", ["llama-tied", "mixtral"])
def test_meta_init_on_gloo_equals_one_rank(workers2, name):
    one = rg.collectives.simulate(1, lambda c: exported_init(c, hf_meta(name)))[0]
    for got in workers2.run(_meta_init, name):
        assert_state_dicts_equal(got, one)


def _train_export_save(name, steps, data, path):
    c = comm()
    full = hf_train(c, name, steps, data)
    model = hf_meta(name)  # another released module: export to rank 0 only, save from there
    units = fsdp.make_units(model, world_size=c.world_size)
    state = fsdp.init(units, full, rg.optim.sgd(0.1), c)
    mine = fsdp.export(units, state.shards, c, module=model, device="cpu")
    if c.rank == 0:
        model.save_pretrained(path, state_dict=dict(mine))
    return full, mine is None


@pytest.mark.parametrize("name", ["llama-tied", "llama", "mixtral"])
def test_meta_built_hf_model_trains_like_torch_and_saves(workers2, name, tmp_path):
    import transformers

    data = batches(3)
    initial = rg.collectives.simulate(1, lambda c: exported_init(c, hf_meta(name)))[0]
    ref = hf_reference_train(name, initial, 3, data)
    results = workers2.run(_train_export_save, name, 3, data, str(tmp_path))
    assert [none for _, none in results] == [False, True]  # rank0_only
    for got, _ in results:
        assert list(got) == list(ref)
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-10
    assert max((ref[k] - initial[k]).abs().max().item() for k in ref) > 1e-3
    extra = {"experts_implementation": "eager"} if name == "mixtral" else {}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float64,
                                                                 **extra).state_dict()
    assert sorted(reloaded) == sorted(ref) and all(torch.equal(reloaded[k], results[0][0][k]) for k in ref)
