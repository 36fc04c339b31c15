"""The FSDP step with MixedPrecision(gather_format=, reduce_format=) on simulated ranks: training
equals the straight-through torch reference (float64, 3 AdamW steps, within 1e-10) for every
format, dense and MoE, micro-batches, activation checkpointing, HSDP 2 x 2 and frozen blocks; the
quantized reduce-scatter equals its rank-order reference; refusals when the step is made. The
same cases on gloo ranks: tests/distributed/test_quant_gloo.py."""

import dataclasses
import re

import pytest
import torch

import ragged as rg
from ragged import fsdp, spec
from tests.fsdp import _quant_cases as qc
from tests.fsdp._cases import Case

CASES = {
    "dense": (Case(), "fp8"),
    "moe-micro-int8": (Case(moe=True, micro_batches=2), "int8"),
    "checkpointing-mxfp8": (Case(activation_checkpointing=True), "mxfp8"),
    "frozen-fp8": (Case(frozen=("blocks.0", "tok_emb")), "fp8"),
}


@pytest.mark.parametrize("key", sorted(CASES))
def test_training_equals_the_straight_through_reference(key):
    case, name = CASES[key]
    ref, ref_losses = qc.gather_reference(case, name)
    for params, losses in rg.collectives.simulate(2, qc.run, case, name):
        assert qc.max_diff(params, ref) < 1e-10
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10


def test_compiled_blocks_equal_the_straight_through_reference():
    case = Case(steps=2)
    ref, _ = qc.gather_reference(case, "fp8")
    for params, _ in rg.collectives.simulate(2, qc.run, case, "fp8", compile="aot_eager"):
        assert qc.max_diff(params, ref) < 1e-10


def test_hsdp_2x2_equals_the_straight_through_reference():
    case = Case()
    ref, _ = qc.gather_reference(case, "mxfp8")
    for params, _ in rg.collectives.simulate(4, qc.run, case, "mxfp8", mesh_shape=(2, 2)):
        assert qc.max_diff(params, ref) < 1e-10


def test_the_reference_tells_quantized_from_plain_training():
    case = Case()
    plain, _ = rg.collectives.simulate(2, qc.run, case, None)[0]
    assert qc.max_diff(plain, qc.gather_reference(case, "fp8")[0]) > 1e-6


@pytest.mark.parametrize("name", ["fp8", "mxfp8"])
def test_quantized_reduce_scatter_equals_the_rank_order_reference(name):
    case = Case(optimizer="sgd", lr=0.5, steps=2)
    ref = qc.reduce_reference(case, 2, "int8", name)
    for params, _ in rg.collectives.simulate(2, qc.run, case, "int8", name):
        assert qc.max_diff(params, ref) < 1e-12
    # summing the ranks' quantized gradients is not the quantized sum: the reference can fail
    plain = rg.collectives.simulate(2, qc.run, case, "int8", None)[0][0]
    assert qc.max_diff(plain, ref) > 1e-9


@pytest.mark.parametrize("m, case, gather, reduce", [
    (2, Case(), "fp8", "int8"),
    (3, Case(moe=True, batch=6, frozen=("blocks.0",), micro_batches=2), "mxfp8", "fp8"),
    (2, Case(), "fp8", None),
    (2, Case(max_inflight_reduce=2), None, "int8"),
], ids=["dense-fp8-int8-m2", "moe-frozen-micro-mxfp8-fp8-m3", "dense-fp8-gather-m2", "dense-int8-reduce-inflight2-m2"])
def test_the_lowering_counts_codes_and_scales_exactly(m, case, gather, reduce):
    """Calls and bytes on the wire, and the scratch the quantized collectives hold (measured at the
    scratch pool): exact for all-gathers, between the bounds once reduce-scatters are quantized
    (when one is waited depends on the network, as for the gradient buffers)."""
    from tests.predict._lower_cases import measured
    from tests.predict.test_lower import check

    out = rg.collectives.simulate(m, measured, case, "adamw", gather=gather, reduce=reduce)
    check(out)
    assert (("all_to_all", "shard") in out[0]["calls"]) == (reduce is not None)
    scratch = out[0]["metrics"]["peak_scratch_bytes"]
    assert scratch > 0
    if reduce is None:  # the gathers' scratch lives from the gather to the unit's first read: exact
        assert out[0]["predicted"]["peak_scratch_bytes_low"] == scratch == out[0]["predicted"]["peak_scratch_bytes"]


def _make(comm, policy, specs=qc.specs, model=None):
    model = model or Case().model()
    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs)
    opt = rg.optim.adamw(1e-2)
    return fsdp.make_step(units, lambda p, b: 0.0, opt, comm, policy=policy)


def test_a_unit_with_no_quantized_leaf_takes_the_plain_collectives():
    """Only blocks.0 is quantized: every other unit gathers and reduce-scatters as without formats
    (no bytes on the wire twice over: no encode, no decode, no wire scratch)."""
    pick = lambda leaf: qc.FORMATS["fp8"] if leaf.path.startswith("['blocks.0") and len(leaf.shape) == 2 else None  # noqa: E731
    steps = {name: rg.collectives.simulate(2, _make, fsdp.MixedPrecision(gather_format=f, reduce_format=f))[0]
             for name, f in (("plain", None), ("blocks.0", pick))}
    layouts = {lay.name: lay for lay in steps["blocks.0"].value_and_grad.layouts}
    assert layouts.pop("blocks.0").gather_formats is not None
    assert all(lay.gather_formats is None and lay.reduce_formats is None for lay in layouts.values())
    units = {name: step.lower().cost_analysis().per_unit for name, step in steps.items()}
    assert {k: v for k, v in units["blocks.0"].items() if k != "blocks.0"} == \
        {k: v for k, v in units["plain"].items() if k != "blocks.0"}
    nothing = rg.collectives.simulate(2, _make, fsdp.MixedPrecision(gather_format=lambda leaf: None))[0]
    assert all(lay.gather_formats is None for lay in nothing.value_and_grad.layouts)
    assert nothing.lower().memory_analysis().peak_scratch_bytes == 0


