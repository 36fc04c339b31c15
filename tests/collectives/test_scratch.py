"""The one scratch pool ([Note: one scratch pool] in ragged/collectives/_scratch.py)."""

import torch

from ragged.collectives import _scratch
from ragged.collectives._scratch import _Scratch


def test_a_buffer_given_back_is_reused_and_one_in_use_is_never_handed_out_twice():
    pool = _Scratch(keep=2)
    a, b = pool.take(8, torch.float32, "cpu"), pool.take(8, torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    c = pool.take(8, torch.float32, "cpu")
    assert c.data_ptr() == a.data_ptr()
    assert pool.take(8, torch.float32, "cpu").data_ptr() not in (b.data_ptr(), c.data_ptr())
    assert pool.take(8, torch.float64, "cpu").dtype == torch.float64  # keyed by dtype and size too


def test_it_keeps_at_most_keep_free_buffers_per_size():
    pool = _Scratch(keep=2)
    bufs = [pool.take(4, torch.float32, "cpu") for _ in range(3)]
    for t in bufs:
        pool.give(t)
    again = {pool.take(4, torch.float32, "cpu").data_ptr() for _ in range(3)}
    assert len(again & {t.data_ptr() for t in bufs}) == 2


def test_inside_torch_func_a_fresh_buffer_is_handed_out():
    pool = _Scratch()
    kept = pool.take(3, torch.float32, "cpu")
    pool.give(kept)

    def f(x):
        buf = pool.take(3, torch.float32, "cpu")
        buf.copy_(x)  # the kept buffer, created outside, could not be written with x here
        return (buf * x).sum()

    g = torch.func.grad(f)(torch.ones(3))
    assert torch.equal(g, 2 * torch.ones(3))
    assert pool.take(3, torch.float32, "cpu").data_ptr() == kept.data_ptr()  # still there for later


def test_a_buffer_given_back_on_one_stream_is_handed_only_to_that_stream(monkeypatch):
    """See [Note: scratch across streams]: on CUDA a buffer is given back while its stream may still
    read it, so another stream must not get it (streams stood in by names here)."""
    current = ["gather"]
    monkeypatch.setattr(_scratch, "current_stream", lambda device: current[0])
    pool = _Scratch(keep=2)
    a = pool.take(8, torch.uint8, "cpu")
    pool.give(a)
    current[0] = "reduce"
    b = pool.take(8, torch.uint8, "cpu")
    assert b.data_ptr() != a.data_ptr()
    pool.give(b)
    current[0] = "gather"
    assert pool.take(8, torch.uint8, "cpu").data_ptr() == a.data_ptr()
