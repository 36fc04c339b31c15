"""What every ragged collective call says about itself, and how two ranks' calls are compared.

[Note: collective headers]
A :class:`Call` names one collective call: the operation (and reduction), the dtype, the
elements per rank, and an *identity*: a hash of the plan fingerprints and operation the
transform declared (``check_plans``) and of the caller's label. On gloo each call sends every
peer a fixed-size header (:func:`encode`, 4 KiB: 17 int64 fields, 376 bytes of text and room
for ``INLINE_BYTES`` of data) ahead of its data, carrying the call plus the exact sizes of the
messages it sends that peer and expects from it; the peer compares it with its own
(:func:`mismatch`) before it uses the data. Data of at most ``INLINE_BYTES`` to a peer rides
inside the header (small all-reduces, plan agreements, barriers, small objects: one message per
peer, as a bare exchange); which data is inline follows from the sizes, so two ranks whose
sizes agree also agree on it. The
comparison is symmetric (a's sends against b's expectations and the other way round, every
other field by equality), so both ranks of a pair reach the same verdict, and for every
operation but ``all_to_all`` the fields are the same towards every peer, so if any two ranks
differ, every rank sees a difference with someone. The text carries the human-readable label
(or, in a poison header, the reason a rank failed), so an error names both sides without
another round trip.

Labels are compared (through the identity): they must not contain rank-specific text.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
from typing import NamedTuple

import torch

__all__ = ["Call", "Header", "encode", "decode", "mismatch", "describe", "identity_of", "inline", "NBYTES", "INLINE_BYTES",
           "POISON", "CALL"]

_MAGIC = 0x5241474745440002  # "RAGGED" v2
_FIELDS = struct.Struct("<17q")
_TEXT_BYTES = 376
_PAYLOAD = _FIELDS.size + _TEXT_BYTES  # 512: where an inline payload starts
INLINE_BYTES = 3584  # messages to a peer up to this size travel inside the header (one message per peer)
NBYTES = _PAYLOAD + INLINE_BYTES  # 4096
CALL, POISON = 1, 2

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_gather_object", "barrier")
_REDUCE = (None, "sum", "mean", "max")
_DTYPES = [
    getattr(torch, n)
    for n in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
              "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, n)
]
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@functools.lru_cache(maxsize=4096)
def _layout(sizes: tuple[int, ...]) -> int:
    """Hash of the byte sizes of the messages of one direction (their split matters: a message
    longer than the receive posted for it aborts gloo's receiving process)."""
    return _hash63(repr(sizes)) if sizes else 0


@functools.lru_cache(maxsize=4096)
def identity_of(scope_identity: int, label: str | None) -> int:
    """The identity a call carries: its scope's (plans and operation, 0 without a scope)
    combined with the caller's label."""
    if not label:
        return scope_identity
    return _hash63(f"{scope_identity}|{label}")


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One collective call, as every rank must issue it identically (see [Note: collective headers]).

    Attributes:
        op: one of ``OPS``.
        reduce: ``"sum"``, ``"mean"``, ``"max"`` or ``None``.
        dtype: element dtype of the data moved (``None`` for objects and barriers).
        numel: elements per rank (the input's, for all-gather and all-reduce; the output's
            for reduce-scatter); ``-1`` where ranks legitimately differ (objects, all-to-all).
        identity: see :func:`identity_of` (0: none declared).
        label: human-readable description (the transform's operation and plan, the caller's label).
    """

    op: str
    reduce: str | None
    dtype: torch.dtype | None
    numel: int
    identity: int = 0
    label: str = ""

    def describe(self) -> str:
        return describe_fields(self.op, self.reduce, _DTYPE_CODE.get(self.dtype, 0) if self.dtype else 0, self.numel,
                               self.label)


class Header(NamedTuple):
    """A decoded header (fields as sent, ``text`` is the label or the poison reason)."""

    kind: int
    seq: int
    op: int
    reduce: int
    dtype: int
    numel: int
    world: int
    identity: int
    send_total: int
    send_count: int
    send_layout: int
    expect_total: int  # -1: the sender sizes its receive from this header (objects)
    expect_count: int
    expect_layout: int
    text: str
    payload: bytes = b""


def _dtype_code(dtype) -> int:
    if dtype is None:
        return 0
    return _DTYPE_CODE.get(dtype, 1000 + _hash63(str(dtype)) % 1000)


def _sizes(tensors) -> tuple[int, ...]:
    return tuple(t.numel() * t.element_size() for t in tensors if t.numel())


def _text(text: str) -> bytes:
    raw = text.encode("utf-8", "replace")[:_TEXT_BYTES]
    return raw.decode("utf-8", "ignore").encode()


def inline(total: int) -> bool:
    """Whether ``total`` bytes to (or from) one peer travel inside the header."""
    return 0 < total <= INLINE_BYTES


def encode(call: Call, seq: int, world: int, sends, expects, with_payload: bool = False) -> tuple[torch.Tensor, bytearray]:
    """The header sent to one peer, as ``(message, fields)``: ``message`` is the uint8 tensor to
    send, ``fields`` its first bytes (what :func:`decode` reads). ``sends`` are the tensors this
    rank sends that peer (in order), ``expects`` the tensors it will receive from it, or ``None``
    when this rank sizes that receive from the peer's header (objects); ``with_payload``:
    ``sends`` travel inside the header (at most ``INLINE_BYTES`` in all, see :func:`inline`).
    The message is a fresh tensor written with torch ops (which ``torch.func`` transforms allow,
    and which read tensors wrapped by them)."""
    out = sizes = _sizes(sends)
    exp = _sizes(expects) if expects is not None else None
    head = bytearray(_PAYLOAD)
    text = _text(call.label)
    npay = sum(out) if with_payload else 0
    _FIELDS.pack_into(
        head, 0, _MAGIC, CALL, seq, OPS.index(call.op) + 1, _REDUCE.index(call.reduce), _dtype_code(call.dtype),
        call.numel, world, call.identity, sum(out), len(out), _layout(sizes),
        -1 if exp is None else sum(exp), -1 if exp is None else len(exp), 0 if exp is None else _layout(exp),
        len(text), npay,
    )
    head[_FIELDS.size : _FIELDS.size + len(text)] = text
    message = torch.zeros(NBYTES, dtype=torch.uint8)
    message[:_PAYLOAD].copy_(torch.frombuffer(head, dtype=torch.uint8))
    pos = _PAYLOAD
    for t in sends if npay else ():
        n = t.numel() * t.element_size()
        if n:
            message[pos : pos + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            pos += n
    return message, head


def encode_poison(seq: int, world: int, reason: str) -> bytearray:
    buf = bytearray(NBYTES)
    text = _text(reason)
    _FIELDS.pack_into(buf, 0, _MAGIC, POISON, seq, 0, 0, 0, 0, world, 0, 0, 0, 0, 0, 0, 0, len(text), 0)
    buf[_FIELDS.size : _FIELDS.size + len(text)] = text
    return buf


def decode(buf, with_payload: bool = True) -> Header:
    f = _FIELDS.unpack_from(buf, 0)
    if f[0] != _MAGIC:
        return Header(0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, f"not a ragged header (magic {f[0]:#x})")
    n = max(0, min(f[15], _TEXT_BYTES))
    text = bytes(buf[_FIELDS.size : _FIELDS.size + n]).decode("utf-8", "replace")
    (_, kind, seq, op, red, dt, numel, world, ident, st, sc, sl, et, ec, el, _, np_) = f
    payload = bytes(buf[_PAYLOAD : _PAYLOAD + max(0, min(np_, INLINE_BYTES))]) if with_payload else b""
    return Header(kind, seq, op, red, dt, numel, world, ident, st, sc, sl, et, ec, el, text, payload)


def unpack(h: "Header", into) -> None:
    """Copies an inline payload into the tensors ``into`` (in order; their sizes were agreed)."""
    src, pos = torch.frombuffer(bytearray(h.payload), dtype=torch.uint8), 0
    for t in into:
        n = t.numel() * t.element_size()
        if n:
            t.view(torch.uint8).copy_(src[pos : pos + n])
            pos += n


def describe_fields(op, reduce, dtype, numel, label) -> str:
    op = OPS[op - 1] if isinstance(op, int) and 0 < op <= len(OPS) else op
    reduce = _REDUCE[reduce] if isinstance(reduce, int) and 0 <= reduce < len(_REDUCE) else reduce
    if isinstance(dtype, int):
        dtype = _DTYPES[dtype - 1] if 0 < dtype <= len(_DTYPES) else (None if dtype == 0 else f"dtype#{dtype}")
    what = f"{op}{f'[{reduce}]' if reduce else ''}"
    if dtype is not None:
        what += f" of {numel} x {str(dtype).replace('torch.', '')}" if numel >= 0 else f" of {str(dtype).replace('torch.', '')}"
    return what + (f" '{label}'" if label else "")


def describe(h: Header) -> str:
    """A header in words (for error messages)."""
    return describe_fields(h.op, h.reduce, h.dtype, h.numel, h.text)


def call_difference(a, b) -> str | None:
    """The first field of what every call carries (:class:`Call` or :class:`Header`) that
    differs: operation, dtype, elements per rank (the identity is compared last, by callers)."""
    if (a.op, a.reduce) != (b.op, b.reduce):
        return "the operation"
    if a.dtype != b.dtype:
        return "the dtype"
    if a.numel != b.numel:
        return "the number of elements per rank"
    return None


def sizes_differ(mine: Header, theirs: Header) -> bool:
    """Whether some message between the two ranks has no receive of its size on the other side."""
    for a, b in ((mine, theirs), (theirs, mine)):
        if b.expect_total >= 0 and (a.send_total, a.send_count, a.send_layout) != (b.expect_total, b.expect_count,
                                                                                  b.expect_layout):
            return True
    return False


def mismatch(mine: Header, theirs: Header) -> str | None:
    """Why two ranks' headers for the same call slot disagree (``None``: they agree).

    Symmetric in its verdict: ``mismatch(a, b) is None`` exactly when ``mismatch(b, a) is None``.
    """
    if theirs.kind != CALL:
        return "not a ragged collective header"
    if mine.seq != theirs.seq:
        return f"out of step: collective #{mine.seq} vs #{theirs.seq}"
    if mine.world != theirs.world:
        return f"group size {mine.world} vs {theirs.world}"
    why = call_difference(mine, theirs)
    if why is not None:
        return why
    for a, b in ((mine, theirs), (theirs, mine)):
        if b.expect_total >= 0 and (a.send_total, a.send_count, a.send_layout) != (b.expect_total, b.expect_count,
                                                                                  b.expect_layout):
            if (a.send_total, a.send_count) == (b.expect_total, b.expect_count):
                return f"the split of the {a.send_total} bytes sent into {a.send_count} messages (buffers of one call)"
            return f"the bytes sent ({a.send_total} in {a.send_count} messages) vs expected ({b.expect_total} in {b.expect_count})"
        if b.expect_total < 0 and a.send_count > 1:
            return "a variable-size message split in parts"
    if mine.identity != theirs.identity:
        return "the plan, transform or label"
    return None