def test_a_format_that_does_not_tile_a_leaf_is_refused_when_the_step_is_made():
    # a plain format applies to every matrix; the MoE router (4 x 32) has 4 rows
    policy = fsdp.MixedPrecision(gather_format=qc.FORMATS["fp8"])
    with pytest.raises(rg.LayoutError, match=re.escape("router.weight']")) as err:
        rg.collectives.simulate(1, _make, policy, qc.specs, Case(moe=True).model())
    assert "MixedPrecision.gather_format (unit 'blocks.1')" in str(err.value) and "does not tile" in str(err.value)


def test_a_granule_that_cuts_blocks_is_refused_naming_the_spec():
    policy = fsdp.MixedPrecision(reduce_format=qc.FORMATS["int8"])
    with pytest.raises(rg.LayoutError, match=re.escape("Fix: plan with `spec.Blocks(16, 16)`")):
        rg.collectives.simulate(2, _make, policy, lambda path, t: spec.Rows(2) if t.dim() >= 2 else None)


def test_mixed_precision_checks_its_formats():
    with pytest.raises(rg.RaggedTypeError, match="gather_format must be None, a rg.quant format"):
        fsdp.MixedPrecision(gather_format="fp8")
    policy = fsdp.MixedPrecision(compute_dtype=torch.bfloat16, reduce_format=qc.FORMATS["int8"])
    assert dataclasses.replace(policy, reduce_format=None) == fsdp.MixedPrecision(compute_dtype=torch.bfloat16)


_EP_FORMATS = {"w_in": rg.quant.int8(block=(4, 8)), "w_out": rg.quant.mxfp8(block=4), "out": rg.quant.fp8(block=(4, 4)),
               "router": rg.quant.mxfp8(block=8)}


def _ep_format(path: str):
    return next((fmt for key, fmt in _EP_FORMATS.items() if f"['{key}']" in path), None)


def test_expert_parallel_step_equals_the_straight_through_reference():
    # FSDP x EP on a 2 x 2 mesh: each rank gathers whole experts, so every block is the global tensor's
    from ragged import parallel
    from tests.parallel._cases import STEPS, batches_per_step, ep_fsdp_step_train, reference_train

    def weights(params):
        def st(path, w):
            fmt = _ep_format(path)
            return w if fmt is None else w + (rg.quant.dequantize(*rg.quant.quantize(w, fmt), fmt, dtype=w.dtype) - w).detach()
        paths, leaves, treedef = rg.pytree.flatten_with_path(params)
        return rg.pytree.unflatten(treedef, [st("".join(f"['{k}']" for k in p), w) for p, w in zip(paths, leaves)])

    mesh = spec.Mesh((2, 2), ("dp", "ep"))
    policy = fsdp.MixedPrecision(gather_format=lambda leaf: _ep_format(leaf.path))
    out = parallel.simulate_mesh(mesh, ep_fsdp_step_train, STEPS, policy=policy)
    ref, _, ref_losses = reference_train("ep", STEPS, n_batches=batches_per_step("ep", mesh), weights=weights)
    plain, _, _ = reference_train("ep", STEPS, n_batches=batches_per_step("ep", mesh))
    for local, losses, coords, mplan in out:
        want = parallel.parts(mplan, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in ref.items()}, coords)
        assert max((a - b).abs().max().item() for a, b in zip(rg.pytree.leaves(local), rg.pytree.leaves(want))) < 1e-10
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10
    assert qc.max_diff({"r": plain["router"]}, {"r": ref["router"]}) > 1e-8   # the quantization showed


def _qlora(comm, model, choose):
    import copy

    from tests.fsdp._cases import lm_batches, train_sharded

    policy = fsdp.MixedPrecision(frozen_dtype=torch.float32, gather_format=choose)
    params, _ = train_sharded(comm, copy.deepcopy(model), lm_batches(), policy=policy)
    return params


def test_a_frozen_base_gathered_quantized_trains_its_adapters_like_torch():
    """QLoRA's traffic: peft's LoRA on a float64 Llama, the frozen base gathered in MXFP8 into its
    own float32 compute dtype (one collective with the float64 adapters): the adapters train like
    torch.optim.AdamW on the same model whose base weights are dequantize(quantize(w)) in float32."""
    import copy

    from ragged.quant._codec import fits_shape
    from tests.distributed.test_finetune_gloo import lora_llama
    from tests.fsdp._cases import lm_batches, train_reference

    fmt = rg.quant.mxfp8(block=16)
    base = lambda shape, path: len(shape) >= 2 and "lora_" not in path and fits_shape(tuple(shape), fmt)  # noqa: E731
    model = lora_llama()
    full, _ = rg.collectives.simulate(2, _qlora, model, lambda leaf: fmt if base(leaf.shape, leaf.path) else None)
    ref_model = copy.deepcopy(model)
    quantized = 0
    for name, p in ref_model.named_parameters():
        if not p.requires_grad:
            if base(p.shape, name):
                p.data = rg.quant.dequantize(*rg.quant.quantize(p.data, fmt), fmt, dtype=torch.float32)
                quantized += 1
            else:
                p.data = p.data.float()
    ref = train_reference(ref_model, lm_batches())
    assert quantized >= 4
    for k, p in model.named_parameters():
        if p.requires_grad:
            assert (full[k] - ref[k]).abs().max().item() < 1e-10, k
        else:
            assert torch.equal(full[k], p)  # the float64 master of a frozen leaf never changes
