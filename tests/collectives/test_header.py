"""Collective headers: what a call says about itself, and the comparison of two ranks' calls."""

import hypothesis.strategies as st
import torch
from hypothesis import given

from ragged.collectives import _header as hd


def _call(op="all_gather", reduce=None, dtype=torch.float32, numel=6, identity=7, label="gather unit 'a'"):
    return hd.Call(op, reduce, dtype, numel, identity, label)


def _h(call, sends=(6,), expects=(6,), seq=3, world=2, dtype=torch.float32):
    s = [torch.empty(n, dtype=dtype) for n in sends]
    e = None if expects is None else [torch.empty(n, dtype=dtype) for n in expects]
    return hd.decode(hd.encode(call, seq, world, s, e)[0].numpy().tobytes())


def test_round_trip_keeps_every_field_and_the_label():
    h = _h(_call(reduce=None, label="gather unit 'layers.3' forward #5"), sends=(4, 2), expects=(4, 2))
    assert (h.kind, h.seq, h.world, h.numel, h.identity) == (hd.CALL, 3, 2, 6, 7)
    assert (h.send_total, h.send_count, h.expect_total, h.expect_count) == (24, 2, 24, 2)
    assert h.text == "gather unit 'layers.3' forward #5"
    assert hd.describe(h) == "all_gather of 6 x float32 'gather unit 'layers.3' forward #5'"


def test_long_and_non_ascii_labels_are_cut_at_a_character_boundary():
    h = _h(_call(label="é" * 400))
    assert h.text == "é" * (376 // 2) and len(h.text.encode()) <= 376


def test_small_data_rides_inside_the_header():
    sends = [torch.arange(3, dtype=torch.float64), torch.tensor([True, False])]
    h = hd.decode(bytearray(hd.encode(_call(), 0, 2, sends, sends, with_payload=True)[0].numpy().tobytes()))
    assert len(h.payload) == 3 * 8 + 2 and hd.inline(len(h.payload)) and not hd.inline(hd.INLINE_BYTES + 1)
    into = [torch.empty(3, dtype=torch.float64), torch.empty(2, dtype=torch.bool)]
    hd.unpack(h, into)
    assert all(torch.equal(a, b) for a, b in zip(into, sends))


def test_poison_carries_its_reason():
    h = hd.decode(hd.encode_poison(9, 4, "rank 2: LayoutError: grads['w'] has shape (9, 4)"))
    assert h.kind == hd.POISON and h.text.endswith("(9, 4)")


def test_a_foreign_buffer_is_not_a_header():
    h = hd.decode(bytearray(hd.NBYTES))
    assert h.kind == 0 and hd.mismatch(_h(_call()), h) == "not a ragged collective header"


def test_each_field_is_compared():
    mine = _h(_call())
    cases = {
        "the operation": _h(_call(op="reduce_scatter", reduce="sum")),
        "the dtype": _h(_call(dtype=torch.bfloat16), dtype=torch.bfloat16),
        "the number of elements per rank": _h(_call(numel=5)),
        "the plan, transform or label": _h(_call(identity=8)),
        "out of step": _h(_call(), seq=4),
        "group size": _h(_call(), world=4),
        "the bytes sent": _h(_call(), sends=(3, 3), expects=(3, 3)),
    }
    for why, theirs in cases.items():
        assert hd.mismatch(mine, theirs).startswith(why), why
    assert hd.mismatch(mine, _h(_call(label="another label, same identity"))) is None


def test_identity_combines_scope_and_label():
    assert hd.identity_of(5, None) == hd.identity_of(5, "") == 5
    assert hd.identity_of(5, "unit a") != hd.identity_of(5, "unit b") != hd.identity_of(6, "unit b")


def test_objects_are_sized_by_the_sender():
    a = _h(_call(op="all_gather_object", dtype=None, numel=-1), sends=(100,), expects=None, dtype=torch.uint8)
    b = _h(_call(op="all_gather_object", dtype=None, numel=-1), sends=(7,), expects=None, dtype=torch.uint8)
    assert a.expect_total == -1 and hd.mismatch(a, b) is None and not hd.sizes_differ(a, b)


@given(st.lists(st.integers(0, 3), min_size=2, max_size=2), st.lists(st.integers(0, 4), min_size=4, max_size=4),
       st.booleans())
def test_the_verdict_is_symmetric(ops, sizes, same_identity):
    """Both ranks of a pair reach the same verdict (so both raise, or neither does)."""
    names = [("all_gather", None), ("reduce_scatter", "sum"), ("all_reduce", "sum"), ("all_to_all", None)]
    calls = [_call(*names[o], identity=7 if same_identity or i == 0 else 8) for i, o in enumerate(ops)]
    a = _h(calls[0], sends=(sizes[0],), expects=(sizes[1],))
    b = _h(calls[1], sends=(sizes[2],), expects=(sizes[3],))
    assert (hd.mismatch(a, b) is None) == (hd.mismatch(b, a) is None)
    assert hd.sizes_differ(a, b) == hd.sizes_differ(b, a)
    if ops[0] == ops[1] and same_identity and sizes[0] == sizes[3] and sizes[1] == sizes[2]:
        assert hd.mismatch(a, b) is None
