"""The fused 8-bit AdamW update of one chunk of whole blocks: torch ops that ``torch.compile`` fuses.

[Note: one update, compiled or eager]
One step of a chunk (a run of whole blocks of one quantized piece, see ``chunks`` in
``_quant8_state.py``) is one function of torch ops, :func:`chunk_update`: decode both moments
(table lookup times the block's absmax), Adam in float32, the update, each block's new absmax,
encode both moments (the formula: [Note: one update] in ``_quant8.py``). Eager, that is ~40
passes over the chunk; ``torch.compile`` (inductor: C++ on CPU, Triton on CUDA) fuses it into one
kernel. ragged calls no compiler of its own: inductor does, with its own toolchain and cache.
Both forms run the very same ops, so they agree bit for bit as long as the compiler keeps
float32 semantics, which the compile options pin: no FMA contraction
(``cpp.enable_floating_point_contract_flag="off"``; on Triton ``emulate_precision_casts``, which
turns fp fusion off), a correctly rounded division on Triton
(``eager_numerics.division_rounding``) and no flush of denormals to zero
(``eager_numerics.disable_ftz``). The square root is taken in float64 and rounded (correct on
every backend); NaN is tested with ``isnan`` (inductor compiles C++ with
``-fno-finite-math-only``).

The rule (``kernel=`` of :func:`ragged.optim.adamw_8bit`):

* ``"eager"``: the torch ops as they are.
* ``"compiled"``: the compiled form; an error if it does not compile, or if its first chunk
  differs from the eager ops' by one bit.
* ``"auto"`` (default): ``$RAGGED_QUANT8_KERNEL`` when set (``compiled`` or ``eager``; the test
  suite sets ``eager``), else the compiled form when it compiles and its first chunk equals the
  eager ops' bit for bit, else the eager ops, with one ``RuntimeWarning`` saying why.

That decision is made once per process and key: (device, block shape, flags of the formula).
One key is one compiled graph: every size is symbolic (buffers, pieces, chunks, offsets; the
step's scalars travel as one float32 tensor; sizes of 1 are not specialized), so a training run
compiles each key once, on its first chunk, and never recompiles (``tests/optim/test_quant8.py``
counts dynamo's graphs). The first compile takes ~20-60 s on a 2-core CPU (inductor caches it on
disk for the next process). Inside an outer ``torch.compile`` the eager function is called, and
traced into the outer graph.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch
import torch.fx.experimental._config

from ragged import _compat
from ragged._errors import RaggedValueError
from ragged.optim._quant8_codec import Codec

__all__ = ["KERNELS", "ENV", "check_kernel", "adam", "chunk_update", "update_fn"]

KERNELS = ("auto", "compiled", "eager")
ENV = "RAGGED_QUANT8_KERNEL"

# hp: the step's scalars, one float32 tensor (rounded as torch rounds Python scalars); its indexes
B1, OMB1, B2, OMB2, EPS, BC1, BC2, DECAY, LR = range(9)


def check_kernel(kernel: str) -> None:
    """Raises unless ``kernel`` (and ``$RAGGED_QUANT8_KERNEL`` for ``"auto"``) names a rule."""
    if kernel not in KERNELS:
        raise RaggedValueError(f"kernel must be one of {KERNELS}, got {kernel!r}.")
    env = os.environ.get(ENV)
    if kernel == "auto" and env is not None and env not in KERNELS[1:]:
        raise RaggedValueError(f"${ENV} must be one of {KERNELS[1:]} (or unset), got {env!r}.")


def adam(m, v, g, p, hp, *, decay: bool, lr: bool, zero_eps: bool, fresh: bool):
    """The formula of [Note: one update, two paths] on fp32 tensors (``m``, ``v`` updated in
    place when ``fresh``); returns ``(m, v, u)``. ``p`` is used when ``decay``."""
    m = m.mul_(hp[B1]) if fresh else m * hp[B1]
    m.add_(g * hp[OMB1])
    v = v.mul_(hp[B2]) if fresh else v * hp[B2]
    v.add_((g * g).mul_(hp[OMB2]))
    u = torch.sqrt(v.double()).to(torch.float32).div_(hp[BC2]).add_(hp[EPS])  # float64 root: correctly rounded
    u = torch.div(m, u).div_(hp[BC1])
    if zero_eps:
        u = torch.where(torch.isnan(u), torch.zeros_like(u), u)
    if decay:
        u.add_(p * hp[DECAY])
    if lr:
        u.mul_(hp[LR])
    return m, v, u


def chunk_update(g, p, mu_codes, nu_codes, mu_scales, nu_scales, hp, cm: Codec, cv: Codec, *, block, grid, decay,
                 lr, zero_eps):
    """One chunk's step (see [Note: one update, compiled or eager]).

    Args:
        g, p: fp32 ``(rows, cols)`` gradient and params (``p`` read when ``decay``).
        mu_codes, nu_codes: uint8 codes of the chunk (``rows * cols``).
        mu_scales, nu_scales: fp32 absmax per block (band-major).
        hp: float32 ``[9]``: ``b1, 1 - b1, b2, 1 - b2, eps, 1 - b1^t, sqrt(1 - b2^t), decay, -lr``.
        cm, cv: the codecs of the two moments.
        block: ``(br, bc)``.
        grid: ``(bands, tiles)``: blocks along the rows and the columns (given, not derived, so
            that the compiled graph has no rounding division of sizes to reason about).

    Returns:
        ``(update, mu codes, mu scales, nu codes, nu scales)``: update and codes ``(rows, cols)``.
    """
    shape = g.shape
    m = cm.decode_grid(mu_codes, mu_scales, shape, block, grid)
    v = cv.decode_grid(nu_codes, nu_scales, shape, block, grid)
    m, v, u = adam(m, v, g, p, hp, decay=decay, lr=lr, zero_eps=zero_eps, fresh=True)
    mc, ms = cm.encode_grid(m, block, grid)
    vc, vs = cv.encode_grid(v, block, grid)
    return u, mc, ms, vc, vs


# pinned so that the compiled form computes what the eager ops compute (see the Note)
_OPTIONS = {
    "cpp": {"cpp.enable_floating_point_contract_flag": "off"},
    "cuda": {"emulate_precision_casts": True, "eager_numerics.division_rounding": True,
             "eager_numerics.disable_ftz": True},
}

_lock = threading.Lock()
_compiled: dict = {}  # key -> compiled function, or the reason it is not used (str)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _first(fn, eager, args):
    """The compiled function's first call, checked against the eager ops: outputs, or a reason."""
    try:
        got = fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure to compile means: the eager ops
        return None, f"torch.compile failed: {type(e).__name__}: {str(e).strip()[:500]}"
    want = eager(*args)
    for name, a, b in zip(("update", "mu codes", "mu scales", "nu codes", "nu scales"), got, want):
        if not torch.equal(_bits(a), _bits(b)):
            return None, f"the compiled update's {name} differ from the eager ops' on its first chunk"
    return got, ""


