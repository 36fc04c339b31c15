"""The fused 8-bit Adam update of one quantized piece, as a small C kernel (CPU, optional).

[Note: why a C kernel]
One 8-bit Adam step per element is: decode two codes (table lookups), the Adam update, the
block absmax of both new moments, and encode both (a lookup each). As torch ops that is ~40
passes over each chunk; measured on the 12.5M-parameter set of ``bench/optim.py --sections
step`` (1 thread) it was 8-14x torch's fp32 foreach AdamW. ``torch.compile`` of the same chunk
function (inductor's C++ backend) reached ~2.9x on a paired micro-benchmark: it splits the
reduction and the encode into separate loop nests that each redo the lookups, with bounds
checks and int64 index vectors. Written once by hand -- per band of blocks: decode, update and
store the update in one loop, a column-wise max, then encode -- it is one pass over the data at
~1.2-1.5x torch's fp32 AdamW (``bench/optim.py``).

It computes exactly what the torch-ops path of ``_quant8.py`` computes, op for op in float32
(no FMA contraction: ``-ffp-contract=off``; ``sqrtf`` and division are correctly rounded, and
the torch path computes its square root in float64, which rounds to the same float), so the
two are bit-identical (tested) and either gives world-size-independent state. The source is
compiled on first use with the system C compiler (``$CC``, else ``gcc`` / ``cc`` / ``clang``,
``-O3 -march=native``) into ``$RAGGED_CACHE_DIR`` (default ``~/.cache/ragged``), keyed by the
source, the flags, the compiler and the CPU, and loaded with ``ctypes`` (which releases the GIL
during the call). Without a compiler :func:`available` is False and ``kernel="auto"`` uses the
torch ops. Where the CPU has AVX512-VBMI the decode looks codes up with byte permutes instead of
gathers (the same table values).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

from ragged.optim._quant8_codec import KEY_SHIFT

__all__ = ["available", "unavailable_reason", "adam8_piece", "workspace_numel", "STRIP"]

STRIP = 32768  # elements of one band strip the kernel keeps in its workspace

_SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <string.h>

static inline int32_t fbits(float x) { int32_t i; memcpy(&i, &x, 4); return i; }
static inline float bitsf(int32_t i) { float x; memcpy(&x, &i, 4); return x; }

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
/* table[code] for 64 codes at once: each byte plane of the 256-entry table looked up with two
   vpermi2b (128 entries each) and a blend on bit 7, then the planes interleaved into floats. */
typedef struct { __m512i t[4][4]; } planes_t;
static void load_planes(const float* tab, planes_t* pl) {
    uint8_t buf[4][256];
    for (int c = 0; c < 256; c++) {
        uint32_t x; memcpy(&x, tab + c, 4);
        for (int k = 0; k < 4; k++) buf[k][c] = (uint8_t)(x >> (8 * k));
    }
    for (int k = 0; k < 4; k++) for (int q = 0; q < 4; q++) pl->t[k][q] = _mm512_loadu_si512(buf[k] + 64 * q);
}
static void decode_row(const uint8_t* codes, int64_t w, const planes_t* pl, const float* tab, float* out) {
    int64_t j = 0;
    for (; j + 64 <= w; j += 64) {
        __m512i idx = _mm512_loadu_si512(codes + j);
        __mmask64 hi = _mm512_movepi8_mask(idx);
        __m512i b[4];
        for (int k = 0; k < 4; k++) {
            __m512i lo = _mm512_permutex2var_epi8(pl->t[k][0], idx, pl->t[k][1]);
            __m512i up = _mm512_permutex2var_epi8(pl->t[k][2], idx, pl->t[k][3]);
            b[k] = _mm512_mask_blend_epi8(hi, lo, up);
        }
        __m512i l01 = _mm512_unpacklo_epi8(b[0], b[1]), h01 = _mm512_unpackhi_epi8(b[0], b[1]);
        __m512i l23 = _mm512_unpacklo_epi8(b[2], b[3]), h23 = _mm512_unpackhi_epi8(b[2], b[3]);
        __m512i f0 = _mm512_unpacklo_epi16(l01, l23), f1 = _mm512_unpackhi_epi16(l01, l23);
        __m512i f2 = _mm512_unpacklo_epi16(h01, h23), f3 = _mm512_unpackhi_epi16(h01, h23);
        __m512i g0 = _mm512_shuffle_i32x4(f0, f1, 0x44), g1 = _mm512_shuffle_i32x4(f2, f3, 0x44);
        __m512i h0 = _mm512_shuffle_i32x4(f0, f1, 0xEE), h1 = _mm512_shuffle_i32x4(f2, f3, 0xEE);
        _mm512_storeu_si512(out + j, _mm512_shuffle_i32x4(g0, g1, 0x88));
        _mm512_storeu_si512(out + j + 16, _mm512_shuffle_i32x4(g0, g1, 0xDD));
        _mm512_storeu_si512(out + j + 32, _mm512_shuffle_i32x4(h0, h1, 0x88));
        _mm512_storeu_si512(out + j + 48, _mm512_shuffle_i32x4(h0, h1, 0xDD));
    }
    for (; j < w; j++) out[j] = tab[codes[j]];
}
#else
typedef int planes_t;
static void load_planes(const float* tab, planes_t* pl) { (void)tab; (void)pl; }
static void decode_row(const uint8_t* codes, int64_t w, const planes_t* pl, const float* tab, float* out) {
    (void)pl;
    for (int64_t j = 0; j < w; j++) out[j] = tab[codes[j]];
}
#endif

/* codes of x[j] * inv[j]: see [Note: exact nearest-code lookup without a search] */
static void encode_row(const float* x, const float* inv, int64_t w, const int32_t* packed, int32_t kmin,
                       int32_t kmax, int32_t zero, int shift, int32_t* key, int32_t* low, uint8_t* out) {
    for (int64_t j = 0; j < w; j++) {
        float normed = x[j] * inv[j];
        int32_t bits = fbits(normed) & 0x7fffffff;
        int32_t k = bits >> shift;
        k = k < kmin ? kmin : k;
        k = k > kmax ? kmax : k;
        key[j] = k - kmin;
        low[j] = (bits & ((1 << shift) - 1)) | (normed < 0 ? (int32_t)0x80000000 : 0);
    }
    for (int64_t j = 0; j < w; j++) key[j] = packed[key[j]];
    const int32_t lowmask = (1 << (shift + 1)) - 1;
    for (int64_t j = 0; j < w; j++) {
        int32_t e = key[j], l = low[j];
        int32_t n = (e >> (shift + 1)) + ((l & 0x7fffffff) > (e & lowmask));
        if (zero) n = l < 0 ? zero - n : zero + n;
        out[j] = (uint8_t)n;
    }
}

/* One quantized piece (rows x cols, row-major, blocks br x bc, scales band-major).
   out may alias g, mc_out mc_in, nc_out nc_in, ms_out ms_in, ns_out ns_in. */
void adam8_piece(const float* g, float* out, const float* p,
                 const uint8_t* mc_in, const uint8_t* nc_in, const float* ms_in, const float* ns_in,
                 uint8_t* mc_out, uint8_t* nc_out, float* ms_out, float* ns_out,
                 int64_t rows, int64_t cols, int64_t br, int64_t bc,
                 float b1, float omb1, float b2, float omb2, float eps, float bc1, float bc2,
                 float wd, float lr, int flags,
                 const float* tab_m, const float* tab_v, const int32_t* pk_m, const int32_t* pk_v,
                 int32_t kmin_m, int32_t kmax_m, int32_t kmin_v, int32_t kmax_v, int32_t zero_m, int shift,
                 float* work, int64_t strip) {
    const int has_decay = flags & 1, has_lr = flags & 2, zero_eps = flags & 4;
    const int64_t bands = (rows + br - 1) / br, tiles = (cols + bc - 1) / bc;
    int64_t per = (strip / br) / bc; if (per < 1) per = 1;  /* tiles per strip */
    const int64_t wmax = per * bc;
    float* lm = work; float* lv = lm + br * wmax;
    float* sm = lv + br * wmax; float* sv = sm + wmax; float* xm = sv + wmax; float* xv = xm + wmax;
    int32_t* key = (int32_t*)(xv + wmax); int32_t* low = key + wmax;
    planes_t plm, plv; load_planes(tab_m, &plm); load_planes(tab_v, &plv);
    for (int64_t b = 0; b < bands; b++) {
        const int64_t r0 = b * br, r1 = r0 + br < rows ? r0 + br : rows;
        for (int64_t t0 = 0; t0 < tiles; t0 += per) {
            const int64_t t1 = t0 + per < tiles ? t0 + per : tiles;
            const int64_t c0 = t0 * bc, c1 = t1 * bc < cols ? t1 * bc : cols, w = c1 - c0;
            for (int64_t j = 0; j < w; j++) {
                int64_t t = b * tiles + (c0 + j) / bc;
                sm[j] = ms_in[t]; sv[j] = ns_in[t]; xm[j] = 0.f; xv[j] = 0.f;
            }
            for (int64_t r = r0; r < r1; r++) {
                const int64_t off = r * cols + c0;
                float* m_ = lm + (r - r0) * w; float* v_ = lv + (r - r0) * w;
                decode_row(mc_in + off, w, &plm, tab_m, m_);
                decode_row(nc_in + off, w, &plv, tab_v, v_);
                #pragma GCC ivdep
                for (int64_t j = 0; j < w; j++) {
                    float gi = g[off + j];
                    float m = (m_[j] * sm[j]) * b1 + gi * omb1;
                    float v = (v_[j] * sv[j]) * b2 + (gi * gi) * omb2;
                    m_[j] = m; v_[j] = v;
                    float u = m / (sqrtf(v) / bc2 + eps) / bc1;
                    if (zero_eps) u = u != u ? 0.f : u;
                    if (has_decay) u = u + p[off + j] * wd;
                    if (has_lr) u = u * lr;
                    out[off + j] = u;
                    /* column-wise running max of |m|, |v| (as int bit patterns: non-negative floats order
                       like their bits, and an int max vectorises) */
                    int32_t am = fbits(fabsf(m)), av = fbits(fabsf(v)), pm = fbits(xm[j]), pv = fbits(xv[j]);
                    xm[j] = bitsf(am > pm ? am : pm); xv[j] = bitsf(av > pv ? av : pv);
                }
            }
            for (int64_t t = t0; t < t1; t++) {
                const int64_t a0 = t * bc - c0, a1 = (t + 1) * bc < cols ? (t + 1) * bc - c0 : w;
                int32_t im = 0, iv = 0;
                for (int64_t j = a0; j < a1; j++) {
                    int32_t x = fbits(xm[j]), y = fbits(xv[j]);
                    im = x > im ? x : im; iv = y > iv ? y : iv;
                }
                float am = bitsf(im), av = bitsf(iv);
                ms_out[b * tiles + t] = am; ns_out[b * tiles + t] = av;
                float inv_m = 1.f / (am > 0 ? am : 1.f), inv_v = 1.f / (av > 0 ? av : 1.f);
                for (int64_t j = a0; j < a1; j++) { sm[j] = inv_m; sv[j] = inv_v; }
            }
            for (int64_t r = r0; r < r1; r++) {
                const int64_t off = r * cols + c0;
                encode_row(lm + (r - r0) * w, sm, w, pk_m, kmin_m, kmax_m, zero_m, shift, key, low, mc_out + off);
                encode_row(lv + (r - r0) * w, sv, w, pk_v, kmin_v, kmax_v, 0, shift, key, low, nc_out + off);
            }
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_P, _I, _F, _I32, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_int
_ARGTYPES = [_P] * 11 + [_I] * 4 + [_F] * 9 + [_C] + [_P] * 4 + [_I32] * 5 + [_C] + [_P, _I]

_lock = threading.Lock()
_state: dict = {}


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found ($CC, gcc, cc, clang)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), cc, version, platform.machine(), _cpu_id()]).encode())
    root = os.environ.get("RAGGED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ragged")
    os.makedirs(root, exist_ok=True)
    lib = os.path.join(root, f"adam8_{key.hexdigest()[:20]}.so")
    if not os.path.exists(lib):
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src, out = os.path.join(tmp, "adam8.c"), os.path.join(tmp, "adam8.so")
            with open(src, "w") as f:
                f.write(_SOURCE)
            res = subprocess.run([cc, *_FLAGS, src, "-o", out, "-lm"], capture_output=True, text=True, timeout=300)
            if res.returncode:
                raise OSError(f"{cc} failed: {res.stderr.strip()[:2000]}")
            os.replace(out, lib)  # atomic: concurrent processes each build, one file wins
    dll = ctypes.CDLL(lib)
    dll.adam8_piece.argtypes = _ARGTYPES
    dll.adam8_piece.restype = None
    return dll


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _build()
                except Exception as e:  # noqa: BLE001 - any failure means: use the torch ops
                    _state["lib"], _state["why"] = None, f"{type(e).__name__}: {e}"
    return _state["lib"]


def available() -> bool:
    """True if the kernel is built (or builds now) and loads."""
    return _lib() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return "" if available() else _state.get("why", "")


def workspace_numel(br: int, bc: int) -> int:
    """fp32 elements of the workspace :func:`adam8_piece` needs for blocks ``(br, bc)``."""
    wmax = max(1, STRIP // br // bc) * bc
    return 2 * br * wmax + 6 * wmax


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def adam8_piece(g, out, p, codes_in, scales_in, codes_out, scales_out, *, rows, cols, block, hyper, tables,
                work) -> None:
    """Runs the kernel on one piece (all CPU, contiguous; see the C source for aliasing).

    Args:
        g, out, p: fp32 gradient / update / params of the piece (``p`` None: no weight decay).
        codes_in, scales_in, codes_out, scales_out: ``(mu, nu)`` pairs of uint8 code / fp32 scale
            views of the piece.
        rows, cols, block: the piece as ``(rows, cols)`` in ``block = (br, bc)`` blocks.
        hyper: ``(b1, 1 - b1, b2, 1 - b2, eps, bc1, bc2_sqrt, weight_decay, lr, flags)`` (floats
            rounded to float32 as torch rounds scalars; flags: 1 decay, 2 lr, 4 eps == 0).
        tables: ``(codec_mu, codec_nu)``.
        work: fp32 workspace of at least :func:`workspace_numel` elements.
    """
    cm, cv = tables
    _lib().adam8_piece(
        _ptr(g), _ptr(out), _ptr(p), _ptr(codes_in[0]), _ptr(codes_in[1]), _ptr(scales_in[0]), _ptr(scales_in[1]),
        _ptr(codes_out[0]), _ptr(codes_out[1]), _ptr(scales_out[0]), _ptr(scales_out[1]),
        rows, cols, block[0], block[1], *hyper,
        _ptr(cm.table), _ptr(cv.table), _ptr(cm.packed), _ptr(cv.packed),
        cm.key_min, cm.key_max, cv.key_min, cv.key_max, cm.zero, KEY_SHIFT, _ptr(work), STRIP)
