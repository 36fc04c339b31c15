"""The safetensors file format, read and written with the standard library only: a header per
file, element ranges of one tensor by byte offsets (through a :class:`TensorRef`, or a
:class:`Concat` of them), and a writer.

[Note: reading safetensors by byte range]
A ``.safetensors`` file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the
tensors' bytes, C-order, little-endian, each at ``8 + n + begin``. So elements ``[a, b)`` of a
tensor's flattened values are the bytes ``[begin + a * itemsize, begin + b * itemsize)``: a rank
reads exactly its piece with ``readinto`` (no ``mmap``, so the file's pages never count in the
process's resident memory; nothing is unpickled, no code runs). ``safe_open(...).get_slice``
would read whole rows and map the file. Every header is checked before anything is read:
known dtype, non-negative shape, offsets that cover exactly ``numel * itemsize`` bytes, do not
overlap and end inside the file. A truncated file or a header that lies about its sizes raises
:class:`CheckpointCorruptError` naming the file and the key. Values are read little-endian
(the format's byte order), so this needs a little-endian host.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

import torch

from ragged._errors import is_sizes
from ragged.checkpoint._format import CheckpointCorruptError, open_regular

__all__ = ["DTYPES", "READ_CHUNK_BYTES", "TensorRef", "Concat", "read_header", "read_range", "write_file"]

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}

READ_CHUNK_BYTES = 16 << 20
"""The read buffer: a range in another dtype than its destination is read (and cast) in chunks
of at most this many bytes."""

_MAX_HEADER = 100 << 20  # safetensors' own limit


def _corrupt(file: str, msg: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{file}: {msg}")


def read_header(path: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """``(data start, {name: {"dtype": torch dtype, "shape": tuple, "begin": absolute byte offset,
    "nbytes": int}})`` of the safetensors file ``path`` (a regular file, never a symlink), every
    entry checked against the file's size (see [Note: reading safetensors by byte range]).

    Raises:
        CheckpointCorruptError: the file is missing, a symlink, truncated, or its header is not
            valid JSON or lies about a tensor's size (the message names the file and the key).

    Examples:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> _ = write_file(path, {"w": torch.arange(6.0).view(2, 3)})
        >>> start, header = read_header(path)
        >>> header["w"]["shape"], header["w"]["dtype"], header["w"]["nbytes"]
        ((2, 3), torch.float32, 24)
        >>> with open(path, "r+b") as f:
        ...     _ = f.truncate(os.path.getsize(path) - 4)
        >>> read_header(path)
        Traceback (most recent call last):
        ...
        ragged.checkpoint._format.CheckpointCorruptError: w.safetensors: 'w' needs bytes up to 24 of the data, but the file holds 20 (truncated)
    """
    file = os.path.basename(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(file, f"{size} bytes, shorter than the 8-byte header length (truncated or not safetensors)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise _corrupt(file, f"the header length says {n} bytes but the file holds {size - 8} after it "
                                 "(truncated or not safetensors)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(file, f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt(file, "the header is not a JSON object")
    start, data_len, out, spans = 8 + n, size - 8 - n, {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and is_sizes(entry["shape"] + entry["data_offsets"])):
            raise _corrupt(file, f"{key!r}: the header entry {entry!r} is not {{dtype, shape, data_offsets: [begin, end]}}")
        if entry["dtype"] not in DTYPES:
            raise _corrupt(file, f"{key!r}: unknown dtype {entry['dtype']!r} (known: {', '.join(DTYPES)})")
        dtype, shape, (begin, end) = DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes:
            raise _corrupt(file, f"{key!r}: the header says {entry['dtype']} {list(shape)} ({nbytes} bytes) but its "
                                 f"offsets [{begin}, {end}] span {end - begin} bytes")
        if end > data_len:
            raise _corrupt(file, f"{key!r} needs bytes up to {end} of the data, but the file holds {data_len} (truncated)")
        out[key] = {"dtype": dtype, "shape": shape, "begin": start + begin, "nbytes": nbytes}
        spans.append((begin, end, key))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise _corrupt(file, f"{b!r}: its bytes overlap those of {a!r} (the header lies about the offsets)")
    return start, out


def read_range(path: str, key: str, entry: dict[str, Any], start: int, stop: int, out: torch.Tensor) -> None:
    """Reads elements ``[start, stop)`` of tensor ``key``'s flattened values into ``out`` (1-D,
    ``stop - start`` elements, any dtype and device: cast by ``copy_``), through a read buffer of
    at most :data:`READ_CHUNK_BYTES` (none when ``out`` is a CPU tensor of the file's dtype).

    Raises:
        CheckpointCorruptError: the file ended early (it shrank after its header was read).
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CheckpointCorruptError("safetensors files are little-endian; this host is not.")
    dtype, item, file = entry["dtype"], entry["dtype"].itemsize, os.path.basename(path)
    direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
    step = max(1, READ_CHUNK_BYTES // item)
    buf = None if direct else torch.empty(min(step, stop - start), dtype=dtype)
    with open_regular(path) as f:
        pos = start
        while pos < stop:
            hi = stop if direct else min(stop, pos + step)
            dst = out[pos - start : hi - start] if direct else buf[: hi - pos]
            view = memoryview(dst.view(torch.uint8).numpy()) if dst.numel() else memoryview(b"")
            f.seek(entry["begin"] + pos * item)
            got = f.readinto(view) or 0
            if got != (hi - pos) * item:
                raise _corrupt(file, f"{key!r}: the file ended after {got} of {(hi - pos) * item} bytes of elements "
                                     f"[{pos}, {hi}) (truncated after its header was read)")
            if not direct:
                out[pos - start : hi - start].copy_(dst)
            pos = hi


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """One tensor of a safetensors file, not read.

    Attributes:
        key: its name in the file.
        file: the file's name in the directory.
        path: the file's resolved path.
        shape, dtype: as the header says.
        begin: absolute byte offset of its first element.
    """

    key: str
    file: str
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sources(self) -> tuple[TensorRef, ...]:
        return (self,)

    def read(self, start: int = 0, stop: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor, read from the file only (into
        ``out`` when given: 1-D, any dtype and device, cast on copy).

        Examples:
            >>> import os, tempfile, torch, ragged as rg
            >>> from ragged.checkpoint._safetensors import write_file
            >>> d = tempfile.mkdtemp()
            >>> _ = write_file(os.path.join(d, "model.safetensors"), {"w": torch.arange(6.0).view(2, 3).bfloat16()})
            >>> w = rg.checkpoint.pretrained(d)["w"]
            >>> w.read(2, 5).tolist(), w.read(out=torch.empty(6, dtype=torch.float64)).dtype
            ([2.0, 3.0, 4.0], torch.float64)
        """
        stop = self.numel if stop is None else stop
        if not 0 <= start <= stop <= self.numel:
            raise IndexError(f"{self.file}: {self.key!r} has {self.numel} elements; [{start}, {stop}) is out of range")
        out = torch.empty(stop - start, dtype=self.dtype) if out is None else out
        entry = {"dtype": self.dtype, "begin": self.begin}
        read_range(self.path, self.key, entry, start, stop, out)
        return out

    def where(self) -> str:
        return f"{self.file}: {self.key!r}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Concat:
    """A tensor whose flattened values are its parts' flattened values one after another (a
    stack or a dim-0 concatenation, e.g. Hugging Face's fused experts), not read.

    Examples:
        >>> import os, tempfile, torch
        >>> import ragged as rg
        >>> d = tempfile.mkdtemp()
        >>> _ = write_file(os.path.join(d, "model.safetensors"), {"a": torch.zeros(2, 2), "b": torch.ones(2, 2)})
        >>> w = rg.checkpoint.pretrained(d)
        >>> Concat(parts=(w["a"], w["b"]), shape=(2, 2, 2)).read(3, 6).tolist()
        [0.0, 1.0, 1.0]
    """

    parts: tuple[TensorRef, ...]
    shape: tuple[int, ...]

    def __post_init__(self):
        if len({p.dtype for p in self.parts}) > 1:
            raise CheckpointCorruptError(f"{self.parts[0].where()}: the parts of one fused tensor have different dtypes "
                                         f"{sorted({str(p.dtype) for p in self.parts})}")
        total = math.prod(self.shape)
        if sum(p.numel for p in self.parts) != total:
            raise CheckpointCorruptError(
                f"{self.parts[0].where()}: the parts {[p.key for p in self.parts][:4]}... hold "
                f"{sum(p.numel for p in self.parts)} elements, not the {total} of the fused shape {self.shape}")

    dtype = property(lambda self: self.parts[0].dtype)
    sources = property(lambda self: self.parts)
    numel = property(lambda self: sum(p.numel for p in self.parts))

    def where(self) -> str:
        return f"{self.parts[0].file}: {self.parts[0].key!r} (+{len(self.parts) - 1} fused)"

    def read(self, start: int = 0, stop: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened fused tensor (see :meth:`TensorRef.read`)."""
        stop = self.numel if stop is None else stop
        out = torch.empty(stop - start, dtype=self.dtype) if out is None else out
        base = 0
        for p in self.parts:
            lo, hi = max(start, base), min(stop, base + p.numel)
            if lo < hi:
                p.read(lo - base, hi - base, out=out[lo - start : hi - start])
            base += p.numel
        return out


def write_file(path: str, tensors: dict[str, torch.Tensor]) -> int:
    """Writes ``tensors`` (any shapes; views of one buffer are fine: each is written from its
    own bytes, nothing is copied whole) as one safetensors file; returns the bytes of tensor data.

    The header is padded with spaces to a multiple of 8 bytes, as ``safetensors`` does, and its
    ``__metadata__`` is ``{"format": "pt"}``.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise CheckpointCorruptError(f"{os.path.basename(path)}: {name!r} has dtype {t.dtype}, which safetensors "
                                         "cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                flat = t.detach().reshape(-1).contiguous().cpu()
                f.write(memoryview(flat.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return pos
