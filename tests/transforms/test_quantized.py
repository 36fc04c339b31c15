"""The quantized all-gather and reduce-scatter on the simulated backend: sharding-invariant
weights at W = 1..4 and HSDP 2 x 2 (single- and multi-buffer plans, float64 / bf16 compute), a
per-shard quantizer (ZeRO++'s rule) that is not, the reduce-scatter against its rank-order
reference, straight-through gradients, the chunk layout, and refusals before any communication.
The same cases run on gloo ranks in tests/distributed/test_quant_gloo.py."""

import re

import pytest
import torch

import ragged as rg
from ragged import spec
from ragged.quant._wire import leaf_formats, wire_layout
from tests.transforms import _quant_cases as cases

NAMES = sorted(cases.FORMATS)


@pytest.mark.parametrize("name", NAMES)
def test_gathered_weights_are_the_same_at_every_world_size(name):
    for m in (1, 2, 3, 4):
        assert rg.collectives.simulate(m, cases.gathered_equal_reference, name) == [True] * m, m
    assert rg.collectives.simulate(4, cases.gathered_equal_reference, name, mesh_shape=(2, 2)) == [True] * 4
    assert rg.collectives.simulate(3, cases.gathered_equal_reference, name, torch.bfloat16, 2) == [True] * 3


def test_a_per_shard_quantizer_depends_on_the_world_size():
    # ZeRO++'s qwZ quantizes groups of each rank's local partition: its weights change with W
    two, three = cases.zero_plus_like_zeropp(2), cases.zero_plus_like_zeropp(3)
    assert any(not torch.equal(two[k], three[k]) for k in two)
    ours = [rg.collectives.simulate(m, lambda c: rg.gather(rg.shard(cases.plan(m), cases.params(), c), c,
                                                           format=rg.quant.int8(block=(16, 16))))[0]
            for m in (2, 3)]
    assert all(torch.equal(ours[0][k], ours[1][k]) for k in two)


@pytest.mark.parametrize("name", NAMES)
def test_reduce_scatter_equals_its_rank_order_reference(name):
    for m in (1, 3):
        assert rg.collectives.simulate(m, cases.reduce_scatter_equals_rank_order, name) == [True] * m
    assert rg.collectives.simulate(2, cases.reduce_scatter_equals_rank_order, name, "mean", torch.float64) == [True] * 2
    assert rg.collectives.simulate(4, cases.reduce_scatter_equals_rank_order, name, mesh_shape=(2, 2)) == [True] * 4


def test_reduce_scatter_reference_can_fail():
    # the rank-order reference is not a tautology: summing ranks in another order changes bits
    fmt = cases.FORMATS["int8"]
    seen = [rg.quant.dequantize(*rg.quant.quantize(cases.grads(i)["w"].float(), fmt), fmt) for i in range(3)]
    assert not torch.equal((seen[0] + seen[1]) + seen[2], seen[0] + (seen[1] + seen[2]))


@pytest.mark.parametrize("name", NAMES)
def test_gradients_pass_straight_through(name):
    assert rg.collectives.simulate(2, cases.straight_through, name) == [True, True]


def test_chunks_carry_codes_scales_and_unquantized_values_in_one_collective():
    plan = cases.plan(2)
    calls = []

    def fn(comm):
        for name in ("all_gather_into", "all_to_all", "all_gather_into_coalesced", "reduce_scatter_into"):
            orig = getattr(comm, name)
            setattr(comm, name, lambda *a, _o=orig, _n=name, **k: (calls.append((_n, a[1].dtype, a[1].numel())), _o(*a, **k))[1])
        d = rg.shard(plan, cases.params(), comm)
        rg.gather(d, comm, format=cases.FORMATS["fp8"])
        rg.reduce_scatter(plan, cases.grads(comm.rank), comm, format=cases.FORMATS["mxfp8"])

    rg.collectives.simulate(2, fn)
    wire = wire_layout(plan, leaf_formats(plan, cases.FORMATS["fp8"]), torch.float64)
    assert sorted(set(calls)) == sorted({("all_gather_into", torch.uint8, wire.chunk_nbytes),
                                         ("all_to_all", torch.uint8, 2 * wire_layout(
                                             plan, leaf_formats(plan, cases.FORMATS["mxfp8"], replicated=False),
                                             torch.float64).chunk_nbytes)})
    # rank 0 holds codes (1 byte), fp32 scales and float64 vectors: widest items first, aligned
    for rank in range(2):
        for seg in wire.segments(rank):
            assert seg.data % (1 if seg.fmt else 8) == 0 and (seg.fmt is None or seg.scales % 4 == 0)


