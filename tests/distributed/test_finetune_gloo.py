"""Fine-tuning on real gloo process groups (2 and 4 ranks), in gloo's default transport and
in the NCCL-shaped one (native collectives + deferred ledger): the trainable parameters equal
single-process ``torch.optim.AdamW`` over them (float64), the frozen ones stay bit-identical; a
Hugging Face Llama with frozen parts, through ``module=`` and ``functional_call``, and LoRA
through ``peft``; per-group hyperparameters by module type."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed._harness import both_transports, comm, workers_2_and_4
from tests.fsdp._cases import Case, fsdp_run, hf_model, lm_batches, train_reference, train_sharded
from tests.fsdp.test_frozen import FROZEN_CASES, check_frozen_case

pytestmark = pytest.mark.distributed

workers2, workers4, workers = workers_2_and_4()
transport = both_transports()


def _gpt(case):
    return fsdp_run(comm(), case)


@pytest.mark.parametrize("name", ["embeddings", "whole-layer", "leaf-in-unit", "embeddings-no-decay"])
def test_frozen_gpt_matches_torch_optim(workers, name):
    case = FROZEN_CASES[name]
    for params, metrics in workers.run(_gpt, case):
        check_frozen_case(params, metrics, case)


def lora_llama():
    """A tiny random Llama with peft's LoRA (r=4 on q/v; B random so every adapter trains from step 1)."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    return peft.get_peft_model(hf_model("llama"), config)


def frozen_llama():
    model = hf_model("llama")
    for name, p in model.named_parameters():
        if name.startswith(("model.embed_tokens.", "model.layers.0.")):
            p.requires_grad_(False)
    return model


def _hf(model, module):
    c = comm()
    params, metrics = train_sharded(c, copy.deepcopy(model), lm_batches(), module=module)
    return params, metrics[-1]["num_reduces"], metrics[-1]["peak_grad_bytes"]


def _check_hf(out, model, max_reduces):
    ref = train_reference(copy.deepcopy(model), lm_batches())
    init = dict(model.named_parameters())
    for r, (params, reduces, grad_bytes) in enumerate(out):
        diff = max((params[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-10, f"rank {r}: {diff}"
        assert all(torch.equal(params[k], p) for k, p in init.items() if not p.requires_grad)
        assert reduces <= max_reduces
    return out


@pytest.mark.parametrize("module", [True, False], ids=["module", "functional_call"])
def test_frozen_hf_llama_matches_torch_optim(workers2, module):
    model = frozen_llama()  # embeddings and the whole first decoder layer frozen
    _check_hf(workers2.run(_hf, model, module), model, max_reduces=2)  # layer 1 and "rest" (norm, head)


def test_peft_lora_trains_only_the_adapters(workers2):
    model = lora_llama()
    adapters = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in k for k in adapters)
    out = _check_hf(workers2.run(_hf, model, True), model, max_reduces=2)  # the base's "rest" unit: none
    # the gradient buffer of the largest layer holds its adapters only: 2 projections x (A: 4x32, B: 32x4 or 16x4)
    per_layer = sum(p.numel() for k, p in adapters.items() if ".layers.0." in k)
    for _, _, grad_bytes in out:
        assert per_layer * 8 <= grad_bytes <= 2 * per_layer * 8 + 256  # float64, + padding; the base is 100x more


def _grouped(case):
    from tests.fsdp.test_param_groups import grouped_run

    return grouped_run(comm(), case)


def test_module_type_groups_match_torch_param_groups(workers2):
    from tests.fsdp.test_param_groups import check_grouped

    case = Case()
    for params, _ in workers2.run(_grouped, case):
        check_grouped(params, case)


def _lora_export(model, out_dir):
    import ragged as rg
    from ragged import fsdp
    from tests.fsdp._cases import cross_entropy, logits_of, rank_slice

    c = comm()
    model = copy.deepcopy(model)
    units = fsdp.make_units(model, world_size=c.world_size)
    opt = rg.optim.adamw(1e-2, weight_decay=0.1)
    state = fsdp.init(units, model, opt, c)
    step = fsdp.make_step(units, lambda p, b: cross_entropy(logits_of(model, b[0]), b[1]), opt, c, module=model)
    for batch in lm_batches():
        state, _ = step(state, rank_slice(batch, c.rank, c.world_size))
    adapters = fsdp.export(units, state.shards, c, module=model, trainable_only=True, device="cpu")
    if c.rank == 0:
        model.save_pretrained(out_dir, state_dict=adapters)  # peft's own layout: adapter weights + config
    return None if adapters is None else sorted(adapters)


def test_lora_adapters_save_with_peft_and_reload(workers2, tmp_path):
    import peft
    from safetensors.torch import load_file

    model = lora_llama()
    names = workers2.run(_lora_export, model, str(tmp_path))[0]
    assert names == sorted(k for k, p in model.named_parameters() if p.requires_grad)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(saved) == len(names) and all("lora_" in k for k in saved)  # the adapters only, no base weight
    reloaded = dict(peft.PeftModel.from_pretrained(hf_model("llama"), str(tmp_path)).named_parameters())
    ref = train_reference(copy.deepcopy(model), lm_batches())
    assert max((reloaded[k] - ref[k]).abs().max().item() for k in ref) < 1e-10


def _two_dtypes(model):
    from tests.fsdp.test_frozen import _lora_in_two_dtypes

    return _lora_in_two_dtypes(comm(), model, torch.float32)


def test_lora_base_gathered_in_its_own_dtype(workers2):
    """MixedPrecision(frozen_dtype=float32) on the float64 LoRA Llama: the base's all-gather is its
    own float32 call; the adapters equal torch.optim.AdamW on the model with a float32 base."""
    model = lora_llama()
    ref_model = copy.deepcopy(model)
    for p in ref_model.parameters():
        if not p.requires_grad:
            p.data = p.data.float()
    ref = train_reference(ref_model, lm_batches())
    for full, _, _ in workers2.run(_two_dtypes, model):
        assert max((full[k] - ref[k]).abs().max().item() for k, p in model.named_parameters() if p.requires_grad) < 1e-10
        assert all(torch.equal(full[k], p) for k, p in model.named_parameters() if not p.requires_grad)