def _chunk_at(g, p, mu_codes, nu_codes, mu_scales, nu_scales, hp, cm, cv, e0, c0, s0, rows, cols, bands, tiles, block,
              flags):
    """:func:`chunk_update` on one chunk of whole buffers, given as offsets and sizes."""
    n, nb = rows * cols, bands * tiles
    for c in (cm, cv):  # the tables' sizes as constants: a lookup needs no bounds check
        torch._check(c.table.shape[0] == 256)
        torch._check(c.packed.shape[0] == c.key_max - c.key_min + 1)
    el = lambda t: t[e0 : e0 + n].view(rows, cols)  # noqa: E731
    return chunk_update(el(g), None if p is None else el(p), mu_codes[c0 : c0 + n], nu_codes[c0 : c0 + n],
                        mu_scales[s0 : s0 + nb], nu_scales[s0 : s0 + nb], hp, cm, cv, block=block,
                        grid=(bands, tiles), decay=flags[0], lr=flags[1], zero_eps=flags[2])


_ARGS = "g, p, mu_codes, nu_codes, mu_scales, nu_scales, hp, cm, cv, e0, c0, s0, rows, cols, bands, tiles"


def _bound(block, flags):
    """:func:`_chunk_at` with the block shape and the flags written into the function's code as
    literals: dynamo makes every other int symbolic under ``dynamic=True`` (closure and default
    values included), but a literal is a constant of the graph (known loop bounds). Each key gets
    a code object of its own, and dynamo keeps its graphs per code object (at most
    ``recompile_limit``), so no two keys share one cache. The sizes and offsets are symbolic,
    and the buffers start at offset 0, so nothing specializes on where a chunk sits."""
    br, bc = (int(x) for x in block)
    name = f"adam8_{br}x{bc}_" + "".join("1" if f else "0" for f in flags)
    src = f"def {name}({_ARGS}):\n    return _chunk_at({_ARGS}, ({br}, {bc}), {tuple(bool(f) for f in flags)!r})\n"
    scope = {"_chunk_at": _chunk_at}
    exec(compile(src, f"<ragged.optim._quant8_fused {name}>", "exec"), scope)  # noqa: S102 - literals only
    return scope[name]


def _eager(block, flags):
    return lambda *args: _chunk_at(*args, block, flags)


def update_fn(kernel: str, device: torch.device, block, flags):
    """The function that runs one chunk (the arguments of :func:`_chunk_at` up to ``tiles``)
    under the rule of [Note: one update, compiled or eager]."""
    if kernel == "auto":
        kernel = os.environ.get(ENV, "auto")
    if kernel == "eager" or torch.compiler.is_compiling():
        return _eager(block, flags)
    key = (device.type, device.index, tuple(block), flags)
    hit = _compiled.get(key)
    if callable(hit):
        return hit
    if isinstance(hit, str):
        if kernel == "compiled":
            raise RaggedValueError(
                f"kernel='compiled' (the update of {tuple(block)} blocks on {device.type}, torch {torch.__version__}): "
                f"{hit}.{_compat.ADAMW_8BIT_COMPILE_NOTE} Fix: kernel='auto' (falls back to eager ops) or "
                "kernel='eager'.")
        return _eager(block, flags)
    return lambda *args: _first_call(kernel, key, device, args)


def _first_call(kernel, key, device, args):
    with _lock:
        if key not in _compiled:
            options = _OPTIONS["cuda" if device.type == "cuda" else "cpp"]
            fn = torch.compile(_bound(key[2], key[3]), dynamic=True, options=options)
            # traced with sizes of 1 not specialized: a chunk of one band, tile or row runs the
            # same graph as any other (the setting matters only while dynamo traces)
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                out, why = _first(fn, _eager(key[2], key[3]), args)
            _compiled[key] = fn if out is not None else why
            if out is not None:
                return out
            if kernel == "auto":
                warnings.warn(f"adamw_8bit: using eager torch ops for the 8-bit update on {device.type} ({why}).",
                              RuntimeWarning, stacklevel=4)
    return update_fn(kernel, device, key[2], key[3])(*args)
