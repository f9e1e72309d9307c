"""CUDA kernels (numba-cuda) with ds4's numerics, graph-ready, on raw GGUF weights.

Weights are addressed as (arena, byte_offset): ``arena`` is a 1-D uint8 device array (the VRAM
image of the model, or an expert-cache slab) and the offset is an int that stays constant per call
site. Activations, outputs and scratch are device arrays the caller owns: the launch functions
allocate nothing (moe_prefill, not graph-ready, keeps its scratch from the first call), never synchronise, and take per-token values (expert ids, route weights, expert
addresses) from device buffers, so a decode step can be captured into a CUDA graph.

Numerics (ds4-model.md §5.1): activations are quantized exactly like the CPU twins (bit-identical
quantizers), every block dot product is an exact integer (dp4a), and the blocks of a row are summed
in f32: lanes accumulate strided blocks with fma, then a fixed butterfly, then the split-K warps in
order. The order is a pure function of (type, K, launch rows) (kernels/orders.py): the prefill
matmuls run the same per-output arithmetic as the matvecs and return bit-identical rows, the
batched MoE returns bit-identical tokens to the decode MoE, and the CPU twins (kernels/cpu.py)
follow the same order, so they give the same bits too.

Layout facts the kernels rely on (checked by the launch functions):
  * Q8_0 and IQ2_XXS blocks (34 B, 66 B) are only 2-byte aligned: they are read as uint16 and
    32-bit words are assembled from halves. Offsets and row sizes must be even.
  * Q2_K, Q4_K and F16 rows are read as uint32: offsets and row sizes must be multiples of 4.
  * The tensor-core kernels read quantized activations as 8-byte words (device allocations are
    256-byte aligned and every slice the engine passes starts at a multiple of 32 values).
"""

from . import compat  # noqa: F401  (numpy>=2.5 shim, before numba.cuda compiles anything)

import math

import numpy as np
from numba import complex64, cuda, float32, int32, int64, uint8, uint32, uint64
from numba.cuda import libdevice

from . import formats as F
from . import numerics, orders
from .compat import cuda_available  # noqa: F401  (re-exported)
from .cuda_intrinsics import (SIMULATOR, bfe, byte_mask, dp2a_hi, dp2a_lo, dp4a, dp4a_us, even_signs, f16_bits_to_f32,
                              forceinline, funnel_r,
                              imad, cp_async16_at, cp_async4_at, cp_async_commit, cp_async_wait1,
                              and_or, iq2_permute, ld_half, ld_pair, ld_quad, lds32, mma_s8,
                              mma_s8_acc, mulhi, negate_bytes, pdl_enter, shared_addr, shr64_lo)
from .cuda_ops import _warp_sync, hc_post_dim
from .disk_cache import cached_jit
from .launch import install as _install_fast_launch, view as memo_view
from .precompile import built_once

FULL_MASK = 0xFFFFFFFF
WARP = 32

# numba-cuda marshals every launch's arguments in Python (31 us + ~8 us per array argument on the
# H200): kernels/launch.py memoizes that for every dispatcher (False under the simulator)
FAST_LAUNCH = _install_fast_launch()

# numba's CUDA simulator takes neither forceinline nor max_registers: there _inline
# (cuda_intrinsics.forceinline) and _jit_capped drop them, so the kernels here can be checked in
# the simulator too (those using mma_s8, a warp-wide instruction it lacks, excepted). On a GPU
# they are exactly the options they name.
_inline = forceinline

# The factory kernels below go through numba-cuda's disk cache (disk_cache.py: the key also holds
# the kernels' sources and the register cap). Every variant a factory builds gets its own entry,
# provided that (1) the pickle of its closure's cells is the same in every process (cuda_intrinsics
# gives its intrinsics fixed uuids for that) and (2) a kernel body reads no module-level knob, only
# closure constants (tests/test_kernels.py checks both): tests and kbench set knobs at run time.
_CACHE_KERNELS = True

if SIMULATOR:
    def _jit_capped(max_regs):
        return cuda.jit
else:
    def _jit_capped(max_regs):
        """cuda.jit with a register cap (0: none), disk-cached with _CACHE_KERNELS."""
        if _CACHE_KERNELS:
            return cached_jit(max_regs)
        return cuda.jit(max_registers=max_regs) if max_regs else cuda.jit

# Array indices in the hot loops are cast to unsigned: numba then skips its negative-index
# wraparound code (3-4 extra instructions per load).
_ix = uint64

_M8 = np.uint32(0xFF)
_M16 = np.uint32(0xFFFF)
_M32 = np.uint64(0xFFFFFFFF)
_LOW2 = np.uint32(0x03030303)
_LOW4 = np.uint32(0x0F0F0F0F)


# ============================================================================================
# Warp helpers
# ============================================================================================

@_inline
def _sum_lanes_of_8_i32(v):
    """Integer sum over the 8 lanes that share a super-block (lane bits 0..2)."""
    v = int32(v + cuda.shfl_xor_sync(FULL_MASK, v, 1))
    v = int32(v + cuda.shfl_xor_sync(FULL_MASK, v, 2))
    v = int32(v + cuda.shfl_xor_sync(FULL_MASK, v, 4))
    return v


@_inline
def _sum_groups_of_8_f32(v):
    """f32 sum over the 4 groups of 8 lanes (lane bits 4, then 3): a fixed butterfly."""
    v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
    return v


@_inline
def _pair_row(row, rows_a, start_a, start_b, stride):
    """Where row `row` of a two-matrix launch starts (in the caller's units): rows below rows_a are
    matrix a's, the others matrix b's."""
    return start_a + row * stride if row < rows_a else start_b + (row - rows_a) * stride


@_inline
def _u16pair(a16, h):
    """32-bit word from two uint16 at halfword index h (little endian)."""
    return uint32(a16[_ix(h)]) | (uint32(a16[_ix(h + 1)]) << uint32(16))


# ============================================================================================
# Activation quantizers (bit-identical to cpu.quantize_q8_0 / cpu.quantize_q8_k)
# ============================================================================================

@_jit_capped(0)
def _quantize_q8_0_kernel(x, q, d, nblocks):
    """One warp per 32-value block, one lane per value."""
    pdl_enter()
    b = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // WARP
    lane = cuda.threadIdx.x % WARP
    if b >= nblocks:
        return
    v = x[b * 32 + lane]
    amax = abs(v)
    for m in (16, 8, 4, 2, 1):
        amax = max(amax, cuda.shfl_xor_sync(FULL_MASK, amax, m))
    db = amax / float32(127.0)
    inv = float32(1.0) / db if db != float32(0.0) else float32(0.0)
    r = libdevice.rintf(v * inv)
    r = min(max(r, float32(-128.0)), float32(127.0))
    q[b * 32 + lane] = int32(r)
    if lane == 0:
        d[b] = db


