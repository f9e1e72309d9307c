"""CPU kernels (Numba) with ds4's numerics: quantized activations, integer dots, f32 sums.

Every weight arrives as raw GGUF bytes (uint8), exactly as it sits in the file: 2-D
(rows, row_bytes) for a matrix, 3-D (n_exp, rows, row_bytes) for routed experts. Nothing needs
more alignment than the file gives: every multi-byte field is assembled from bytes.

The arithmetic follows ds4-model.md §5.1:
  * Q8_0 weights   x activation quantized to Q8_0 blocks (32 values, f32 scale d = amax/127);
  * IQ2_XXS, Q2_K, Q4_K weights x activation quantized to Q8_K (256 values, signed max,
    iscale = -127/max, d = 1/iscale, per-16 sums);
  * F16/F32 weights x the f32 activation, no quantization.
Inside a block the dot product is an exact integer; across blocks it is summed in f32, in the
order the CUDA kernels use for the same launch shape (kernels/orders.py: lane-strided partial sums
with fused multiply-adds, then a fixed butterfly, then the split-K warps in order), so that a row
here has the bits of the same row on the GPU. Rows are independent, so matmul (many tokens) gives
bit-identical rows to matvec.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import formats as F
from . import numerics, orders
from .precompile import built_once

# f16 bit pattern -> f32 value for all 65536 patterns (exact, subnormals included).
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_GRID = np.ascontiguousarray(F.IQ2XXS_GRID_BYTES)      # uint8[256, 8]
_KSIGNS = np.ascontiguousarray(F.KSIGNS_IQ2XS)         # uint8[128]

_F32, _F16, _Q8_0, _Q2_K, _Q4_K, _IQ2_XXS = F.F32, F.F16, F.Q8_0, F.Q2_K, F.Q4_K, F.IQ2_XXS

# Activation kinds (how ds4 prepares x for a weight type).
_ACT_F32, _ACT_Q8_0, _ACT_Q8_K = 0, 1, 2


# --------------------------------------------------------------------------------------------
# Activation quantizers
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _quantize_q8_0_into(x, q, d):
    """Q8_0 blocks of 32: d = amax/127 in f32, q = clamp(rint(x/d), -128, 127)."""
    for b in range(x.shape[0] // 32):
        amax = np.float32(0.0)
        for i in range(32):
            a = abs(x[32 * b + i])
            if a > amax:
                amax = a
        db = amax / np.float32(127.0)
        inv = np.float32(1.0) / db if db != np.float32(0.0) else np.float32(0.0)
        d[b] = db
        for i in range(32):
            v = np.rint(x[32 * b + i] * inv)
            v = min(max(v, np.float32(-128.0)), np.float32(127.0))
            q[32 * b + i] = np.int8(v)


@njit(cache=True)
def _quantize_q8_k_into(x, q, d, bsums):
    """Q8_K blocks of 256: signed max (first of the largest |x|), iscale = -127/max, d = 1/iscale."""
    for b in range(x.shape[0] // 256):
        base = 256 * b
        amax = np.float32(0.0)
        vmax = np.float32(0.0)
        for i in range(256):
            a = abs(x[base + i])
            if a > amax:
                amax = a
                vmax = x[base + i]
        if amax == np.float32(0.0):
            d[b] = np.float32(0.0)
            for i in range(256):
                q[base + i] = 0
            for j in range(16):
                bsums[16 * b + j] = 0
            continue
        iscale = np.float32(-127.0) / vmax
        for i in range(256):
            v = np.rint(iscale * x[base + i])
            v = min(max(v, np.float32(-128.0)), np.float32(127.0))
            q[base + i] = np.int8(v)
        for j in range(16):
            s = 0
            for i in range(16):
                s += np.int32(q[base + 16 * j + i])
            bsums[16 * b + j] = s
        d[b] = np.float32(1.0) / iscale


def quantize_q8_0(x):
    """x: f32[K], K % 32 == 0 -> (q int8[K], d f32[K//32])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.shape[0] % 32:
        raise ValueError("quantize_q8_0 needs a 1-D f32 vector whose length is a multiple of 32")
    q = np.empty(x.shape[0], np.int8)
    d = np.empty(x.shape[0] // 32, np.float32)
    _quantize_q8_0_into(x, q, d)
    return q, d


def quantize_q8_k(x):
    """x: f32[K], K % 256 == 0 -> (q int8[K], d f32[K//256], bsums int32[K//16])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.shape[0] % 256:
        raise ValueError("quantize_q8_k needs a 1-D f32 vector whose length is a multiple of 256")
    q = np.empty(x.shape[0], np.int8)
    d = np.empty(x.shape[0] // 256, np.float32)
    bsums = np.empty(x.shape[0] // 16, np.int32)
    _quantize_q8_k_into(x, q, d, bsums)
    return q, d, bsums


# --------------------------------------------------------------------------------------------
# Row dot products (one weight row against one prepared activation), in the CUDA kernels' order
# --------------------------------------------------------------------------------------------

@intrinsic
def _fma32(typingctx, a, b, c):
    """a·b + c rounded once (f32), as the CUDA kernels' cuda.fma: LLVM never fuses a multiply
    and an add on its own here (no fast-math), so the twins say where the GPU fuses."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fma, args)
    return sig, codegen


@njit(inline="always")
def _f16(row, pos, lut):
    return lut[np.int64(row[pos]) | (np.int64(row[pos + 1]) << 8)]


@njit(inline="always")
def _u32(row, pos):
    return (np.int64(row[pos]) | (np.int64(row[pos + 1]) << 8) | (np.int64(row[pos + 2]) << 16)
            | (np.int64(row[pos + 3]) << 24))


@njit(inline="always")
def _fma_into(q, a, b, s0, s1, s2, s3):
    """The four sums with fma(a, b, s_q) in place of s_q: a lane group's accumulator."""
    if q == 0:
        return _fma32(a, b, s0), s1, s2, s3
    if q == 1:
        return s0, _fma32(a, b, s1), s2, s3
    if q == 2:
        return s0, s1, _fma32(a, b, s2), s3
    return s0, s1, s2, _fma32(a, b, s3)


@njit(inline="always")
def _q8_0_block(row, xq, xd, lut, b):
    """Block b's (d_w·d_x, isum) of a Q8_0 row."""
    base = 34 * b
    isum = 0
    for i in range(32):
        isum += np.int32(np.int8(row[base + 2 + i])) * np.int32(xq[32 * b + i])
    return _f16(row, base, lut) * xd[b], np.float32(isum)


@njit(inline="always")
def _dot_q8_0(row, xq, xd, lut, S, U, nchunks):
    """Lane group g (of 8) of warp w: fma(d_w·d_x, isum, acc) over blocks 8·step + g of the warp's
    chunks (w, w + S, ...; U steps each), in order; the groups meet in the butterfly g ^ 4, g ^ 2,
    g ^ 1; the S warps add in order. One pass over the blocks, each into its group's sum."""
    nb = xq.shape[0] // 32
    total = np.float32(0.0)
    for w in range(S):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for c in range(w, nchunks, S):
            for b in range(c * U * 8, min((c + 1) * U * 8, nb)):
                dd, isum = _q8_0_block(row, xq, xd, lut, b)
                if b & 4:
                    a4, a5, a6, a7 = _fma_into(b & 3, dd, isum, a4, a5, a6, a7)
                else:
                    a0, a1, a2, a3 = _fma_into(b & 3, dd, isum, a0, a1, a2, a3)
        part = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
        total = part if w == 0 else total + part
    return total


@njit(inline="always")
def _iq2_xxs_block(row, xq, xd, lut, grid, ksigns, sb):
    """Super-block sb's (d_w·d_x, isum) of an IQ2_XXS row."""
    base = 66 * sb
    bsum = 0
    for ib in range(8):
        o = base + 2 + 8 * ib
        aux = _u32(row, o + 4)
        ls = 2 * (aux >> 28) + 1
        xo = 256 * sb + 32 * ib
        sumi = 0
        for l in range(4):
            g = np.int64(row[o + l])
            signs = np.int64(ksigns[(aux >> (7 * l)) & 127])
            for j in range(8):
                v = np.int32(grid[g, j]) * np.int32(xq[xo + 8 * l + j])
                if (signs >> j) & 1:
                    sumi -= v
                else:
                    sumi += v
        bsum += sumi * ls
    return _f16(row, base, lut) * xd[sb], np.float32(bsum)


@njit(inline="always")
def _dot_iq2_xxs(row, xq, xd, lut, grid, ksigns):
    """Group q (of 4): fma(d_w·d_x, isum, acc) over super-blocks q, q + 4, ...; the butterfly
    q ^ 2, q ^ 1; then 1/8."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for sb in range(xq.shape[0] // 256):
        dd, bsum = _iq2_xxs_block(row, xq, xd, lut, grid, ksigns, sb)
        a0, a1, a2, a3 = _fma_into(sb & 3, dd, bsum, a0, a1, a2, a3)
    return np.float32(0.125) * ((a0 + a2) + (a1 + a3))


@njit(inline="always")
def _q2_k_term(row, xq, xd, xbs, lut, sb):
    """Super-block sb's term of a Q2_K row: fma(d_x·d, isum, −(d_x·dmin)·summs)."""
    base = 84 * sb
    d = _f16(row, base + 80, lut)
    dmin = _f16(row, base + 82, lut)
    summs = 0
    for j in range(16):
        summs += np.int32(xbs[16 * sb + j]) * np.int32(row[base + j] >> 4)
    isum = 0
    sub = 0
    for h in range(2):
        for s in range(4):
            for half in range(2):
                sc = np.int32(row[base + sub] & 15)
                sub += 1
                isuml = 0
                xo = 256 * sb + 128 * h + 32 * s + 16 * half
                qo = base + 16 + 32 * h + 16 * half
                for l in range(16):
                    isuml += np.int32(xq[xo + l]) * np.int32((row[qo + l] >> (2 * s)) & 3)
                isum += sc * isuml
    return _fma32(xd[sb] * d, np.float32(isum), -((xd[sb] * dmin) * np.float32(summs)))


@njit(inline="always")
def _q4_k_scale_min(row, base, j):
    """6-bit scale and min of sub-block j (0..7); the 12 scale bytes start at base + 4."""
    s = base + 4
    if j < 4:
        sc = np.int32(row[s + j] & 63)
        m = np.int32(row[s + j + 4] & 63)
    else:
        sc = np.int32((row[s + j + 4] & 15) | ((row[s + j - 4] >> 6) << 4))
        m = np.int32((row[s + j + 4] >> 4) | ((row[s + j] >> 6) << 4))
    return sc, m


@njit(inline="always")
def _q4_k_term(row, xq, xd, xbs, lut, sb):
    """Super-block sb's term of a Q4_K row, as _q2_k_term."""
    base = 144 * sb
    d = _f16(row, base, lut)
    dmin = _f16(row, base + 2, lut)
    isum = 0
    summs = 0
    for j in range(8):
        sc, m = _q4_k_scale_min(row, base, j)
        summs += m * (np.int32(xbs[16 * sb + 2 * j]) + np.int32(xbs[16 * sb + 2 * j + 1]))
        qo = base + 16 + 32 * (j // 2)
        shift = 4 * (j % 2)
        xo = 256 * sb + 32 * j
        isuml = 0
        for l in range(32):
            isuml += np.int32(xq[xo + l]) * np.int32((row[qo + l] >> shift) & 15)
        isum += sc * isuml
    return _fma32(xd[sb] * d, np.float32(isum), -((xd[sb] * dmin) * np.float32(summs)))


@njit(inline="always")
def _dot_k_quant(wtype, row, xq, xd, xbs, lut):
    """Q2_K / Q4_K: group q (of 4) adds the terms of super-blocks q, q + 4, ...; the butterfly
    q ^ 2, q ^ 1."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for sb in range(xq.shape[0] // 256):
        if wtype == _Q2_K:
            term = _q2_k_term(row, xq, xd, xbs, lut, sb)
        else:
            term = _q4_k_term(row, xq, xd, xbs, lut, sb)
        # acc + term, exactly: fma(term, 1, acc) rounds the same sum once
        a0, a1, a2, a3 = _fma_into(sb & 3, term, np.float32(1.0), a0, a1, a2, a3)
    return (a0 + a2) + (a1 + a3)


@njit(inline="always")
def _f16_pair(row, x, lut, p, acc):
    acc = _fma32(_f16(row, 4 * p, lut), x[2 * p], acc)
    return _fma32(_f16(row, 4 * p + 2, lut), x[2 * p + 1], acc)


@njit(inline="always")
def _dot_f16(row, x, lut, S):
    """Lane l of warp w: fma over weight pairs 32·step + l (steps w, w + S, ...; the last, partial
    step in warp nfull % S), then the butterfly l ^ 16, 8, 4, 2, 1; S warps add in order."""
    npairs = x.shape[0] // 2
    nfull = npairs >> 5
    lanes = np.empty(32, np.float32)
    total = np.float32(0.0)
    for w in range(S):
        for lane in range(32):
            acc = np.float32(0.0)
            for step in range(w, nfull, S):
                acc = _f16_pair(row, x, lut, step * 32 + lane, acc)
            if (npairs & 31) != 0 and nfull % S == w and nfull * 32 + lane < npairs:
                acc = _f16_pair(row, x, lut, nfull * 32 + lane, acc)
            lanes[lane] = acc
        m = 16
        while m >= 1:
            for lane in range(m):
                lanes[lane] = lanes[lane] + lanes[lane + m]
            m //= 2
        total = lanes[0] if w == 0 else total + lanes[0]
    if x.shape[0] & 1:                   # odd K (the GPU takes even K only): the last weight last
        total = _fma32(_f16(row, 2 * (x.shape[0] - 1), lut), x[x.shape[0] - 1], total)
    return total


@njit(inline="always")
def _dot_row(wtype, row, xf, xq, xd, xbs, lut, grid, ksigns, S, U, nchunks):
    """One row of a quantized or F16 type against the activation prepared for that type; S, U,
    nchunks: the GPU launch's split (orders.q8_0_order for Q8_0, S = orders.f16_split for F16)."""
    if wtype == _Q8_0:
        return _dot_q8_0(row, xq, xd, lut, S, U, nchunks)
    elif wtype == _IQ2_XXS:
        return _dot_iq2_xxs(row, xq, xd, lut, grid, ksigns)
    elif wtype == _Q2_K or wtype == _Q4_K:
        return _dot_k_quant(wtype, row, xq, xd, xbs, lut)
    else:
        return _dot_f16(row, xf, lut, S)


@njit(inline="always")
def _act_kind(wtype):
    if wtype == _Q8_0:
        return _ACT_Q8_0
    if wtype == _IQ2_XXS or wtype == _Q2_K or wtype == _Q4_K:
        return _ACT_Q8_K
    return _ACT_F32


@njit(inline="always")
def _prepare(wtype, x, xq, xd, xbs):
    """Quantize x the way ds4 does for weight type wtype (no-op for F16/F32)."""
    kind = _act_kind(wtype)
    if kind == _ACT_Q8_0:
        _quantize_q8_0_into(x, xq, xd)
    elif kind == _ACT_Q8_K:
        _quantize_q8_k_into(x, xq, xd, xbs)


# --------------------------------------------------------------------------------------------
# matvec / matmul
# --------------------------------------------------------------------------------------------

_KERNELS = {}    # (factory name, its arguments...) -> the kernel it built (kernels/precompile.py reads it)


def _cached(factory, *args):
    """factory(*args), built once per process (kept in _KERNELS: precompile.built_once)."""
    return built_once(_KERNELS, factory, *args)


def _matmul_kernel(wtype):
    """matmul's kernel for one weight type. The type is a closure constant, so numba builds only
    that type's row dot: one kernel taking the type as an argument built all five, 4.6 s of a
    first run's compile."""
    WTYPE = int(wtype)

    @njit(parallel=True, cache=True)
    def matmul_kernel(w, X, out, lut, grid, ksigns, S, U, nchunks):
        n_tok, K = X.shape
        rows = w.shape[0]
        xq = np.empty((n_tok, K), np.int8)
        xd = np.empty((n_tok, K // 32), np.float32)
        xbs = np.empty((n_tok, K // 16), np.int32)
        for t in prange(n_tok):
            _prepare(WTYPE, X[t], xq[t], xd[t], xbs[t])
        # rows outer so that each weight row is read once and reused for every token
        for r in prange(rows):
            row = w[r]
            for t in range(n_tok):
                out[t, r] = _dot_row(WTYPE, row, X[t], xq[t], xd[t], xbs[t], lut, grid, ksigns, S, U, nchunks)

    return matmul_kernel


@njit(parallel=True, cache=True)
def _matmul_f32_kernel(w, X, out):
    for r in prange(w.shape[0]):
        for t in range(X.shape[0]):
            acc = np.float32(0.0)
            for i in range(X.shape[1]):
                acc += w[r, i] * X[t, i]
            out[t, r] = acc


def _check_weight(w, wtype, K):
    if w.dtype != np.uint8 or w.ndim != 2:
        raise TypeError("weights must be raw GGUF bytes: a 2-D uint8 array (rows, row_bytes)")
    F.activation_kind(wtype)
    if w.shape[1] != F.row_bytes(wtype, K):
        raise ValueError(f"row of {w.shape[1]} bytes does not hold {K} {F.TYPE_NAMES[wtype]} weights")


def gpu_split(ggml_type, order_rows: int, K: int) -> tuple[int, int, int]:
    """(S, U, nchunks) of the GPU launch of `order_rows` rows of K weights: the order its rows
    are summed in (kernels/orders.py; only Q8_0 and F16 rows depend on it)."""
    if ggml_type == F.Q8_0:
        return orders.q8_0_order(order_rows, K // 32)
    if ggml_type == F.F16:
        return orders.f16_split(order_rows, K), 0, 0
    return 1, 0, 0


def matmul(w, ggml_type, X, order_rows: int | None = None):
    """w: uint8[rows, row_bytes]; X: f32[n_tok, K] -> f32[n_tok, rows].

    Each token's activation is quantized on its own, so row t equals matvec(w, type, X[t]).
    order_rows: the rows of the GPU launch that computes this matrix (the GPU engine launches
    some matrices in pairs or groups, and the row count picks its split-K order); default: rows.
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2:
        raise ValueError("X must be 2-D (n_tok, K)")
    _check_weight(w, ggml_type, X.shape[1])
    out = np.empty((X.shape[0], w.shape[0]), np.float32)
    if ggml_type == F.F32:
        # f32 weights: reinterpret the bytes (copy only when the file offset is not 4-aligned)
        wf = w.view("<f4") if w.flags.c_contiguous else np.ascontiguousarray(w).view("<f4")
        if not wf.flags.aligned:
            wf = wf.copy()
        _matmul_f32_kernel(wf, X, out)
        return out
    S, U, nchunks = gpu_split(ggml_type, order_rows or w.shape[0], X.shape[1])
    _cached(_matmul_kernel, int(ggml_type))(w, X, out, F16_TO_F32, _GRID, _KSIGNS, S, U, nchunks)
    return out


def matvec(w, ggml_type, x, order_rows: int | None = None):
    """w: uint8[rows, row_bytes]; x: f32[K] -> f32[rows] (order_rows: see matmul)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError("x must be 1-D")
    return matmul(w, ggml_type, x[None, :], order_rows)[0]


# --------------------------------------------------------------------------------------------
# Routed experts (ds4-model.md §6.11)
# --------------------------------------------------------------------------------------------

_swiglu = njit(inline="always")(numerics.swiglu)    # the CUDA kernels' SwiGLU (kernels/numerics.py)


def _moe_kernel(gate_type, down_type):
    """moe_batch's kernel for one pair of expert types, closure constants as in _matmul_kernel
    (one kernel for every pair compiled three generic row dots: 13.7 s of a first run's compile)."""
    GATE_TYPE, DOWN_TYPE = int(gate_type), int(down_type)

    @njit(parallel=True, cache=True)
    def moe_kernel(gate_w, up_w, down_w, X, ids, route_w, clamp, out, mids, lut, grid, ksigns, gS, gU, gN,
                   dS, dU, dN):
        n_tok, n_embd = X.shape
        n_used = ids.shape[1]
        n_ff = gate_w.shape[1]
        # gS, gU, gN / dS, dU, dN: the GPU split of a gate/up and of a down row (gpu_split)
        for t in range(n_tok):
            x = X[t]
            xq = np.empty(n_embd, np.int8)
            xd = np.empty(n_embd // 32, np.float32)
            xbs = np.empty(n_embd // 16, np.int32)
            _prepare(GATE_TYPE, x, xq, xd, xbs)
            mid = mids[t]
            for k in range(n_used):
                e = ids[t, k]
                wk = route_w[t, k]
                for r in prange(n_ff):
                    g = _dot_row(GATE_TYPE, gate_w[e, r], x, xq, xd, xbs, lut, grid, ksigns, gS, gU, gN)
                    u = _dot_row(GATE_TYPE, up_w[e, r], x, xq, xd, xbs, lut, grid, ksigns, gS, gU, gN)
                    mid[k, r] = _swiglu(g, u, clamp, wk)
            acc = np.zeros(n_embd, np.float32)
            mq = np.empty(n_ff, np.int8)
            md = np.empty(n_ff // 32, np.float32)
            mbs = np.empty(n_ff // 16, np.int32)
            for k in range(n_used):
                e = ids[t, k]
                _prepare(DOWN_TYPE, mid[k], mq, md, mbs)
                for r in prange(n_embd):
                    acc[r] += _dot_row(DOWN_TYPE, down_w[e, r], mid[k], mq, md, mbs, lut, grid,
                                       ksigns, dS, dU, dN)
            for r in range(n_embd):
                out[t, r] = acc[r]

    return moe_kernel


def _check_experts(gate_w, up_w, down_w, gate_type, down_type, n_embd):
    for name, w in (("gate", gate_w), ("up", up_w), ("down", down_w)):
        if w.dtype != np.uint8 or w.ndim != 3:
            raise TypeError(f"{name} experts must be raw GGUF bytes: uint8 (n_exp, rows, row_bytes)")
    n_ff = gate_w.shape[1]
    if up_w.shape != gate_w.shape or gate_w.shape[2] != F.row_bytes(gate_type, n_embd):
        raise ValueError("gate/up expert shapes do not match (n_exp, n_ff, row_bytes(n_embd))")
    if down_w.shape[1] != n_embd or down_w.shape[2] != F.row_bytes(down_type, n_ff):
        raise ValueError("down expert shape does not match (n_exp, n_embd, row_bytes(n_ff))")


def moe_batch(gate_w, up_w, down_w, gate_type, down_type, X, expert_ids, route_w, clamp, with_mids=False):
    """Routed experts for n_tok tokens: X f32[n_tok, n_embd], expert_ids int32[n_tok, n_used],
    route_w f32[n_tok, n_used] -> f32[n_tok, n_embd]; each row equals moe() of that token.
    with_mids: also return the down projections' inputs, f32[n_tok, n_used, n_ff] (a test's
    view of the activations the down kernel quantizes)."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    ids = np.ascontiguousarray(expert_ids, dtype=np.int32)
    rw = np.ascontiguousarray(route_w, dtype=np.float32)
    _check_experts(gate_w, up_w, down_w, gate_type, down_type, X.shape[1])
    if ids.shape != rw.shape or ids.shape[0] != X.shape[0]:
        raise ValueError("expert_ids and route_w must both be (n_tok, n_used)")
    if ids.size and (ids.min() < 0 or ids.max() >= gate_w.shape[0]):
        raise ValueError("expert id out of range")
    out = np.empty_like(X)
    n_ff, n_embd = gate_w.shape[1], X.shape[1]
    mids = np.empty((X.shape[0], ids.shape[1], n_ff), np.float32)
    _cached(_moe_kernel, int(gate_type), int(down_type))(
        gate_w, up_w, down_w, X, ids, rw, np.float32(clamp), out, mids, F16_TO_F32, _GRID, _KSIGNS,
        *gpu_split(gate_type, n_ff, n_embd), *gpu_split(down_type, n_embd, n_ff))
    return (out, mids) if with_mids else out


def moe(gate_w, up_w, down_w, gate_type, down_type, x, expert_ids, route_w, clamp):
    """ds4's routed MoE for one token (§6.11): x f32[n_embd] -> f32[n_embd].

    xq = Q(x); for each slot k: g, u = W_gate[e].xq, W_up[e].xq; g = min(g, clamp);
    u = clip(u, -clamp, clamp); mid = silu(g)*u*route_w[k]; out += W_down[e].Q(mid), in slot order.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    return moe_batch(gate_w, up_w, down_w, gate_type, down_type, x[None, :],
                     np.asarray(expert_ids, np.int32)[None, :],
                     np.asarray(route_w, np.float32)[None, :], clamp)[0]