def test_chunk_bytes_are_the_longest_rank_by_arithmetic():
    for m in (1, 2, 3, 5, 7):
        for buffers in (1, 2):
            plan = cases.plan(m, buffers=buffers)
            for fmt in cases.FORMATS.values():
                formats = leaf_formats(plan, fmt)
                for dtype in (torch.bfloat16, torch.float64):
                    wire = wire_layout(plan, formats, dtype)
                    used = []
                    for rank in range(m):
                        segs = wire.segments(rank)
                        ends = [s.data + (s.numel if s.fmt else s.numel * dtype.itemsize) for s in segs]
                        ends += [s.scales + s.numel // s.fmt.block_numel * s.fmt.scale_nbytes for s in segs if s.fmt]
                        used.append(max(ends, default=0))
                    assert wire.chunk_nbytes == max(-(-max(used) // 8) * 8, 8), (m, buffers, fmt, dtype)


def test_a_granule_that_cuts_blocks_is_refused_on_every_rank_before_any_communication():
    params = {"w": torch.randn(64, 32)}
    plan = rg.make_plan(params, {"w": spec.Rows(8)}, world_size=2)

    def fn(comm):
        d = rg.shard(plan, params, comm)
        try:
            rg.gather(d, comm, format=rg.quant.fp8(block=(16, 16)))
        except rg.LayoutError as err:
            return str(err)

    errors = rg.collectives.simulate(2, fn)
    assert errors[0] == errors[1]
    assert "params['w'] of shape (64, 32) is planned with Rows(n=8)" in errors[0]
    assert "granule of 256 elements is not a multiple of 512" in errors[0]
    assert "Fix: plan with `spec.Blocks(16, 16)`" in errors[0]


@pytest.mark.parametrize("specs, fmt, fix", [
    ({"w": spec.Elements(24)}, rg.quant.mxfp8(block=32), "spec.Rows(1)"),
    ({"w": spec.Blocks(8, 32)}, rg.quant.int8(block=(16, 32)), "spec.Blocks(16, 32)"),
])
def test_refusals_name_the_spec_to_plan_with(specs, fmt, fix):
    plan = rg.make_plan({"w": torch.empty(64, 32)}, specs, world_size=4)
    with pytest.raises(rg.LayoutError, match=re.escape(f"Fix: plan with `{fix}`")):
        leaf_formats(plan, fmt)


def test_granules_that_hold_whole_blocks_fit():
    shapes = {"w": torch.empty(64, 64), "v": torch.empty(256)}
    for specs, fmt in [({"w": spec.Blocks(32, 64), "v": spec.Elements(64)}, rg.quant.fp8(block=(16, 16))),
                       ({"w": spec.Rows(16), "v": spec.Elements(64)}, rg.quant.int8(block=(16, 64))),
                       ({"w": spec.Elements(32), "v": spec.Elements(32)}, rg.quant.mxfp8())]:
        plan = rg.make_plan(shapes, specs, world_size=3)
        assert leaf_formats(plan, lambda leaf: fmt if leaf.path == "['w']" or fmt.block[0] == 1 else None)


def test_bad_choices_are_refused():
    plan = cases.plan(2)
    with pytest.raises(rg.RaggedTypeError, match=re.escape("gather_format(['b']) returned 'fp8'")):
        leaf_formats(plan, lambda leaf: "fp8")
    with pytest.raises(rg.RaggedTypeError, match="must be None, a rg.quant format or a callable"):
        leaf_formats(plan, "fp8")
    with pytest.raises(rg.LayoutError, match=re.escape("does not tile")):
        leaf_formats(plan, lambda leaf: rg.quant.fp8(block=(128, 128)) if leaf.path == "['w']" else None)


def test_a_callable_chooses_per_leaf_and_the_rest_rides_along():
    plan = cases.plan(2)
    fmt = cases.FORMATS["int8"]
    only_w = lambda leaf: fmt if leaf.path == "['w']" else None  # noqa: E731
    outs = rg.collectives.simulate(2, lambda c: rg.gather(rg.shard(plan, cases.params(), c), c, format=only_w))
    ref = cases.params()
    for full in outs:
        assert torch.equal(full["w"], rg.quant.dequantize(*rg.quant.quantize(ref["w"], fmt), fmt, dtype=torch.float64))
        assert all(torch.equal(full[k], ref[k]) for k in ref if k != "w")


def test_ranks_that_quantize_differently_are_refused():
    plan = cases.plan(2)

    def fn(comm):
        fmt = cases.FORMATS["fp8"] if comm.rank == 0 else cases.FORMATS["int8"]
        try:
            rg.gather(rg.shard(plan, cases.params(), comm), comm, format=fmt)
        except rg.PlanMismatchError as err:
            return type(err).__name__

    assert rg.collectives.simulate(2, fn) == ["PlanMismatchError"] * 2


def test_units_and_mesh_layouts_refuse_format():
    from ragged import fsdp

    params = {"w": torch.zeros(32, 32)}
    units = fsdp.make_units(params, world_size=1)
    with pytest.raises(rg.RaggedTypeError, match=re.escape("format= is for one DBuffer of a LayoutPlan")):
        rg.collectives.simulate(1, lambda c: rg.gather(units, rg.shard(units, params, c), c, format=rg.quant.mxfp8()))