@_jit_capped(0)
def _quantize_q8_k_kernel(x, q, d, bsums, nblocks):
    """One warp per 256-value block; lane l holds values 8l..8l+7."""
    pdl_enter()
    b = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // WARP
    lane = cuda.threadIdx.x % WARP
    if b >= nblocks:
        return
    base = b * 256 + lane * 8
    # first occurrence of the largest |x| within the lane ...
    amax = float32(0.0)
    vmax = float32(0.0)
    imax = int32(1 << 30)
    for i in range(8):
        v = x[base + i]
        if abs(v) > amax:
            amax = abs(v)
            vmax = v
            imax = int32(lane * 8 + i)
    # ... then across lanes: larger |x| wins, ties go to the smaller index
    for m in (16, 8, 4, 2, 1):
        oa = cuda.shfl_xor_sync(FULL_MASK, amax, m)
        ov = cuda.shfl_xor_sync(FULL_MASK, vmax, m)
        oi = cuda.shfl_xor_sync(FULL_MASK, imax, m)
        if oa > amax or (oa == amax and oi < imax):
            amax = oa
            vmax = ov
            imax = oi
    if amax == float32(0.0):
        for i in range(8):
            q[base + i] = 0
        if lane % 2 == 0:
            bsums[b * 16 + lane // 2] = 0
        if lane == 0:
            d[b] = float32(0.0)
        return
    iscale = float32(-127.0) / vmax
    s = int32(0)
    for i in range(8):
        r = libdevice.rintf(iscale * x[base + i])
        r = min(max(r, float32(-128.0)), float32(127.0))
        qi = int32(r)
        q[base + i] = qi
        s += qi
    s += cuda.shfl_xor_sync(FULL_MASK, s, 1)
    if lane % 2 == 0:
        bsums[b * 16 + lane // 2] = s
    if lane == 0:
        d[b] = float32(1.0) / iscale


def _stream(stream):
    return 0 if stream is None else stream


def _flat(a):
    """1-D view of a contiguous device array (numba refuses some size-1-dim reshapes); memoized,
    so that the launches it feeds keep their arguments (kernels/launch.py)."""
    if a.ndim == 1:
        return a
    return memo_view(a, "flat", _flat_view)


def _flat_view(a):
    try:
        return a.reshape(a.size)
    except NotImplementedError:
        dims = [(n, st) for n, st in zip(a.shape, a.strides) if n != 1]
        expect = a.dtype.itemsize
        for n, st in reversed(dims):
            if st != expect:
                raise
            expect *= n
        return type(a)(shape=(a.size,), strides=(a.dtype.itemsize,), dtype=a.dtype,
                       gpu_data=a.gpu_data)


def quantize_q8_0(x, q, d, stream=0):
    """Q8_0-quantize x (f32, any shape, size % 32 == 0) into q (int8, same size), d (f32, size/32).

    Blocks never straddle tokens (K % 32 == 0), so one call serves one token or a [n_tok, K] batch.
    """
    n = x.size
    if n % 32 or q.size != n or d.size != n // 32:
        raise ValueError("quantize_q8_0: sizes must be x[n], q[n], d[n/32] with n % 32 == 0")
    nb = n // 32
    _quantize_q8_0_kernel[(nb + 7) // 8, 256, _stream(stream)](_flat(x), _flat(q), _flat(d), nb)


def quantize_q8_k(x, q, d, bsums, stream=0):
    """Q8_K-quantize x (f32, size % 256 == 0) into q (int8), d (f32, n/256), bsums (int32, n/16)."""
    n = x.size
    if n % 256 or q.size != n or d.size != n // 256 or bsums.size != n // 16:
        raise ValueError("quantize_q8_k: sizes must be x[n], q[n], d[n/256], bsums[n/16], n % 256 == 0")
    nb = n // 256
    _quantize_q8_k_kernel[(nb + 7) // 8, 256, _stream(stream)](
        _flat(x), _flat(q), _flat(d), _flat(bsums), nb)


# A [n_tok, K] batch is the same operation on the flattened array.
quantize_q8_0_batch = quantize_q8_0
quantize_q8_k_batch = quantize_q8_k


# ============================================================================================
# Arena views
# ============================================================================================

_VIEW_CACHE = {}


def _arena_views(arena):
    """(uint16, uint32, uint8, uint64) views of a uint8 device arena; cached, so no per-call work."""
    if not cuda.is_cuda_array(arena):
        raise TypeError("arena must be a device array (uint8)")
    iface = arena.__cuda_array_interface__
    key = (iface["data"][0], arena.size)
    views = _VIEW_CACHE.get(key)
    if views is None:
        a = arena if hasattr(arena, "gpu_data") else cuda.as_cuda_array(arena)
        if a.dtype != np.uint8 or a.ndim != 1:
            raise TypeError("arena must be a 1-D uint8 device array")
        n = a.size
        views = (a[: n // 2 * 2].view(np.uint16), a[: n // 4 * 4].view(np.uint32), a,
                 a[: n // 8 * 8].view(np.uint64))
        if len(_VIEW_CACHE) > 64:
            _VIEW_CACHE.clear()
        _VIEW_CACHE[key] = views
    return views


def _dev_ptr(a):
    """The device address of array a's first element (0 in the simulator, whose arrays have
    no device address and no alignment to keep)."""
    return 0 if SIMULATOR else a.__cuda_array_interface__["data"][0]


def _as_i32(a):
    """int32 view of an int8 device array (size % 4 == 0, base 4-aligned as allocations are)."""
    return memo_view(a, "i32", lambda a: _flat(a).view(np.int32))


def _as_i64(a):
    return memo_view(a, "i64", lambda a: _flat(a).view(np.int64))


_TABLES = None


def _iq2_tables():
    """Device copies of the IQ2_XXS grid (uint64[256]) and sign table (uint8[128]), made once."""
    global _TABLES
    if _TABLES is None:
        _TABLES = (cuda.to_device(F.IQ2XXS_GRID.astype(np.uint64)),
                   cuda.to_device(F.KSIGNS_IQ2XS.astype(np.uint8)))
    return _TABLES


# ============================================================================================
# Q8_0 x Q8_0-activation and F16 x f32 (dense projections): warp per row, optional split-K
# ============================================================================================
#
# Q8_0 lane map: lane = 4*g + t. A warp step covers 8 consecutive blocks; group g takes block
# 8*step + g and lane t its bytes 8t..8t+7 (two dp4a). The 4 lanes of a group sum their integer
# partials (exact), then each lane accumulates (d_w*d_x)*isum for its group's blocks in f32.
# At the end a butterfly over the groups (lane xor 16, 8, 4) gives the warp's sum. With S warps
# per row (split-K for short grids) warp w takes steps w, w+S, ... and the S partials are added in
# warp order through shared memory.

_NW_DENSE = 8      # warps per block in the dense kernels


def _rows_per_block(S):
    """Rows (or row groups) per block of a dense kernel with S warps per row: a block of
    _NW_DENSE warps must hold whole rows (_dense_split goes up to 8 warps per row)."""
    if _NW_DENSE % S:
        raise ValueError(f"_NW_DENSE = {_NW_DENSE} warps per block cannot hold rows of {S} warps: "
                         f"use a multiple of 8")
    return _NW_DENSE // S


def _dense_split(rows, chunks):
    """Warps per row (a pure function of the shape, so matmul and matvec agree, and the CPU twins
    follow it: kernels/orders.py)."""
    return orders.dense_split(rows, chunks)



def _make_finish(S, T):
    """Write the row results: directly (S == 1) or after adding the S warp partials in order."""

    @_inline
    def finish(part, acc, warp, lane, w, row, rows, tok0, n_tok, out, out_ld):
        if S == 1:
            if lane == 0 and row < rows:
                for tt in range(T):
                    if tok0 + tt < n_tok:
                        out[(tok0 + tt) * out_ld + row] = acc[tt]
        else:
            if lane == 0:
                for tt in range(T):
                    part[warp, tt] = acc[tt]
            cuda.syncthreads()
            if w == 0 and lane == 0 and row < rows:
                for tt in range(T):
                    if tok0 + tt < n_tok:
                        s = part[warp, tt]
                        for k in range(1, S):
                            s += part[warp + k, tt]
                        out[(tok0 + tt) * out_ld + row] = s

    return finish


_KERNELS = {}


def _cached(factory, *args):
    """factory(*args), built once per process (kept in _KERNELS: precompile.built_once)."""
    return built_once(_KERNELS, factory, *args)


_Q8_0_U = orders.Q8_0_U    # steps (of 8 blocks) whose weights a warp loads before it uses the first
# From this many rows on a Q8_0 launch gives each row one warp. Measured on the H200 (kbench
# tune_split, session 21): at 4096 rows (out_b K8192, shared gate+up, shared down) one warp per
# row beats two by 12-17 % in decode and 20-28 % in prefill; the U=4 loads in flight per lane
# already hide the latency that the second warp was there to cover. Below it (q_a+kv, 1536 rows)
# the dense split still spreads a row over warps to fill the SMs.
_Q8_0_S1_ROWS = orders.Q8_0_S1_ROWS


def _q8_0_work(rows, nb):
    """(S warps per row, U steps per chunk, chunks per row) of a Q8_0 launch of `rows` rows of nb
    blocks. A pure function of the shape: it fixes the order in which a row's blocks are added, so
    matvec, dp4a matmul and tensor-core matmul of one shape give the same bits (and the CPU twin,
    with the default knobs: kernels/orders.py)."""
    return orders.q8_0_order(rows, nb, _Q8_0_U, _Q8_0_S1_ROWS)


def _make_q8_0_chunk(T, U, scales_last=False):
    """U warp steps of a Q8_0 row for T tokens. All U steps' weight words are loaded first, so
    each lane has U*5 independent loads in flight (decode is latency-bound without that).
    scales_last: the row is in q8_0_relayout's layout and `a` is the arena's uint32 view: a lane's
    8 quant bytes are one aligned 8-byte load and d one 16-bit load (2 loads per step, not 5),
    the same words. Returns (load_fn, dot_fn): the chunk's weight loads into q0, q1, wd (arrays
    of U), then its dots with x."""

    @_inline
    def load_fn(a, hrow, step0, g, t, nb, q0, q1, wd):
        for u in range(U):
            b = (step0 + u) * 8 + g
            q0[u] = uint32(0)
            q1[u] = uint32(0)
            wd[u] = float32(0.0)
            if b < nb:
                if scales_last:
                    wd[u] = f16_bits_to_f32(ld_half(a, _ix(hrow + 16 * nb + b)))
                    w0, w1 = ld_pair(a, _ix((hrow >> 1) + 8 * b + 2 * t))
                    q0[u] = w0
                    q1[u] = w1
                else:
                    hb = hrow + 17 * b
                    wd[u] = f16_bits_to_f32(a[_ix(hb)])
                    q0[u] = _u16pair(a, hb + 1 + 4 * t)
                    q1[u] = _u16pair(a, hb + 3 + 4 * t)

    @_inline
    def dot_fn(step0, g, t, nb, xq64, xd, tok0, n_tok, q0, q1, wd, acc):
        for tt in range(T):
            tok = tok0 + tt
            if T == 1 or tok < n_tok:          # warp-uniform
                for u in range(U):
                    b = (step0 + u) * 8 + g
                    valid = b < nb
                    xv = int64(0)
                    xs = float32(0.0)
                    if valid:
                        xv = xq64[_ix(tok * (nb * 4) + b * 4 + t)]
                        xs = xd[_ix(tok * nb + b)]
                    isum = dp4a(q0[u], int32(xv & 0xFFFFFFFF), 0)
                    isum = dp4a(q1[u], int32(xv >> 32), isum)
                    isum = int32(isum + cuda.shfl_xor_sync(FULL_MASK, isum, 1))
                    isum = int32(isum + cuda.shfl_xor_sync(FULL_MASK, isum, 2))
                    if valid:
                        acc[tt] = cuda.fma(wd[u] * xs, float32(isum), acc[tt])

    return load_fn, dot_fn


_Q8_0_PRE = True  # q8_0_rows loads each warp's first chunk of weights before pdl_enter(): the weights
                  # never change while a graph replays, so they may be read before the grids this
                  # one waits for have finished, and their latency hides behind them (decode_ab on
                  # the H200, flash at 2k: 7.90 / 7.84 -> 7.76 / 7.76 ms per step, the same logits;
                  # in split-K launches only: 7.89 / 7.84; as L2 prefetches instead: 24.3)


def _q8_0_kernel(S, T, U=_Q8_0_U, scales_last=False, PRE=False):
    """Q8_0 rows for T tokens per block row, S warps per row (split-K). nchunks (chunks of U
    steps per row) comes from the host, and x_tok needs a division only for grouped launches:
    the per-warp set-up was ~half of q_b's instructions (ncu: 354 per row of 1,024 weights;
    kbench on the H200, q_b 16.5 -> 14.6 us without it). PRE: see _Q8_0_PRE (the same bits)."""
    NWD = _NW_DENSE   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    RPB = _rows_per_block(S)   # rows per block
    finish = _make_finish(S, T)
    load_fn, dot_fn = _make_q8_0_chunk(T, U, scales_last)

    @_jit_capped(0)
    def q8_0_rows(a16, row_h0, row_h, rows, nb, nchunks, xq64, xd, n_tok, out, out_ld, row_h0_b,
                  rows_a, x_group_rows, hc_on, hc_state, hc_fb, hc_post, hc_comb):
        if not PRE:
            pdl_enter()
        part = cuda.shared.array((NWD, T), float32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        w = warp % S
        row = cuda.blockIdx.x * RPB + warp // S
        tok0 = cuda.blockIdx.y * T
        acc = cuda.local.array(T, float32)
        for tt in range(T):
            acc[tt] = float32(0.0)
        q0 = cuda.local.array(U, uint32)
        q1 = cuda.local.array(U, uint32)
        wd = cuda.local.array(U, float32)
        # rows past rows_a belong to a second matrix (two matrices, one launch)
        hrow = _pair_row(row, rows_a, row_h0, row_h0_b, row_h)
        if PRE:
            if row < rows and w < nchunks:  # warp-uniform: the warp's first chunk (weights only)
                load_fn(a16, hrow, w * U, g, t, nb, q0, q1, wd)
            pdl_enter()                     # everything below may read what earlier grids wrote
        if row < rows:                      # warp-uniform
            # with x_group_rows < rows (decode only), row group k reads the k-th slice of x
            x_tok = tok0 + row // x_group_rows if x_group_rows < rows else tok0
            # chunks of U steps go round-robin to the S warps of the row; every lane adds its
            # group's blocks in increasing order
            for c in range(w, nchunks, S):
                if not PRE or c != w:
                    load_fn(a16, hrow, c * U, g, t, nb, q0, q1, wd)
                dot_fn(c * U, g, t, nb, xq64, xd, x_tok, n_tok, q0, q1, wd, acc)
        for tt in range(T):
            v = acc[tt]
            v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
            v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
            v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
            acc[tt] = v
        finish(part, acc, warp, lane, w, row, rows, tok0, n_tok, out, out_ld)
        if hc_on and w == 0 and lane == 0 and row < rows:     # one token: the HC post of dim `row`
            hc_post_dim(hc_state, row, out[row] + hc_fb[row], hc_post, hc_comb)

    return q8_0_rows


_Q8_0_PAIRS = True   # one-token, one-warp-per-row launches on scales-last rows take q8_0_pairs
                     # (H200, session 25, kbench: q_b 15.4 -> 13.5 us, out_a 14.7 -> 12.3, out_b
                     # 14.8 -> 12.2, head 143 -> 132; decode_ab 7.47 -> 7.15 ms per step)
_Q8_0_PAIRS_U = 2    # its steps (of 16 blocks) whose weights a lane loads before it uses the first
                     # (decode_ab: U 1 7.55 ms, 2 7.11-7.18, 3 7.24-7.28, 4 7.32-7.35; kbench alone
                     # favours 3 on out_a / out_b, 11.6 against 12.3 us)
_Q8_0_PAIRS_REGS = 0  # its register cap (0: none; 40 spills 16 bytes at U 2: 7.37-7.39 ms)
_Q8_0_PAIRS_ONE = True  # rows of one chunk (nsteps <= U: q_b, K 1024) get a kernel without the chunk
                        # loop (ptxas sm_90 at U 2: 32 registers instead of 48, 64 warps per SM;
                        # H200, session 25: q_b 13.35 -> 11.6 us, decode_ab 7.07 -> 6.99 ms per step)


def _q8_0_pairs_kernel(U=_Q8_0_PAIRS_U, PRE=False, max_regs=0, ONE=False):
    """q8_0_rows for one token and one warp per row (S = 1), on scales-last rows, with half its
    instructions per weight byte: two lanes per block (16 quant bytes each, one 16-byte load; four
    dp4a and one shuffle give the block's integer dot), so a warp step covers 16 blocks, not 8.
    The f32 sums are q8_0_rows' in q8_0_rows' order, so both give the same bits (and so does the
    prefill matmul of the shape): with S = 1, lane group g of q8_0_rows adds the blocks b = g
    (mod 8) in increasing order; here the lane pair of slot j < 8 carries group j's sum (block
    16 s + j of step s, then block 16 s + j + 8, received from slot j + 8, i.e. lane + 16), and
    the butterfly over the groups runs over lane pairs (xor 8, 4, 2 instead of 16, 8, 4).
    nsteps = ceil(nb / 16) steps per row, nchunks = ceil(nsteps / U) chunks; ONE: nchunks is 1
    (a compile-time constant: no chunk loop)."""
    NWD = _NW_DENSE   # closure constants, not globals, in the kernel: see _CACHE_KERNELS

    @_inline
    def quad_into(dst, u, src, i, valid):
        """dst[u, 0:4] = the 4 words src[i:i + 4] (one 16-byte load), or zeros."""
        for k in range(4):
            dst[u, k] = 0
        if valid:
            dst[u, 0], dst[u, 1], dst[u, 2], dst[u, 3] = ld_quad(src, _ix(i))

    @_inline
    def load_fn(a32, hrow, step0, slot, h, nb, q, wd):
        for u in range(U):
            b = (step0 + u) * 16 + slot
            quad_into(q, u, a32, (hrow >> 1) + 8 * b + 4 * h, b < nb)
            wd[u] = f16_bits_to_f32(ld_half(a32, _ix(hrow + 16 * nb + b))) if b < nb else float32(0.0)

    @_inline
    def dot_fn(step0, slot, h, nb, xq32, xd, x_tok, q, wd, xw, xs, acc):
        # every step's activation words first: x is in L2, but one load per step, each used
        # at once, would add U round trips to the warp's life
        for u in range(U):
            b = (step0 + u) * 16 + slot
            quad_into(xw, u, xq32, x_tok * (nb * 8) + b * 8 + 4 * h, b < nb)
            xs[u] = xd[_ix(x_tok * nb + b)] if b < nb else float32(0.0)
        for u in range(U):
            b = (step0 + u) * 16 + slot
            scale = wd[u] * xs[u]
            isum = dp4a(q[u, 0], xw[u, 0], 0)
            isum = dp4a(q[u, 1], xw[u, 1], isum)
            isum = dp4a(q[u, 2], xw[u, 2], isum)
            isum = dp4a(q[u, 3], xw[u, 3], isum)
            isum = int32(isum + cuda.shfl_xor_sync(FULL_MASK, isum, 1))
            fsum = float32(isum)
            scale_hi = cuda.shfl_xor_sync(FULL_MASK, scale, 16)      # block b + 8 (slots 0-7)
            fsum_hi = cuda.shfl_xor_sync(FULL_MASK, fsum, 16)
            if b < nb:
                acc = cuda.fma(scale, fsum, acc)
            if b + 8 < nb:
                acc = cuda.fma(scale_hi, fsum_hi, acc)
        return acc

    @_jit_capped(max_regs)
    def q8_0_pairs(a32, row_h0, row_h, rows, nb, nchunks, xq32, xd, out, row_h0_b, rows_a,
                   x_group_rows, hc_on, hc_state, hc_fb, hc_post, hc_comb):
        if not PRE:
            pdl_enter()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        slot = lane >> 1
        h = lane & 1
        row = cuda.blockIdx.x * NWD + warp
        q = cuda.local.array((U, 4), uint32)
        wd = cuda.local.array(U, float32)
        xw = cuda.local.array((U, 4), int32)
        xs = cuda.local.array(U, float32)
        hrow = _pair_row(row, rows_a, row_h0, row_h0_b, row_h)
        if PRE:
            if row < rows:                  # warp-uniform: the first chunk (weights only)
                load_fn(a32, hrow, 0, slot, h, nb, q, wd)
            pdl_enter()                     # everything below may read what earlier grids wrote
        acc = float32(0.0)
        if row < rows:                      # warp-uniform
            x_tok = row // x_group_rows if x_group_rows < rows else 0
            for c in range(1 if ONE else nchunks):
                if not PRE or c != 0:
                    load_fn(a32, hrow, c * U, slot, h, nb, q, wd)
                acc = dot_fn(c * U, slot, h, nb, xq32, xd, x_tok, q, wd, xw, xs, acc)
        acc += cuda.shfl_xor_sync(FULL_MASK, acc, 8)
        acc += cuda.shfl_xor_sync(FULL_MASK, acc, 4)
        acc += cuda.shfl_xor_sync(FULL_MASK, acc, 2)
        if lane == 0 and row < rows:
            out[row] = acc
            if hc_on:                       # the HC post of dim `row`
                hc_post_dim(hc_state, row, acc + hc_fb[row], hc_post, hc_comb)

    return q8_0_pairs


# ---- Q8_0 matmul on the int8 tensor cores (prefill) --------------------------------------------
#
# K = 32 is one Q8_0 block, so one mma.m16n8k32 gives the exact integer block dots of 16 rows x 8
# tokens. The f32 side then replays the dp4a kernel's order for every (row, token): in warp w of
# the S warps of a row (split-K), lane group g of 8 adds (d_w·d_x)·isum of blocks b = g (mod 8) in
# increasing order (chunks of U steps of 8 blocks, round-robin over the S warps); the 8 group sums
# meet in the butterfly ((g0 + g4) + (g2 + g6)) + ((g1 + g5) + (g3 + g7)); the S warp sums are added
# in warp order. Here a block of 8 warps takes 16 rows x 32 tokens (4 MMAs per block b share the
# A fragment); warp g takes lane group g (blocks b = g mod 8), keeps one sum per output, and the 8
# warps meet in the butterfly through shared memory; warp 0 adds the result to `out` in warp-split
# order: every output equals the dp4a matmul and matvec bit for bit. (A single warp walking the 8
# groups needed 5 live sums per output, 168 registers, and ran 1.2x slower on the H200.)
#
# k order inside an MMA: the 32 products of one MMA are summed exactly, so the kernels may feed the
# 32 k-slots in any order as long as A and B agree. PTX gives lane tig the k-slots 4 tig .. + 3
# (registers a0/a1, b0) and 16 + 4 tig .. + 3 (a2/a3, b1); the tensor-core kernels here put the
# weights and activations 8 tig .. 8 tig + 7 there instead, so a lane's B pair is one 8-byte
# load and its A pair comes from 8 contiguous weight bytes (one IQ2 grid entry, one Q2_K scale).

_MMA_WARPS = 4       # warps per block in the MoE tensor-core kernels, 16 rows each
_MMA_NT = 4          # MMAs of 8 tokens per warp tile (32 tokens)
_MMA_MIN_TOKENS = 16  # fewer tokens: the dp4a kernel (the MMA tile would be mostly padding)
_USE_MMA = True       # the engine's prefill matmuls (test_q8_0_mma_matches_matvec passed on the
                      # H200; 4096->2048 x 2048 tokens: 5.18 ms dp4a -> 1.29 ms)
_MMA_G_WARPS = 8      # warps per block of the Q8_0 kernel: one per lane group
_MMA_G_REGS = 80      # its register cap: 3 blocks per SM (H200, 4096->2048 x 2048 tokens: none 1.93 ms,
                      # 96: 1.30, 80: 1.10, 64: 1.11)


def _q8_0_mma_kernel(S, U, max_regs=_MMA_G_REGS):
    NT = _MMA_NT   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    NE = 4 * NT
    SC = 4 * NE * 32

    @_inline
    def meet(acc, comb, warp, lane, src_lo, n_src):
        """Warps src_lo .. src_lo + n_src - 1 hand their sums over; warps 0 .. n_src - 1 add them."""
        cuda.syncthreads()
        if warp >= src_lo and warp < src_lo + n_src:
            for i in range(NE):
                comb[((warp - src_lo) * NE + i) * 32 + lane] = acc[i]
        cuda.syncthreads()
        if warp < n_src:
            for i in range(NE):
                acc[i] = acc[i] + comb[(warp * NE + i) * 32 + lane]

    jit = _jit_capped(max_regs)

    @jit
    def q8_0_rows_mma(a16, row_h0, row_h, rows, nb, xq64, xd, n_tok, out, out_ld, row_h0_b, rows_a):
        pdl_enter()
        comb = cuda.shared.array(SC, float32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        gid = lane >> 2
        tig = lane & 3
        g = warp
        row0 = cuda.blockIdx.x * 16
        tok0 = cuda.blockIdx.y * (8 * NT)
        r_lo = min(row0 + gid, rows - 1)              # a short last tile repeats a row
        r_hi = min(row0 + gid + 8, rows - 1)
        h_lo = _pair_row(r_lo, rows_a, row_h0, row_h0_b, row_h)
        h_hi = _pair_row(r_hi, rows_a, row_h0, row_h0_b, row_h)
        words = 4 * nb                                # int64 words per token of xq
        nchunks = ((nb + 7) // 8 + U - 1) // U
        acc = cuda.local.array(NE, float32)
        for w in range(S):
            for e in range(NE):
                acc[e] = float32(0.0)
            for c in range(w, nchunks, S):
                for u in range(U):
                    b = (c * U + u) * 8 + g
                    if b < nb:                        # warp-uniform
                        hb_lo = h_lo + 17 * b
                        hb_hi = h_hi + 17 * b
                        # k order (see above): lane tig takes weights and activations 8 tig .. + 7
                        a0 = _u16pair(a16, hb_lo + 1 + 4 * tig)
                        a1 = _u16pair(a16, hb_hi + 1 + 4 * tig)
                        a2 = _u16pair(a16, hb_lo + 3 + 4 * tig)
                        a3 = _u16pair(a16, hb_hi + 3 + 4 * tig)
                        wd_lo = f16_bits_to_f32(a16[_ix(hb_lo)])
                        wd_hi = f16_bits_to_f32(a16[_ix(hb_hi)])
                        for nt in range(NT):
                            tb = min(tok0 + 8 * nt + gid, n_tok - 1)
                            bx = xq64[_ix(tb * words + 4 * b + tig)]
                            c0, c1, c2, c3 = mma_s8(a0, a1, a2, a3, bx, bx >> 32)
                            t0 = min(tok0 + 8 * nt + 2 * tig, n_tok - 1)
                            t1 = min(tok0 + 8 * nt + 2 * tig + 1, n_tok - 1)
                            xs0 = xd[_ix(t0 * nb + b)]
                            xs1 = xd[_ix(t1 * nb + b)]
                            e = 4 * nt
                            acc[e] = cuda.fma(wd_lo * xs0, float32(c0), acc[e])
                            acc[e + 1] = cuda.fma(wd_lo * xs1, float32(c1), acc[e + 1])
                            acc[e + 2] = cuda.fma(wd_hi * xs0, float32(c2), acc[e + 2])
                            acc[e + 3] = cuda.fma(wd_hi * xs1, float32(c3), acc[e + 3])
            meet(acc, comb, warp, lane, 4, 4)         # g + (g + 4)
            meet(acc, comb, warp, lane, 2, 2)         # (g0 + g4) + (g2 + g6), (g1 + g5) + (g3 + g7)
            meet(acc, comb, warp, lane, 1, 1)         # left + right
            if warp == 0:
                for nt in range(NT):
                    for k in range(4):
                        row = row0 + gid + 8 * (k >> 1)
                        tok = tok0 + 8 * nt + 2 * tig + (k & 1)
                        if row < rows and tok < n_tok:
                            o = _ix(tok * out_ld + row)
                            v = acc[4 * nt + k]
                            out[o] = v if w == 0 else out[o] + v     # the warp-split order

    return q8_0_rows_mma


# ---- Q8_0 matmul on the tensor cores through shared memory (prefill) ----------------------------
#
# The kernel above reads every A and B fragment straight from global memory: 16-bit weight loads
# from 8 rows 34 bytes apart, the activations 8 tokens apart, a scale load per (row, block) and per
# (token, block); ncu (H200, 4096->2048 x 2048 tokens) counted ~100 instructions per MMA at 1.9
# IPC. This one stages each step of 8 blocks (272 bytes of each of 32 rows, 256 bytes and 8 scales
# of each of 32 tokens) in shared memory with coalesced 8-byte loads, the next step's loads in
# flight in registers while the warps compute the current one; each warp covers the 32 x 32 tile
# for its lane group (8 MMAs per staged step: every A fragment feeds 4 token tiles, every B
# fragment 2 row tiles), shared-memory indices are unsigned (numba's negative-index wraparound
# was ~5 instructions per access) and the weight words come from two funnel shifts, no branch.
# kbench (session 12): 4096->2048 x 2048 1.175 -> 0.78 ms, 1024->32768 x 512 0.835 -> 0.634,
# 8192->4096 x 512 0.854 -> 0.573, 4096->1536 x 512 0.29 -> 0.23. Tiles of 64 x 16 and 64 x 32
# and other register caps were slower or spilled (tune_prefill).
# The f32 arithmetic per output is the kernel above's (warp g adds lane group g's blocks in the
# same order, the same butterfly, the same split-K order), so the outputs are the same bits.
#
# Integer to float: the block dots are < 2^22 in magnitude (32 x 128 x 127), so float(c) is
# (bits(1.5 x 2^23) + c read as a float) - 1.5 x 2^23, two full-rate instructions instead of an
# I2F at a quarter of the rate (4 conversions per MMA per lane would cap the kernel below the
# tensor cores otherwise). Exact, so the same bits.

_MMA_ST_ROWS = 32     # rows per block tile (2 MMA row tiles of 16)
_MMA_ST_TOKS = 32     # tokens per block tile (4 MMA token tiles of 8)
_MMA_ST_REGS = 128    # register cap: two blocks of 256 threads per SM
_MMA_ST_PREFETCH = True   # the next step's loads in flight during the MMAs (else after them)
_MMA_ST_PAD = 36      # uint64 words per staged row (34 or 32 used): the 16 lanes of a half-warp's
                      # 8-byte fragment loads (4 rows x 4 lanes) fall on distinct banks
_MMA_STAGED = True    # the engine's Q8_0 prefill matmuls use this kernel where it applies
_MAGIC = 0x4B400000   # bits of 1.5 x 2^23
_MAGIC_F = 12582912.0
# The tensor core adds the magic bits itself: C = bits(1.5 x 2^23) in every accumulator, so each
# result is already c + bits(1.5 x 2^23) (|c| < 2^22: no int32 overflow, the same int32 value as
# the VIADD after a C = 0 MMA) and only the FADD remains: the same bits, 4 VIADDs fewer per MMA.
_MMA_ST_MAGIC_C = True
# The lean cp.async staging: 16-byte cp.async copies straight into a second set of staging
# buffers (double-buffered shared memory, 47.6 KB a block: no registers in flight, no STS); lane l
# copies chunks l % 8, + 8, + 16 of staged row l // 8 (tokens alike), so a lane's copies are one
# shared and one global base plus immediates (the shared offsets reach the copy as an immediate
# operand: LLVM had hoisted one 64-bit address per copy and buffer, and ptxas spilled them); the
# activation scales block-major (a lane's token pair in one 8-byte load), the weight scales as
# 16-bit loads, token tiles outermost, and with _MMA_ST_MAGIC_C the magic C words read once from
# shared memory (ptxas re-created the constant in the C registers before every MMA). The same
# bytes staged in the same places, the same products and sums: the same bits. Needs 16-byte
# aligned weight offsets and activation rows (the launch falls back to the 8-byte loads
# otherwise). ptxas sm_90 at cap 128, main loop per MMA with magic C: 24.0 instructions, no
# spills (the 8-byte loads: ~40, 52 B of spills). H200, session 16, 2,048-token prefill of the
# flash preset: 2,305 -> 2,581 tok/s with it and magic C. Two variants lost and were removed:
# 16-byte loads into registers (with magic C 1,986-2,001 tok/s against cp.async's 2,080-2,107,
# from 1,892-1,915), and cp.async with one copy per chunk i = lane + 32 j (28.9 instructions per
# MMA and 84 B of spills against 24.0 and none).
_MMA_ST_CPASYNC = True


@_inline
def _magic_float(c):
    """float32(c') for the int32 c' = c + bits(1.5 x 2^23) (|c| < 2^22): c exactly."""
    return libdevice.int_as_float(int32(c)) - float32(_MAGIC_F)


@_inline
def _exact_float(c):
    """float32(c) for |c| < 2^22, without an I2F (see above)."""
    return libdevice.int_as_float(int32(c + _MAGIC)) - float32(_MAGIC_F)


def _q8_0_mma_staged_kernel(S, U, prefetch=_MMA_ST_PREFETCH, max_regs=_MMA_ST_REGS,
                            MT=_MMA_ST_ROWS // 16, NT=_MMA_ST_TOKS // 8, magic_c=_MMA_ST_MAGIC_C,
                            cpa=_MMA_ST_CPASYNC, scales_last=False):
    """scales_last: the rows are in q8_0_relayout's layout. A step's 256 quant bytes and its 8
    scales (16 bytes) are staged in the same 272 bytes of shared memory, quants first: the A
    fragments are then aligned words (no funnel shift) and the scales the step's last 16 bytes.
    The same bytes reach the same MMAs and sums: the same bits."""
    ROWS = 16 * MT                   # rows and tokens of the block tile
    TOKS = 8 * NT
    NE = 4 * MT * NT                 # sums per lane: (row tile, token tile, 4 MMA results)
    HALF = NE // 2                   # the warps meet in two halves (16 KB of shared memory each)
    P = _MMA_ST_PAD
    NTH = _MMA_G_WARPS * WARP
    RPW = ROWS // 8                  # staged rows per warp (34 words each)
    TPW = TOKS // 8                  # staged tokens per warp (32 words each)
    A_PER = RPW + 1
    B_PER = TPW
    XD_N = TOKS * 8                  # activation scales of one step (at most one per thread)
    NT2 = 2 * NT
    P32 = 2 * P                      # 32-bit words per staged weight row
    SA_N = ROWS * P32
    SB_N = TOKS * P
    SXD_N = TOKS * 9
    COMB_N = 4 * HALF * 32
    NBUF = 2 if cpa else 1              # cp.async: the next step lands in the other buffer
    SA_T, SB_T, SXD_T = NBUF * SA_N, NBUF * SB_N, NBUF * SXD_N
    assert _MMA_G_WARPS == 8 and XD_N <= NTH and 2 * RPW <= WARP
    # cpa: lane l copies chunks l % LPR, + LPR, ... of staged row l // LPR (tokens alike, LPT
    # lanes a token), so a lane's chunks of one step are one base plus constants: one global and
    # one shared index a lane for the weights, the same for the activations
    LPR = WARP // RPW                        # lanes per staged row
    L_AJ = (17 + LPR - 1) // LPR             # weight chunks a lane (the last one: lanes < L_ALAST)
    L_ALAST = 17 - LPR * (L_AJ - 1)
    LPT = WARP // TPW                        # lanes per staged token
    L_BJ = 16 // LPT
    assert not cpa or (WARP % RPW == 0 and WARP % TPW == 0 and 16 % LPT == 0)
    # cpa: the activation scales block-major (scale g of token t at g XS_P + t), so a lane's two
    # tokens' scales are one 8-byte load (XS_P = TOKS + 4: the copies of a warp on distinct banks)
    XS_P = TOKS + 4
    AF_N, WD_N = 4 * MT, 2 * MT              # cpa: a lane's A fragments and weight scales
    SM_AL = 16 if cpa else None              # cpa: the staging aligned for its 16- and 8-byte accesses
    if cpa:
        SXD_N = 8 * XS_P
        SXD_T = NBUF * SXD_N

    @_inline
    def lean_bases(rbase, warp, lane, tid, tok0, n_tok, nb, abase, sa_o, bbase, sb_o, dpos):
        """Per-lane loop invariants of issue_lean: the global index of its first chunk at step 0
        (int64 weights, uint32 activations) and its shared-memory index; chunk j of a lane is at
        + j LPR chunks."""
        m = lane // LPR
        q = lane % LPR
        abase[0] = rbase[_ix(warp + 8 * m)] + 2 * q
        abase[1] = rbase[_ix(warp + 8 * m)] + 4 * nb          # scales_last: the row's scales
        sa_o[0] = uint32((warp + 8 * m) * P32 + 4 * q)
        m = lane // LPT
        q = lane % LPT
        tok = min(tok0 + warp + 8 * m, n_tok - 1)
        bbase[0] = uint32(tok * (4 * nb) + 2 * q)
        sb_o[0] = uint32((warp + 8 * m) * P + 2 * q)
        tok = min(tok0 + (tid >> 3), n_tok - 1)
        dpos[0] = uint32(tok * nb + (tid & 7))
        dpos[1] = uint32((tid & 7) * XS_P + (tid >> 3))

    @_inline
    def issue_lean(sa, sb, sxd, a64, xq64, xd, st, lane, tid, abase, sa_o, bbase, sb_o, dpos, buf):
        """Step st's chunks as asynchronous copies into staging buffer buf (lean_bases)."""
        ga = abase[0] + int64(32 if scales_last else 34) * int64(st)
        for j in range(L_AJ):
            if j < L_AJ - 1 or L_ALAST == LPR or lane % LPR < L_ALAST:
                if scales_last and j == L_AJ - 1 and lane % LPR == L_ALAST - 1:   # chunk 16: the scales
                    cp_async16_at(sa, sa_o[0], buf * SA_N + 4 * LPR * j, a64, abase[1] + int64(2) * int64(st),
                                  uint32(0))
                else:
                    cp_async16_at(sa, sa_o[0], buf * SA_N + 4 * LPR * j, a64, ga, uint32(2 * LPR * j))
        gb = uint32(bbase[0] + uint32(32 * st))
        for j in range(L_BJ):
            cp_async16_at(sb, sb_o[0], buf * SB_N + 2 * LPT * j, xq64, gb, uint32(2 * LPT * j))
        if XD_N == NTH or tid < XD_N:
            cp_async4_at(sxd, dpos[1], buf * SXD_N, xd, 0, uint32(dpos[0] + uint32(8 * st)))

    @_inline
    def load_step(a64, rbase, xq64, xd, st, tok0, n_tok, nb, warp, lane, tid, pa, pb, pd):
        """Step st's tiles into registers: warp w takes rows w, w + 8, ... (lane l the row's
        8-byte word l; words 32 and 33 of the warp's rows in one more load, two lanes a row) and
        tokens w, w + 8, ... (256 bytes, word l); thread t one activation scale."""
        for m in range(RPW):
            pa[m] = a64[_ix(rbase[_ix(warp + 8 * m)] + (32 if scales_last else 34) * st + lane)]
        if lane < 2 * RPW:
            r = rbase[_ix(warp + 8 * (lane >> 1))]
            if scales_last:
                pa[RPW] = a64[_ix(r + 4 * nb + 2 * st + (lane & 1))]
            else:
                pa[RPW] = a64[_ix(r + 34 * st + 32 + (lane & 1))]
        for m in range(TPW):
            tok = min(tok0 + warp + 8 * m, n_tok - 1)
            pb[m] = xq64[_ix(tok * (4 * nb) + 32 * st + lane)]
        if tid < XD_N:
            tok = min(tok0 + (tid >> 3), n_tok - 1)
            pd[0] = xd[_ix(tok * nb + 8 * st + (tid & 7))]

    @_inline
    def store_step(sa, sb, sxd, warp, lane, tid, pa, pb, pd):
        """The registers of load_step into shared memory: weight rows as 32-bit words (the
        fragments are read at 2-byte offsets), activation rows as 8-byte words."""
        for m in range(RPW):
            o = _ix((warp + 8 * m) * P32 + 2 * lane)
            sa[o] = uint32(pa[m] & _M32)
            sa[o + 1] = uint32(pa[m] >> uint64(32))
        if lane < 2 * RPW:
            o = _ix((warp + 8 * (lane >> 1)) * P32 + 64 + 2 * (lane & 1))
            sa[o] = uint32(pa[RPW] & _M32)
            sa[o + 1] = uint32(pa[RPW] >> uint64(32))
        for m in range(TPW):
            sb[_ix((warp + 8 * m) * P + lane)] = pb[m]
        if tid < XD_N:
            sxd[_ix((tid >> 3) * 9 + (tid & 7))] = pd[0]

    @_inline
    def frag(sa, o, sh):
        """The 8 weight bytes at 32-bit word o of the staged rows shifted right by sh bits (0 or
        16: the quants of a block start 2 bytes into a word for even g): (low word, high word)."""
        x0 = sa[_ix(o)]
        x1 = sa[_ix(o + 1)]
        if scales_last:                 # the quants start on a word
            return x0, x1
        x2 = sa[_ix(o + 2)]
        return funnel_r(x0, x1, sh), funnel_r(x1, x2, sh)

    @_inline
    def meet(acc, comb, warp, lane, src_lo, n_src, e0):
        """acc[e0 .. e0 + HALF) of warps src_lo .. src_lo + n_src - 1 are added to warps 0 ..."""
        cuda.syncthreads()
        if warp >= src_lo and warp < src_lo + n_src:
            for i in range(HALF):
                comb[_ix(((warp - src_lo) * HALF + i) * 32 + lane)] = acc[e0 + i]
        cuda.syncthreads()
        if warp < n_src:
            for i in range(HALF):
                acc[e0 + i] = acc[e0 + i] + comb[_ix((warp * HALF + i) * 32 + lane)]

    @_inline
    def write_half(acc, e0, out, out_ld, row0, tok0, gid, tig, rows, n_tok, w):
        """Sums e0 .. e0 + HALF - 1 into `out` (sum e = 4 (row tile x NT + token tile) + k; one
        flat loop of HALF, as in meet: nested loops were left rolled, acc then lived in memory)."""
        for i in range(HALF):
            e = e0 + i
            row = row0 + 16 * (e // (4 * NT)) + gid + 8 * ((e & 3) >> 1)
            tok = tok0 + 8 * ((e >> 2) % NT) + 2 * tig + (e & 1)
            if row < rows and tok < n_tok:
                o = _ix(tok * out_ld + row)
                out[o] = acc[e] if w == 0 else out[o] + acc[e]     # the warp-split order

    @_inline
    def mma_step(sa, sb, sxd, acc, gid, tig, g, q_word, sh, d_word, d_sh, buf):
        """The staged step's 4 MT NT MMAs of this warp (staging buffer buf) and their sums into
        acc."""
        bx = cuda.local.array(NT, uint64)
        xs = cuda.local.array(NT2, float32)
        for nt in range(NT):
            bx[nt] = sb[_ix(buf * SB_N + (8 * nt + gid) * P + 4 * g + tig)]
            xs[2 * nt] = sxd[_ix(buf * SXD_N + (8 * nt + 2 * tig) * 9 + g)]
            xs[2 * nt + 1] = sxd[_ix(buf * SXD_N + (8 * nt + 2 * tig + 1) * 9 + g)]
        for mt in range(MT):
            r_lo = buf * SA_N + (16 * mt + gid) * P32
            r_hi = r_lo + 8 * P32
            a0, a2 = frag(sa, r_lo + q_word + 2 * tig, sh)
            a1, a3 = frag(sa, r_hi + q_word + 2 * tig, sh)
            wd_lo = f16_bits_to_f32((sa[_ix(r_lo + d_word)] >> uint32(d_sh)) & _M16)
            wd_hi = f16_bits_to_f32((sa[_ix(r_hi + d_word)] >> uint32(d_sh)) & _M16)
            for nt in range(NT):
                e = 4 * (mt * NT + nt)
                if magic_c:
                    m = int32(_MAGIC)
                    c0, c1, c2, c3 = mma_s8_acc(a0, a1, a2, a3, bx[nt], bx[nt] >> uint64(32),
                                                m, m, m, m)
                    f0, f1, f2, f3 = _magic_float(c0), _magic_float(c1), _magic_float(c2), _magic_float(c3)
                else:
                    c0, c1, c2, c3 = mma_s8(a0, a1, a2, a3, bx[nt], bx[nt] >> uint64(32))
                    f0, f1, f2, f3 = _exact_float(c0), _exact_float(c1), _exact_float(c2), _exact_float(c3)
                acc[e] = cuda.fma(wd_lo * xs[2 * nt], f0, acc[e])
                acc[e + 1] = cuda.fma(wd_lo * xs[2 * nt + 1], f1, acc[e + 1])
                acc[e + 2] = cuda.fma(wd_hi * xs[2 * nt], f2, acc[e + 2])
                acc[e + 3] = cuda.fma(wd_hi * xs[2 * nt + 1], f3, acc[e + 3])

    @_inline
    def mma_step_lean(sa, sb, sxd, acc, gid, tig, g, q_word, sh, d_word, d_sh, buf, mg):
        """mma_step for the cp.async staging: the scales block-major (one 8-byte load a token pair),
        the weight scales as 16-bit loads, token tiles outermost (the 2 MT A fragments stay, one B
        fragment at a time), the magic C from the 4 registers mg (loaded once: ptxas cannot
        rematerialise them as 4 moves before each MMA). The same products and sums."""
        af = cuda.local.array(AF_N, uint32)
        wd = cuda.local.array(WD_N, float32)
        for mt in range(MT):
            r_lo = buf * SA_N + (16 * mt + gid) * P32
            r_hi = r_lo + 8 * P32
            af[4 * mt], af[4 * mt + 2] = frag(sa, r_lo + q_word + 2 * tig, sh)
            af[4 * mt + 1], af[4 * mt + 3] = frag(sa, r_hi + q_word + 2 * tig, sh)
            wd[2 * mt] = f16_bits_to_f32(ld_half(sa, 2 * (r_lo + d_word) + (d_sh >> 4)))
            wd[2 * mt + 1] = f16_bits_to_f32(ld_half(sa, 2 * (r_hi + d_word) + (d_sh >> 4)))
        for nt in range(NT):
            bx = sb[_ix(buf * SB_N + (8 * nt + gid) * P + 4 * g + tig)]
            xs0, xs1 = ld_pair(sxd, buf * SXD_N + g * XS_P + 8 * nt + 2 * tig)
            for mt in range(MT):
                e = 4 * (mt * NT + nt)
                a0, a1, a2, a3 = af[4 * mt], af[4 * mt + 1], af[4 * mt + 2], af[4 * mt + 3]
                wd_lo, wd_hi = wd[2 * mt], wd[2 * mt + 1]
                if magic_c:
                    c0, c1, c2, c3 = mma_s8_acc(a0, a1, a2, a3, bx, bx >> uint64(32),
                                                mg[0], mg[1], mg[2], mg[3])
                    f0, f1, f2, f3 = _magic_float(c0), _magic_float(c1), _magic_float(c2), _magic_float(c3)
                else:
                    c0, c1, c2, c3 = mma_s8(a0, a1, a2, a3, bx, bx >> uint64(32))
                    f0, f1, f2, f3 = _exact_float(c0), _exact_float(c1), _exact_float(c2), _exact_float(c3)
                acc[e] = cuda.fma(wd_lo * xs0, f0, acc[e])
                acc[e + 1] = cuda.fma(wd_lo * xs1, f1, acc[e + 1])
                acc[e + 2] = cuda.fma(wd_hi * xs0, f2, acc[e + 2])
                acc[e + 3] = cuda.fma(wd_hi * xs1, f3, acc[e + 3])

    @_inline
    def end_pass(acc, comb, warp, lane, out, out_ld, row0, tok0, gid, tig, rows, n_tok, w):
        """The end of split pass w: the warps meet, warp 0 writes (or adds), the sums restart."""
        meet(acc, comb, warp, lane, 4, 4, 0)       # g + (g + 4)
        meet(acc, comb, warp, lane, 2, 2, 0)       # (g0 + g4) + (g2 + g6), (g1 + g5) + (g3 + g7)
        meet(acc, comb, warp, lane, 1, 1, 0)       # left + right
        meet(acc, comb, warp, lane, 4, 4, HALF)    # the same for the second half
        meet(acc, comb, warp, lane, 2, 2, HALF)
        meet(acc, comb, warp, lane, 1, 1, HALF)
        if warp == 0:
            write_half(acc, 0, out, out_ld, row0, tok0, gid, tig, rows, n_tok, w)
            write_half(acc, HALF, out, out_ld, row0, tok0, gid, tig, rows, n_tok, w)
        for e in range(NE):
            acc[e] = float32(0.0)

    @_inline
    def cpa_step(sa, sb, sxd, a64, xq64, xd, lane, tid, abase, sa_o, bbase, sb_o, dpos, acc, comb,
                 warp, out, out_ld, row0, tok0, gid, tig, rows, n_tok, g, q_word, sh, d_word, d_sh,
                 nst, nch, w32, c32, u32, buf, mg):
        """One step of split pass w32 (chunk c32, step u32 of it) from staging buffer buf (a
        constant), the next step's copies into the other buffer; returns the next (w, c, u)."""
        wn32 = w32
        cn32 = c32
        un32 = uint32(u32 + 1)
        if un32 == U or uint32(cn32 * U + un32) >= nst:
            un32 = uint32(0)
            cn32 = uint32(c32 + S)
            if cn32 >= nch:
                wn32 = uint32(w32 + 1)
                cn32 = wn32
        if wn32 < S:                        # in flight while the MMAs run
            issue_lean(sa, sb, sxd, a64, xq64, xd, uint32(cn32 * U + un32), lane, tid, abase, sa_o,
                       bbase, sb_o, dpos, 1 - buf)
        cp_async_commit()                   # (an empty group after the last step)
        cp_async_wait1()                    # this thread's copies of this step have landed
        cuda.syncthreads()                  # and every thread's
        mma_step_lean(sa, sb, sxd, acc, gid, tig, g, q_word, sh, d_word, d_sh, buf, mg)
        cuda.syncthreads()                  # buffer buf is read before it is refilled
        if wn32 != w32:
            end_pass(acc, comb, warp, lane, out, out_ld, row0, tok0, gid, tig, rows, n_tok, w32)
        return wn32, cn32, un32

    jit = _jit_capped(max_regs)

    @jit
    def q8_0_rows_mma_staged(a64, row_w0, row_w, rows, nb, nchunks, xq64, xd, n_tok, out, out_ld,
                             row_w0_b, rows_a):
        pdl_enter()
        sa = cuda.shared.array(SA_T, uint32, alignment=SM_AL)
        sb = cuda.shared.array(SB_T, uint64, alignment=SM_AL)
        sxd = cuda.shared.array(SXD_T, float32, alignment=SM_AL)
        rbase = cuda.shared.array(ROWS, int64)
        comb = cuda.shared.array(COMB_N, float32)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        gid = lane >> 2
        tig = lane & 3
        g = warp                                    # this warp's lane group: blocks b = g mod 8
        q_word = (34 * g + 2) >> 2                  # where block g's quants start in a staged row
        sh = 8 * ((34 * g + 2) & 3)                 # (32-bit word, bit offset: 16 for even g)
        d_word = (34 * g) >> 2                      # and its f16 scale (low or high half)
        d_sh = 16 * (g & 1)
        if scales_last:                             # quants in words 0-63, the 8 scales in 64-67
            q_word = 8 * g
            sh = 0
            d_word = 64 + (g >> 1)
        row0 = cuda.blockIdx.x * ROWS
        tok0 = cuda.blockIdx.y * TOKS
        if tid < ROWS:                      # where each staged row starts (uint64 words)
            r = min(row0 + tid, rows - 1)           # a short last tile repeats a row
            rbase[tid] = _pair_row(r, rows_a, row_w0, row_w0_b, row_w)
        mg = cuda.local.array(4, int32)     # cpa: the magic C words, from shared memory once
        if cpa:
            smg = cuda.shared.array(4, int32)
            if tid < 4:
                smg[tid] = int32(_MAGIC)
        cuda.syncthreads()
        if cpa:
            for i in range(4):
                mg[i] = smg[i]
        nsteps = nb // 8
        acc = cuda.local.array(NE, float32)
        for e in range(NE):
            acc[e] = float32(0.0)
        # split pass w takes chunks w, w + S, ... (the dp4a kernel's round robin), U steps each
        if cpa:
            abase = cuda.local.array(2, int64)      # the lane's first chunk, its row's scales (lean_bases)
            sa_o = cuda.local.array(1, uint32)
            bbase = cuda.local.array(1, uint32)
            sb_o = cuda.local.array(1, uint32)
            dpos = cuda.local.array(2, uint32)
            lean_bases(rbase, warp, lane, tid, tok0, n_tok, nb, abase, sa_o, bbase, sb_o, dpos)
            nst = uint32(nsteps)
            nch = uint32(nchunks)
            w32 = uint32(0)
            c32 = uint32(0)
            u32 = uint32(0)
            issue_lean(sa, sb, sxd, a64, xq64, xd, uint32(0), lane, tid, abase, sa_o, bbase, sb_o,
                       dpos, 0)
            cp_async_commit()
            # two steps per trip, one per staging buffer: the buffer offsets are constants
            while True:
                w32, c32, u32 = cpa_step(sa, sb, sxd, a64, xq64, xd, lane, tid, abase, sa_o, bbase,
                                         sb_o, dpos, acc, comb, warp, out, out_ld, row0, tok0, gid,
                                         tig, rows, n_tok, g, q_word, sh, d_word, d_sh, nst, nch,
                                         w32, c32, u32, 0, mg)
                if w32 >= S:
                    break
                w32, c32, u32 = cpa_step(sa, sb, sxd, a64, xq64, xd, lane, tid, abase, sa_o, bbase,
                                         sb_o, dpos, acc, comb, warp, out, out_ld, row0, tok0, gid,
                                         tig, rows, n_tok, g, q_word, sh, d_word, d_sh, nst, nch,
                                         w32, c32, u32, 1, mg)
                if w32 >= S:
                    break
            return
        pa = cuda.local.array(A_PER, uint64)
        pb = cuda.local.array(B_PER, uint64)
        pd = cuda.local.array(1, float32)
        w = 0
        c = 0
        u = 0
        load_step(a64, rbase, xq64, xd, 0, tok0, n_tok, nb, warp, lane, tid, pa, pb, pd)
        while w < S:
            wn = w                                  # the step after this one
            cn = c
            un = u + 1
            if un == U or cn * U + un >= nsteps:
                un = 0
                cn = c + S
                if cn >= nchunks:
                    wn = w + 1
                    cn = wn
            cuda.syncthreads()                      # every warp is done with the last step
            store_step(sa, sb, sxd, warp, lane, tid, pa, pb, pd)
            cuda.syncthreads()
            if prefetch and wn < S:                 # in flight while the MMAs run
                load_step(a64, rbase, xq64, xd, cn * U + un, tok0, n_tok, nb, warp, lane, tid, pa, pb, pd)
            mma_step(sa, sb, sxd, acc, gid, tig, g, q_word, sh, d_word, d_sh, 0)
            if not prefetch and wn < S:
                cuda.syncthreads()
                load_step(a64, rbase, xq64, xd, cn * U + un, tok0, n_tok, nb, warp, lane, tid, pa, pb, pd)
            if wn != w:                         # the end of split pass w: meet and write
                end_pass(acc, comb, warp, lane, out, out_ld, row0, tok0, gid, tig, rows, n_tok, w)
            w = wn
            c = cn
            u = un

    return q8_0_rows_mma_staged


_F16_R = 4     # rows per warp in the F16 matmul (prefill): one activation load feeds R rows
_F16_U = 8     # steps whose words a split-K F16 decode warp loads before it uses the first
_F16_CONST_DECODE = True    # one-warp-per-row F16 decode rows of <= 32 whole steps: the step count a
                            # compile-time constant, the weight loads unrolled ahead of the fma's


def _f16_kernel(S, T, R=1, NF=0):
    """F16 x f32: a lane takes one pair of weights (one uint32) per step of each of the warp's R
    rows, and fma's it with the T tokens' activation pair in f32. Every (row, token) sees the same
    steps in the same order whatever R is (the per-row order of R = 1, the decode matvec), so R
    only changes how often an activation is loaded: once per R rows. NF > 0 (decode, S = R = T =
    1, _F16_CONST_DECODE): rows of exactly NF whole steps (plus the partial one, if any), the
    weight loads written ahead of the fma's in an unrolled loop (ptxas sm_90 keeps ~12 in flight;
    the loop below issues a step's loads only once the step before has its words), the same fma
    order."""
    NWD = _NW_DENSE
    FU = _F16_U   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    assert NF == 0 or (S == 1 and T == 1 and R == 1)
    NFA = max(1, NF)       # local array sizes must be plain constants for numba
    RPB = _rows_per_block(S)   # row groups per block
    RT = R * T
    finish = _make_finish(S, T)

    @_inline
    def step_fn(a32, wrow, p, valid, x64, npairs, tok0, n_tok, acc, w0, w1):
        if valid:
            for r in range(R):
                wv = a32[_ix(wrow[r] + p)]
                w0[r] = f16_bits_to_f32(wv & _M16)
                w1[r] = f16_bits_to_f32(wv >> uint32(16))
            for tt in range(T):
                tok = tok0 + tt
                if T == 1 or tok < n_tok:
                    xv = x64[_ix(tok * npairs + p)]
                    for r in range(R):
                        acc[r * T + tt] = cuda.fma(w0[r], xv.real, acc[r * T + tt])
                        acc[r * T + tt] = cuda.fma(w1[r], xv.imag, acc[r * T + tt])

    @_jit_capped(0)
    def f16_rows(a32, row_w0, row_w, rows, npairs, x64, n_tok, out, out_ld, row_w0_b, rows_a):
        pdl_enter()
        part = cuda.shared.array((NWD, T), float32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        w = warp % S
        row_first = (cuda.blockIdx.x * RPB + warp // S) * R
        tok0 = cuda.blockIdx.y * T
        acc = cuda.local.array(RT, float32)
        one = cuda.local.array(T, float32)
        wrow = cuda.local.array(R, int64)
        w0 = cuda.local.array(R, float32)
        w1 = cuda.local.array(R, float32)
        for i in range(RT):
            acc[i] = float32(0.0)
        for r in range(R):
            row = min(row_first + r, rows - 1)       # rows past the end repeat the last (not written)
            wrow[r] = _pair_row(row, rows_a, row_w0, row_w0_b, row_w)
        if row_first < rows:
            nfull = npairs >> 5
            if R == 1 and T == 1 and S > 1:
                # decode, split-K: the weight and activation words of _F16_U of the warp's steps
                # are loaded before the first is used; the same steps, the same fma order (ncu on
                # the H200: indexer proj 4096->64 11 -> 3.3 us, router 5.5 -> 4.5; but the one-warp-
                # per-row indexer q_b 1024->8192 went 11 -> 17 us in chunks of 8, so S = 1 keeps
                # the loop below)
                wv = cuda.local.array(FU, uint32)
                xv = cuda.local.array(FU, complex64)
                n_mine = (nfull - w + S - 1) // S
                for c0 in range(0, n_mine, FU):
                    for u in range(FU):
                        p = (w + S * (c0 + u)) * WARP + lane
                        if c0 + u < n_mine:
                            wv[u] = a32[_ix(wrow[0] + p)]
                            xv[u] = x64[_ix(p)]
                    for u in range(FU):
                        if c0 + u < n_mine:
                            acc[0] = cuda.fma(f16_bits_to_f32(wv[u] & _M16), xv[u].real, acc[0])
                            acc[0] = cuda.fma(f16_bits_to_f32(wv[u] >> uint32(16)), xv[u].imag, acc[0])
            elif NF:
                # the weights (DRAM) first; the activation (the same for every row: L1/L2) at its use
                wv = cuda.local.array(NFA, uint32)
                for u in range(NF):
                    wv[u] = a32[_ix(wrow[0] + u * WARP + lane)]
                for u in range(NF):
                    xu = x64[_ix(u * WARP + lane)]
                    acc[0] = cuda.fma(f16_bits_to_f32(wv[u] & _M16), xu.real, acc[0])
                    acc[0] = cuda.fma(f16_bits_to_f32(wv[u] >> uint32(16)), xu.imag, acc[0])
            else:
                for step in range(w, nfull, S):
                    step_fn(a32, wrow, step * WARP + lane, True, x64, npairs, tok0, n_tok, acc, w0, w1)
            if (npairs & 31) != 0 and nfull % S == w:
                p = nfull * WARP + lane
                step_fn(a32, wrow, p, p < npairs, x64, npairs, tok0, n_tok, acc, w0, w1)
        for i in range(RT):
            v = acc[i]
            v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
            v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
            v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
            v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
            v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
            acc[i] = v
        for r in range(R):
            for tt in range(T):
                one[tt] = acc[r * T + tt]
            finish(part, one, warp, lane, w, row_first + r, rows, tok0, n_tok, out, out_ld)
            if S > 1 and R > 1:
                cuda.syncthreads()               # part is read before the next row writes it

    return f16_rows


# The tiled F16 prefill matmul (_F16_TILED): a warp holds R rows x T tokens of sums per lane (8 x 8:
# 128 FMAs per step for 8 weight words and 8 activation pairs, against 64 for 4 + 8 in f16_rows), the
# row length is a compile-time constant (every weight and activation address of a step is one of
# two pointers plus a constant), and a warp's R rows lie in one matrix (its last group moved back to
# end at the matrix's last row, the tile's last token group likewise: overlapping outputs are
# computed twice, the same bits, and written once). The lane sums are reduced by a transposing
# butterfly: at each level (lane xor 16, 8, 4, 2, 1) a lane keeps half of its sums and adds the
# partner's copy of them, so 32 sums take 31 shuffles instead of 160 and lane l ends holding sum l.
# Per output it adds the same two values at every level as the xor butterfly (v(l) + v(l ^ m)), so
# every (row, token) gets the bits of f16_rows and of the decode matvec: the same steps, pairs and
# fma order per lane, the same butterfly tree, the split-K partials added in warp order.
if SIMULATOR:
    def _f32_of_bits(v):
        """The f32 whose bits are the low 32 of v (a register reinterpretation on the GPU)."""
        return np.array([int(v) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]
else:
    @_inline
    def _f32_of_bits(v):
        """The f32 whose bits are the low 32 of v (a register reinterpretation on the GPU)."""
        return libdevice.int_as_float(int32(v & _M32))


# The default since session 16 (H200, 2,048-token prefill of the flash preset: 2,289 -> 2,581
# tok/s with it).
_F16_TILED = True    # the engine's F16 prefill matmuls use f16_rows_tiled where it applies
_F16_TILE_R = 8      # rows per warp
_F16_TILE_T = 8      # tokens per warp (R * T a multiple of 32)
_F16_TILE_REGS = 0   # register cap (0: none)
_F16_TILE_PREFETCH = False   # the next step's words loaded before this step's fma's


def _f16_tiled_kernel(S, NP, R, T, max_regs=0, PREFETCH=False):
    """F16 x f32 over rows of NP weight pairs (a compile-time constant), R rows x T tokens per warp,
    S warps per row group (split-K); see above. PREFETCH: each step's words loaded during the
    previous step's fma's (two register sets)."""
    NWD = _NW_DENSE   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    if (R * T) % WARP:
        raise ValueError("f16_rows_tiled: R * T must be a multiple of 32")
    RPB = _rows_per_block(S)   # row groups per block
    RT = R * T
    NG = RT // WARP        # sums per lane after the transposing butterfly
    NFULL = NP >> 5        # whole steps of 32 pairs
    TAIL = NP & 31         # pairs of the partial last step (lanes below TAIL)
    N_EVEN = NFULL // S if NFULL % S == 0 else -1   # steps per warp when every warp has as many
    STEP = S * WARP        # pairs from one of a warp's steps to its next

    @_inline
    def tile_load(a32, x64, wi, xi, wv, xv):
        """The words of one step of 32 pairs for the R x T tile: the lane's pair at wi (row 0's
        word) and xi (token 0's pair); the other rows and tokens are NP words / pairs apart."""
        for r in range(R):
            wv[r] = a32[_ix(wi + r * NP)]
        for tt in range(T):
            xv[tt] = x64[_ix(xi + tt * NP)]

    @_inline
    def tile_fma(wv, xv, acc):
        """The step's 2 R T fma's, each sum's pair low half first (rows outer: two weights live)."""
        for r in range(R):
            w_lo = f16_bits_to_f32(wv[r] & _M16)
            w_hi = f16_bits_to_f32(wv[r] >> uint32(16))
            for tt in range(T):
                x_lo = _f32_of_bits(xv[tt])
                x_hi = _f32_of_bits(xv[tt] >> uint64(32))
                acc[r * T + tt] = cuda.fma(w_lo, x_lo, acc[r * T + tt])
                acc[r * T + tt] = cuda.fma(w_hi, x_hi, acc[r * T + tt])

    @_jit_capped(max_regs)
    def f16_rows_tiled(a32, row_w0, rows_a, row_w0_b, rows_b, x64, n_tok, out, out_ld, groups_a, n_groups):
        pdl_enter()
        part = cuda.shared.array((NWD, RT), float32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        w = warp % S
        g = cuda.blockIdx.x * RPB + warp // S
        live = g < n_groups                      # a block's spare warps run group 0 unwritten
        if not live:
            g = 0
        if g < groups_a:
            first = g * R                        # the group's first row not in an earlier group
            start = min(first, rows_a - R)
            wbase = row_w0 + start * NP
            orow = start
        else:
            first = (g - groups_a) * R
            start = min(first, rows_b - R)
            wbase = row_w0_b + start * NP
            orow = rows_a + start
        tok0 = cuda.blockIdx.y * T
        tok_first = min(tok0, n_tok - T)
        acc = cuda.local.array(RT, float32)
        wa = cuda.local.array(R, uint32)
        xa = cuda.local.array(T, uint64)
        wb = cuda.local.array(R, uint32)
        xb = cuda.local.array(T, uint64)
        for i in range(RT):
            acc[i] = float32(0.0)
        wi = wbase + w * WARP + lane
        xi = tok_first * NP + w * WARP + lane
        n_mine = int32(N_EVEN if N_EVEN >= 0 else (NFULL - w + S - 1) // S)
        if PREFETCH:
            # two word sets: the next step's loads are in flight during this step's fma's
            if n_mine > 0:
                tile_load(a32, x64, wi, xi, wa, xa)
            for h in range(n_mine >> 1):
                i = 2 * h
                tile_load(a32, x64, wi + (i + 1) * STEP, xi + (i + 1) * STEP, wb, xb)
                tile_fma(wa, xa, acc)
                if i + 2 < n_mine:
                    tile_load(a32, x64, wi + (i + 2) * STEP, xi + (i + 2) * STEP, wa, xa)
                tile_fma(wb, xb, acc)
            if n_mine & 1:
                tile_fma(wa, xa, acc)
        else:
            for i in range(n_mine):
                tile_load(a32, x64, wi + i * STEP, xi + i * STEP, wa, xa)
                tile_fma(wa, xa, acc)
        if TAIL != 0 and NFULL % S == w and lane < TAIL:
            tile_load(a32, x64, wi + (NFULL - w) * WARP, xi + (NFULL - w) * WARP, wa, xa)
            tile_fma(wa, xa, acc)
        # transposing butterfly: after level m a lane's first half of sums is its share
        for k in range(5):
            m = 16 >> k
            upper = (lane & m) != 0
            for gi in range(NG):
                for j in range(m):
                    lo = acc[gi * WARP + j]
                    hi = acc[gi * WARP + j + m]
                    keep = hi if upper else lo
                    send = lo if upper else hi
                    acc[gi * WARP + j] = keep + cuda.shfl_xor_sync(FULL_MASK, send, m)
        for gi in range(NG):
            i = gi * WARP + lane                 # this lane's sum: row i // T, token i % T
            if S == 1:
                r = i // T
                tok = tok_first + i % T
                if live and start + r >= first and tok >= tok0:
                    out[tok * out_ld + orow + r] = acc[gi * WARP]
            else:
                part[warp, i] = acc[gi * WARP]
        if S > 1:
            cuda.syncthreads()
            if w == 0:
                for gi in range(NG):
                    i = gi * WARP + lane
                    r = i // T
                    tok = tok_first + i % T
                    if live and start + r >= first and tok >= tok0:
                        s = part[warp, i]
                        for k in range(1, S):
                            s += part[warp + k, i]
                        out[tok * out_ld + orow + r] = s

    return f16_rows_tiled


def _tok_tile(n_tok):
    return 1 if n_tok == 1 else 8


def _hc_args(hc):
    """The HC-post epilogue arguments of a one-token launch (kernels: hc_post_dim): (on, state
    [n_hc, n_embd], f_b [n_embd], post [n_hc], comb [n_hc²]); placeholders when hc is None."""
    if hc is None:
        if "hc" not in _DUMMY:
            _DUMMY["hc"] = (False, cuda.device_array((1, 1), np.float32),
                            *(cuda.device_array(1, np.float32) for _ in range(3)))
        return _DUMMY["hc"]
    state, f_b, post, comb = hc
    return (True, state, f_b, post, comb)


def _launch_q8_0(arena, parts, K, n_tok, xq, xd, out, stream, x_groups=1, mma=None, hc=None,
                 staged=None, scales_last=False):
    """Q8_0 rows of one or two matrices `parts` = [(byte offset, rows), ...] in one launch:
    out[t] = concat(W_a · X[t], W_b · X[t]). With x_groups > 1 (one token), the rows split into
    x_groups equal groups and group k reads X's k-th K-slice (the grouped output projection).
    hc = (state, f_b, post, comb), one token and one matrix of n_embd rows: the HC post of each
    dim as soon as its output is written (hc_post_dim), instead of an hc_post launch.
    scales_last: every matrix's rows are in q8_0_relayout's layout (formats.scales_last_ok)."""
    if K % 32 or any(off % 2 for off, _ in parts):
        raise ValueError("Q8_0: offset must be even and K a multiple of 32")
    rows = sum(r for _, r in parts)
    if xq.size != n_tok * K * x_groups or xd.size != xq.size // 32 or out.size != n_tok * rows:
        raise ValueError("Q8_0: activation or output size does not match (n_tok, K, rows)")
    if x_groups > 1 and (n_tok != 1 or rows % x_groups):
        raise ValueError("Q8_0: grouped activations need one token and rows divisible by the groups")
    a16, a32, _, a64 = _arena_views(arena)
    nb = K // 32
    for off, r in parts:
        if off + r * 34 * nb > 2 * a16.size:
            raise ValueError("Q8_0: tensor runs past the end of the arena")
    (off_a, rows_a), (off_b, _) = parts[0], parts[-1]
    rows_a = rows_a if len(parts) > 1 else rows
    S, U, nchunks = _q8_0_work(rows, nb)         # chunks of U steps (8 blocks each) per row
    if hc is not None and (n_tok != 1 or len(parts) != 1 or x_groups != 1 or hc[0].shape[1] != rows):
        raise ValueError("Q8_0: the HC-post epilogue takes one token and one matrix of n_embd rows")
    sl = bool(scales_last)
    if sl and not all(F.scales_last_ok(F.Q8_0, K, off) for off, _ in parts):
        raise ValueError("Q8_0: scales-last rows need 16-byte aligned offsets and K a multiple of 256")
    if mma is None:
        mma = _USE_MMA and n_tok >= _MMA_MIN_TOKENS and x_groups == 1 and hc is None
    if mma and staged is None:
        staged = _MMA_STAGED
    if mma and sl and not staged:
        raise NotImplementedError("Q8_0: the direct tensor-core kernel reads the file's layout only")
    if mma and staged and nb % 8 == 0 and all(off % 8 == 0 for off, _ in parts):
        # whole steps of 8 blocks, rows that start on 8-byte boundaries (GGUF aligns tensors to 32)
        R, T, regs, pf, mc = _MMA_ST_ROWS, _MMA_ST_TOKS, _MMA_ST_REGS, _MMA_ST_PREFETCH, _MMA_ST_MAGIC_C
        # the cp.async staging: weight rows and activation rows on 16-byte boundaries
        cpa = bool(_MMA_ST_CPASYNC) and all(off % 16 == 0 for off, _ in parts) and (
            _dev_ptr(xq) % 16 == 0)
        kernel = _cached(_q8_0_mma_staged_kernel, S, U, pf, regs, R // 16, T // 8, mc, cpa, sl)
        grid = ((rows + R - 1) // R, (n_tok + T - 1) // T)
        kernel[grid, _MMA_G_WARPS * WARP, _stream(stream)](
            a64, off_a // 8, 17 * nb // 4, rows, nb, nchunks, _as_i64(xq),
            _flat(xd), n_tok, _flat(out), rows, off_b // 8, rows_a)
        return
    if mma:
        kernel = _cached(_q8_0_mma_kernel, S, U)
        grid = ((rows + 15) // 16, (n_tok + 8 * _MMA_NT - 1) // (8 * _MMA_NT))
        kernel[grid, _MMA_G_WARPS * WARP, _stream(stream)](
            a16, off_a // 2, 17 * nb, rows, nb, _as_i64(xq), _flat(xd), n_tok, _flat(out), rows,
            off_b // 2, rows_a)
        return
    pre = bool(_Q8_0_PRE)
    if _Q8_0_PAIRS and sl and n_tok == 1 and S == 1 and _dev_ptr(xq) % 16 == 0:
        nsteps = (nb + 15) // 16
        U2, regs = min(_Q8_0_PAIRS_U, nsteps), _Q8_0_PAIRS_REGS    # U sets no sum's order here
        one = bool(_Q8_0_PAIRS_ONE) and nsteps <= U2
        kernel = _cached(_q8_0_pairs_kernel, U2, pre, regs, one)
        kernel[(rows + _NW_DENSE - 1) // _NW_DENSE, _NW_DENSE * WARP, _stream(stream)](
            a32, off_a // 2, 17 * nb, rows, nb, (nsteps + U2 - 1) // U2, _as_i32(xq), _flat(xd),
            _flat(out), off_b // 2, rows_a, rows // x_groups, *_hc_args(hc))
        return
    T = _tok_tile(n_tok)
    kernel = _cached(_q8_0_kernel, S, T, U, sl, pre)
    grid = ((rows * S + _NW_DENSE - 1) // _NW_DENSE, (n_tok + T - 1) // T)
    kernel[grid, _NW_DENSE * WARP, _stream(stream)](
        a32 if sl else a16, off_a // 2, 17 * nb, rows, nb, nchunks, _as_i64(xq), _flat(xd),
        n_tok, _flat(out), rows, off_b // 2, rows_a, rows // x_groups, *_hc_args(hc))


def matmul_q8_0(arena, off, rows, K, n_tok, xq, xd, out, stream=0, hc=None, scales_last=False):
    """out[t, r] = W[r] . X[t] for Q8_0 weights at arena[off:], X given Q8_0-quantized
    (xq int8[n_tok*K], xd f32[n_tok*K/32]); out f32[n_tok, rows] (row-major, contiguous). hc: see
    _launch_q8_0 (one token). scales_last: the rows are in q8_0_relayout's layout (every Q8_0
    launcher takes it)."""
    _launch_q8_0(arena, [(off, rows)], K, n_tok, xq, xd, out, stream, hc=hc, scales_last=scales_last)


def matmul_q8_0_mma(arena, off, rows, K, n_tok, xq, xd, out, stream=0, staged=None, scales_last=False):
    """matmul_q8_0 on the int8 tensor cores (the same numbers bit for bit; any n_tok). staged:
    the shared-memory kernel (None: where it applies and _MMA_STAGED), or the direct one."""
    _launch_q8_0(arena, [(off, rows)], K, n_tok, xq, xd, out, stream, mma=True, staged=staged, scales_last=scales_last)


def matvec_q8_0(arena, off, rows, K, xq, xd, out, stream=0, scales_last=False):
    """out[r] = W[r] . x for Q8_0 weights; x given Q8_0-quantized (xq int8[K], xd f32[K/32])."""
    _launch_q8_0(arena, [(off, rows)], K, 1, xq, xd, out, stream, scales_last=scales_last)


def matvec_q8_0_pair(arena, off_a, rows_a, off_b, rows_b, K, xq, xd, out, stream=0, scales_last=False):
    """Two Q8_0 matrices with the same input in one launch: out = concat(A · x, B · x)."""
    _launch_q8_0(arena, [(off_a, rows_a), (off_b, rows_b)], K, 1, xq, xd, out, stream, scales_last=scales_last)


def matmul_q8_0_pair(arena, off_a, rows_a, off_b, rows_b, K, n_tok, xq, xd, out, stream=0, scales_last=False):
    """Two Q8_0 matrices with the same n_tok inputs in one launch: out[t] = concat(A · X[t], B · X[t])
    (out f32[n_tok, rows_a + rows_b]); with n_tok = 1 it is matvec_q8_0_pair."""
    _launch_q8_0(arena, [(off_a, rows_a), (off_b, rows_b)], K, n_tok, xq, xd, out, stream, scales_last=scales_last)


def matvec_q8_0_grouped(arena, off, rows, K, n_groups, xq, xd, out, stream=0, scales_last=False):
    """Grouped projection in one launch: rows split into n_groups equal groups, group k computes
    W[group k rows] · x[k*K:(k+1)*K] (x holds n_groups*K values)."""
    _launch_q8_0(arena, [(off, rows)], K, 1, xq, xd, out, stream, x_groups=n_groups, scales_last=scales_last)


def _launch_f16(arena, parts, K, n_tok, X, out, stream):
    """F16 rows of one or two matrices [(byte offset, rows), ...] in one launch, as _launch_q8_0."""
    if K % 2 or any(off % 4 for off, _ in parts):
        raise ValueError("F16: offset must be a multiple of 4 and K even")
    rows = sum(r for _, r in parts)
    if X.size != n_tok * K or out.size != n_tok * rows:
        raise ValueError("F16: activation or output size does not match (n_tok, K, rows)")
    _, a32, _, _ = _arena_views(arena)
    for off, r in parts:
        if off + r * 2 * K > 4 * a32.size:
            raise ValueError("F16: tensor runs past the end of the arena")
    (off_a, rows_a), (off_b, _) = parts[0], parts[-1]
    S = orders.f16_split(rows, K)
    R, T = _F16_TILE_R, _F16_TILE_T
    if _F16_TILED and n_tok >= T and all(r >= R for _, r in parts):
        # every row group inside one matrix, every token tile inside the n_tok (see f16_rows_tiled)
        rows_b = parts[1][1] if len(parts) > 1 else 0
        groups_a, groups_b = (rows_a + R - 1) // R, (rows_b + R - 1) // R
        regs, pf = _F16_TILE_REGS, _F16_TILE_PREFETCH
        kernel = _cached(_f16_tiled_kernel, S, K // 2, R, T, regs, pf)
        grid = (((groups_a + groups_b) * S + _NW_DENSE - 1) // _NW_DENSE, (n_tok + T - 1) // T)
        kernel[grid, _NW_DENSE * WARP, _stream(stream)](
            a32, off_a // 4, rows_a, off_b // 4, rows_b, memo_view(X, "u64", lambda a: _flat(a).view(np.uint64)),
            n_tok, _flat(out), rows, groups_a, groups_a + groups_b)
        return
    T = _tok_tile(n_tok)
    R = 1 if n_tok == 1 else _F16_R
    nfull = (K // 2) >> 5
    NF = nfull if _F16_CONST_DECODE and n_tok == 1 and S == 1 and 0 < nfull <= 32 else 0
    kernel = _cached(_f16_kernel, S, T, R, NF)
    grid = (((rows + R - 1) // R * S + _NW_DENSE - 1) // _NW_DENSE, (n_tok + T - 1) // T)
    kernel[grid, _NW_DENSE * WARP, _stream(stream)](
        a32, off_a // 4, K // 2, rows, K // 2, memo_view(X, "c64", lambda a: _flat(a).view(np.complex64)), n_tok, _flat(out), rows,
        off_b // 4, rows_a if len(parts) > 1 else rows)


def matmul_f16(arena, off, rows, K, n_tok, X, out, stream=0):
    """out[t, r] = W[r] . X[t] for F16 weights and f32 activations X[n_tok, K] (no quantization)."""
    _launch_f16(arena, [(off, rows)], K, n_tok, X, out, stream)


def matvec_f16(arena, off, rows, K, x, out, stream=0):
    """out[r] = W[r] . x for F16 weights and an f32 activation x[K]."""
    _launch_f16(arena, [(off, rows)], K, 1, x, out, stream)


def matvec_f16_pair(arena, off_a, rows_a, off_b, rows_b, K, x, out, stream=0):
    """Two F16 matrices with the same input in one launch: out = concat(A · x, B · x)."""
    _launch_f16(arena, [(off_a, rows_a), (off_b, rows_b)], K, 1, x, out, stream)


def matmul_f16_pair(arena, off_a, rows_a, off_b, rows_b, K, n_tok, X, out, stream=0):
    """Two F16 matrices with the same n_tok inputs in one launch: out[t] = concat(A · X[t], B · X[t])."""
    _launch_f16(arena, [(off_a, rows_a), (off_b, rows_b)], K, n_tok, X, out, stream)


# ============================================================================================
# Q8_K-activation types (IQ2_XXS, Q2_K, Q4_K): row dot products shared by every kernel
# ============================================================================================
#
# Lane map: lane = 8*q + j. A warp step covers 4 super-blocks; the 8 lanes of group q share
# super-block 4*step + q, lane j taking one 32-weight slice of it. The 8 lanes sum their integer
# partials (exact: that is the super-block's integer dot), then accumulate its f32 term; a final
# butterfly over the 4 groups (lane xor 16, 8) adds the groups. The row dot for T tokens decodes
# each weight slice once and applies it to every token: the arithmetic per token is the same for
# every T, which is what makes prefill rows bit-identical to decode.
#
# IQ2_XXS reads its activation from shared memory, padded with one word per 8 so that the 32
# lanes (each reading 8 consecutive words) hit 32 different banks. Q2_K and Q4_K lanes read
# consecutive words, so they read the activation straight from global memory (L1/L2).

def _pad_words(K):
    """Padded shared-memory length (int32 words) of one Q8_K-quantized activation of K values."""
    k4 = K // 4
    return k4 + k4 // 8


# Each row dot is split in two phases: `load` fetches the raw weight words a lane needs for a
# chunk of up to NCH steps (of R rows at once), `compute` turns them into integer dots and f32
# terms. Loading a whole chunk first gives every lane R*NCH*words independent loads in flight:
# decode matvecs are latency-bound without that. The per-row arithmetic (steps in order, one
# f32 accumulator per lane group and token) does not depend on R, NCH or T.

def _make_load_iq2_xxs(repacked_nsb=0):
    """repacked_nsb > 0: rows of that many super-blocks in iq2_xxs_relayout's layout (every
    super-block's 64 grid/sign bytes first, then the f16 scales; rows 8-byte aligned): a
    sub-block's 8 bytes are one aligned 8-byte load and d one 16-bit load, the same words."""
    NWORDS = 3
    NSBR = repacked_nsb

    @_inline
    def load(a16, a32, roff, sb, j, valid, raw, o):
        raw[o] = uint32(0)
        raw[o + 1] = uint32(0)
        raw[o + 2] = uint32(0)
        if valid:
            if NSBR:
                raw[o] = uint32(a16[_ix((roff >> 1) + 32 * NSBR + sb)])
                w0, w1 = ld_pair(a32, _ix((roff >> 2) + 16 * sb + 2 * j))
                raw[o + 1] = w0
                raw[o + 2] = w1
            else:
                hsb = (roff >> 1) + 33 * sb
                raw[o] = uint32(a16[_ix(hsb)])                 # f16 d
                raw[o + 1] = _u16pair(a16, hsb + 1 + 4 * j)    # 4 grid indices
                raw[o + 2] = _u16pair(a16, hsb + 3 + 4 * j)    # 4 x 7 sign bits, 4-bit scale

    return load, NWORDS


_IQ2_SPLIT_SIGNS = True   # signed dot as dot(g, x) - 2 dot(g & m, x), parity by popc (no table)


def _make_compute_iq2_xxs(T, x_regs=False, perm=False):
    """Lane j decodes sub-block j (32 weights) of super-block sb into 8 signed-byte words and
    dots them with each token's 32 activation bytes (padded shared-memory layout; with x_regs,
    one token whose words for step u are the lane's registers xsrc[xu = 8u ..]).

    With _IQ2_SPLIT_SIGNS the signs are not applied to the weights: the grid bytes g (< 0x80)
    are dotted as they are and the bytes of the negative weights (g & m, m a byte mask) a second
    time, sum s_i g_i x_i = dot(g, x) - 2 dot(g & m, x): the same integer, one SASS instruction
    per word fewer, and the 8th sign bit from a popc instead of a shared-memory table load (the
    gate/up kernel's time moved within the noise: 27.5 -> 27.2 us in one H200 run, 25.7 -> 26.0
    in another).

    perm (the gate/up decode kernel's _IQ2_PERM_GATE_UP): the tables are the byte-permute
    selectors of iq2_selector_tables (grid_s uint32[256], ks_s uint32[129] whose last word is
    iq2_permute's byte positions) and each grid entry becomes its 8 signed weights in two words
    (two prmt), dotted once: the same integer in half the dp4a, no byte masks."""
    split = _IQ2_SPLIT_SIGNS and not perm

    @_inline
    def compute(raw, o, nsb, sb, j, valid, xsrc, xbase, xd, xbs, toks, to, cnt, grid_s, ks_s,
                acc, ao, xu):
        wv = cuda.local.array(8, uint32)
        mv = cuda.local.array(8, uint32)
        dbits = raw[o]
        aux0 = raw[o + 1]
        aux1 = raw[o + 2]
        pos = ks_s[128] if perm else uint32(0)              # a register operand (see iq2_permute)
        for l in range(4):
            if perm:
                w_lo, w_hi = iq2_permute(grid_s[_ix(bfe(aux0, 8 * l, 8))], ks_s[_ix(bfe(aux1, 7 * l, 7))], pos)
                wv[2 * l] = w_lo
                wv[2 * l + 1] = w_hi
                continue
            gv = grid_s[_ix(bfe(aux0, 8 * l, 8))]            # 8 magnitudes (bytes < 0x80)
            if split:
                s8 = even_signs(bfe(aux1, 7 * l, 7))
                wv[2 * l] = uint32(gv & uint64(0xFFFFFFFF))
                wv[2 * l + 1] = uint32(gv >> uint64(32))
                mv[2 * l] = byte_mask(s8 & 15)
                mv[2 * l + 1] = byte_mask(s8 >> 4)
            else:
                s8 = int32(ks_s[_ix(bfe(aux1, 7 * l, 7))])       # 8 sign bits (parity added)
                wv[2 * l] = negate_bytes(uint32(gv & uint64(0xFFFFFFFF)), s8 & 15)
                wv[2 * l + 1] = negate_bytes(uint32(gv >> uint64(32)), s8 >> 4)
        ls = imad(bfe(aux1, 28, 4), 2, 1)                   # 2*s + 1
        dw = f16_bits_to_f32(dbits)
        xw = 9 * (8 * sb + j)
        for tt in range(T):
            if T == 1 or tt < cnt:
                sumi = int32(0)
                if valid:
                    neg = int32(0)
                    if x_regs:
                        for i in range(8):
                            sumi = dp4a(wv[i], xsrc[xu + i], sumi)
                            if split:
                                neg = dp4a(wv[i] & mv[i], xsrc[xu + i], neg)
                    else:
                        xb = xbase[to + tt] + xw
                        for i in range(8):
                            sumi = dp4a(wv[i], xsrc[_ix(xb + i)], sumi)
                            if split:
                                neg = dp4a(wv[i] & mv[i], xsrc[_ix(xb + i)], neg)
                    if split:
                        sumi = imad(neg, -2, sumi)
                bsum = _sum_lanes_of_8_i32(imad(sumi, ls, 0))
                if valid:
                    acc[ao + tt] = cuda.fma(dw * xd[_ix(toks[to + tt] * nsb + sb)], float32(bsum),
                                            acc[ao + tt])

    return compute


def _make_load_q2_k():
    NWORDS = 8

    @_inline
    def load(a16, a32, roff, sb, j, valid, raw, o):
        for i in range(8):
            raw[o + i] = uint32(0)
        if valid:
            wsb = (roff >> 2) + 21 * sb
            for i in range(4):
                raw[o + i] = a32[_ix(wsb + i)]             # the 16 scale/min bytes
            raw[o + 4] = a32[_ix(wsb + 4 + j)]             # qs bytes 4j..      (h = 0, l = 4j)
            raw[o + 5] = a32[_ix(wsb + 12 + j)]            # qs bytes 32+4j..   (h = 1, l = 4j)
            raw[o + 6] = a32[_ix(wsb + 20)]                # f16 d, f16 dmin
            raw[o + 7] = a32[_ix(wsb + (j >> 1))]          # scale bytes 2j, 2j+1 (min sums)

    return load, NWORDS


def _make_compute_q2_k(T, x_regs=False):
    """Lane j owns qs words j and 8+j: 32 weights (4 shifts x 2 halves x 4 bytes).

    With x_regs (one token) the lane's activation of step u is in registers: xsrc[xu + 4h + s]
    the 8 words (xu = 8u), xbs[xu >> 2 ..] its 2 bsums, xd[xu >> 3] the super-block scale (as
    moe_down_decode_slots loads them). The same integers and the same f32 operations."""

    @_inline
    def compute(raw, o, nsb, sb, j, valid, xsrc, xbase, xd, xbs, toks, to, cnt, grid_s, ks_s,
                acc, ao, xu):
        hj = j >> 2                      # which 16-weight half of each 32-weight chunk
        dd = raw[o + 6]
        msc = raw[o + 7]
        d = f16_bits_to_f32(dd & _M16)
        dmin = f16_bits_to_f32(dd >> uint32(16))
        sh = 16 * (j & 1)
        m0 = bfe(msc, sh + 4, 4)
        m1 = bfe(msc, sh + 12, 4)
        # the lane's scale nibbles (bytes hj and 2 + hj of each scale word) moved to bytes 0 and 2
        # once: a bfe at a position known only at run time is 4 instructions on sm_90 (SASS),
        # a constant shift and mask 1-2
        sw = cuda.local.array(4, uint32)
        for k in range(4):
            sw[k] = raw[o + k] >> uint32(8 * hj)
        for tt in range(T):
            if T == 1 or tt < cnt:
                isum = int32(0)
                summs = int32(0)
                if valid:
                    if x_regs:
                        for h in range(2):
                            qw = raw[o + 4 + h]
                            for s in range(4):
                                scale = int32((sw[2 * h + (s >> 1)] >> uint32(16 * (s & 1))) & uint32(15))
                                q2 = (qw >> uint32(2 * s)) & _LOW2
                                isum = imad(scale, dp4a(q2, xsrc[xu + 4 * h + s], 0), isum)
                        summs = imad(m0, xbs[xu >> 2], imad(m1, xbs[(xu >> 2) + 1], 0))
                    else:
                        xb = xbase[to + tt] + 64 * sb + j
                        for h in range(2):
                            qw = raw[o + 4 + h]
                            for s in range(4):
                                scale = int32((sw[2 * h + (s >> 1)] >> uint32(16 * (s & 1))) & uint32(15))
                                q2 = (qw >> uint32(2 * s)) & _LOW2
                                isum = imad(scale, dp4a(q2, xsrc[_ix(xb + 32 * h + 8 * s)], 0), isum)
                        bs = toks[to + tt] * (16 * nsb) + 16 * sb + 2 * j
                        summs = imad(m0, xbs[_ix(bs)], imad(m1, xbs[_ix(bs + 1)], 0))
                isum = _sum_lanes_of_8_i32(isum)
                summs = _sum_lanes_of_8_i32(summs)
                if valid:
                    if x_regs:
                        xdv = xd[xu >> 3]
                    else:
                        xdv = xd[_ix(toks[to + tt] * nsb + sb)]
                    term = cuda.fma(xdv * d, float32(isum), -((xdv * dmin) * float32(summs)))
                    acc[ao + tt] = acc[ao + tt] + term

    return compute


def _make_load_q4_k():
    NWORDS = 8

    @_inline
    def load(a16, a32, roff, sb, j, valid, raw, o):
        for i in range(8):
            raw[o + i] = uint32(0)
        if valid:
            wsb = (roff >> 2) + 36 * sb
            for i in range(4):
                raw[o + i] = a32[_ix(wsb + i)]             # d, dmin, 12 scale bytes
            for c in range(4):
                raw[o + 4 + c] = a32[_ix(wsb + 4 + 8 * c + j)]   # chunk c, bytes 4j..4j+3

    return load, NWORDS


def _make_compute_q4_k(T, x_regs=False):
    """Lane j owns qs words j, 8+j, 16+j, 24+j (low and high nibbles: 32 weights)."""
    assert not x_regs, "Q4_K: no register-activation variant"

    @_inline
    def compute(raw, o, nsb, sb, j, valid, xsrc, xbase, xd, xbs, toks, to, cnt, grid_s, ks_s,
                acc, ao, xu):
        scl = cuda.local.array(8, int32)
        w0 = raw[o]
        d = f16_bits_to_f32(w0 & _M16)
        dmin = f16_bits_to_f32(w0 >> uint32(16))
        mine = int32(0)
        for k in range(8):       # 6-bit scales and mins (ggml's packing); scale bytes in words 1..3
            if k < 4:
                scl[k] = int32((raw[o + 1 + (k >> 2)] >> uint32(8 * (k & 3))) & uint32(63))
                mk = int32((raw[o + 1 + ((k + 4) >> 2)] >> uint32(8 * ((k + 4) & 3))) & uint32(63))
            else:
                b_hi = (raw[o + 1 + ((k + 4) >> 2)] >> uint32(8 * ((k + 4) & 3))) & _M8
                b_lo = (raw[o + 1 + ((k - 4) >> 2)] >> uint32(8 * ((k - 4) & 3))) & _M8
                b_k = (raw[o + 1 + (k >> 2)] >> uint32(8 * (k & 3))) & _M8
                scl[k] = int32((b_hi & uint32(15)) | ((b_lo >> uint32(6)) << uint32(4)))
                mk = int32((b_hi >> uint32(4)) | ((b_k >> uint32(6)) << uint32(4)))
            if k == j:
                mine = mk
        for tt in range(T):
            if T == 1 or tt < cnt:
                isum = int32(0)
                summs = int32(0)
                if valid:
                    xb = xbase[to + tt] + 64 * sb + j
                    for c in range(4):
                        qw = raw[o + 4 + c]
                        lo = dp4a(qw & _LOW4, xsrc[_ix(xb + 16 * c)], 0)
                        hi = dp4a((qw >> uint32(4)) & _LOW4, xsrc[_ix(xb + 16 * c + 8)], 0)
                        isum = imad(scl[2 * c], lo, imad(scl[2 * c + 1], hi, isum))
                    bs = toks[to + tt] * (16 * nsb) + 16 * sb + 2 * j
                    summs = imad(mine, xbs[_ix(bs)], imad(mine, xbs[_ix(bs + 1)], 0))
                isum = _sum_lanes_of_8_i32(isum)
                summs = _sum_lanes_of_8_i32(summs)
                if valid:
                    xdv = xd[_ix(toks[to + tt] * nsb + sb)]
                    term = cuda.fma(xdv * d, float32(isum), -((xdv * dmin) * float32(summs)))
                    acc[ao + tt] = acc[ao + tt] + term

    return compute


_LOADERS = {F.IQ2_XXS: _make_load_iq2_xxs, F.Q2_K: _make_load_q2_k, F.Q4_K: _make_load_q4_k}
_COMPUTERS = {F.IQ2_XXS: _make_compute_iq2_xxs, F.Q2_K: _make_compute_q2_k,
              F.Q4_K: _make_compute_q4_k}
_FINAL_SCALE = {F.IQ2_XXS: 0.125, F.Q2_K: 1.0, F.Q4_K: 1.0}


def _make_chunk_parts(wtype, T, NCH, x_regs=False, NSB=0, perm=False, repacked=False):
    """One load chunk (up to NCH steps) of one row's dot with T tokens, in its two phases:
    load_chunk(..., c0, raw, o) fills raw[o:], dot_chunk(raw, o, ..., c0, ..., acc, ao) adds the
    chunk's terms to acc[ao + tt]. rowdots runs them chunk after chunk; a kernel may instead load
    its next chunk while it computes this one (moe_down_decode). Lane map: lane = 8*q + j; a step
    covers 4 super-blocks, group q takes super-block 4*step + q, lane j one 32-weight slice of
    it. Returns (load_chunk, dot_chunk, words of raw per chunk).

    NSB > 0: the row's super-block count is that constant (the nsb arguments are ignored), a step
    wholly inside the row needs no bound check (valid is the same boolean), and with x_regs the
    activation registers are indexed by the absolute step (xu = 8 (c0 + u)): a caller whose chunk
    loop has constant bounds gets it unrolled (c0 constant), the registers of every step live."""
    # repacked: IQ2_XXS rows of NSB super-blocks in iq2_xxs_relayout's layout
    assert not repacked or (wtype == F.IQ2_XXS and NSB > 0)
    load, NWORDS = _make_load_iq2_xxs(NSB) if repacked else _LOADERS[wtype]()
    # perm: IQ2_XXS weights through the byte-permute selectors (_make_compute_iq2_xxs)
    assert not perm or wtype == F.IQ2_XXS
    compute = _make_compute_iq2_xxs(T, x_regs, perm=True) if perm else _COMPUTERS[wtype](T, x_regs)

    @_inline
    def load_chunk(a16, a32, roff, nsb, c0, raw, o):
        q = cuda.laneid >> 3
        j = cuda.laneid & 7
        for u in range(NCH):
            sb = (c0 + u) * 4 + q
            if NSB:
                load(a16, a32, roff, sb, j, (c0 + u + 1) * 4 <= NSB or sb < NSB, raw, o + u * NWORDS)
            else:
                load(a16, a32, roff, sb, j, sb < nsb, raw, o + u * NWORDS)

    @_inline
    def dot_chunk(raw, o, nsb, c0, xsrc, xbase, xd, xbs, toks, to, cnt, grid_s, ks_s, acc, ao):
        q = cuda.laneid >> 3
        j = cuda.laneid & 7
        for u in range(NCH):
            sb = (c0 + u) * 4 + q
            if NSB:
                compute(raw, o + u * NWORDS, NSB, sb, j, (c0 + u + 1) * 4 <= NSB or sb < NSB, xsrc,
                        xbase, xd, xbs, toks, to, cnt, grid_s, ks_s, acc, ao, 8 * (c0 + u))
            else:
                compute(raw, o + u * NWORDS, nsb, sb, j, sb < nsb, xsrc, xbase, xd, xbs, toks, to,
                        cnt, grid_s, ks_s, acc, ao, 8 * u)

    return load_chunk, dot_chunk, NCH * NWORDS


def _make_rowdots(wtype, T, R, NCH, x_regs=False, NSB=0, perm=False, repacked=False):
    """Dot products of R rows (byte offsets roffs[r]) with T tokens each: res[r*T + tt].

    Row r uses tokens toks[r*T + tt] (index into xd / xbs) whose activation words start at
    xbase[r*T + tt] in xsrc. Each chunk's weights of all R rows are loaded before any is used
    (_make_chunk_parts); the 8 lanes of a group add their integer partials exactly, then
    accumulate the super-block's f32 term; at the end a fixed butterfly (lane xor 16, 8) adds the
    4 groups. NSB > 0: rows of that many super-blocks (a compile-time constant; the chunk loop
    has constant bounds and unrolls)."""
    load_chunk, dot_chunk, NCHUNK = _make_chunk_parts(wtype, T, NCH, x_regs, NSB, perm, repacked)
    scale = float32(_FINAL_SCALE[wtype])
    NACC = R * T                  # local array sizes must be plain constants for numba
    NRAW = R * NCHUNK
    NSTEPS = (NSB + 3) >> 2

    @_inline
    def rowdots(a16, a32, roffs, nsb, xsrc, xbase, xd, xbs, toks, cnt, grid_s, ks_s, res):
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        raw = cuda.local.array(NRAW, uint32)
        nsteps = NSTEPS if NSB else (nsb + 3) >> 2
        for c0 in range(0, nsteps, NCH):
            for r in range(R):
                load_chunk(a16, a32, roffs[r], nsb, c0, raw, r * NCHUNK)
            for r in range(R):
                dot_chunk(raw, r * NCHUNK, nsb, c0, xsrc, xbase, xd, xbs, toks, r * T, cnt, grid_s,
                          ks_s, acc, r * T)
        for i in range(NACC):
            res[i] = scale * _sum_groups_of_8_f32(acc[i])

    return rowdots


_ROWDOTS = {}


def _rowdots(wtype, T, R, NCH, x_regs=False, NSB=0, perm=False, repacked=False):
    key = (wtype, T, R, NCH, x_regs, NSB, perm, repacked)
    if key not in _ROWDOTS:
        _ROWDOTS[key] = _make_rowdots(wtype, T, R, NCH, x_regs, NSB, perm, repacked)
    return _ROWDOTS[key]


def _nch(K):
    """Steps per load chunk: the whole row up to 4 steps (K = 4096)."""
    return max(1, min(4, (K // 256 + 3) // 4))


def _stages_x(wtype):
    return wtype == F.IQ2_XXS


@_inline
def _load_iq2_tables(grid_s, ks_s, grid_g, ks_g):
    """The grid and sign tables into shared memory."""
    for i in range(cuda.threadIdx.x, 256, cuda.blockDim.x):
        grid_s[i] = grid_g[i]
    for i in range(cuda.threadIdx.x, 128, cuda.blockDim.x):
        ks_s[i] = ks_g[i]


@_inline
def _stage_row(xs, dst, xq32, src, k4):
    """Copy k4 activation words from xq32[src:] into the padded shared layout at xs[dst:]."""
    for p in range(cuda.threadIdx.x, k4, cuda.blockDim.x):
        xs[_ix(dst + p + (p >> 3))] = xq32[_ix(src + p)]


_NW_Q8K = 8   # warps per block in the Q8_K-activation kernels


def _q8k_dense_kernel(wtype, T, R, NCH):
    """matvec / matmul for IQ2_XXS, Q2_K, Q4_K: each warp does R rows at once, T tokens."""
    NWQ = _NW_Q8K   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    rowdots = _rowdots(wtype, T, R, NCH)
    stage = _stages_x(wtype)
    RT = R * T

    @_jit_capped(0)
    def q8k_rows(a16, a32, off, rb, rows, nsb, xq32, xd, xbs, n_tok, out, out_ld, grid_g, ks_g):
        pdl_enter()
        grid_s = cuda.shared.array(256, uint64)
        ks_s = cuda.shared.array(128, uint8)
        xs = cuda.shared.array(0, int32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        tok0 = cuda.blockIdx.y * T
        cnt = min(T, n_tok - tok0)
        k4 = nsb * 64
        pad = k4 + k4 // 8
        toks = cuda.local.array(RT, int64)
        xbase = cuda.local.array(RT, int64)
        for r in range(R):
            for tt in range(T):
                toks[r * T + tt] = tok0 + tt if tt < cnt else tok0
                xbase[r * T + tt] = tt * pad if stage else toks[r * T + tt] * k4
        if stage:
            _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)
            for tt in range(T):
                if tt < cnt:
                    _stage_row(xs, tt * pad, xq32, (tok0 + tt) * k4, k4)
            cuda.syncthreads()
        row0 = (cuda.blockIdx.x * NWQ + warp) * R
        if row0 < rows:                                   # warp-uniform
            roffs = cuda.local.array(R, int64)
            for r in range(R):
                roffs[r] = off + min(row0 + r, rows - 1) * rb   # a short last group repeats a row
            res = cuda.local.array(RT, float32)
            rowdots(a16, a32, roffs, nsb, xs if stage else xq32, xbase, xd, xbs, toks, cnt,
                    grid_s, ks_s, res)
            if lane == 0:
                for r in range(R):
                    if row0 + r < rows:
                        for tt in range(T):
                            if tt < cnt:
                                out[(tok0 + tt) * out_ld + row0 + r] = res[r * T + tt]

    return q8k_rows


_DUMMY = {}


def _dummy_i32():
    if "i32" not in _DUMMY:
        _DUMMY["i32"] = cuda.device_array(4, np.int32)
    return _DUMMY["i32"]


def _check_q8k(wtype, off, rows, K, n_tok, xq, xd, bsums, out, arena_bytes):
    name = F.TYPE_NAMES[wtype]
    rb = F.row_bytes(wtype, K)
    # IQ2_XXS is read as uint16 (2-byte alignment is enough); Q2_K and Q4_K as uint32
    align = 2 if wtype == F.IQ2_XXS else 4
    if K % 256 or off % align or rb % align:
        raise ValueError(f"{name}: K must be a multiple of 256, offset and row size of {align}")
    if xq.size != n_tok * K or xd.size != n_tok * (K // 256) or out.size != n_tok * rows:
        raise ValueError(f"{name}: activation or output size does not match (n_tok, K, rows)")
    if wtype != F.IQ2_XXS and (bsums is None or bsums.size != n_tok * (K // 16)):
        raise ValueError(f"{name}: needs the Q8_K bsums (n_tok*K/16 int32)")
    if off + rows * rb > arena_bytes:
        raise ValueError(f"{name}: tensor runs past the end of the arena")
    if 4 * 4 * _pad_words(K) > 48 * 1024:
        raise ValueError(f"{name}: K = {K} is too wide for the shared-memory activation tile")
    return rb


_R_DENSE_Q8K = 2


def _matmul_q8k(wtype, arena, off, rows, K, n_tok, xq, xd, bsums, out, stream):
    a16, a32, a8, _ = _arena_views(arena)
    rb = _check_q8k(wtype, off, rows, K, n_tok, xq, xd, bsums, out, a8.size)
    T = 1 if n_tok == 1 else 4
    R = _R_DENSE_Q8K
    NCH = _nch(K)
    kernel = _cached(_q8k_dense_kernel, wtype, T, R, NCH)
    grid_g, ks_g = _iq2_tables()
    shmem = 4 * T * _pad_words(K) if _stages_x(wtype) else 0
    rpb = _NW_Q8K * R
    grid = ((rows + rpb - 1) // rpb, (n_tok + T - 1) // T)
    kernel[grid, _NW_Q8K * WARP, _stream(stream), shmem](
        a16, a32, off, rb, rows, K // 256, _as_i32(xq), _flat(xd),
        _flat(bsums) if bsums is not None else _dummy_i32(), n_tok, _flat(out), rows, grid_g, ks_g)


def matmul_iq2_xxs(arena, off, rows, K, n_tok, xq, xd, out, stream=0):
    """IQ2_XXS weights x Q8_K activations (xq int8[n_tok*K], xd f32[n_tok*K/256]) -> out[n_tok, rows]."""
    _matmul_q8k(F.IQ2_XXS, arena, off, rows, K, n_tok, xq, xd, None, out, stream)


def matvec_iq2_xxs(arena, off, rows, K, xq, xd, out, stream=0):
    """IQ2_XXS weights x one Q8_K activation -> out[rows]."""
    _matmul_q8k(F.IQ2_XXS, arena, off, rows, K, 1, xq, xd, None, out, stream)


def matmul_q2_k(arena, off, rows, K, n_tok, xq, xd, bsums, out, stream=0):
    """Q2_K weights x Q8_K activations (with bsums int32[n_tok*K/16]) -> out[n_tok, rows]."""
    _matmul_q8k(F.Q2_K, arena, off, rows, K, n_tok, xq, xd, bsums, out, stream)


def matvec_q2_k(arena, off, rows, K, xq, xd, bsums, out, stream=0):
    """Q2_K weights x one Q8_K activation (with bsums) -> out[rows]."""
    _matmul_q8k(F.Q2_K, arena, off, rows, K, 1, xq, xd, bsums, out, stream)


def matmul_q4_k(arena, off, rows, K, n_tok, xq, xd, bsums, out, stream=0):
    """Q4_K weights x Q8_K activations (with bsums) -> out[n_tok, rows]."""
    _matmul_q8k(F.Q4_K, arena, off, rows, K, n_tok, xq, xd, bsums, out, stream)


def matvec_q4_k(arena, off, rows, K, xq, xd, bsums, out, stream=0):
    """Q4_K weights x one Q8_K activation (with bsums) -> out[rows]."""
    _matmul_q8k(F.Q4_K, arena, off, rows, K, 1, xq, xd, bsums, out, stream)


# ============================================================================================
# Routed experts (ds4-model.md §6.11)
# ============================================================================================
#
# Decode, 4 launches, all graph-capturable (expert addresses and route weights in device memory):
#   quantize_q8_k(x)                          -> xq
#   moe_gate_up: a block stages xq once and computes rows [r0, r0+RPB) of every slot; a warp
#                takes one (row, slot) unit at a time, gate and up rows loaded together:
#                mid[k, r] = silu(min(g, c)) * clip(u, -c, c) * w_k
#   quantize_q8_k(mid)  (n_used*n_ff values)  -> mq
#   moe_down:    a warp owns one output row and walks its slots in order, the next slot's
#                weights in flight while the current one is computed, adding the slot results
#                in slot order (0 + r_0 + r_1 + ...): one write per output, no atomics.
# Prefill runs the same row dots on tiles of up to T (token, slot) pairs that share an expert,
# writes each pair's down result, and adds them per token in slot order (moe_sum): every token
# equals its decode result bit for bit.

_NW_MOE = 8          # warps per block
_RPB_GATE_UP = 4     # output rows per gate/up decode block (x is staged once per block)
_NW_GATE_UP = 6      # warps per gate/up decode block (kbench tune_moe, H200, session 15, const
                     # steps: rows 4 warps 6 23.3 us, 4 x 4 23.8, 8 x 8 23.9; per-length kernel 8 x 8 26.0)
_REGS_GATE_UP = 0    # register cap of the gate/up decode kernel (0: none)
_X_REGS_GATE_UP = True  # IQ2_XXS x in registers when a row is one chunk (else staged in shared memory)
_CONST_STEPS_GATE_UP = True  # a kernel per row length (super-blocks a compile-time constant: the
                             # chunk loop unrolls; ptxas sm_90: 80 registers instead of 128, 72
                             # with _NCH_GATE_UP 2 or 1, no spills); False: one kernel for any length
_IQ2_REPACKED_GATE_UP = False  # the arena's IQ2_XXS gate/up experts are in iq2_xxs_relayout's layout
                               # (a candidate: kbench's tune sweeps relayout their experts to time it;
                               # no source writes it)
_IQ2_PERM_GATE_UP = True   # IQ2_XXS gate/up decode: signed weights from byte-permute selectors
                            # (iq2_permute, as the staged prefill kernel), 2 dp4a per grid entry
_PRE_GATE_UP = True         # the gate/up decode kernel fills its tables before pdl_enter() (they
                            # are constants: no grid writes them; H200, session 23: kbench tune_gu
                            # with PDL edges 20.82 us against 22.21, decode_ab 7.865 / 7.840 ms per
                            # step against 7.881 / 7.866)
_NCH_GATE_UP = 0     # steps per load chunk of the gate/up decode rows (0: _nch(K), the whole row up
                     # to 4 steps); with _CONST_STEPS_GATE_UP, x stays in registers for any NCH
_NW_DOWN = 4         # warps (output rows) per down decode block (2: 18.1 us, 4: 17.6, 8: 17.9)
_REGS_DOWN = 64      # its register cap: 32 warps per SM, so the 4,096 rows of a flash layer are
                     # one wave on 132 SMs (uncapped it takes 69 registers, 28 warps per SM, 1.1
                     # waves: 23.3 us against 17.6; kbench tune_moe on the H200, session 11)
_R_DOWN_SLOTS = 8    # > 0: moe_down_decode_slots (one warp per slot, this many output rows per
                     # block) where down_slots_applies; 0: moe_down_decode. ptxas sm_90: 80
                     # registers, ~220 SASS instructions per (row, slot) against ~460; kbench
                     # (H200, session 15): 12.1 us against 16.5 (R 4: 13.6, R 16: 15.5)
_REGS_DOWN_SLOTS = 0  # its register cap (0: none)
_DOWN_SB = 8         # > 0: moe_down_sb (a lane per super-block) with this many output rows per block
                     # where down_sb_applies (H200 kbench tune_down, session 30: 10.2 us against
                     # 12.1-12.2 for moe_down_decode_slots with PDL edges; rows 4: 14.1, 12: 11.8,
                     # 16: 11.0 before the activation was staged after the first copies)
_DOWN_EARLY = 1      # moe_down_sb starts its first _DOWN_EARLY weight groups' copies before pdl_enter
                     # (its fixed cost a launch: ~5 us on the H100 against ~2 for a plain read of the
                     # same bytes, kbench scale_moe; H100 kbench tune_down, session 43, PDL edges:
                     # 9.87 / 10.00 us against 10.85 / 10.98 with 0, 10.72 / 10.75 with 2; the
                     # engine's step the same within noise, decode_ab, same logits)
_SB_X_WORDS = 76     # moe_down_sb's activation words per (slot, super-block): 64 x words, 8 bsum
                     # pairs, the scale, 3 pad words (76 = 12 mod 32 banks: the 8 super-blocks'
                     # 16-byte loads of one instruction fall on 8 disjoint bank quads)


_swiglu = _inline(numerics.swiglu)     # the routed experts' SwiGLU, shared with the CPU twin


def _gate_up_x_regs(wtype, K, NCH=None, const_steps=False):
    """IQ2_XXS gate/up decode keeps the activation in registers when a row is one load chunk
    (K <= 4096): lane (q, j) reads the same 8 words of each of its super-blocks for every (row,
    slot) unit, so 8 x NCH registers replace the shared-memory staging and its 8 loads per
    sub-block (the kernel was bound by shared-memory traffic: a byte-mask sign table in shared
    memory made it slower, 30 -> 36 us, measured on the H200). A kernel with a constant step
    count (const_steps) holds the x words of all the row's steps (up to 4) for any chunk size."""
    nsteps = (K // 256 + 3) // 4
    return wtype == F.IQ2_XXS and nsteps <= (_nch(K) if const_steps else (NCH or _nch(K)))


@_inline
def _first_unit(rpb, n_ff, n_used, warp):
    """The gate/up decode blocks' work: block b takes rows b * rpb .. (rpb of them, fewer at the
    end) of every slot, as units (r - r0) * n_used + k, warp w starting at unit w. Returns the
    block's unit count and warp w's first (row, slot)."""
    r0 = cuda.blockIdx.x * rpb
    return min(rpb, n_ff - r0) * n_used, r0 + warp // n_used, warp % n_used


@_inline
def _next_unit(r, k, nwarps, n_used):
    """(row, slot) nwarps units further on, without a division per unit, in 32-bit integers
    (numba widens int32 arithmetic to 64 bits: each compare or step would be a pair)."""
    k = int32(k + nwarps)
    while k >= n_used:
        k = int32(k - n_used)
        r = int32(r + 1)
    return r, k


def _moe_gate_up_decode_kernel(wtype, NCH, max_regs=0, x_regs=False, NSB=0, perm=False, repacked=False,
                               PRE=False):
    """NSB > 0 (_CONST_STEPS_GATE_UP): a kernel for rows of exactly NSB super-blocks (the nsb
    argument is ignored): the chunk loop unrolls, the bound checks of whole steps go, and with x in
    registers those of every step of the row are held (chunks of NCH < all steps possible). The
    same loads, integers and f32 operations in the same order: the same bits. perm (IQ2_XXS):
    the byte-permute selector tables (grid_g uint32[256], ks_g uint32[128]) instead of the grid
    and sign tables; the same integers. repacked (IQ2_XXS, NSB > 0): the rows in
    iq2_xxs_relayout's layout; the same words. PRE: the tables are filled before pdl_enter()
    (constants: the fill may overlap the grid before; the same bits)."""
    perm = perm and wtype == F.IQ2_XXS
    rowdots = _rowdots(wtype, 1, 2, NCH, x_regs, NSB, perm, repacked)   # gate row and up row together
    GRID_T, KS_T, KS_N = (uint32, uint32, 129) if perm else (uint64, uint8, 128)
    stage = _stages_x(wtype) and not x_regs
    tables = _stages_x(wtype)
    NXS = (NSB + 3) >> 2 if NSB else NCH                   # steps whose x words are registers
    NX = 8 * NXS
    jit = _jit_capped(max_regs)

    @jit
    def moe_gate_up_decode(a16, a32, slot_off, n_used, xq32, xd, xbs, nsb, route_w, clamp,
                           n_ff, rb, rpb, mid, grid_g, ks_g):
        if not PRE:
            pdl_enter()
        grid_s = cuda.shared.array(256, GRID_T)
        ks_s = cuda.shared.array(KS_N, KS_T)
        if PRE:
            if tables:                                  # constants: no grid writes them
                _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)
            pdl_enter()                                 # everything below may read earlier grids' output
        if NSB:
            nsb = NSB
        xs = cuda.shared.array(0, int32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        c32 = float32(clamp)
        k4 = nsb * 64
        toks = cuda.local.array(2, int64)
        xbase = cuda.local.array(2, int64)
        toks[0] = 0
        toks[1] = 0
        xbase[0] = 0
        xbase[1] = 0
        if tables and not PRE:
            _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)
        if tables and perm and cuda.threadIdx.x == 0:
            ks_s[128] = uint32(0x2B190800)                 # iq2_permute's bytes 0, 8, 25, 43
        if stage:
            _stage_row(xs, 0, xq32, 0, k4)
        if tables:
            cuda.syncthreads()
        x_reg = cuda.local.array(NX, int32)
        if x_regs:                                     # lane (q, j): slice j of super-blocks 4u + q
            q = lane >> 3
            for u in range(NXS):
                sb = 4 * u + q
                for i in range(8):
                    x_reg[8 * u + i] = xq32[_ix(64 * sb + 8 * (lane & 7) + i)] if sb < nsb else int32(0)
        roffs = cuda.local.array(2, int64)
        res = cuda.local.array(2, float32)
        nwarps = cuda.blockDim.x >> 5
        n_units, r, k = _first_unit(rpb, n_ff, n_used, warp)
        for unit in range(warp, n_units, nwarps):     # warp-uniform loop
            roffs[0] = slot_off[k * 3] + r * rb
            roffs[1] = slot_off[k * 3 + 1] + r * rb
            rowdots(a16, a32, roffs, nsb, x_reg if x_regs else (xs if stage else xq32), xbase, xd, xbs,
                    toks, 1, grid_s, ks_s, res)
            if lane == 0:
                mid[k * n_ff + r] = _swiglu(res[0], res[1], c32, route_w[k])
            r, k = _next_unit(r, k, nwarps, n_used)

    return moe_gate_up_decode


_GU_HALVES = True  # IQ2_XXS gate/up decode rows of at most 16 super-blocks: moe_gate_up_halves
                   # (H200, kbench tune_halves: 21.3 us against 22.3, 20.3 / 20.9 with PDL edges)


def gate_up_halves_applies(wtype, K, xq):
    """moe_gate_up_halves takes IQ2_XXS rows of 1..16 super-blocks in the file's layout with the
    activation on a 16-byte boundary (it reads x in 16-byte words); else moe_gate_up_decode."""
    return (_GU_HALVES and wtype == F.IQ2_XXS and K % 256 == 0
            and 256 <= K <= 4096 and _dev_ptr(xq) % 16 == 0)


_GU_DEFER = True   # moe_gate_up_halves keeps each unit's gate and up in lane (unit index mod 32)
                   # and computes the f64 SwiGLU of 32 units at once, not one lane per unit (H100
                   # kbench: 19.92 us against 20.40 with PDL edges; 80 registers, 4 blocks per SM;
                   # in the engine the same step time, decode_ab 8.04-8.08 ms either way)


_REGS_GU_HALVES = 0   # register cap of moe_gate_up_halves (0: none; ptxas sm_90 gives it 76)


@_inline
def _halves_selectors(aux0, aux1, l, four, shk, gbase, sbase):
    """The grid and sign selector words of group l of an IQ2_XXS sub-block (moe_gate_up_halves):
    grid byte l of aux0, sign index bits 7 l .. 7 l + 6 of aux1, both looked up in shared memory."""
    gsel = lds32(imad(bfe(aux0, 8 * l, 8), four, gbase))
    # l = 0: aux1 << 2; else aux1 >> (7 l - 2): the sign index x 4 either way
    sraw = imad(aux1, four, 0) if l == 0 else mulhi(aux1, shk[l])
    return gsel, lds32(and_or(sraw, 0x7F << 2, sbase))


def _moe_gate_up_halves_kernel(NSB, PRE=True, DEFER=True, REGS=0, REPACKED=False):
    """IQ2_XXS gate/up decode with a lane per half super-block (lane = 2 sb + h: sub-blocks 4 h ..
    4 h + 3 of super-block sb, 128 weights), for rows of NSB <= 16 super-blocks; the grid, block
    shape and arguments of moe_gate_up_decode (xbs and nsb unused).

    moe_gate_up_decode gives a lane one 32-weight sub-block and adds the 8 lanes of a super-block
    with 3 shuffles per sub-block; here a lane adds its 4 sub-blocks in registers, one shuffle joins
    the two halves, and the f32 terms of a row cost one chain of shuffles. Its 32 weight bytes are
    9 aligned 4-byte loads and one funnel shift per word (a super-block is 66 bytes: half of them
    start 2 bytes off a word), 10 loads where moe_gate_up_decode has 20 (16-bit) per 128 weights.
    ptxas sm_90 (before the FMA-pipe lookups below): 70 registers, ~600 SASS instructions per
    (row, slot) unit against ~680. On the
    H200 it gains 4-5 % only (session 26): with the next unit's words in registers (118
    registers) it was 23.9 us, with each unit's rows copied to shared memory by cp.async two units
    ahead (coalesced 16-byte pieces, 128 registers) 21.1-24.3, against 21.3: neither the load
    latency nor the L1 traffic of the weight loads is what bounds it.

    The SASS (ptxas sm_90) runs a unit as a chain of dependent global round trips: the gate row's
    offset (slot_off, from L2), its words, then the up row's offset and words only after the gate
    row's sums (ptxas sinks the second row's loads below the first row's work; it hoists them only
    when allowed ~94 registers), the f16 d of each in the middle. Neither shortening that chain
    (the slots' offsets copied to shared memory once per block: 20.62 us against 20.40) nor L2
    hits for every load (the block's rows prefetched into L2 by cp.async.bulk.prefetch at its
    start: 24.5) helped (H100 kbench, PDL edges, session 34). What did: one lane's f64 SwiGLU
    (~120 instructions, a chain of ~25 DFMA) was issued by the whole warp per unit; DEFER
    (_GU_DEFER) hands each unit's two sums to lane (unit mod 32) and runs the SwiGLU of up to 32
    units in one pass (19.92 us).

    The same bits as moe_gate_up_decode: the block's integer sum is exact in any order, and the f32
    order is kept. There, lane group q (lane >> 3) adds the terms (d_w d_x) * isum of super-blocks
    sb = q, q + 4, q + 8, q + 12 with fma in that order, then the groups meet in a butterfly (xor
    16: q ^ 2, then xor 8: q ^ 1). Here the term of sb sits in lanes 2 sb, 2 sb + 1; the chain
    hands the partial sum of sb to the lanes of sb + 4 (lane xor 8 or 24: from 8-lane group g - 1
    to g, g = sb >> 2), each adding its own term with the same fma, and the butterfly runs over lane
    xor 4 (q ^ 2), then xor 2 (q ^ 1) in the last group (lanes 8 (NST - 1) ..).

    Work moved from the integer ALU pipe (54.5 % busy, the busiest: session 27's ncu) to the FMA
    pipe (18.7 %): the two table addresses of each grid entry are IMADs with a register 4 (lds32 at
    shared_addr + 4 index) instead of LEAs, the sign index's shift a mulhi by a register
    2^(34 - 7 l), its mask and base one LOP3 on a 512-aligned table (SHF + SGXT + LEA before): 9 ALU
    instructions per 8 weights become 5 + 2 IMAD (ptxas sm_90: 72 registers, 525 SASS instructions
    per unit against 554; H200 kbench: 19.7 us against 20.3-20.4 with PDL edges, session 30).
    The same words from the same tables: the same bits."""
    NST = (NSB + 3) >> 2                # chain length: super-blocks per lane group q
    LOUT = 8 * (NST - 1)                # a lane of the last group: it holds the row's sum
    NWD = 10                            # words per row and lane: 9 data words, the f16 d
    NW2 = 2 * NWD                       # local array sizes must be plain constants for numba
    # ks_s: the 128 sign masks, then the multipliers (registers, not immediates, so that ptxas
    # keeps IMAD / IMAD.HI): 4 at KC, 2^(34 - 7 l) at KC + l, then pos once per lane at KC + 4
    KC = 128
    KS_N = KC + 4 + 32
    # and_or adds the table's base: aligned past the index field (the simulator takes no
    # alignment; its addresses are aligned)
    KS_ALIGN = 0 if SIMULATOR else 512

    @_inline
    def load_half(a16, a32, roff, sb, h, valid, w, o):
        """w[o:o + 9]: the aligned words covering the lane's 32 bytes, w[o + 9]: d (f16 bits).
        REPACKED (rows in iq2_xxs_relayout's layout, 16-byte aligned): w[o:o + 8] are the
        lane's 32 bytes, two 16-byte loads (the lanes of a warp read 1 KB contiguously)."""
        start = roff + 66 * sb + 2 + 32 * h             # bytes: after d, sub-blocks 4 h ..
        base = start >> 2
        for i in range(NWD):
            w[o + i] = uint32(0)
        if REPACKED:
            if valid:
                qbase = (roff >> 2) + 16 * sb + 8 * h
                w[o], w[o + 1], w[o + 2], w[o + 3] = ld_quad(a32, _ix(qbase))
                w[o + 4], w[o + 5], w[o + 6], w[o + 7] = ld_quad(a32, _ix(qbase + 4))
                w[o + 9] = uint32(a16[_ix((roff >> 1) + 32 * NSB + sb)])
        elif valid:
            for i in range(8):
                w[o + i] = a32[_ix(base + i)]
            if start & 2:                               # 2 bytes off a word: one word more
                w[o + 8] = a32[_ix(base + 8)]
            w[o + 9] = uint32(a16[_ix((roff >> 1) + 33 * sb)])

    @_jit_capped(REGS)
    def moe_gate_up_halves(a16, a32, slot_off, n_used, xq32, xd, xbs, nsb, route_w, clamp,
                           n_ff, rb, rpb, mid, grid_g, ks_g):
        if not PRE:
            pdl_enter()
        grid_s = cuda.shared.array(256, uint32)
        if KS_ALIGN:
            ks_s = cuda.shared.array(KS_N, uint32, alignment=KS_ALIGN)
        else:
            ks_s = cuda.shared.array(KS_N, uint32)
        _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)    # constants: no grid writes them
        if PRE:
            pdl_enter()                                 # everything below may read earlier grids' output
        if cuda.threadIdx.x == 0:
            ks_s[KC] = uint32(4)
            for l in range(1, 4):
                ks_s[KC + l] = uint32(1 << (34 - 7 * l))    # mulhi by it: >> (7 l - 2)
        if cuda.threadIdx.x < 32:       # pos (iq2_permute's bytes 0, 8, 25, 43) once per lane:
            ks_s[KC + 4 + cuda.threadIdx.x] = uint32(0x2B190800)   # see below
        cuda.syncthreads()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        sb = lane >> 1
        h = lane & 1
        valid = sb < NSB
        grp = int32(sb >> 2)
        xw = cuda.local.array(32, int32)                # x of the lane's 128 weights, all rows
        for i in range(32):
            xw[i] = int32(0)
        xds = float32(0.0)
        if valid:
            for i in range(8):
                xw[4 * i], xw[4 * i + 1], xw[4 * i + 2], xw[4 * i + 3] = ld_quad(xq32, _ix(64 * sb + 32 * h + 4 * i))
            xds = xd[sb]
        # a register operand (see iq2_permute), read from a per-lane address: read from one
        # address, ptxas holds it in a uniform register and copies it into a vector one before
        # every prmt
        pos = ks_s[KC + 4 + lane]
        shk = cuda.local.array(4, uint32)              # l = 0: 4 (a multiply); else mulhi's 2^(34 - 7 l)
        for l in range(4):
            shk[l] = ks_s[KC + l]
        four = shk[0]
        gbase = shared_addr(grid_s)
        sbase = shared_addr(ks_s)
        c32 = float32(clamp)
        w = cuda.local.array(NW2, uint32)
        res = cuda.local.array(2, float32)
        roffs = cuda.local.array(2, int64)
        shs = cuda.local.array(2, uint32)
        totals = cuda.local.array(2, int32)
        terms = cuda.local.array(2, float32)
        # the unit walk in 32-bit integers (numba's are 64-bit: a compare or step costs a pair)
        nwarps = int32(cuda.blockDim.x >> 5)
        n_slots = int32(n_used)
        n_units, r64, k64 = _first_unit(rpb, n_ff, n_used, warp)
        n_units = int32(n_units)
        r = int32(r64)
        k = int32(k64)
        kept_g = float32(0.0)                           # DEFER: this lane's unit (n_kept == lane)
        kept_u = float32(0.0)
        kept_r = r
        kept_k = k
        n_kept = int32(0)
        lane32 = int32(lane)
        unit = int32(warp)
        while unit < n_units:                           # warp-uniform loop
            for m in range(2):                          # gate row, up row: all loads first
                roffs[m] = slot_off[_ix(k * 3 + m)] + r * rb
                load_half(a16, a32, roffs[m], sb, h, valid, w, m * NWD)
            # both rows' sub-blocks interleaved: ptxas keeps a load near its first use, so a
            # row computed after the other would get its words (and both d) only then
            for m in range(2):
                # the lane's bytes start 2 bytes off a word when roff/2 + sb is even
                shs[m] = uint32(16) if ((roffs[m] >> 1) + sb) & 1 == 0 and not REPACKED else uint32(0)
                totals[m] = int32(0)
                terms[m] = f16_bits_to_f32(w[m * NWD + 9]) * xds
            for s in range(4):
                for m in range(2):
                    o = m * NWD
                    if REPACKED:
                        aux0 = w[o + 2 * s]
                        aux1 = w[o + 2 * s + 1]
                    else:
                        aux0 = funnel_r(w[o + 2 * s], w[o + 2 * s + 1], shs[m])
                        aux1 = funnel_r(w[o + 2 * s + 1], w[o + 2 * s + 2], shs[m])
                    sumi = int32(0)
                    for l in range(4):
                        gsel, ssel = _halves_selectors(aux0, aux1, l, four, shk, gbase, sbase)
                        w_lo, w_hi = iq2_permute(gsel, ssel, pos)
                        sumi = dp4a(w_lo, xw[8 * s + 2 * l], sumi)
                        sumi = dp4a(w_hi, xw[8 * s + 2 * l + 1], sumi)
                    # the sub-block scale 2 s + 1, s = aux1's top nibble (a shift: bfe costs a SGXT more)
                    totals[m] = imad(sumi, imad(aux1 >> uint32(28), 2, 1), totals[m])
            for m in range(2):
                bsum = float32(int32(totals[m] + cuda.shfl_xor_sync(FULL_MASK, totals[m], 1)))
                acc = cuda.fma(terms[m], bsum, float32(0.0)) if valid else float32(0.0)
                for g in range(1, NST):                 # the chain: group g - 1 hands on to g
                    prev = cuda.shfl_xor_sync(FULL_MASK, acc, ((g - 1) ^ g) << 3)
                    if grp == int32(g):
                        acc = cuda.fma(terms[m], bsum, prev) if valid else prev
                acc += cuda.shfl_xor_sync(FULL_MASK, acc, 4)
                acc += cuda.shfl_xor_sync(FULL_MASK, acc, 2)
                res[m] = float32(0.125) * acc
            if DEFER:
                gate = cuda.shfl_sync(FULL_MASK, res[0], LOUT)
                up = cuda.shfl_sync(FULL_MASK, res[1], LOUT)
                if lane32 == n_kept:
                    kept_g, kept_u, kept_r, kept_k = gate, up, r, k
                n_kept = int32(n_kept + 1)
                if n_kept == int32(32):                 # warp-uniform
                    mid[kept_k * n_ff + kept_r] = _swiglu(kept_g, kept_u, c32, route_w[kept_k])
                    n_kept = int32(0)
            elif lane == LOUT:
                mid[k * n_ff + r] = _swiglu(res[0], res[1], c32, route_w[k])
            r, k = _next_unit(r, k, nwarps, n_slots)
            unit = int32(unit + nwarps)
        if DEFER and lane32 < n_kept:
            mid[kept_k * n_ff + kept_r] = _swiglu(kept_g, kept_u, c32, route_w[kept_k])

    return moe_gate_up_halves


def _moe_down_decode_kernel(wtype, NCH, NW, max_regs=0):
    """One warp per output row: it walks the row's (slot, chunk) units in slot order, the next
    unit's weights loading while the current one is computed, and adds the slot results in slot
    order (0 + r_0 + r_1 + ...), as ds4 does. No shared partials, no barrier after the staging."""
    load_chunk, dot_chunk, NRAW = _make_chunk_parts(wtype, 1, NCH)
    stage = _stages_x(wtype)
    scale = float32(_FINAL_SCALE[wtype])
    jit = _jit_capped(max_regs)

    @_inline
    def slot_chunk(i, n_chunks):
        """(slot, chunk) of unit i; no division when rows are one chunk (the flash shapes)."""
        k = i if n_chunks == 1 else i // n_chunks
        return k, i - k * n_chunks

    @_inline
    def load_unit(a16, a32, slot_off, r, rb, nsb, n_chunks, i, raw):
        k, c = slot_chunk(i, n_chunks)
        load_chunk(a16, a32, slot_off[k * 3 + 2] + r * rb, nsb, c * NCH, raw, 0)

    @_inline
    def dot_unit(raw, nsb, n_chunks, i, xsrc, pad, md, mbs, toks, xbase, grid_s, ks_s, acc, total):
        """Unit i's terms; at the last chunk of a slot its row result joins total."""
        k, c = slot_chunk(i, n_chunks)
        if c == 0:
            acc[0] = float32(0.0)
            toks[0] = k
            xbase[0] = k * pad
        dot_chunk(raw, 0, nsb, c * NCH, xsrc, xbase, md, mbs, toks, 0, 1, grid_s, ks_s, acc, 0)
        if c == n_chunks - 1:
            total = total + scale * _sum_groups_of_8_f32(acc[0])
        return total

    @jit
    def moe_down_decode(a16, a32, slot_off, n_used, mq32, md, mbs, nsb, rb, n_embd, out,
                        grid_g, ks_g, hc_on, hc_state, hc_fb, hc_post, hc_comb):
        pdl_enter()
        grid_s = cuda.shared.array(256, uint64)
        ks_s = cuda.shared.array(128, uint8)
        xs = cuda.shared.array(0, int32)
        k4 = nsb * 64
        pad = k4 + k4 // 8 if stage else k4
        if stage:
            _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)
            for k in range(n_used):
                _stage_row(xs, k * pad, mq32, k * k4, k4)
            cuda.syncthreads()
        r = cuda.blockIdx.x * NW + (cuda.threadIdx.x >> 5)
        if r < n_embd:                                     # warp-uniform
            n_chunks = (((nsb + 3) >> 2) + NCH - 1) // NCH
            n_units = n_used * n_chunks
            raw_a = cuda.local.array(NRAW, uint32)
            raw_b = cuda.local.array(NRAW, uint32)
            toks = cuda.local.array(1, int64)
            xbase = cuda.local.array(1, int64)
            acc = cuda.local.array(1, float32)
            xsrc = xs if stage else mq32
            total = float32(0.0)
            load_unit(a16, a32, slot_off, r, rb, nsb, n_chunks, 0, raw_a)
            for i in range(0, n_units, 2):                 # units i (raw_a) and i + 1 (raw_b)
                if i + 1 < n_units:
                    load_unit(a16, a32, slot_off, r, rb, nsb, n_chunks, i + 1, raw_b)
                total = dot_unit(raw_a, nsb, n_chunks, i, xsrc, pad, md, mbs, toks, xbase,
                                 grid_s, ks_s, acc, total)
                if i + 1 < n_units:
                    if i + 2 < n_units:
                        load_unit(a16, a32, slot_off, r, rb, nsb, n_chunks, i + 2, raw_a)
                    total = dot_unit(raw_b, nsb, n_chunks, i + 1, xsrc, pad, md, mbs, toks,
                                     xbase, grid_s, ks_s, acc, total)
            if cuda.laneid == 0:
                out[r] = total
                if hc_on:                        # the HC post of this dim (f_b: the shared expert)
                    hc_post_dim(hc_state, r, total + hc_fb[r], hc_post, hc_comb)

    return moe_down_decode


def down_slots_applies(wtype, K, n_used):
    """moe_down_decode_slots takes Q2_K rows of one load chunk (K <= 4096) and up to 32 slots."""
    return wtype == F.Q2_K and K % 256 == 0 and (K // 256 + 3) // 4 <= _nch(K) and 1 <= n_used <= 32


@_inline
def _add_slots(part, R, nr, r0, n_used, scale, out, hc_on, hc_state, hc_fb, hc_post, hc_comb):
    """After the block barrier of a down kernel with the slots' row results in part[slot * R +
    row]: a thread per output row adds them in slot order (0 + scale r_0 + scale r_1 + ..., as
    moe_down_decode does), writes the sum and does that dim's HC post (f_b: the shared expert)."""
    for rr in range(cuda.threadIdx.x, nr, cuda.blockDim.x):
        total = float32(0.0)
        for kk in range(n_used):
            total = total + scale * part[kk * R + rr]
        r = r0 + rr
        out[r] = total
        if hc_on:
            hc_post_dim(hc_state, r, total + hc_fb[r], hc_post, hc_comb)


def _moe_down_decode_slots_kernel(wtype, NSB, R, max_regs=0):
    """Down with one warp per slot: a block of n_used warps takes R output rows; warp k dots rows
    r0 .. r0 + R - 1 of slot k's expert with slot k's activation, which it holds in registers for
    the whole block (8 words, 2 bsums and the scale per step), the next row's weights loading
    while the current row is computed. The slot results go to shared memory; after one barrier a
    thread per row adds them in slot order (0 + r_0 + r_1 + ...), as moe_down_decode does, with the
    same row dot (same loads, integers, f32 steps): the same bits. Rows of NSB super-blocks (a
    compile-time constant), one load chunk. scripts/check_moe_decode_sim.py checks the indexing
    against moe_down_decode without a GPU."""
    assert wtype == F.Q2_K, "moe_down_decode_slots: Q2_K only"
    NSTEPS = (NSB + 3) >> 2
    load_chunk, dot_chunk, NRAW = _make_chunk_parts(wtype, 1, NSTEPS, True, NSB)
    scale = float32(_FINAL_SCALE[wtype])
    NXW, NXB = 8 * NSTEPS, 2 * NSTEPS       # local array sizes must be plain constants for numba
    jit = _jit_capped(max_regs)

    @_inline
    def row_dot(raw, xw, xbs2, xdr, toks, xbase, grid_s, ks_s, acc):
        acc[0] = float32(0.0)
        dot_chunk(raw, 0, NSB, 0, xw, xbase, xdr, xbs2, toks, 0, 1, grid_s, ks_s, acc, 0)
        return _sum_groups_of_8_f32(acc[0])

    @jit
    def moe_down_decode_slots(a16, a32, slot_off, n_used, mq32, md, mbs, nsb, rb, n_embd, out,
                              grid_g, ks_g, hc_on, hc_state, hc_fb, hc_post, hc_comb):
        pdl_enter()
        part = cuda.shared.array(0, float32)           # [n_used, R] slot results
        k = cuda.threadIdx.x >> 5                      # this warp's slot
        lane = cuda.laneid
        q = lane >> 3
        j = lane & 7
        r0 = cuda.blockIdx.x * R
        nr = min(R, n_embd - r0)
        # slot k's activation as _make_compute_q2_k reads it with x_regs: step u of lane (q, j)
        # is super-block 4u + q, its words j + 8s + 32h, bsums 2j and 2j + 1, scale
        xw = cuda.local.array(NXW, int32)
        xbs2 = cuda.local.array(NXB, int32)
        xdr = cuda.local.array(NSTEPS, float32)
        for u in range(NSTEPS):
            sb = 4 * u + q
            ok = (u + 1) * 4 <= NSB or sb < NSB
            xb = k * (64 * NSB) + 64 * sb + j
            bs = k * (16 * NSB) + 16 * sb + 2 * j
            for h in range(2):
                for s in range(4):
                    xw[8 * u + 4 * h + s] = mq32[_ix(xb + 32 * h + 8 * s)] if ok else int32(0)
            xbs2[2 * u] = mbs[_ix(bs)] if ok else int32(0)
            xbs2[2 * u + 1] = mbs[_ix(bs + 1)] if ok else int32(0)
            xdr[u] = md[_ix(k * NSB + sb)] if ok else float32(0.0)
        toks = cuda.local.array(1, int64)              # unused with x in registers
        xbase = cuda.local.array(1, int64)
        toks[0] = 0
        xbase[0] = 0
        acc = cuda.local.array(1, float32)
        raw_a = cuda.local.array(NRAW, uint32)
        raw_b = cuda.local.array(NRAW, uint32)
        base = slot_off[k * 3 + 2] + r0 * rb
        load_chunk(a16, a32, base, NSB, 0, raw_a, 0)
        for i in range(0, nr, 2):                      # rows i (raw_a) and i + 1 (raw_b)
            if i + 1 < nr:
                load_chunk(a16, a32, base + (i + 1) * rb, NSB, 0, raw_b, 0)
            v = row_dot(raw_a, xw, xbs2, xdr, toks, xbase, grid_g, ks_g, acc)
            if lane == 0:
                part[k * R + i] = v
            if i + 1 < nr:
                if i + 2 < nr:
                    load_chunk(a16, a32, base + (i + 2) * rb, NSB, 0, raw_a, 0)
                v = row_dot(raw_b, xw, xbs2, xdr, toks, xbase, grid_g, ks_g, acc)
                if lane == 0:
                    part[k * R + i + 1] = v
        cuda.syncthreads()
        _add_slots(part, R, nr, r0, n_used, scale, out, hc_on, hc_state, hc_fb, hc_post, hc_comb)

    return moe_down_decode_slots


def _down_sb_shmem(n_used, NSB, R):
    """moe_down_sb's dynamic shared memory in bytes: the slot results (rounded to 4 words), the
    slots' activations, and each warp's two stages of 4 weight rows."""
    return 4 * (((n_used * R + 3) & ~3) + n_used * NSB * _SB_X_WORDS + n_used * 2 * 4 * 21 * NSB)


def down_sb_applies(wtype, K, n_used, R):
    """moe_down_sb takes Q2_K rows of 1..8 super-blocks (K <= 2048: the flash experts), rows per
    block a multiple of 4, and needs its shared memory under the 48 KB a launch gets unasked."""
    NSB = K // 256
    return (wtype == F.Q2_K and K % 256 == 0 and 1 <= NSB <= 8 and R > 0 and R % 4 == 0
            and 1 <= n_used <= 32 and _down_sb_shmem(n_used, NSB, R) <= 48 * 1024)


@_inline
def _q2_k_sb_half(su, o, xo, h, acc):
    """Half h (128 weights) of a Q2_K super-block whose 21 words start at su[o], against the
    activation words at su[xo] (moe_down_sb): acc[s] += scale x (sum of q << 2s times x) for the
    8 sub-blocks, by shift s."""
    sc_lo = su[_ix(o + 2 * h)] & _LOW4                 # the scales of sub-blocks 8 h .. 8 h + 3
    sc_hi = su[_ix(o + 2 * h + 1)] & _LOW4             # and 8 h + 4 .. 8 h + 7
    for half in range(2):
        qo = o + 4 + 8 * h + 4 * half
        q0 = su[_ix(qo)]
        q1 = su[_ix(qo + 1)]
        q2 = su[_ix(qo + 2)]
        q3 = su[_ix(qo + 3)]
        for s in range(4):
            m = uint32(0x03030303 << (2 * s))
            x0, x1, x2, x3 = ld_quad(su, _ix(xo + 32 * h + 8 * s + 4 * half))
            dp = dp4a_us(q0 & m, x0, 0)
            dp = dp4a_us(q1 & m, x1, dp)
            dp = dp4a_us(q2 & m, x2, dp)
            dp = dp4a_us(q3 & m, x3, dp)
            sub = 2 * s + half                          # within the half: 0 .. 7
            sc = bfe(sc_lo if sub < 4 else sc_hi, 8 * (sub & 3), 8)
            acc[s] = imad(sc, dp, acc[s])


def _moe_down_sb_kernel(NSB, R, EARLY=1):
    """Down decode with a lane per super-block: the block and arguments of moe_down_decode_slots
    (warp k = slot k, R output rows); lane (rho, sb) = (lane >> 3, lane & 7) dots super-block sb of
    row 4 g + rho, so a warp takes 4 rows at once, in R / 4 groups.

    moe_down_decode_slots gives a lane 32 weights of a super-block: each of the 8 lanes of a
    super-block loads its 4 scale words and d again, and their integer partials meet in 6
    shuffles per super-block (~3 warp instructions per 32 weights and lane, ~244 per row). Here a
    lane does a whole super-block in registers:
    * the qs bits of shift s are masked in place (byte values q << 2s, at most 192: dp4a_us) and
      the sub-block sums of one shift kept apart, divided by 4^s once (exact: multiples of 4^s);
    * the min sums are 8 dp2a of the bsums as 16-bit pairs (|bsum| <= 2032) with the 4-bit mins;
    * the weights come through shared memory: each group's 4 rows are contiguous (4 x 84 NSB
      bytes), copied by cp.async in 16-byte pieces (coalesced) one group ahead, and each lane reads
      its 21 words at 21 lane + i: conflict-free (21 is odd). Rows off 16 bytes (an expert base, or
      NSB not a multiple of 4) are copied word by word instead;
    * the activation (x words, bsum pairs, scale) of each slot is staged once per block.
    The integers are those of every Q2_K kernel (exact), the f32 term of a super-block is
    _make_compute_q2_k's, and the order of the sums is moe_down_decode's: term(q) + term(q + 4)
    (lane xor 4), then the butterfly over q ^ 2 (lane xor 2) and q ^ 1 (lane xor 1), where
    _sum_groups_of_8_f32 has lane xor 16 and 8; the slots meet as in moe_down_decode_slots. So the
    same bits. scripts/check_moe_decode_sim.py checks them without a GPU.

    The activation is staged after the first weight group's copies have started (H200 kbench,
    session 30: 10.2 us against 11.0 staged before them; its x words by cp.async too: 12.1-12.3;
    groups 0 and 1 both copied before the staging: 11.9-12.2 against 10.9-11.1 on the H100,
    session 34).

    EARLY > 0 (_DOWN_EARLY, 1 by default): the first EARLY weight groups' copies start before
    pdl_enter, while the previous grid still runs. Legal because slot_off is written at least two
    grids earlier (route or the host, then gate/up, then the middle's Q8_K): this grid is launched
    only once the previous one passed its own griddepcontrol.wait (pdl_enter waits, then lets
    dependents launch), so the grid before that has finished and its writes are visible; the
    weights are constant. EARLY 0 keeps the kernel before session 43 instruction for instruction
    (group 0 fetched after the wait, its commit after the staging), for comparisons."""
    assert 1 <= NSB <= 8 and R % 4 == 0
    scale = float32(_FINAL_SCALE[F.Q2_K])
    RW = 21 * NSB                        # words per row
    GW = 4 * RW                          # words per group of 4 rows (one stage)
    NG = R // 4
    XW = _SB_X_WORDS

    @_inline
    def stage_x(su, sf, xs0, k, lane, mq32, mbs, md):
        """Slot k's activation at su[xs0:]: per super-block 64 x words, 8 bsum pairs, the scale."""
        for i in range(lane, NSB * 64, 32):
            su[_ix(xs0 + (i >> 6) * XW + (i & 63))] = uint32(mq32[_ix(k * NSB * 64 + i)])
        for i in range(lane, NSB * 8, 32):
            b = k * 16 * NSB + 2 * i
            su[_ix(xs0 + (i >> 3) * XW + 64 + (i & 7))] = (uint32(mbs[_ix(b)]) & _M16) | (uint32(mbs[_ix(b + 1)]) << uint32(16))
        for i in range(lane, NSB, 32):
            sf[_ix(xs0 + i * XW + 72)] = md[_ix(k * NSB + i)]

    @_inline
    def fetch(su, a32, so, wbase, rw, nr, aligned, lane, g):
        """Start copying weight group g (rows 4 g .. 4 g + 3 of the block) into stage g & 1."""
        if g < NG and 4 * g < nr:
            src = wbase + 4 * g * rw
            dst = so + (g & 1) * GW
            words = min(4, nr - 4 * g) * rw
            if aligned:
                for p in range(lane, words >> 2, 32):
                    cp_async16_at(su, dst + 4 * p, 0, a32, src, 4 * p)
            else:
                for i in range(lane, words, 32):
                    su[_ix(dst + i)] = a32[_ix(src + i)]

    @_jit_capped(0)
    def moe_down_sb(a16, a32, slot_off, n_used, mq32, md, mbs, nsb, rb, n_embd, out,
                    grid_g, ks_g, hc_on, hc_state, hc_fb, hc_post, hc_comb):
        if not EARLY:
            pdl_enter()
        su = cuda.shared.array(0, uint32)             # dynamic shared memory, as words ...
        sf = cuda.shared.array(0, float32)            # ... and as floats (the same bytes)
        part_n = (n_used * R + 3) & ~3                # [n_used, R] slot results first
        k = cuda.threadIdx.x >> 5                     # this warp's slot
        lane = cuda.threadIdx.x & 31
        sb = lane & 7
        rho = lane >> 3
        r0 = cuda.blockIdx.x * R
        nr = min(R, n_embd - r0)
        xs0 = part_n + k * NSB * XW                   # slot k's activation
        so = part_n + n_used * NSB * XW + k * 2 * GW  # this warp's two stages
        ebase = slot_off[k * 3 + 2]                   # slot k's expert (bytes)
        wbase = (ebase + r0 * rb) >> 2                # row r0 (words)
        rw = rb >> 2
        aligned = (ebase & 15) == 0 and (rb & 15) == 0
        if EARLY:
            for g in range(EARLY):                    # before the wait: see the docstring
                fetch(su, a32, so, wbase, rw, nr, aligned, lane, g)
                cp_async_commit()
            pdl_enter()
        else:
            fetch(su, a32, so, wbase, rw, nr, aligned, lane, 0)
        stage_x(su, sf, xs0, k, lane, mq32, mbs, md)  # while group 0's copies are under way
        if not EARLY:
            cp_async_commit()
        for g in range(1, NG + 1):
            if EARLY == 0 or g >= EARLY:              # (an empty group keeps wait1's count)
                fetch(su, a32, so, wbase, rw, nr, aligned, lane, g)
            cp_async_commit()
            gg = g - 1                                # compute group gg (its copies are done)
            cp_async_wait1()
            _warp_sync()
            row = 4 * gg + rho
            term = float32(0.0)
            if sb < NSB and row < nr:
                o = so + (gg & 1) * GW + rho * RW + 21 * sb
                xo = xs0 + sb * XW
                acc = cuda.local.array(4, int32)      # the sub-block sums of shift s, times 4^s
                for s in range(4):
                    acc[s] = int32(0)
                _q2_k_sb_half(su, o, xo, 0, acc)        # two calls, not a loop: both unroll
                _q2_k_sb_half(su, o, xo, 1, acc)
                isum = int32(acc[0] + (acc[1] >> 2) + (acc[2] >> 4) + (acc[3] >> 6))
                summs = int32(0)
                for kk in range(4):
                    mins = (su[_ix(o + kk)] >> uint32(4)) & _LOW4
                    summs = dp2a_lo(su[_ix(xo + 64 + 2 * kk)], mins, summs)
                    summs = dp2a_hi(su[_ix(xo + 65 + 2 * kk)], mins, summs)
                dd = su[_ix(o + 20)]
                d = f16_bits_to_f32(dd & _M16)
                dmin = f16_bits_to_f32(dd >> uint32(16))
                xdv = sf[_ix(xo + 72)]
                term = cuda.fma(xdv * d, float32(isum), -((xdv * dmin) * float32(summs)))
            v = term + cuda.shfl_xor_sync(FULL_MASK, term, 4)     # term(q) + term(q + 4)
            v += cuda.shfl_xor_sync(FULL_MASK, v, 2)              # the butterfly over q
            v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
            if sb == 0 and row < nr:
                sf[_ix(k * R + row)] = v
            _warp_sync()                              # the stage is free for group gg + 2
        cuda.syncthreads()
        _add_slots(sf, R, nr, r0, n_used, scale, out, hc_on, hc_state, hc_fb, hc_post, hc_comb)

    return moe_down_sb


def _moe_gate_up_tiles_kernel(wtype, T, NCH):
    """Prefill: each block takes one tile (<= T (token, slot) pairs sharing an expert) and
    NW rows; gate and up for all pairs of the tile, the same arithmetic as decode."""
    NWM = _NW_MOE   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    rowdots = _rowdots(wtype, T, 2, NCH)
    stage = _stages_x(wtype)
    T2 = 2 * T

    @_jit_capped(0)
    def moe_gate_up_tiles(a16, a32, tile_off, tile_tok, tile_slot, tile_cnt, n_used, xq32, xd,
                          xbs, nsb, route_w, clamp, n_ff, rb, mid, grid_g, ks_g):
        pdl_enter()
        grid_s = cuda.shared.array(256, uint64)
        ks_s = cuda.shared.array(128, uint8)
        xs = cuda.shared.array(0, int32)
        tile = cuda.blockIdx.y
        cnt = tile_cnt[tile]
        if cnt <= 0:                      # block-uniform
            return
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        c32 = float32(clamp)
        k4 = nsb * 64
        pad = k4 + k4 // 8
        toks = cuda.local.array(T2, int64)
        xbase = cuda.local.array(T2, int64)
        for tt in range(T):
            tok = tile_tok[tile * T + tt] if tt < cnt else tile_tok[tile * T]
            for r in range(2):
                toks[r * T + tt] = tok
                xbase[r * T + tt] = tt * pad if stage else tok * k4
        if stage:
            _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)
            for tt in range(T):
                if tt < cnt:
                    _stage_row(xs, tt * pad, xq32, toks[tt] * k4, k4)
            cuda.syncthreads()
        r = cuda.blockIdx.x * NWM + warp
        if r < n_ff:                          # warp-uniform
            roffs = cuda.local.array(2, int64)
            roffs[0] = tile_off[tile * 3] + r * rb
            roffs[1] = tile_off[tile * 3 + 1] + r * rb
            res = cuda.local.array(T2, float32)
            rowdots(a16, a32, roffs, nsb, xs if stage else xq32, xbase, xd, xbs, toks, cnt,
                    grid_s, ks_s, res)
            if lane == 0:
                for tt in range(T):
                    if tt < cnt:
                        pair = toks[tt] * n_used + tile_slot[tile * T + tt]
                        mid[pair * n_ff + r] = _swiglu(res[tt], res[T + tt], c32, route_w[pair])

    return moe_gate_up_tiles


_MMA_HALVES_DN = 2   # 8-pair MMA columns per down tile (as _MMA_HALVES_GU)
_MMA_STAGED_DN = True  # moe_prefill's Q2_K down projection: the shared-memory kernel
                       # (_moe_down_tiles_staged_kernel), else _moe_down_tiles_mma_kernel
_MMA_HALVES_GU = 2   # 8-pair MMA columns per gate/up tile: a tile of up to 16 pairs decodes each
                     # IQ2 A fragment once for two MMAs (a 512-token chunk gives ~12 pairs/expert)


def _moe_gate_up_tiles_mma_kernel(NH):
    """Prefill gate/up for IQ2_XXS experts on the int8 tensor cores: a warp takes 16 rows x one
    tile of <= 8·NH pairs (NH MMA column halves of 8 pairs). Per super-block, 8 x NH MMAs (one per
    32-weight sub-block and half; the thread decodes its A bytes from the grid and sign tables once
    for all halves) give the exact integer sub-block dots; weighted by the sub-block scales they
    make the super-block's integer sum, which meets the f32 side in the decode kernel's order: lane
    group q = sb % 4 accumulates fma(d_w·d_x, sum) over its super-blocks, then (q0 + q2) + (q1 +
    q3), times 1/8. So mid equals moe_decode's bit for bit, whatever NH."""
    NWM = _MMA_WARPS   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    scale = float32(_FINAL_SCALE[F.IQ2_XXS])
    TILE = 8 * NH
    NACC = 32 * NH
    NB = 4 * NH

    @_jit_capped(0)
    def moe_gate_up_tiles_mma(a16, tile_off, tile_tok, tile_slot, tile_cnt, n_used, xq64, xd, nsb,
                              route_w, clamp, n_ff, rb, mid, grid_g, ks_g):
        pdl_enter()
        grid_s = cuda.shared.array(256, uint64)
        ks_s = cuda.shared.array(128, uint8)
        tile = cuda.blockIdx.y
        cnt = tile_cnt[tile]
        if cnt <= 0:                                   # block-uniform
            return
        _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)
        cuda.syncthreads()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        gid = lane >> 2
        tig = lane & 3
        row0 = (cuda.blockIdx.x * NWM + warp) * 16
        if row0 >= n_ff:                               # warp-uniform, after the only barrier
            return
        r_lo = min(row0 + gid, n_ff - 1)
        r_hi = min(row0 + gid + 8, n_ff - 1)
        base = tile * TILE
        halves = (cnt + 7) >> 3                                # column halves holding pairs
        tok_b = cuda.local.array(NH, int64)                    # B column of half h: pair 8h + gid
        tok_c0 = cuda.local.array(NH, int64)                   # C columns: pairs 8h + 2 tig (+ 1)
        tok_c1 = cuda.local.array(NH, int64)
        for h in range(NH):
            tok_b[h] = tile_tok[base + min(8 * h + gid, cnt - 1)]
            tok_c0[h] = tile_tok[base + min(8 * h + 2 * tig, cnt - 1)]
            tok_c1[h] = tile_tok[base + min(8 * h + 2 * tig + 1, cnt - 1)]
        words = 32 * nsb                                       # int64 words per token of xq
        acc = cuda.local.array(NACC, float32)                  # [h][gate/up][q][lo c0, lo c1, hi c0, hi c1]
        for e in range(NACC):
            acc[e] = float32(0.0)
        bsum = cuda.local.array(NB, int32)
        for sb0 in range(0, nsb, 4):
            for q in range(4):                     # q = sb % 4: constant accumulator indices
                sb = sb0 + q
                if sb >= nsb:
                    continue
                for m in range(2):                 # gate, up
                    h_lo = (tile_off[tile * 3 + m] + r_lo * rb) // 2 + 33 * sb
                    h_hi = (tile_off[tile * 3 + m] + r_hi * rb) // 2 + 33 * sb
                    for e in range(NB):
                        bsum[e] = int32(0)
                    for j in range(8):
                        aux0_lo = _u16pair(a16, h_lo + 1 + 4 * j)
                        aux1_lo = _u16pair(a16, h_lo + 3 + 4 * j)
                        aux0_hi = _u16pair(a16, h_hi + 1 + 4 * j)
                        aux1_hi = _u16pair(a16, h_hi + 3 + 4 * j)
                        # k order (Q8_0 section): lane tig takes the 8 weights of grid entry tig
                        a0, a2 = _iq2_entry(grid_s, ks_s, aux0_lo, aux1_lo, tig)
                        a1, a3 = _iq2_entry(grid_s, ks_s, aux0_hi, aux1_hi, tig)
                        ls_lo = imad(bfe(aux1_lo, 28, 4), 2, 1)
                        ls_hi = imad(bfe(aux1_hi, 28, 4), 2, 1)
                        for h in range(NH):
                            if h < halves:                 # warp-uniform
                                bx = xq64[_ix(tok_b[h] * words + 32 * sb + 4 * j + tig)]
                                c0, c1, c2, c3 = mma_s8(a0, a1, a2, a3, bx, bx >> 32)
                                bsum[4 * h] = imad(c0, ls_lo, bsum[4 * h])
                                bsum[4 * h + 1] = imad(c1, ls_lo, bsum[4 * h + 1])
                                bsum[4 * h + 2] = imad(c2, ls_hi, bsum[4 * h + 2])
                                bsum[4 * h + 3] = imad(c3, ls_hi, bsum[4 * h + 3])
                    dw_lo = f16_bits_to_f32(a16[_ix(h_lo)])
                    dw_hi = f16_bits_to_f32(a16[_ix(h_hi)])
                    for h in range(NH):
                        xd0 = xd[_ix(tok_c0[h] * nsb + sb)]
                        xd1 = xd[_ix(tok_c1[h] * nsb + sb)]
                        e = 32 * h + 16 * m + 4 * q
                        acc[e] = cuda.fma(dw_lo * xd0, float32(bsum[4 * h]), acc[e])
                        acc[e + 1] = cuda.fma(dw_lo * xd1, float32(bsum[4 * h + 1]), acc[e + 1])
                        acc[e + 2] = cuda.fma(dw_hi * xd0, float32(bsum[4 * h + 2]), acc[e + 2])
                        acc[e + 3] = cuda.fma(dw_hi * xd1, float32(bsum[4 * h + 3]), acc[e + 3])
        c32 = float32(clamp)
        for h in range(NH):
            for k in range(4):
                row = row0 + gid + 8 * (k >> 1)
                col = 8 * h + 2 * tig + (k & 1)
                if row < n_ff and col < cnt:
                    o = 32 * h
                    g = scale * ((acc[o + k] + acc[o + 8 + k]) + (acc[o + 4 + k] + acc[o + 12 + k]))
                    u = scale * ((acc[o + 16 + k] + acc[o + 24 + k]) + (acc[o + 20 + k] + acc[o + 28 + k]))
                    pair = tile_tok[base + col] * n_used + tile_slot[base + col]
                    mid[_ix(pair * n_ff + row)] = _swiglu(g, u, c32, route_w[_ix(pair)])

    return moe_gate_up_tiles_mma


# ---- gate/up prefill with staged step tiles ---------------------------------------------------
#
# The kernel above is instruction-bound (ncu, session 12: ~115 instructions per MMA): each lane
# reads its rows' IQ2_XXS words as 16-bit loads with 64-bit addresses (the 4 lanes of a quad the
# same words), each warp loads the tile's activations from global memory on its own, and the
# sign bits go through negate_bytes. The staged kernel (below) is the staged Q8_0 kernel's recipe:
#
# * block = 8 warps over 64 rows of gate (warps 0-3) and the same 64 rows of up (warps 4-7), one
#   tile of <= 8·NH pairs; a step is 2 super-blocks (132 bytes a row: 33 aligned 32-bit words,
#   the row bytes 66·nsb being a multiple of 4 when nsb is even);
# * the step's 128 weight rows and the tile's activations (2 x 256 bytes a pair) are loaded with
#   coalesced loads into registers one step ahead, then stored into shared memory between two
#   barriers: each activation word crosses L2 once per block instead of once per warp;
# * a lane reads its two rows' aux words from shared memory at constant offsets.
#
# f32 order (bit-identical to moe_decode and the kernel above): sum bank q = sb % 4 of each
# (row, pair) accumulates fma(d_w·d_x, isum, acc) over its super-blocks in order; a step covers
# banks 0 and 1 (sb = 2s, 2s + 1 with s even) or 2 and 3, so the banks swap halves after every
# step (constant register indices whatever the compiler unrolls) and the end sums (b0 + b2) +
# (b1 + b3), the same bits in either orientation (a + b == b + a). Gate and up meet in shared
# memory for the SwiGLU.

_MMA_STAGED_GU = True   # the engine's IQ2_XXS gate/up prefill uses the staged kernel where it applies
_GU_ST_ROWS = 64        # rows of each matrix per block (4 warps x 16 for gate, 4 for up)
_GU_ST_REGS = 128       # register cap: two blocks of 256 threads per SM
_GU_ST_WPAD = 33        # 32-bit words per staged weight row (33 used; odd: 8 rows, 8 banks)
_GU_ST_XPAD = 68        # 64-bit words per staged pair (64 used; 68 = 4 mod 16: a half-warp's
                        # loads, 4 pairs x 4 lanes, fall on distinct banks)


def gate_up_staged_applies(n_embd):
    """The staged gate/up kernel's shape condition: whole steps of 2 super-blocks (the expert
    offsets must also be multiples of 4 bytes, as GGUF tensor offsets are)."""
    return n_embd % 512 == 0


# The staged kernel's decode (the "lean" one; the first staged kernel, removed in session 16, took
# 1,086 SASS instructions for 32 MMAs in its step loop, by kind 328 IMAD, 193 LOP3, 181 LDS,
# 128 SHF, 74 LEA; this one 944), none of it in the integer dots or the f32 side (the same A
# bytes, the same MMAs, the same imad / fma sequence per output as the first kernel, so the same
# bits):
#
# * the signed weights from byte-permute selectors (iq2_permute): the grid as 4-bit selectors of
#   the bytes 8, 25, 43 (uint32 per entry) and the signs as selector bit 2 (uint32 per pattern),
#   so an entry is 2 LDS.32 + 4 instructions instead of 2 LDS.64 + 6 (the sign table as 8-byte
#   masks, each word negated by (g ^ m) + (m & 0x01010101), the first kernel's), and
#   the tables' loads are half the bytes (32 lanes' random entries: fewer bank wavefronts);
# * the table offsets in 2 instructions (a rotate or 64-bit shift that lands the index at its
#   byte offset, then one mask) instead of 3, and super-block 0 of a step (it starts 2 bytes
#   into the words) without funnel shifts: a lane's index field is taken from the two words by one
#   64-bit shift (shr64_lo), the scale from the third word;
# * the step's weight loads from 32-bit row offsets in shared memory added to one 64-bit base per
#   matrix and step, instead of 64-bit offsets per row (LDS.64, 64-bit add, LEA pair per row).
#
# Copies of each table in shared memory (lane l reading copy l % copies, to spread a warp's random
# lookups over more banks) were slower: H200, session 16, MoE prefill of 2,048 tokens, one copy
# 5.29 ms, 2/4/8 copies 5.39/5.40/5.44 ms (removed).
#
# H200, session 16, 2,048-token prefill of the flash preset: 2,426 -> 2,581 tok/s against the
# first staged kernel; kbench MoE prefill of 2,048 tokens 6.68 -> 5.29 ms.

_SEL_TABLES = None


def iq2_selector_tables():
    """Host tables of the staged gate/up kernel: the IQ2_XXS grid as byte-permute selectors
    (uint32[256]: nibble k = 1, 2, 3 for the value 8, 25, 43 of weight k) and the 128 sign
    patterns as selector bit 2 (uint32[128]: nibble k = 4 where weight k is negated)."""
    code = np.zeros(256, np.uint32)
    code[[8, 25, 43]] = [1, 2, 3]
    grid = F.IQ2XXS_GRID_BYTES
    assert np.all(code[grid] > 0), "IQ2_XXS grid values other than 8, 25, 43"
    nib = np.uint32(1) << (np.uint32(4) * np.arange(8, dtype=np.uint32))
    gsel = (code[grid] * nib).sum(axis=1).astype(np.uint32)
    bits = (F.KSIGNS_IQ2XS[:, None].astype(np.uint32) >> np.arange(8, dtype=np.uint32)) & np.uint32(1)
    ssel = (bits * np.uint32(4) * nib).sum(axis=1).astype(np.uint32)
    return gsel, ssel


def _iq2_selector_tables_device():
    global _SEL_TABLES
    if _SEL_TABLES is None:
        _SEL_TABLES = tuple(cuda.to_device(t) for t in iq2_selector_tables())
    return _SEL_TABLES


def _moe_gate_up_tiles_staged_kernel(NH, max_regs=_GU_ST_REGS):
    """IQ2_XXS gate/up of moe_prefill, staged (the recipe above): grid (row groups of _GU_ST_ROWS,
    tiles), 256 threads; the launch of _moe_gate_up_tiles_mma_kernel with the selector tables
    (iq2_selector_tables) as its last two arguments instead of the grid and sign tables, and the
    same numbers."""
    GROWS = _GU_ST_ROWS   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    scale = float32(_FINAL_SCALE[F.IQ2_XXS])
    TILE = 8 * NH
    NB = 4 * NH
    NACC = 4 * NB
    ROWS = 2 * GROWS
    WP = _GU_ST_WPAD
    XP = _GU_ST_XPAD
    RPW = ROWS // 8
    PPW = TILE // 8
    XCH = 4 * NB * WARP
    SW_N = ROWS * WP
    SX_N = TILE * XP
    SXD_N = 2 * TILE
    PW_N = RPW + 1
    PX_N = 2 * PPW
    SH = 2                                      # log2 of a table entry's bytes
    MG = np.uint32(0xFF << SH)                  # the grid index field at its byte offset
    MS = np.uint32(0x7F << SH)                  # the sign index field
    assert ROWS == 128 and RPW == 16

    @_inline
    def load_step(a32, rbase, roff, wbase_g, wbase_u, xq64, xd, s, tok_w, tok_d, words, nsb, warp, lane,
                  tid, pw, px, pd):
        """As the staged kernel's; rows w + 8i are gate rows for i < 8, up rows after (the
        32-bit word offsets roff from the matrix's first word, wbase_*)."""
        bg = uint64(wbase_g + 33 * s + lane)           # unsigned: int64 + uint64 would be a float
        bu = uint64(wbase_u + 33 * s + lane)
        for i in range(RPW):
            if i < RPW // 2:
                pw[i] = a32[_ix(bg + uint64(roff[_ix(warp + 8 * i)]))]
            else:
                pw[i] = a32[_ix(bu + uint64(roff[_ix(warp + 8 * i)]))]
        if lane < RPW:
            pw[RPW] = a32[_ix(rbase[_ix(warp + 8 * lane)] + 33 * s + 32)]
        for i in range(PPW):
            src = tok_w[i] * words + 64 * s + lane
            px[2 * i] = xq64[_ix(src)]
            px[2 * i + 1] = xq64[_ix(src + 32)]
        if tid < 2 * TILE:
            pd[0] = xd[_ix(tok_d * nsb + 2 * s + (tid & 1))]

    @_inline
    def store_step(sw, sx, sxd, warp, lane, tid, pw, px, pd):
        for i in range(RPW):
            sw[_ix((warp + 8 * i) * WP + lane)] = pw[i]
        if lane < RPW:
            sw[_ix((warp + 8 * lane) * WP + 32)] = pw[RPW]
        for i in range(PPW):
            o = (warp + 8 * i) * XP + lane
            sx[_ix(o)] = px[2 * i]
            sx[_ix(o + 32)] = px[2 * i + 1]
        if tid < 2 * TILE:
            sxd[_ix(tid)] = pd[0]

    @_inline
    def row_fields(sw, gsel_s, ssel_s, r, b, j, lsh):
        """Row offset r's group j of super-block b: its entry's selector words (this lane's grid
        entry of the 4) and its scale 2·s + 1. Super-block 0 starts 2 bytes into the words: the
        aux words are bits 16.. of the pairs (w0, w1), (w1, w2), so a field at bit p of aux is
        bit p + 16 of the pair (one 64-bit shift); the scale, bits 28..31 of aux1, is bits
        12..15 of w2. lsh: the lane's shifts (b0 grid, b0 sign, b1 grid, b1 sign)."""
        if b == 0:
            w0 = sw[_ix(r + 2 * j)]
            w1 = sw[_ix(r + 2 * j + 1)]
            w2 = sw[_ix(r + 2 * j + 2)]
            og = shr64_lo(w0, w1, lsh[0]) & MG
            os = shr64_lo(w1, w2, lsh[1]) & MS
            ls = imad((w2 >> uint32(12)) & uint32(15), 2, 1)
        else:
            aux0 = sw[_ix(r + 17 + 2 * j)]
            aux1 = sw[_ix(r + 18 + 2 * j)]
            og = funnel_r(aux0, aux0, lsh[2]) & MG
            os = funnel_r(aux1, aux1, lsh[3]) & MS
            ls = imad(aux1 >> uint32(28), 2, 1)
        return gsel_s[_ix(og >> uint32(2))], ssel_s[_ix(os >> uint32(2))], ls

    @_inline
    def block_scale(sw, r, b):
        if b == 0:
            return f16_bits_to_f32(sw[_ix(r)] & _M16)
        return f16_bits_to_f32(sw[_ix(r + 16)] >> uint32(16))

    @_inline
    def group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, j, bsum):
        g_lo, s_lo, ls_lo = row_fields(sw, gsel_s, ssel_s, r_lo, b, j, lsh)
        g_hi, s_hi, ls_hi = row_fields(sw, gsel_s, ssel_s, r_hi, b, j, lsh)
        # k order (Q8_0 section): lane tig takes the 8 weights of grid entry tig
        a0, a2 = iq2_permute(g_lo, s_lo, pos)
        a1, a3 = iq2_permute(g_hi, s_hi, pos)
        for h in range(NH):
            if h < halves:                     # warp-uniform
                bx = sx[_ix(xo + h * 8 * XP + 32 * b + 4 * j)]
                c0, c1, c2, c3 = mma_s8(a0, a1, a2, a3, bx, bx >> uint64(32))
                bsum[4 * h] = imad(c0, ls_lo, bsum[4 * h])
                bsum[4 * h + 1] = imad(c1, ls_lo, bsum[4 * h + 1])
                bsum[4 * h + 2] = imad(c2, ls_hi, bsum[4 * h + 2])
                bsum[4 * h + 3] = imad(c3, ls_hi, bsum[4 * h + 3])

    @_inline
    def super_block(sw, sx, sxd, gsel_s, ssel_s, r_lo, r_hi, xo, tig, lsh, pos, halves, b, acc, bsum):
        for e in range(NB):
            bsum[e] = int32(0)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 0, bsum)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 1, bsum)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 2, bsum)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 3, bsum)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 4, bsum)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 5, bsum)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 6, bsum)
        group(sw, sx, gsel_s, ssel_s, r_lo, r_hi, xo, lsh, pos, halves, b, 7, bsum)
        dw_lo = block_scale(sw, r_lo, b)
        dw_hi = block_scale(sw, r_hi, b)
        for h in range(NH):
            xd0 = sxd[_ix((8 * h + 2 * tig) * 2 + b)]
            xd1 = sxd[_ix((8 * h + 2 * tig + 1) * 2 + b)]
            e = NB * b + 4 * h
            acc[e] = cuda.fma(dw_lo * xd0, float32(bsum[4 * h]), acc[e])
            acc[e + 1] = cuda.fma(dw_lo * xd1, float32(bsum[4 * h + 1]), acc[e + 1])
            acc[e + 2] = cuda.fma(dw_hi * xd0, float32(bsum[4 * h + 2]), acc[e + 2])
            acc[e + 3] = cuda.fma(dw_hi * xd1, float32(bsum[4 * h + 3]), acc[e + 3])

    jit = _jit_capped(max_regs)

    @jit
    def moe_gate_up_tiles_staged(a32, tile_off, tile_tok, tile_slot, tile_cnt, n_used, xq64, xd, nsb,
                               route_w, clamp, n_ff, rb, mid, gsel_g, ssel_g):
        pdl_enter()
        gsel_s = cuda.shared.array(256, uint32)
        ssel_s = cuda.shared.array(128, uint32)
        sw = cuda.shared.array(SW_N, uint32)
        sx = cuda.shared.array(SX_N, uint64)
        sxd = cuda.shared.array(SXD_N, float32)
        rbase = cuda.shared.array(ROWS, int64)
        roff = cuda.shared.array(ROWS, uint32)
        xch = cuda.shared.array(XCH, float32)
        pos_s = cuda.shared.array(WARP, uint32)
        tile = cuda.blockIdx.y
        cnt = tile_cnt[tile]
        if cnt <= 0:                                   # block-uniform
            return
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        gid = lane >> 2
        tig = lane & 3
        row0 = cuda.blockIdx.x * GROWS
        base = tile * TILE
        for i in range(tid, 256, cuda.blockDim.x):
            gsel_s[i] = gsel_g[i]
        for i in range(tid, 128, cuda.blockDim.x):
            ssel_s[i] = ssel_g[i]
        if tid < WARP:
            pos_s[tid] = uint32(0x2B190800)            # iq2_permute's bytes 0, 8, 25, 43
        wbase_g = tile_off[tile * 3] >> 2              # the matrices' first 32-bit words
        wbase_u = tile_off[tile * 3 + 1] >> 2
        if tid < ROWS:                                 # staged row tid: matrix tid >> 6
            r = min(row0 + (tid & (GROWS - 1)), n_ff - 1)      # a short last group repeats a row
            roff[tid] = uint32((r * rb) >> 2)
            rbase[tid] = (tile_off[tile * 3 + (tid >> 6)] + r * rb) >> 2
        tok_w = cuda.local.array(PPW, int64)
        for i in range(PPW):
            tok_w[i] = tile_tok[base + min(warp + 8 * i, cnt - 1)]
        tok_d = tile_tok[base + min(tid >> 1, cnt - 1)] if tid < 2 * TILE else 0
        words = 32 * nsb
        halves = (cnt + 7) >> 3
        m = warp >> 2
        rt = warp & 3
        r_lo = uint32((64 * m + 16 * rt + gid) * WP)
        r_hi = r_lo + uint32(8 * WP)
        xo = uint32(gid * XP + tig)
        # the lane's index fields (grid byte tig of aux0, sign bits 7·tig of aux1) moved to bit SH
        lsh = cuda.local.array(4, uint32)
        lsh[0] = uint32(16 + 8 * tig - SH)
        lsh[1] = uint32(16 + 7 * tig - SH)
        lsh[2] = uint32((8 * tig - SH) & 31)
        lsh[3] = uint32((7 * tig - SH) & 31)
        pw = cuda.local.array(PW_N, uint32)
        px = cuda.local.array(PX_N, uint64)
        pd = cuda.local.array(1, float32)
        acc = cuda.local.array(NACC, float32)
        for e in range(NACC):
            acc[e] = float32(0.0)
        bsum = cuda.local.array(NB, int32)
        cuda.syncthreads()
        # a register for the whole loop: read as a constant (or from one shared word, which ptxas
        # reads into a uniform register) it is moved into a register before every prmt (SASS)
        pos = pos_s[lane]
        nsteps = nsb >> 1
        load_step(a32, rbase, roff, wbase_g, wbase_u, xq64, xd, 0, tok_w, tok_d, words, nsb, warp, lane, tid,
                  pw, px, pd)
        for s in range(nsteps):
            cuda.syncthreads()
            store_step(sw, sx, sxd, warp, lane, tid, pw, px, pd)
            cuda.syncthreads()
            if s + 1 < nsteps:
                load_step(a32, rbase, roff, wbase_g, wbase_u, xq64, xd, s + 1, tok_w, tok_d, words, nsb, warp,
                          lane, tid, pw, px, pd)
            super_block(sw, sx, sxd, gsel_s, ssel_s, r_lo, r_hi, xo, tig, lsh, pos, halves, 0, acc, bsum)
            super_block(sw, sx, sxd, gsel_s, ssel_s, r_lo, r_hi, xo, tig, lsh, pos, halves, 1, acc, bsum)
            for e in range(2 * NB):
                first = acc[e]
                acc[e] = acc[2 * NB + e]
                acc[2 * NB + e] = first
        if m == 1:
            for e in range(NB):
                v = scale * ((acc[e] + acc[2 * NB + e]) + (acc[NB + e] + acc[3 * NB + e]))
                xch[_ix((rt * NB + e) * WARP + lane)] = v
        cuda.syncthreads()
        if m == 0:
            c32 = float32(clamp)
            for h in range(NH):
                for k in range(4):
                    e = 4 * h + k
                    row = row0 + 16 * rt + gid + 8 * (k >> 1)
                    col = 8 * h + 2 * tig + (k & 1)
                    if row < n_ff and col < cnt:
                        g = scale * ((acc[e] + acc[2 * NB + e]) + (acc[NB + e] + acc[3 * NB + e]))
                        u = xch[_ix((rt * NB + e) * WARP + lane)]
                        pair = tile_tok[base + col] * n_used + tile_slot[base + col]
                        mid[_ix(pair * n_ff + row)] = _swiglu(g, u, c32, route_w[_ix(pair)])

    return moe_gate_up_tiles_staged


def _moe_down_tiles_mma_kernel(NH):
    """Prefill down projection for Q2_K experts on the int8 tensor cores: a warp takes 16 output
    rows x one tile of <= 8·NH pairs (NH MMA column halves of 8 pairs; the A fragment is built once
    for all halves). The A bytes are the 2-bit weights times their 4-bit sub-block scale (<= 45,
    an exact int8), so each of a super-block's 8 MMAs per half gives Σ scale·q·x of its 32
    weights; the mins term Σ min·bsum is integer too. The f32 side is the decode kernel's:
    term = fma(d_x·d, isum, -(d_x·dmin)·summs) added per lane group q = sb % 4, then
    (q0 + q2) + (q1 + q3): pair_out equals moe_decode's per-slot result bit for bit, whatever NH."""
    NWM = _MMA_WARPS   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    TILE = 8 * NH
    NACC = 16 * NH
    NI = 4 * NH

    @_jit_capped(0)
    def moe_down_tiles_mma(a32, tile_off, tile_tok, tile_slot, tile_cnt, n_used, mq64, md, mbs, nsb, rb,
                           n_embd, pair_out):
        pdl_enter()
        tile = cuda.blockIdx.y
        cnt = tile_cnt[tile]
        if cnt <= 0:                                   # block-uniform
            return
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        gid = lane >> 2
        tig = lane & 3
        row0 = (cuda.blockIdx.x * NWM + warp) * 16
        if row0 >= n_embd:                             # warp-uniform; no barrier in this kernel
            return
        r_lo = min(row0 + gid, n_embd - 1)
        r_hi = min(row0 + gid + 8, n_embd - 1)
        base = tile * TILE
        halves = (cnt + 7) >> 3                        # column halves holding pairs
        pair_b = cuda.local.array(NH, int64)           # rows of the quantized mid: B column of half h
        pair0 = cuda.local.array(NH, int64)            # C columns 2 tig (+ 1) of half h
        pair1 = cuda.local.array(NH, int64)
        for h in range(NH):
            col_b = base + min(8 * h + gid, cnt - 1)
            col0 = base + min(8 * h + 2 * tig, cnt - 1)
            col1 = base + min(8 * h + 2 * tig + 1, cnt - 1)
            pair_b[h] = tile_tok[col_b] * n_used + tile_slot[col_b]
            pair0[h] = tile_tok[col0] * n_used + tile_slot[col0]
            pair1[h] = tile_tok[col1] * n_used + tile_slot[col1]
        words = 32 * nsb                               # int64 words per pair of mq
        acc = cuda.local.array(NACC, float32)
        for e in range(NACC):
            acc[e] = float32(0.0)
        isum = cuda.local.array(NI, int32)
        summs = cuda.local.array(NI, int32)
        # acc holds 4 banks [bank][h][lo c0, lo c1, hi c0, hi c1]; bank 0 is always lane group
        # q = sb % 4 (the banks rotate after every super-block), so no index depends on q and acc
        # stays in registers however the compiler unrolls
        for sb0 in range(0, nsb, 4):
            for q in range(4):
                sb = sb0 + q
                if sb < nsb:
                    w_lo = (tile_off[tile * 3 + 2] + r_lo * rb) // 4 + 21 * sb
                    w_hi = (tile_off[tile * 3 + 2] + r_hi * rb) // 4 + 21 * sb
                    for e in range(NI):
                        isum[e] = int32(0)
                        summs[e] = int32(0)
                    for kk in range(8):                # weights 32 kk.. : chunk kh, shift sh
                        kh = kk >> 2
                        sh = 2 * (kk & 3)
                        # k order (Q8_0 section): lane tig takes weights 8 tig .. + 7 of the 32: qs
                        # words 2 tig, 2 tig + 1 of the chunk, one sub-block (its scale read once)
                        sub = 2 * kk + (tig >> 1)
                        sc_lo = uint32(bfe(a32[_ix(w_lo + (sub >> 2))], 8 * (sub & 3), 4))
                        sc_hi = uint32(bfe(a32[_ix(w_hi + (sub >> 2))], 8 * (sub & 3), 4))
                        a0 = _q2_times(a32, w_lo, 4 + 8 * kh + 2 * tig, sh, sc_lo)
                        a1 = _q2_times(a32, w_hi, 4 + 8 * kh + 2 * tig, sh, sc_hi)
                        a2 = _q2_times(a32, w_lo, 5 + 8 * kh + 2 * tig, sh, sc_lo)
                        a3 = _q2_times(a32, w_hi, 5 + 8 * kh + 2 * tig, sh, sc_hi)
                        for h in range(NH):
                            if h < halves:             # warp-uniform
                                bx = mq64[_ix(pair_b[h] * words + 32 * sb + 4 * kk + tig)]
                                c0, c1, c2, c3 = mma_s8(a0, a1, a2, a3, bx, bx >> 32)
                                isum[4 * h] = int32(isum[4 * h] + c0)
                                isum[4 * h + 1] = int32(isum[4 * h + 1] + c1)
                                isum[4 * h + 2] = int32(isum[4 * h + 2] + c2)
                                isum[4 * h + 3] = int32(isum[4 * h + 3] + c3)
                    for sub in range(16):              # Σ min · bsum over the 16 sub-blocks
                        m_lo = bfe(a32[_ix(w_lo + (sub >> 2))], 8 * (sub & 3) + 4, 4)
                        m_hi = bfe(a32[_ix(w_hi + (sub >> 2))], 8 * (sub & 3) + 4, 4)
                        for h in range(NH):
                            if h < halves:
                                bs0 = mbs[_ix(pair0[h] * 16 * nsb + 16 * sb + sub)]
                                bs1 = mbs[_ix(pair1[h] * 16 * nsb + 16 * sb + sub)]
                                summs[4 * h] = imad(m_lo, bs0, summs[4 * h])
                                summs[4 * h + 1] = imad(m_lo, bs1, summs[4 * h + 1])
                                summs[4 * h + 2] = imad(m_hi, bs0, summs[4 * h + 2])
                                summs[4 * h + 3] = imad(m_hi, bs1, summs[4 * h + 3])
                    dd_lo = a32[_ix(w_lo + 20)]
                    dd_hi = a32[_ix(w_hi + 20)]
                    for h in range(NH):
                        for k in range(4):
                            dd = dd_lo if k < 2 else dd_hi
                            d = f16_bits_to_f32(dd & _M16)
                            dmin = f16_bits_to_f32(dd >> uint32(16))
                            xdv = md[_ix((pair0[h] if k % 2 == 0 else pair1[h]) * nsb + sb)]
                            term = cuda.fma(xdv * d, float32(isum[4 * h + k]),
                                            -((xdv * dmin) * float32(summs[4 * h + k])))
                            acc[4 * h + k] = acc[4 * h + k] + term
                for e in range(NI):                    # rotate: bank 0 becomes lane group q + 1
                    first = acc[e]
                    acc[e] = acc[NI + e]
                    acc[NI + e] = acc[2 * NI + e]
                    acc[2 * NI + e] = acc[3 * NI + e]
                    acc[3 * NI + e] = first
        for h in range(NH):
            for k in range(4):
                row = row0 + gid + 8 * (k >> 1)
                col = 8 * h + 2 * tig + (k & 1)
                if row < n_embd and col < cnt:
                    pair = tile_tok[base + col] * n_used + tile_slot[base + col]
                    e = 4 * h + k                      # banks 0..3 = lane groups 0..3 again
                    pair_out[_ix(pair * n_embd + row)] = (acc[e] + acc[2 * NI + e]) + (acc[NI + e] + acc[3 * NI + e])

    return moe_down_tiles_mma


# ---- Q2_K down projection on the tensor cores through shared memory (prefill) -------------------
#
# The kernel above builds every fragment from global memory: 4-byte weight loads from 16 rows 672
# bytes apart, an 8-byte activation load per MMA, and per super-block and output 16 min x bsum
# products from 2 x 16 bsum loads (most of its instructions). This one follows the Q8_0 staged
# recipe. A block of 8 warps takes 128 rows x one tile of <= 8·NH pairs, one super-block per
# step: the 128 rows x 84 bytes of weights and the tile's pairs x 256 bytes of activations and
# their scales are loaded with coalesced loads into registers while the warps run the MMAs of the
# step before, then stored into the other of two shared-memory buffers; one barrier per step.
# (Steps of two super-blocks through one buffer held 30 words per thread in flight and spilled
# under the register cap; two such buffers are past the 48 KB of static shared memory.) Weights
# are loaded as 4-byte words: only the 4-byte alignment every Q2_K kernel needs is assumed
# (device expert tables cannot be checked on the host). The row length is a compile-time
# constant, so every load's offset from the thread's first is an immediate (a run-time row
# stride made the compiler keep one address per load in registers).
#
# The mins go through the tensor cores too: lane tig's 8 weights of a 32-weight group lie in one
# 16-weight sub-block, so an A fragment holding that sub-block's 4-bit min in all 4 bytes, times
# the same B fragment, sums min·x over the group; over the super-block that is Σ min·bsum exactly
# (integers), and mbs is not read. Both MMAs accumulate in the tensor core (mma_s8_acc).
#
# k order: lane tig takes qs words wa = tig + 4 (tig >> 1) (0, 1, 6, 7) and wb = wa ^ 2 (2, 3, 4,
# 5) of each 8-word chunk (both in sub-block 2 kk + (tig >> 1)); with rows 28 words apart (the 8
# rows of a fragment load start on the banks 0, 4, ..., 28) that puts its 32 lanes on 32 banks.
# The activations are stored permuted to match: position 2 tig holds word wa, 2 tig + 1 word wb,
# so the B fragment is one 8-byte load.
#
# The f32 side is the decode kernel's: term = fma(d_x·d, isum, -((d_x·dmin)·summs)) added to bank
# sb % 4 (the loop runs four steps per iteration, so every bank and buffer index is a constant),
# then (q0 + q2) + (q1 + q3): pair_out equals moe_decode's per-slot result bit for bit.
# isum < 256·45·128 and summs < 16·15·2048 are below 2^22 (_exact_float).

_DN_ST_WARPS = 8      # warps per block; warp w takes rows 16 w .. 16 w + 15 of the block's 128
_DN_ST_REGS = 128     # register cap: two blocks of 256 threads per SM
_DN_ST_WPAD = 28      # 32-bit words per staged weight row (21 used). 28 = 4·7 mod 32: the 8 rows of
                      # a fragment load start on banks 0, 4, ..., 28 (conflict-free with the k order)
_DN_ST_XPAD = 72      # 32-bit words per staged pair (64 used). 72 = 8 mod 32: the 16 lanes of a
                      # half-warp's 8-byte B loads (4 pairs x 4 lanes) fall on distinct banks


def _moe_down_tiles_staged_kernel(NH, NSB, max_regs=_DN_ST_REGS):
    """Prefill down projection for Q2_K experts (rows of NSB super-blocks) on the int8 tensor
    cores, staged through shared memory (see above): a block takes 128 output rows x one tile of
    <= 8·NH pairs (grid: row groups of 128 x tiles, 256 threads), warp w rows 16 w .. 16 w + 15
    and all pairs. Any NSB (an odd last step needs nothing special: steps are one super-block)
    and any row count; offsets need only be multiples of 4 (as for every Q2_K kernel). Arguments
    as _moe_down_tiles_mma_kernel's less mbs, nsb and rb (compiled in as NSB); pair_out is the
    same bit for bit (scripts/check_down_staged_sim.py checks the indexing without a GPU)."""
    TILE = 8 * NH
    NTH = _DN_ST_WARPS * WARP
    ROWS = 16 * _DN_ST_WARPS
    RBW = 21 * NSB                  # 32-bit words per row
    BW = 21                         # 32-bit words per row and step (one Q2_K block)
    ROUND = NTH // BW               # rows one pass of the threads covers (12 rows, 252 threads)
    LOADS = (ROWS + ROUND - 1) // ROUND   # weight words per thread and step (11; the last pass short)
    PW = _DN_ST_WPAD
    PX = _DN_ST_XPAD
    XTH = 16                        # threads per staged pair: two loads of 8 bytes each
    NI = 4 * NH                     # sums per lane and bank: [h][lo c0, lo c1, hi c0, hi c1]
    NACC = 4 * NI                   # 4 banks
    SW_N = ROWS * PW                # one buffer (shared array sizes must be plain constants)
    SX_N = TILE * PX
    SW_2 = 2 * SW_N
    SX_2 = 2 * SX_N
    SXD_2 = 2 * TILE
    assert TILE * XTH <= NTH and PW >= BW and PX >= 64

    @_inline
    def load_step(a32, mq64, md, sb, full, g_first, nv, last_on, x_first, x_on, d_first, d_on, tid,
                  pw, px, pd):
        """Super-block sb's tiles into registers. Weights: thread t takes word t % 21 of rows
        t // 21 + 12 m, m < LOADS (threads 252 .. 255 load rows 12 + 12 m too, and store
        nothing). In a full block (all 128 rows before n_embd: block-uniform) only the last pass
        is short (last_on: w_row < 8); in the last, short block the loads m < nv are those of
        rows before n_embd. Activations: thread t takes 8-byte words t % 16 + 16 m (m = 0, 1) of
        pair t // 16; thread t < TILE the scale of pair t. Registers that would hold nothing are
        left unset (store_step skips them)."""
        g = g_first + BW * sb
        if full:
            for m in range(LOADS - 1):
                pw[m] = a32[_ix(g + m * (ROUND * RBW))]
            if last_on:
                pw[LOADS - 1] = a32[_ix(g + (LOADS - 1) * (ROUND * RBW))]
        else:
            for m in range(LOADS):
                if m < nv:
                    pw[m] = a32[_ix(g + m * (ROUND * RBW))]
        if x_on:
            for m in range(2):
                px[m] = uint64(mq64[_ix(x_first + 32 * sb + 16 * m)])
        if d_on:
            pd[0] = md[_ix(d_first + sb)]

    @_inline
    def store_step(sw, sx, sxd, buf, full, s_first, nv, last_on, st_on, s_x, x_on, d_on, tid, pw, px,
                   pd):
        """load_step's registers into buffer buf (a constant): weight words at row·PW + word,
        each activation word's halves at their k-order positions (s_x + 32 m and + 2)."""
        o = buf * SW_N + s_first
        if full:
            if st_on:
                for m in range(LOADS - 1):
                    sw[_ix(o + m * (ROUND * PW))] = pw[m]
                if last_on:
                    sw[_ix(o + (LOADS - 1) * (ROUND * PW))] = pw[LOADS - 1]
        else:
            for m in range(LOADS):
                if m < nv:
                    sw[_ix(o + m * (ROUND * PW))] = pw[m]
        if x_on:
            for m in range(2):
                sx[_ix(buf * SX_N + s_x + 32 * m)] = uint32(px[m] & _M32)
                sx[_ix(buf * SX_N + s_x + 32 * m + 2)] = uint32(px[m] >> uint64(32))
        if d_on:
            sxd[buf * TILE + tid] = pd[0]

    @_inline
    def half_sums(sw, sx64, bx0, kh, w_lo, w_hi, wa, wb, sc_sh, gid, tig, halves, isum, summs):
        """The integer sums of the 128-weight half kh (a constant: LLVM left a loop over the two
        halves rolled) added to isum and summs: groups kk = 4 kh + s, s = 0 .. 3, read from the
        qs words 4 + 8 kh + wa, wb at shift 2 s and from scale words 2 kh, 2 kh + 1."""
        q_lo_a = sw[_ix(w_lo + 4 + 8 * kh + wa)]
        q_lo_b = sw[_ix(w_lo + 4 + 8 * kh + wb)]
        q_hi_a = sw[_ix(w_hi + 4 + 8 * kh + wa)]
        q_hi_b = sw[_ix(w_hi + 4 + 8 * kh + wb)]
        for sp in range(2):                     # scale word 2 kh + sp: groups kk = 4 kh + 2 sp (+ 1)
            # the lane's scale/min bytes (2 kk + (tig >> 1)) moved to bytes 0 (kk even) and 2, and
            # split into nibbles: then a byte permute gives the scale (byte 0, the rest 0) or the
            # min replicated in all 4 bytes (the A fragment of the mins MMA)
            sc_lo = sw[_ix(w_lo + 2 * kh + sp)] >> sc_sh
            sc_hi = sw[_ix(w_hi + 2 * kh + sp)] >> sc_sh
            sl_lo = int32(sc_lo & _LOW4)
            sl_hi = int32(sc_hi & _LOW4)
            mh_lo = int32((sc_lo >> uint32(4)) & _LOW4)
            mh_hi = int32((sc_hi >> uint32(4)) & _LOW4)
            for odd in range(2):
                s = 2 * sp + odd                # the 2-bit shift of group kk
                kk = 4 * kh + s
                scale_lo = uint32(libdevice.byte_perm(sl_lo, 0, 0x4440 + 2 * odd))
                scale_hi = uint32(libdevice.byte_perm(sl_hi, 0, 0x4440 + 2 * odd))
                min_lo = libdevice.byte_perm(mh_lo, 0, 0x2222 * odd)
                min_hi = libdevice.byte_perm(mh_hi, 0, 0x2222 * odd)
                a0 = uint32(((q_lo_a >> uint32(2 * s)) & _LOW2) * scale_lo)
                a1 = uint32(((q_hi_a >> uint32(2 * s)) & _LOW2) * scale_hi)
                a2 = uint32(((q_lo_b >> uint32(2 * s)) & _LOW2) * scale_lo)
                a3 = uint32(((q_hi_b >> uint32(2 * s)) & _LOW2) * scale_hi)
                for h in range(NH):
                    if h < halves:              # block-uniform
                        bx = sx64[_ix(bx0 + h * (4 * PX) + 4 * kk)]
                        b0 = bx & _M32
                        b1 = bx >> uint64(32)
                        e = 4 * h
                        isum[e], isum[e + 1], isum[e + 2], isum[e + 3] = mma_s8_acc(
                            a0, a1, a2, a3, b0, b1, isum[e], isum[e + 1], isum[e + 2], isum[e + 3])
                        summs[e], summs[e + 1], summs[e + 2], summs[e + 3] = mma_s8_acc(
                            min_lo, min_hi, min_lo, min_hi, b0, b1,
                            summs[e], summs[e + 1], summs[e + 2], summs[e + 3])

    @_inline
    def super_block(sw, sx64, sxd, buf, bank, w_lo, gid, tig, halves, isum, summs, acc):
        """The super-block in buffer buf into bank `bank` (constants at every call)."""
        w_lo = w_lo + buf * SW_N
        w_hi = w_lo + 8 * PW
        wa = tig + 4 * (tig >> 1)               # k order (above): qs words wa, wb of each chunk
        wb = wa ^ 2
        sc_sh = uint32(8 * (tig >> 1))          # scale byte 2 kk + (tig >> 1) -> bits 16 (kk & 1)
        bx0 = (buf * SX_N + gid * PX) // 2 + tig    # B fragment of group 0, half 0 (8-byte words)
        for e in range(NI):
            isum[e] = int32(0)
            summs[e] = int32(0)
        half_sums(sw, sx64, bx0, 0, w_lo, w_hi, wa, wb, sc_sh, gid, tig, halves, isum, summs)
        half_sums(sw, sx64, bx0, 1, w_lo, w_hi, wa, wb, sc_sh, gid, tig, halves, isum, summs)
        dd_lo = sw[_ix(w_lo + 20)]
        dd_hi = sw[_ix(w_hi + 20)]
        d_lo = f16_bits_to_f32(dd_lo & _M16)
        dmin_lo = f16_bits_to_f32(dd_lo >> uint32(16))
        d_hi = f16_bits_to_f32(dd_hi & _M16)
        dmin_hi = f16_bits_to_f32(dd_hi >> uint32(16))
        for h in range(NH):
            if h < halves:
                xd0 = sxd[_ix(buf * TILE + 8 * h + 2 * tig)]
                xd1 = sxd[_ix(buf * TILE + 8 * h + 2 * tig + 1)]
                for k in range(4):
                    d = d_lo if k < 2 else d_hi
                    dmin = dmin_lo if k < 2 else dmin_hi
                    xdv = xd0 if k % 2 == 0 else xd1
                    term = cuda.fma(xdv * d, _exact_float(isum[4 * h + k]),
                                    -((xdv * dmin) * _exact_float(summs[4 * h + k])))
                    e = NI * bank + 4 * h + k
                    acc[e] = acc[e] + term

    @_inline
    def step(a32, mq64, md, sw, sx, sx64, sxd, sb, bank, buf, full, g_first, nv, last_on, st_on,
             s_first, x_first, x_on, s_x, d_first, d_on, tid, w_lo, gid, tig, halves, rows_on, pw, px,
             pd, isum, summs, acc):
        """Super-block sb (staged in buffer buf) into bank `bank` while sb + 1 is loaded into
        the other buffer (bank and buf constants)."""
        more = sb + 1 < NSB
        if more:                                # in flight while the MMAs run
            load_step(a32, mq64, md, sb + 1, full, g_first, nv, last_on, x_first, x_on, d_first, d_on,
                      tid, pw, px, pd)
        if rows_on:                             # warp-uniform: not all 16 rows past n_embd
            super_block(sw, sx64, sxd, buf, bank, w_lo, gid, tig, halves, isum, summs, acc)
        if more:
            store_step(sw, sx, sxd, 1 - buf, full, s_first, nv, last_on, st_on, s_x, x_on, d_on, tid,
                       pw, px, pd)
        cuda.syncthreads()                      # buffer 1 - buf full, buffer buf free again

    jit = _jit_capped(max_regs)

    @jit
    def moe_down_tiles_staged(a32, tile_off, tile_tok, tile_slot, tile_cnt, n_used, mq64, md, n_embd,
                              pair_out):
        pdl_enter()
        sw = cuda.shared.array(SW_2, uint32)            # two buffers: [buf][row][word]
        sx = cuda.shared.array(SX_2, uint32)            # [buf][pair][k-order word]
        sxd = cuda.shared.array(SXD_2, float32)         # [buf][pair]
        spair = cuda.shared.array(TILE, int64)          # the tile's pairs (rows of mq, pair_out)
        tile = cuda.blockIdx.y
        cnt = tile_cnt[tile]
        if cnt <= 0:                                     # block-uniform
            return
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        gid = lane >> 2
        tig = lane & 3
        if tid < TILE:                                   # columns past cnt repeat the last pair
            col = tile * TILE + min(tid, cnt - 1)
            spair[tid] = tile_tok[col] * n_used + tile_slot[col]
        halves = (cnt + 7) >> 3                          # column halves holding pairs
        row0 = cuda.blockIdx.x * ROWS
        # weight staging (load_step): the thread's first row and word; which of its loads hold
        # weights of rows before n_embd and the block's end
        w_row = tid // BW
        w_word = tid - BW * w_row
        rows_in = min(ROWS, n_embd - row0)
        full = rows_in == ROWS
        st_on = tid < ROUND * BW
        nv = min(LOADS, max(0, (rows_in - w_row + ROUND - 1) // ROUND)) if st_on else 0
        last_on = st_on and w_row + ROUND * (LOADS - 1) < rows_in
        g_first = (tile_off[tile * 3 + 2] >> 2) + (row0 + w_row) * RBW + w_word
        s_first = w_row * PW + w_word
        # activation staging: pair tid // 16, 8-byte words tid % 16 + 16 m; s_x: where the low
        # half of word m = 0 goes (k order: u32 word w of a group at position 0, 2, 1, 3, 5, 7, 4, 6)
        x_pair = tid >> 4
        x_word = tid & 15
        jj = x_word & 3
        s_x = x_pair * PX + 8 * (x_word >> 2) + 4 * (jj >> 1) + ((jj ^ (jj >> 1)) & 1)
        x_on = x_pair < 8 * halves                       # warp-uniform
        d_on = tid < 8 * halves
        cuda.syncthreads()
        x_first = spair[min(x_pair, TILE - 1)] * (32 * NSB) + x_word
        d_first = spair[min(tid, TILE - 1)] * NSB
        w_lo = (16 * warp + gid) * PW                    # the warp's staged rows gid, gid + 8
        rows_on = row0 + 16 * warp < n_embd
        sx64 = sx.view(np.uint64)
        pw = cuda.local.array(LOADS, uint32)
        px = cuda.local.array(2, uint64)
        pd = cuda.local.array(1, float32)
        isum = cuda.local.array(NI, int32)
        summs = cuda.local.array(NI, int32)
        acc = cuda.local.array(NACC, float32)            # [bank = sb % 4][h][k]
        for e in range(NACC):
            acc[e] = float32(0.0)
        load_step(a32, mq64, md, 0, full, g_first, nv, last_on, x_first, x_on, d_first, d_on, tid, pw,
                  px, pd)
        store_step(sw, sx, sxd, 0, full, s_first, nv, last_on, st_on, s_x, x_on, d_on, tid, pw, px, pd)
        cuda.syncthreads()
        sb = 0
        while sb < NSB:                                  # super-block sb + i: bank i, buffer i % 2
            step(a32, mq64, md, sw, sx, sx64, sxd, sb, 0, 0, full, g_first, nv, last_on, st_on, s_first,
                 x_first, x_on, s_x, d_first, d_on, tid, w_lo, gid, tig, halves, rows_on, pw, px, pd,
                 isum, summs, acc)
            if sb + 1 < NSB:
                step(a32, mq64, md, sw, sx, sx64, sxd, sb + 1, 1, 1, full, g_first, nv, last_on, st_on,
                     s_first, x_first, x_on, s_x, d_first, d_on, tid, w_lo, gid, tig, halves, rows_on,
                     pw, px, pd, isum, summs, acc)
            if sb + 2 < NSB:
                step(a32, mq64, md, sw, sx, sx64, sxd, sb + 2, 2, 0, full, g_first, nv, last_on, st_on,
                     s_first, x_first, x_on, s_x, d_first, d_on, tid, w_lo, gid, tig, halves, rows_on,
                     pw, px, pd, isum, summs, acc)
            if sb + 3 < NSB:
                step(a32, mq64, md, sw, sx, sx64, sxd, sb + 3, 3, 1, full, g_first, nv, last_on, st_on,
                     s_first, x_first, x_on, s_x, d_first, d_on, tid, w_lo, gid, tig, halves, rows_on,
                     pw, px, pd, isum, summs, acc)
            sb += 4
        for h in range(NH):
            for k in range(4):
                row = row0 + 16 * warp + gid + 8 * (k >> 1)
                col = 8 * h + 2 * tig + (k & 1)
                if row < n_embd and col < cnt:
                    e = 4 * h + k
                    pair_out[_ix(spair[col] * n_embd + row)] = (acc[e] + acc[2 * NI + e]) + (acc[NI + e] + acc[3 * NI + e])

    return moe_down_tiles_staged


@_inline
def _q2_times(a32, w, qword, shift, scale):
    """Four Q2_K weights (qs word `qword` of the block at word w, bits `shift`) times their
    sub-block's 4-bit scale: bytes <= 3 x 15, so no carry between them."""
    q2 = (a32[_ix(w + qword)] >> uint32(shift)) & _LOW2
    return uint32(q2 * scale)


@_inline
def _iq2_entry(grid_s, ks_s, aux0, aux1, l):
    """The 8 signed weights of IQ2_XXS group l (grid index byte l of aux0, sign index bits 7l.. of
    aux1) as two int8x4 words (weights 0..3, 4..7): one grid and one sign lookup for both."""
    gv = grid_s[_ix(bfe(aux0, 8 * l, 8))]
    s8 = int32(ks_s[_ix(bfe(aux1, 7 * l, 7))])
    return (negate_bytes(uint32(gv & uint64(0xFFFFFFFF)), s8 & 15),
            negate_bytes(uint32(gv >> uint64(32)), (s8 >> 4) & 15))


def _moe_down_tiles_kernel(wtype, T, NCH):
    """Prefill: each (token, slot) pair's down projection, written to pair_out[pair, n_embd]."""
    NWM = _NW_MOE   # closure constants, not globals, in the kernel: see _CACHE_KERNELS
    rowdots = _rowdots(wtype, T, 1, NCH)
    stage = _stages_x(wtype)

    @_jit_capped(0)
    def moe_down_tiles(a16, a32, tile_off, tile_tok, tile_slot, tile_cnt, n_used, mq32, md, mbs,
                       nsb, rb, n_embd, pair_out, grid_g, ks_g):
        pdl_enter()
        grid_s = cuda.shared.array(256, uint64)
        ks_s = cuda.shared.array(128, uint8)
        xs = cuda.shared.array(0, int32)
        tile = cuda.blockIdx.y
        cnt = tile_cnt[tile]
        if cnt <= 0:
            return
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        k4 = nsb * 64
        pad = k4 + k4 // 8
        toks = cuda.local.array(T, int64)     # here: the pair's row in the quantized mid
        xbase = cuda.local.array(T, int64)
        for tt in range(T):
            t_ = tt if tt < cnt else 0
            toks[tt] = tile_tok[tile * T + t_] * n_used + tile_slot[tile * T + t_]
            xbase[tt] = tt * pad if stage else toks[tt] * k4
        if stage:
            _load_iq2_tables(grid_s, ks_s, grid_g, ks_g)
            for tt in range(T):
                if tt < cnt:
                    _stage_row(xs, tt * pad, mq32, toks[tt] * k4, k4)
            cuda.syncthreads()
        r = cuda.blockIdx.x * NWM + warp
        if r < n_embd:
            roffs = cuda.local.array(1, int64)
            roffs[0] = tile_off[tile * 3 + 2] + r * rb
            res = cuda.local.array(T, float32)
            rowdots(a16, a32, roffs, nsb, xs if stage else mq32, xbase, md, mbs, toks, cnt,
                    grid_s, ks_s, res)
            if lane == 0:
                for tt in range(T):
                    if tt < cnt:
                        pair_out[toks[tt] * n_embd + r] = res[tt]

    return moe_down_tiles


@_jit_capped(0)
def _moe_sum_kernel(pair_out, n_tok, n_used, n_embd, out):
    """out[t, r] = sum over slots k (in order) of pair_out[t*n_used + k, r], as decode adds them."""
    pdl_enter()
    i = cuda.grid(1)
    if i >= n_tok * n_embd:
        return
    t = i // n_embd
    r = i - t * n_embd
    acc = float32(0.0)
    for k in range(n_used):
        acc = acc + pair_out[(t * n_used + k) * n_embd + r]
    out[i] = acc


@_jit_capped(0)
def _expert_offsets_kernel(expert_ids, n_used, base_gate, base_up, base_down, stride_gu,
                           stride_down, slot_offsets):
    pdl_enter()
    k = cuda.grid(1)
    if k < n_used:
        e = int64(expert_ids[k])
        slot_offsets[k * 3] = base_gate + e * stride_gu
        slot_offsets[k * 3 + 1] = base_up + e * stride_gu
        slot_offsets[k * 3 + 2] = base_down + e * stride_down


def expert_offsets(expert_ids, base_gate, base_up, base_down, stride_gu, stride_down,
                   slot_offsets, stream=0):
    """slot_offsets[k] = (base_gate + e*stride_gu, base_up + e*stride_gu, base_down + e*stride_down)
    with e = expert_ids[k], all on the device (expert_ids int32[n_used], slot_offsets int64[n_used, 3])."""
    n_used = expert_ids.size
    _expert_offsets_kernel[1, 32, _stream(stream)](
        _flat(expert_ids), n_used, int(base_gate), int(base_up), int(base_down), int(stride_gu),
        int(stride_down), _flat(slot_offsets))


@_jit_capped(0)
def _scales_last_relayout_kernel(a8, off, n_rows, row_bytes, n_blocks, payload, to_repacked):
    """One block per row (grid-stride): the row into shared memory, then each byte to its place.
    The row's blocks are [2-byte f16 scale][payload bytes]. Position t of a repacked row holds:
    t < payload * n_blocks, byte 2 + (t % payload) of block t // payload; else byte (i % 2) of
    block i // 2's scale, i = t - payload * n_blocks."""
    pdl_enter()
    row_s = cuda.shared.array(0, uint8)
    for row in range(cuda.blockIdx.x, n_rows, cuda.gridDim.x):     # block-uniform
        base = off + row * row_bytes
        for t in range(cuda.threadIdx.x, row_bytes, cuda.blockDim.x):
            row_s[t] = a8[base + t]
        cuda.syncthreads()
        for t in range(cuda.threadIdx.x, row_bytes, cuda.blockDim.x):
            if t < payload * n_blocks:
                old = (payload + 2) * (t // payload) + 2 + t % payload
            else:
                i = t - payload * n_blocks
                old = (payload + 2) * (i >> 1) + (i & 1)
            if to_repacked:
                a8[base + t] = row_s[old]
            else:
                a8[base + old] = row_s[t]
        cuda.syncthreads()


def _scales_last_relayout(arena, ggml_type, off, n_rows, K, to_repacked, stream):
    """Rewrite n_rows rows of K values at byte offset off (8-byte aligned) in place, into
    (to_repacked) or back out of the scales-last layout: the payload of every block first, so a
    lane's quant bytes are aligned 8-byte loads, then the blocks' f16 scales. A row keeps its size."""
    if off % 8:
        raise ValueError(f"{F.TYPE_NAMES[ggml_type]} relayout needs 8-byte aligned rows")
    row_bytes = F.row_bytes(ggml_type, K)
    if row_bytes % 8:
        raise ValueError(f"{F.TYPE_NAMES[ggml_type]} rows of {K} values ({row_bytes} bytes) are not 8-byte multiples")
    block_values, block_bytes = F.BLOCK_GEOMETRY[ggml_type]
    _, _, a8, _ = _arena_views(arena)
    blocks = max(1, min(n_rows, 4096))
    _scales_last_relayout_kernel[blocks, 256, _stream(stream), row_bytes](
        a8, off, n_rows, row_bytes, K // block_values, block_bytes - 2, bool(to_repacked))


def iq2_xxs_relayout(arena, off, n_rows, K, to_repacked=True, stream=0):
    """IQ2_XXS rows into (or back out of) the layout that _IQ2_REPACKED_GATE_UP reads: each
    super-block's 64 grid/sign bytes first (a lane's sub-block is one 8-byte load), then the
    scales (66 bytes per 256 values, as in the file)."""
    _scales_last_relayout(arena, F.IQ2_XXS, off, n_rows, K, to_repacked, stream)


def q8_0_relayout(arena, off, n_rows, K, to_repacked=True, stream=0):
    """Q8_0 rows into (or back out of) the scales-last layout that the Q8_0 launchers read with
    scales_last=True (formats.to_scales_last): each block's 32 quants first (a lane's 8 bytes are
    one aligned load), then the scales (34 bytes per 32 values)."""
    _scales_last_relayout(arena, F.Q8_0, off, n_rows, K, to_repacked, stream)


def _check_moe_types(gate_type, down_type):
    for t in (gate_type, down_type):
        if t not in _LOADERS:
            raise ValueError(f"MoE experts of type {F.TYPE_NAMES.get(t, t)} are not supported "
                             "(IQ2_XXS, Q2_K, Q4_K)")


def _shmem_x(wtype, n_rows, K):
    return 4 * n_rows * _pad_words(K) if _stages_x(wtype) else 0


def moe_gate_up(arena, slot_offsets, gate_type, n_embd, n_ff, xq, xd, route_w, clamp, mid,
                stream=0, bsums=None):
    """Gate and up of every selected expert in ONE launch, with ds4's clamped SwiGLU and the
    route weight: mid[k, r] = silu(min(g, c)) * clip(u, -c, c) * route_w[k].

    slot_offsets: device int64[n_used, 3] byte offsets (gate, up, down) into arena (expert
    tensors 4-byte aligned); xq/xd(/bsums): the token's Q8_K activation; route_w: device
    f32[n_used]; mid: f32[n_used, n_ff]. bsums is needed for Q2_K / Q4_K gate and up.
    """
    _check_moe_types(gate_type, gate_type)
    n_used = slot_offsets.shape[0]
    a16, a32, _, _ = _arena_views(arena)
    if gate_up_halves_applies(gate_type, n_embd, xq):
        NSB, pre = n_embd // 256, _PRE_GATE_UP
        if _IQ2_REPACKED_GATE_UP and F.row_bytes(gate_type, n_embd) % 16:
            raise ValueError("moe_gate_up_halves reads repacked rows in 16-byte words: rows of a "
                             "multiple of 8 super-blocks (expert bases 16-byte aligned)")
        # the variant knobs after (NSB, PRE), their defaults left off the end of the key:
        # kernels/manifest.json lists (NSB, PRE)
        extra = (_GU_DEFER, _REGS_GU_HALVES, bool(_IQ2_REPACKED_GATE_UP))
        defaults = _moe_gate_up_halves_kernel.__defaults__[1:]
        while extra and extra[-1] == defaults[len(extra) - 1]:
            extra = extra[:-1]
        kernel = _cached(_moe_gate_up_halves_kernel, NSB, pre, *extra)
        tables, shmem = _iq2_selector_tables_device(), 0
    else:
        NCH = min(_NCH_GATE_UP, _nch(n_embd)) if _NCH_GATE_UP else _nch(n_embd)
        regs = _REGS_GATE_UP
        NSB = n_embd // 256 if _CONST_STEPS_GATE_UP else 0
        x_regs = _X_REGS_GATE_UP and _gate_up_x_regs(gate_type, n_embd, NCH, NSB > 0)
        perm = _IQ2_PERM_GATE_UP and gate_type == F.IQ2_XXS
        repacked = _IQ2_REPACKED_GATE_UP and gate_type == F.IQ2_XXS
        if repacked and not NSB:
            raise ValueError("_IQ2_REPACKED_GATE_UP needs _CONST_STEPS_GATE_UP (the row's super-block count)")
        pre = _PRE_GATE_UP
        kernel = _cached(_moe_gate_up_decode_kernel, gate_type, NCH, regs, x_regs, NSB, perm, repacked, pre)
        tables = _iq2_selector_tables_device() if perm else _iq2_tables()
        shmem = 0 if x_regs else _shmem_x(gate_type, 1, n_embd)
    rpb = _RPB_GATE_UP          # both kernels: the same grid, block and arguments
    kernel[(n_ff + rpb - 1) // rpb, _NW_GATE_UP * WARP, _stream(stream), shmem](
        a16, a32, _flat(slot_offsets), n_used, _as_i32(xq), _flat(xd),
        _flat(bsums) if bsums is not None else _dummy_i32(), n_embd // 256, _flat(route_w),
        np.float32(clamp), n_ff, F.row_bytes(gate_type, n_embd), rpb, _flat(mid), *tables)


def moe_down(arena, slot_offsets, down_type, n_ff, n_embd, mq, md, mbs, out, stream=0, hc=None):
    """out[r] = sum over slots k (in order) of W_down[e_k][r] . Q8_K(mid[k]); ONE launch.

    mq/md/mbs: Q8_K of mid (n_used*n_ff values, quantized as one vector); out: f32[n_embd].
    hc = (state, f_b, post, comb): the HC post of each dim once its sum is written (_hc_args)."""
    _check_moe_types(down_type, down_type)
    n_used = slot_offsets.shape[0]
    a16, a32, _, _ = _arena_views(arena)
    grid_g, ks_g = _iq2_tables()
    if _DOWN_SB and down_sb_applies(down_type, n_ff, n_used, _DOWN_SB):
        R, NSB = _DOWN_SB, n_ff // 256
        # (the manifest's key is (NSB, R): EARLY joins it only when not the default)
        kernel = _cached(_moe_down_sb_kernel, NSB, R, *((_DOWN_EARLY,) if _DOWN_EARLY != 1 else ()))
        kernel[(n_embd + R - 1) // R, n_used * WARP, _stream(stream), _down_sb_shmem(n_used, NSB, R)](
            a16, a32, _flat(slot_offsets), n_used, _as_i32(mq), _flat(md), _flat(mbs), NSB,
            F.row_bytes(down_type, n_ff), n_embd, _flat(out), grid_g, ks_g, *_hc_args(hc))
        return
    if _R_DOWN_SLOTS and down_slots_applies(down_type, n_ff, n_used):
        R, NSB, regs = _R_DOWN_SLOTS, n_ff // 256, _REGS_DOWN_SLOTS
        kernel = _cached(_moe_down_decode_slots_kernel, down_type, NSB, R, regs)
        kernel[(n_embd + R - 1) // R, n_used * WARP, _stream(stream), 4 * n_used * R](
            a16, a32, _flat(slot_offsets), n_used, _as_i32(mq), _flat(md), _flat(mbs), NSB,
            F.row_bytes(down_type, n_ff), n_embd, _flat(out), grid_g, ks_g, *_hc_args(hc))
        return
    NCH = _nch(n_ff)
    NW, regs = _NW_DOWN, _REGS_DOWN
    kernel = _cached(_moe_down_decode_kernel, down_type, NCH, NW, regs)
    kernel[(n_embd + NW - 1) // NW, NW * WARP, _stream(stream), _shmem_x(down_type, n_used, n_ff)](
        a16, a32, _flat(slot_offsets), n_used, _as_i32(mq), _flat(md),
        _flat(mbs) if mbs is not None else _dummy_i32(), n_ff // 256,
        F.row_bytes(down_type, n_ff), n_embd, _flat(out), grid_g, ks_g, *_hc_args(hc))


class MoEWorkspace:
    """Scratch for one decode MoE (allocate once, before capturing a graph)."""

    def __init__(self, n_used, n_embd, n_ff):
        self.n_used, self.n_embd, self.n_ff = n_used, n_embd, n_ff
        self.xq = cuda.device_array(n_embd, np.int8)
        self.xd = cuda.device_array(n_embd // 256, np.float32)
        self.xbs = cuda.device_array(n_embd // 16, np.int32)
        self.mid = cuda.device_array((n_used, n_ff), np.float32)
        self.mq = cuda.device_array(n_used * n_ff, np.int8)
        self.md = cuda.device_array(n_used * n_ff // 256, np.float32)
        self.mbs = cuda.device_array(n_used * n_ff // 16, np.int32)
        _iq2_tables()                        # device tables made before any graph capture
        _iq2_selector_tables_device()
        _dummy_i32()


def moe_decode(arena, slot_offsets, gate_type, down_type, x, route_w, clamp, out, ws, stream=0):
    """The whole routed MoE for one token: 4 launches, no allocation, no sync.

    x: device f32[n_embd]; route_w: device f32[n_used]; out: device f32[n_embd];
    ws: a MoEWorkspace(n_used, n_embd, n_ff)."""
    moe_decode_input(x, ws, stream)
    moe_decode_experts(arena, slot_offsets, gate_type, down_type, route_w, clamp, out, ws, stream)


def moe_decode_input(x, ws, stream=0):
    """moe_decode's first launch, the input's Q8_K quantization into ws: it depends on x alone,
    so a caller may run it on another stream while the router picks the experts."""
    quantize_q8_k(x, ws.xq, ws.xd, ws.xbs, stream)


def moe_decode_experts(arena, slot_offsets, gate_type, down_type, route_w, clamp, out, ws, stream=0,
                       before_down=None, hc=None):
    """moe_decode after moe_decode_input: gate+up, the middle's Q8_K, down (3 launches);
    before_down() is called between the last two (the engine joins a side stream there), hc is
    moe_down's."""
    moe_gate_up(arena, slot_offsets, gate_type, ws.n_embd, ws.n_ff, ws.xq, ws.xd, route_w, clamp,
                ws.mid, stream, bsums=ws.xbs)
    quantize_q8_k(ws.mid, ws.mq, ws.md, ws.mbs, stream)
    if before_down is not None:
        before_down()
    moe_down(arena, slot_offsets, down_type, ws.n_ff, ws.n_embd, ws.mq, ws.md, ws.mbs, out, stream, hc=hc)


_T_MOE_PREFILL = 4


_PREFILL_SCRATCH = {}


def _moe_prefill_scratch(n_tok, n_used, n_embd, n_ff):
    """moe_prefill's device scratch for n_tok tokens, kept between calls and grown when a call
    needs more (one engine prefill calls it per layer and chunk; ~90 MB for 512 tokens). Calls on
    one stream run in order, so reusing the buffers is safe there."""
    key = (n_used, n_embd, n_ff)
    held = _PREFILL_SCRATCH.get(key)
    if held is None or held[0] < n_tok:
        sizes = dict(xq=(n_embd, np.int8), xd=(n_embd // 256, np.float32), xbs=(n_embd // 16, np.int32),
                     mid=(n_used * n_ff, np.float32), mq=(n_used * n_ff, np.int8),
                     md=(n_used * n_ff // 256, np.float32), mbs=(n_used * n_ff // 16, np.int32),
                     pair_out=(n_used * n_embd, np.float32))
        held = _PREFILL_SCRATCH[key] = (n_tok, {name: (cuda.device_array(n_tok * per_tok, dt), per_tok)
                                                for name, (per_tok, dt) in sizes.items()})
    bufs = held[1]
    return tuple(memo_view(bufs[name][0], n_tok * bufs[name][1], lambda a, n=n_tok * bufs[name][1]: a[:n])
                 for name in ("xq", "xd", "xbs", "mid", "mq", "md", "mbs", "pair_out"))


def group_tiles(ids, table, T):
    """The (token, slot) pairs of ids [n_tok, n_used] grouped by expert (stable: token order within
    an expert), each group cut into tiles of at most T pairs. Returns per tile the expert's byte
    offsets table[e] (int64[n_tiles, 3]), its tokens and slots (int32[n_tiles, T], 0 past the
    count) and its pair count (int32[n_tiles]). Vectorised: a 512-token chunk has ~800 tiles."""
    n_tok, n_used = ids.shape
    pairs_exp = ids.reshape(-1)
    order = np.argsort(pairs_exp, kind="stable")          # pair p = token p // n_used, slot p % n_used
    exps, starts, counts = np.unique(pairs_exp[order], return_index=True, return_counts=True)
    tiles_per = (counts + T - 1) // T
    owner = np.repeat(np.arange(len(exps)), tiles_per)    # tile -> index into exps
    first = np.cumsum(tiles_per) - tiles_per
    within = np.arange(len(owner)) - first[owner]          # tile's rank inside its expert's group
    tile_cnt = np.minimum(T, counts[owner] - within * T).astype(np.int32)
    member = np.arange(T)
    valid = member[None, :] < tile_cnt[:, None]
    pos = np.where(valid, starts[owner][:, None] + within[:, None] * T + member[None, :], 0)
    pair = order[pos]
    tile_tok = np.where(valid, pair // n_used, 0).astype(np.int32)
    tile_slot = np.where(valid, pair % n_used, 0).astype(np.int32)
    tile_off = np.ascontiguousarray(table[exps[owner]], dtype=np.int64)
    return tile_off, tile_tok, tile_slot, tile_cnt


def _tiles_to_device(ids, table, T, s):
    """group_tiles(ids, table, T) on the device in two copies (the int64 offsets, then token, slot
    and count as one int32 array viewed in three parts): (offsets, tokens, slots, counts)."""
    tile_off, tile_tok, tile_slot, tile_cnt = group_tiles(ids, table, T)
    n = tile_tok.size
    ints = cuda.to_device(np.concatenate([tile_tok.reshape(-1), tile_slot.reshape(-1), tile_cnt]), stream=s)
    return cuda.to_device(tile_off.reshape(-1), stream=s), ints[:n], ints[n:2 * n], ints[2 * n:]


# ---- the same grouping on the device (resident experts: no host sync per layer) -------------------

_GROUP_MAX_EXP = 1024      # experts per layer the one-block grouping kernel can count
_GROUP_THREADS = 1024


@_jit_capped(0)
def _group_tiles_kernel(ids, n_pairs, n_used, n_exp, table, T, rank, tile_off, tile_tok, tile_slot, tile_cnt):
    """group_tiles in one block: pairs counted per expert with shared-memory atomics (the count
    before a pair's increment is its rank in the expert's group), tiles numbered by expert, then
    every pair written into its tile. The order inside a group follows the atomics, not the
    tokens: each pair's numbers are computed on their own and summed per token in slot order
    (_moe_sum_kernel), so the outputs do not depend on it. Tiles past the used ones get count 0
    (the tile kernels return at once)."""
    pdl_enter()
    count = cuda.shared.array(_GROUP_MAX_EXP, int32)
    first = cuda.shared.array(_GROUP_MAX_EXP, int32)
    used = cuda.shared.array(1, int32)
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    for e in range(tid, n_exp, nthr):
        count[e] = 0
    cuda.syncthreads()
    for p in range(tid, n_pairs, nthr):
        rank[p] = cuda.atomic.add(count, ids[p], 1)
    cuda.syncthreads()
    if tid == 0:                     # n_exp tile counts: a serial scan is a few microseconds
        total = 0
        for e in range(n_exp):
            first[e] = total
            total += (count[e] + T - 1) // T
        used[0] = total
    cuda.syncthreads()
    for p in range(tid, n_pairs, nthr):
        r = rank[p]
        k = r // T
        t = first[ids[p]] + k
        tok = p // n_used
        tile_tok[t * T + r - k * T] = tok
        tile_slot[t * T + r - k * T] = p - tok * n_used
    for e in range(tid, n_exp, nthr):
        c = count[e]
        for k in range((c + T - 1) // T):
            t = first[e] + k
            m = min(T, c - k * T)
            tile_cnt[t] = m
            for i in range(3):
                tile_off[t * 3 + i] = table[e, i]
            for j in range(m, T):
                tile_tok[t * T + j] = 0
                tile_slot[t * T + j] = 0
    for t in range(used[0] + tid, tile_cnt.size, nthr):
        tile_cnt[t] = 0


_DEVICE_TILES = {}


def _tiles_on_device(ids, table, T, s):
    """group_tiles for device ids int32[n_tok, n_used] and a device table int64[n_exp, 3]: the
    same four arrays, sized for the most tiles any grouping can need (n_pairs / T + one partial
    tile per expert), kept between calls (calls on one stream run in order)."""
    n_pairs = ids.size
    n_exp = table.shape[0]
    if n_exp > _GROUP_MAX_EXP:
        raise ValueError(f"moe_prefill: {n_exp} experts; the device grouping counts at most {_GROUP_MAX_EXP}")
    max_tiles = n_pairs // T + min(n_exp, n_pairs) + 1
    held = _DEVICE_TILES.get(T)
    if held is None or held[0] < max_tiles or held[1].size < n_pairs:
        held = _DEVICE_TILES[T] = (max_tiles, cuda.device_array(n_pairs, np.int32),
                                   cuda.device_array(max_tiles * 3, np.int64),
                                   cuda.device_array(max_tiles * (2 * T + 1), np.int32))
    _, rank, offs, ints = held
    n = max_tiles * T
    tiles = memo_view(ints, ("tiles", max_tiles, T), lambda ints: (
        offs[:max_tiles * 3], ints[:n], ints[n:2 * n], ints[2 * n:2 * n + max_tiles]))
    _group_tiles_kernel[1, _GROUP_THREADS, s](_flat(ids), n_pairs, ids.shape[1], n_exp, table, T, rank, *tiles)
    return tiles


def _tile_launch(kernel, rows, tiles, mma, s, shmem=0):
    """kernel configured over (row groups, tiles): the tensor-core kernels take 16 rows per warp
    and _MMA_WARPS warps per block, the dp4a ones a row per warp and _NW_MOE warps."""
    warps = _MMA_WARPS if mma else _NW_MOE
    per_block = 16 * warps if mma else warps
    return kernel[((rows + per_block - 1) // per_block, tiles[3].size), warps * WARP, s, shmem]


def _launch_moe_down_mma(a32, tiles, n_used, n_ff, n_embd, mq, md, mbs, pair_out, s, staged):
    """moe_prefill's Q2_K down projection on the tensor cores for tiles of 8·_MMA_HALVES_DN pairs
    (group_tiles): the staged kernel (any shape) or the direct one; the same bits either way."""
    NH, nsb = _MMA_HALVES_DN, n_ff // 256
    if staged:
        dn = _cached(_moe_down_tiles_staged_kernel, NH, nsb)
        rows = 16 * _DN_ST_WARPS
        dn[((n_embd + rows - 1) // rows, tiles[3].size), _DN_ST_WARPS * WARP, s](
            a32, *tiles, n_used, _as_i64(mq), md, n_embd, pair_out)
    else:
        dn = _cached(_moe_down_tiles_mma_kernel, NH)
        _tile_launch(dn, n_embd, tiles, True, s)(
            a32, *tiles, n_used, _as_i64(mq), md, mbs, nsb, F.row_bytes(F.Q2_K, n_ff), n_embd, pair_out)


def moe_prefill(arena, expert_table, gate_type, down_type, n_embd, n_ff, X, expert_ids, route_w,
                clamp, out, stream=0, mma=None):
    """Routed MoE for n_tok tokens, grouping tokens by expert; each token equals moe_decode.

    expert_table: int64[n_exp, 3] byte offsets (gate, up, down) of every expert in arena;
    X: device f32[n_tok, n_embd]; expert_ids: int32[n_tok, n_used]; route_w: device
    f32[n_tok, n_used]; out: device f32[n_tok, n_embd]. With expert_ids and expert_table on the
    host the tokens are grouped on the host; with both on the device, on the device (no sync).
    Allocates its scratch on first use (not for graphs).
    """
    _check_moe_types(gate_type, down_type)
    on_device = cuda.is_cuda_array(expert_ids)
    if on_device != cuda.is_cuda_array(expert_table):
        raise ValueError("moe_prefill: expert_ids and expert_table must be both on the host or both on the device")
    if on_device:
        ids, table, group = expert_ids, expert_table, _tiles_on_device
    else:
        ids = np.ascontiguousarray(expert_ids, dtype=np.int32)
        table, group = np.asarray(expert_table, dtype=np.int64), _tiles_to_device
    n_tok, n_used = ids.shape
    T = _T_MOE_PREFILL
    s = _stream(stream)
    if mma is None:
        mma = _USE_MMA
    mma_gu, mma_dn = mma and gate_type == F.IQ2_XXS, mma and down_type == F.Q2_K
    # the tile lists each kernel kind needs, grouped once per tile size (gate/up and down share
    # one when their tiles are the same size)
    grouped = {}

    def tiles_of(size):
        if size not in grouped:
            grouped[size] = group(ids, table, size, s)
        return grouped[size]

    tiles = tiles_of(T) if not (mma_gu and mma_dn) else None
    gu_tiles = tiles_of(8 * _MMA_HALVES_GU) if mma_gu else None
    mma_tiles = tiles_of(8 * _MMA_HALVES_DN) if mma_dn else None
    xq, xd, xbs, mid, mq, md, mbs, pair_out = _moe_prefill_scratch(n_tok, n_used, n_embd, n_ff)
    a16, a32, _, _ = _arena_views(arena)
    grid_g, ks_g = _iq2_tables()
    quantize_q8_k(X, xq, xd, xbs, s)
    if mma_gu and _MMA_STAGED_GU and gate_up_staged_applies(n_embd):
        NH = _MMA_HALVES_GU
        gu = _cached(_moe_gate_up_tiles_staged_kernel, NH)
        gu[((n_ff + _GU_ST_ROWS - 1) // _GU_ST_ROWS, gu_tiles[3].size), 8 * WARP, s](
            a32, *gu_tiles, n_used, _as_i64(xq), xd, n_embd // 256, _flat(route_w),
            np.float32(clamp), n_ff, F.row_bytes(gate_type, n_embd), mid, *_iq2_selector_tables_device())
    elif mma_gu:
        gu = _cached(_moe_gate_up_tiles_mma_kernel, _MMA_HALVES_GU)
        _tile_launch(gu, n_ff, gu_tiles, True, s)(
            a16, *gu_tiles, n_used, _as_i64(xq), xd, n_embd // 256, _flat(route_w), np.float32(clamp), n_ff,
            F.row_bytes(gate_type, n_embd), mid, grid_g, ks_g)
    else:
        NCH = _nch(n_embd)
        gu = _cached(_moe_gate_up_tiles_kernel, gate_type, T, NCH)
        _tile_launch(gu, n_ff, tiles, False, s, _shmem_x(gate_type, T, n_embd))(
            a16, a32, *tiles, n_used, _as_i32(xq), xd, xbs, n_embd // 256,
            _flat(route_w), np.float32(clamp), n_ff, F.row_bytes(gate_type, n_embd), mid, grid_g, ks_g)
    quantize_q8_k(mid, mq, md, mbs, s)
    if mma_dn:
        _launch_moe_down_mma(a32, mma_tiles, n_used, n_ff, n_embd, mq, md, mbs, pair_out, s, _MMA_STAGED_DN)
    else:
        NCH = _nch(n_ff)
        dn = _cached(_moe_down_tiles_kernel, down_type, T, NCH)
        _tile_launch(dn, n_embd, tiles, False, s, _shmem_x(down_type, T, n_ff))(
            a16, a32, *tiles, n_used, _as_i32(mq), md, mbs, n_ff // 256,
            F.row_bytes(down_type, n_ff), n_embd, pair_out, grid_g, ks_g)
    n_out = n_tok * n_embd
    _moe_sum_kernel[(n_out + 255) // 256, 256, s](pair_out, n_tok, n_used, n_embd, _flat(out))
