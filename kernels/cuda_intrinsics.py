"""The few GPU instructions numba-cuda does not expose, as inline-PTX intrinsics.

Kept in one small module on purpose: numba-cuda is in maintenance mode and its successor
(numba-cuda-mlir) has no llvmlite ``@intrinsic``; this is the only file to port.

* ``dp4a(a, b, c)``: c + sum of the four signed byte products of a and b (PTX dp4a.s32.s32).
* ``dp4a_us(a, b, c)``: dp4a with a's bytes unsigned (PTX dp4a.u32.s32): bytes up to 255.
* ``dp2a_lo(a, b, c)``, ``dp2a_hi(a, b, c)``: c + the two signed 16-bit halves of a times bytes 0, 1
  (lo) or 2, 3 (hi) of b, unsigned (PTX dp2a.lo/.hi.s32.u32).
* ``f16_bits_to_f32(bits)``: the IEEE half in the low 16 bits of an int, as f32 (exact).
* ``bfe(x, pos, n)``: bits pos..pos+n-1 of a 32-bit word (PTX bfe.u32), as int32.
* ``imad(a, b, c)``: a*b + c in 32-bit (numba would widen a 32x32 product to 64 bits).
* ``mma_s8(a0, a1, a2, a3, b0, b1)``: one warp-wide int8 tensor-core product (PTX
  mma.sync.m16n8k32.row.col.s32.s8.s8.s32, C = 0): A 16 x 32 (row-major), B 32 x 8 (one column per
  token), the thread's four int32 results (rows lane/4 and lane/4 + 8, columns 2(lane%4) + 0/1).
  Exact integer dots, so a kernel that scales them per Q8_0 block gets the dp4a kernels' numbers.
* ``mma_s8_acc(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)``: the same product added to the thread's
  four int32 accumulators c0..c3 by the tensor core itself (ptxas does not fold an mma_s8 and the
  integer adds after it: four IADDs per MMA saved where a kernel sums many MMAs).
* ``mma_f16_acc(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)``: one warp-wide f16 tensor-core product
  added to f32 accumulators (PTX mma.sync.m16n8k16.row.col.f32.f16.f16.f32): A 16 x 16 row-major
  as four f16x2 words (a0: row lane/4, cols 2(lane%4) + 0/1; a1: row + 8; a2, a3: cols + 8),
  B 16 x 8 as two f16x2 words (b0: rows 2(lane%4) + 0/1 of column lane/4; b1: rows + 8), C/D the
  thread's four f32 (rows lane/4 and lane/4 + 8, columns 2(lane%4) + 0/1). The lower-indexed
  element of each pair is the word's low half.
* ``mma_f64_acc(a, b, c0, c1)``: one warp-wide f64 tensor-core product added to f64 accumulators
  (PTX mma.sync.m8n8k4.row.col.f64.f64.f64.f64, sm_80+): A 8 x 4 row-major (a: row lane/4,
  column lane%4), B 4 x 8 (b: row lane%4, column lane/4), C/D the thread's two f64 (row lane/4,
  columns 2(lane%4) + 0/1). In the simulator D = A @ B + C in numpy's f64 (the tensor core's
  order of the four products differs: ~1e-16).
* ``pack_f16x2(x0, x1)``: two f32 rounded to f16 (round to nearest even) in one word, x0 in the
  low half (PTX cvt.rn.f16x2.f32, whose first source goes to the upper half).
* ``split_f16x2(x0, x1)``: the pair as hi + lo f16 words: hi = pack_f16x2(x0, x1) and lo the
  f16 rounding of the remainders x - f32(hi) (exact in f32): hi + lo carries ~22 bits of x where
  x stays in f16's normal range, ~2^-25 absolute below it.
* ``halves_lo(a, b)``, ``halves_hi(a, b)``: the low (high) f16 halves of a and b as one word, a's
  in the low half (PTX prmt.b32 with selector 0x5410 / 0x7632).
* ``ld_f32x4_pick(a, b, pick_a, index)``: the 4 floats at flat element index .. index + 3 of the
  C-contiguous f32 array a (pick_a) or b, in one 16-byte load through the read-only path (PTX
  ld.global.nc.v4.f32; index a multiple of 4, the arrays 16-byte aligned, neither written by the
  kernel). The pointer is chosen before the load, so a kernel staging rows from either of two
  caches issues one unconditional load per 4 values.
* ``cp_async16_at(s, si, sk, a, base, off)``, ``cp_async4_at(...)``: an asynchronous copy of the
  16 (4) bytes at element base + off of the global array a (C-contiguous, 8-byte / 4-byte
  elements) to element si + sk of the shared array s (PTX cp.async.cg / .ca; both addresses
  aligned to the size), through no registers; sk is added after si's zero extension (a constant
  sk folds into the copy's shared-address immediate: one register for all the copies of a lane,
  not one per copy). ``cp_async_commit()`` closes the thread's group of copies,
  ``cp_async_wait1()`` waits until at most the newest group is in flight (the thread's own
  copies only: a block barrier must follow before other threads read them).
* ``ld_pair(s, i)``: elements i and i + 1 of the 32-bit array s (i even) in one 8-byte load.
* ``ld_quad(s, i)``: elements i .. i + 3 of the 32-bit array s (i a multiple of 4) in one 16-byte load.
  Both take a flat element index, so s may be a C-contiguous array of any rank.
* ``ld_half(s, i)``: the 16-bit element i of the 32-bit array s (little-endian: the low half of
  element i // 2 for even i) zero-extended to uint32, in one 16-bit load (shared arrays: LDS.U16).
* ``negate_bytes(g, nibble)``: the 4 bytes of g, byte k negated where bit k of nibble is set.
  Exact for bytes < 0x80 (IQ2_XXS grid values): (g ^ m) + (m & 0x01010101), m from a
  multiply that moves bit k to bit 8k+7 and a sign-replicating byte permute.
* ``byte_mask(nibble)``: 0xFF in byte k where bit k of nibble is set, else 0 (the multiply and
  permute of negate_bytes alone).
* ``even_signs(bits7)``: IQ2_XXS's 8 sign bits from the 7 stored ones: bit 7 makes the count of
  set bits even (the ksigns table of ggml, as popc and one bit insert instead of a lookup).
* ``funnel_r(lo, hi, n)``: the 32 bits of the 64-bit value hi:lo starting at bit n (0 <= n < 32;
  PTX shf.r.wrap.b32): a word at a 2-byte offset from two aligned ones, in one instruction.
* ``shr64_lo(lo, hi, n)``: the low 32 bits of the 64-bit value hi:lo shifted right by n
  (0 <= n < 64; PTX shr.b64 of the pair): a field that may start in either word, one SHF.
* ``iq2_permute(gsel, ssel, pos)``: the 8 signed IQ2_XXS weights of one grid entry as two words
  (the low 4 weights, the high 4) from byte-permute selectors: gsel's nibble k is 1, 2, 3 for the
  grid value 8, 25, 43 of weight k, ssel's nibble k is 4 where weight k is negated; the OR of the
  two selects from the 8 bytes 0, 8, 25, 43 (pos, which must be 0x2B190800) and 0, -8, -25, -43
  (two prmt.b32, an or and a shift: four instructions where negating by an 8-byte mask took six). pos is
  an operand so that the caller can hold it in a register: a prmt takes one immediate, and given
  two constants ptxas moved the other one from a uniform register before every prmt (SASS).
* ``shared_addr(s)``: the 32-bit shared-window address of element 0 of the shared array s
  (PTX cvta.to.shared), and ``lds32(addr)``: the 32-bit word at that address (ld.shared.u32): a
  table lookup whose address the caller computes, e.g. ``imad(index, four, base)`` with ``four``
  a register holding 4, so that ptxas issues an IMAD (the FMA pipe) where array indexing gives a
  LEA (the integer ALU pipe, the busiest of the gate/up decode).
* ``mulhi(a, b)``: the high 32 bits of the unsigned product (mul.hi.u32): with b = 2^(32 - n) in a
  register, a >> n on the FMA pipe instead of a shift on the ALU pipe.
* ``and_or(x, m, b)``: (x & m) | b (one LOP3): a pre-scaled table index plus a base aligned past m.
* ``pdl_enter()``: the first statement of every kernel. Programmatic dependent launch (sm_90+):
  wait until the grids this one depends on have finished and their writes are visible
  (griddepcontrol.wait), then let the grids that depend on this one be launched now
  (griddepcontrol.launch_dependents), so their blocks are resident and waiting when this grid
  ends instead of being launched after it. Both are no-ops for a grid launched without a
  programmatic edge (eager launches, ordinary graph edges); kernels/graph.py makes the edges.
  Nothing is emitted for GPUs before sm_90.
* ``mul_rn(a, b)``, ``add_rn(a, b)``: an f32 product or sum rounded on its own (libdevice
  __nv_fmul_rn / __nv_fadd_rn), which NVVM never contracts into an fma: where a GPU kernel must
  round exactly as the CPU engine does (numba on the CPU does not contract).

Numba widens every integer operation on 32-bit values to 64 bits; these keep the hot
bit-twiddling in 32-bit registers (half the instructions of the widened code).

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) custom intrinsics cannot run, so plain-Python
versions with the same results are used instead. mma_f16_acc and mma_f64_acc gather the warp's
fragments at the simulated block barrier (so every thread of the block must make the same calls);
mma_s8 has none.
"""

from . import compat  # noqa: F401  (numpy shim before numba.cuda loads)

import numpy as np
from numba import cuda

SIMULATOR = bool(getattr(cuda.config, "ENABLE_CUDASIM", False))
# A device function NVVM inlines into its caller, so the constants a caller passes fold (numba's
# simulator takes no forceinline: there it is a plain device function).
forceinline = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


def _pdl_supported() -> bool:
    """griddepcontrol exists from sm_90 on; compiles with no GPU (scripts/check_cuda_compile.py)
    target sm_90."""
    try:
        from numba.cuda.cudadrv import devices
        return tuple(devices.get_context().device.compute_capability) >= (9, 0)
    except Exception:
        return True


if SIMULATOR:  # pragma: no cover - exercised only under the simulator

    def dp4a(a, b, c):
        ab = np.array([a], dtype=np.int64).astype(np.uint32).view(np.int8)
        bb = np.array([b], dtype=np.int64).astype(np.uint32).view(np.int8)
        return np.int32(int(c) + int((ab.astype(np.int32) * bb.astype(np.int32)).sum()))

    def f16_bits_to_f32(bits):
        return np.float32(np.array([int(bits) & 0xFFFF], np.uint16).view(np.float16)[0])

    def dp4a_us(a, b, c):
        ab = np.array([a], dtype=np.int64).astype(np.uint32).view(np.uint8)
        bb = np.array([b], dtype=np.int64).astype(np.uint32).view(np.int8)
        return np.int32(int(c) + int((ab.astype(np.int64) * bb.astype(np.int64)).sum()))

    def _dp2a(a, b, c, hi):
        ah = np.array([a], dtype=np.int64).astype(np.uint32).view(np.int16).astype(np.int64)
        bb = np.array([b], dtype=np.int64).astype(np.uint32).view(np.uint8).astype(np.int64)
        return np.int32(int(c) + int(ah[0] * bb[2 * hi] + ah[1] * bb[2 * hi + 1]))

    def dp2a_lo(a, b, c):
        return _dp2a(a, b, c, 0)

    def dp2a_hi(a, b, c):
        return _dp2a(a, b, c, 1)

    def bfe(x, pos, n):
        return np.int32((int(x) & 0xFFFFFFFF) >> int(pos) & ((1 << int(n)) - 1))

    def imad(a, b, c):
        return np.int32(((int(a) * int(b) + int(c)) + 2**31) % 2**32 - 2**31)

    def mma_s8(a0, a1, a2, a3, b0, b1):
        raise NotImplementedError("mma_s8 is a warp-wide tensor-core instruction: no simulator version")

    def mma_s8_acc(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        raise NotImplementedError("mma_s8_acc is a warp-wide tensor-core instruction: no simulator version")

    def _f16_bits(x):
        return int(np.array([x], np.float32).astype(np.float16).view(np.uint16)[0])

    def _f16_value(bits):
        return np.float32(np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0])

    def _warp_gather(value):
        """The values of the 32 lanes of this thread's warp (every thread of the block must call
        it the same number of times: it waits at the simulated block barrier twice)."""
        import threading
        th = threading.current_thread()
        slots = th._manager.__dict__.setdefault("_ds4py_warp_slots", {})
        slots[th.thread_id] = value
        th.syncthreads()
        base = th.thread_id - th.thread_id % 32
        values = [slots[base + lane] for lane in range(32)]
        th.syncthreads()
        return values

    def mma_f16_acc(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """The warp's m16n8k16 product from the PTX fragment layout, summed in float64 and rounded
        to f32 once (the tensor core rounds differently, within the same tolerance)."""
        lanes = _warp_gather((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for lane, v in enumerate(lanes):
            g, c = lane >> 2, lane & 3
            for i, (r, k) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
                A[r, k] = _f16_value(int(v[i]))
                A[r, k + 1] = _f16_value(int(v[i]) >> 16)
            for i, k in enumerate((2 * c, 2 * c + 8)):
                B[k, g] = _f16_value(int(v[4 + i]))
                B[k + 1, g] = _f16_value(int(v[4 + i]) >> 16)
            C[g, 2 * c], C[g, 2 * c + 1], C[g + 8, 2 * c], C[g + 8, 2 * c + 1] = v[6:10]
        D = (A @ B + C).astype(np.float32)
        import threading
        lane = threading.current_thread().thread_id % 32
        g, c = lane >> 2, lane & 3
        return D[g, 2 * c], D[g, 2 * c + 1], D[g + 8, 2 * c], D[g + 8, 2 * c + 1]

    def mma_f64_acc(a, b, c0, c1):
        """The warp's m8n8k4 f64 product from the PTX fragment layout (module docstring)."""
        lanes = _warp_gather((a, b, c0, c1))
        A = np.zeros((8, 4))
        B = np.zeros((4, 8))
        C = np.zeros((8, 8))
        for lane, v in enumerate(lanes):
            g, c = lane >> 2, lane & 3
            A[g, c] = v[0]
            B[c, g] = v[1]
            C[g, 2 * c], C[g, 2 * c + 1] = v[2], v[3]
        D = A @ B + C
        import threading
        lane = threading.current_thread().thread_id % 32
        g, c = lane >> 2, lane & 3
        return np.float64(D[g, 2 * c]), np.float64(D[g, 2 * c + 1])

    def pack_f16x2(x0, x1):
        return np.uint32(_f16_bits(x0) | (_f16_bits(x1) << 16))

    def split_f16x2(x0, x1):
        hi = int(pack_f16x2(x0, x1))
        r0 = np.float32(np.float32(x0) - _f16_value(hi))
        r1 = np.float32(np.float32(x1) - _f16_value(hi >> 16))
        return np.uint32(hi), pack_f16x2(r0, r1)

    def halves_lo(a, b):
        return np.uint32((int(a) & 0xFFFF) | ((int(b) & 0xFFFF) << 16))

    def ld_f32x4_pick(a, b, pick_a, index):
        arr = a if pick_a else b
        row, col = divmod(int(index), arr.shape[1])
        return tuple(np.float32(arr[row, col + k]) for k in range(4))

    def halves_hi(a, b):
        return np.uint32(((int(a) >> 16) & 0xFFFF) | (int(b) & 0xFFFF0000))

    def cp_async16_at(s, si, sk, a, base, off):
        # a synchronous copy: the simulator has no asynchronous one to wait for
        src = _flat(np.asarray(a)).view(np.uint8)
        dst = _flat(s).view(np.uint8)
        g = (int(base) + int(off)) * a.dtype.itemsize
        d = (int(si) + int(sk)) * s.dtype.itemsize
        dst[d:d + 16] = src[g:g + 16]

    def cp_async4_at(s, si, sk, a, base, off):
        raise NotImplementedError("cp.async: no simulator version")

    def _flat(s):
        return s.reshape(-1) if s.ndim > 1 else s

    def ld_pair(s, i):
        s = _flat(s)
        return s[int(i)], s[int(i) + 1]

    def ld_quad(s, i):
        s = _flat(s)
        return tuple(s[int(i) + k] for k in range(4))

    def ld_half(s, i):
        w = int(s[int(i) >> 1]) & 0xFFFFFFFF
        return np.uint32((w >> (16 * (int(i) & 1))) & 0xFFFF)

    _SIM_SHARED = {}                       # fake shared address -> the simulated array

    def shared_addr(s):
        for base, arr in list(_SIM_SHARED.items()):
            if arr is s:
                return np.uint32(base)
        base = (len(_SIM_SHARED) + 1) << 20     # 1 MiB apart: aligned past any table index
        _SIM_SHARED[base] = s
        return np.uint32(base)

    def lds32(addr):
        base = int(addr) & ~((1 << 20) - 1)
        return np.uint32(int(_flat(_SIM_SHARED[base])[(int(addr) - base) >> 2]) & 0xFFFFFFFF)

    def mulhi(a, b):
        return np.uint32(((int(a) & 0xFFFFFFFF) * (int(b) & 0xFFFFFFFF)) >> 32)

    def and_or(x, m, b):
        return np.uint32(((int(x) & int(m)) | int(b)) & 0xFFFFFFFF)

    def cp_async_commit():
        return None

    def cp_async_wait1():
        return None

    def negate_bytes(g, nibble):
        g = int(g) & 0xFFFFFFFF
        out = 0
        for k in range(4):
            b = (g >> (8 * k)) & 0xFF
            if (int(nibble) >> k) & 1:
                b = (-b) & 0xFF
            out |= b << (8 * k)
        return np.uint32(out)

    def byte_mask(nibble):
        return np.uint32(sum(0xFF << (8 * k) for k in range(4) if (int(nibble) >> k) & 1))

    def even_signs(bits7):
        b = int(bits7) & 0x7F
        return np.int32(b | ((bin(b).count("1") & 1) << 7))

    def pdl_enter():
        return None

    def funnel_r(lo, hi, n):
        v = ((int(hi) & 0xFFFFFFFF) << 32) | (int(lo) & 0xFFFFFFFF)
        return np.uint32((v >> (int(n) & 31)) & 0xFFFFFFFF)

    def shr64_lo(lo, hi, n):
        v = ((int(hi) & 0xFFFFFFFF) << 32) | (int(lo) & 0xFFFFFFFF)
        return np.uint32((v >> (int(n) & 63)) & 0xFFFFFFFF)

    _IQ2_PERMUTE_BYTES = (0, 8, 25, 43, 0, 0xF8, 0xE7, 0xD5)

    def iq2_permute(gsel, ssel, pos):
        assert int(pos) == 0x2B190800
        sel = (int(gsel) | int(ssel)) & 0xFFFFFFFF
        w = [sum(_IQ2_PERMUTE_BYTES[(sel >> (4 * (4 * h + k))) & 7] << (8 * k) for k in range(4))
             for h in range(2)]
        return np.uint32(w[0]), np.uint32(w[1])

    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    def add_rn(a, b):
        return np.float32(np.float32(a) + np.float32(b))

else:
    from llvmlite import ir
    from numba.core import types      # the module itself: numba.types is a redirect that pickles by
                                      # value in some import orders, and kernel cache keys pickle closures
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    mul_rn = libdevice.fmul_rn      # never contracted into an fma (see the module docstring)
    add_rn = libdevice.fadd_rn

    @intrinsic
    def f16_bits_to_f32(typingctx, bits):
        if not isinstance(bits, types.Integer):
            return None
        sig = types.float32(bits)

        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], types.int32)
            fnty = ir.FunctionType(ir.FloatType(), [ir.IntType(32)])
            asm = ir.InlineAsm(
                fnty, "{ .reg .b16 h; cvt.u16.u32 h, $1; cvt.f32.f16 $0, h; }", "=f,r")
            return builder.call(asm, [v])

        return sig, codegen

    def _i32(context, builder, v, t):
        return context.cast(builder, v, t, types.int32)

    _MMA_S8 = ("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    def _mma_s8_codegen(context, builder, signature, llargs, accumulate):
        """The inline mma.sync: C from the last four arguments, or 0 (accumulate False)."""
        vals = [_i32(context, builder, v, t) for v, t in zip(llargs, signature.args)]
        i32 = ir.IntType(32)
        if not accumulate:
            vals += [ir.Constant(i32, 0)] * 4
        fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * 10)
        res = builder.call(ir.InlineAsm(fnty, _MMA_S8, "=r,=r,=r,=r," + ",".join(["r"] * 10)), vals)
        parts = [builder.extract_value(res, i) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, parts)

    @intrinsic
    def mma_s8(typingctx, a0, a1, a2, a3, b0, b1):
        args = (a0, a1, a2, a3, b0, b1)
        if not all(isinstance(t, types.Integer) for t in args):
            return None

        def codegen(context, builder, signature, llargs):
            return _mma_s8_codegen(context, builder, signature, llargs, False)

        return types.UniTuple(types.int32, 4)(*args), codegen

    @intrinsic
    def mma_s8_acc(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        args = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        if not all(isinstance(t, types.Integer) for t in args):
            return None

        def codegen(context, builder, signature, llargs):
            return _mma_s8_codegen(context, builder, signature, llargs, True)

        return types.UniTuple(types.int32, 4)(*args), codegen

    _MMA_F16 = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    @intrinsic
    def mma_f16_acc(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        words = (a0, a1, a2, a3, b0, b1)
        accs = (c0, c1, c2, c3)
        if not (all(isinstance(t, types.Integer) for t in words)
                and all(isinstance(t, types.Float) for t in accs)):
            return None

        def codegen(context, builder, signature, llargs):
            n = len(words)
            vals = [_i32(context, builder, v, t) for v, t in zip(llargs[:n], signature.args[:n])]
            vals += [context.cast(builder, v, t, types.float32)
                     for v, t in zip(llargs[n:], signature.args[n:])]
            i32, f32 = ir.IntType(32), ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            cons = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)
            res = builder.call(ir.InlineAsm(fnty, _MMA_F16, cons), vals)
            parts = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, signature.return_type, parts)

        return types.UniTuple(types.float32, 4)(*(words + accs)), codegen

    _MMA_F64 = "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {$0, $1}, {$2}, {$3}, {$4, $5};"

    @intrinsic
    def mma_f64_acc(typingctx, a, b, c0, c1):
        args = (a, b, c0, c1)
        if not all(isinstance(t, types.Float) for t in args):
            return None

        def codegen(context, builder, signature, llargs):
            vals = [context.cast(builder, v, t, types.float64) for v, t in zip(llargs, signature.args)]
            f64 = ir.DoubleType()
            fnty = ir.FunctionType(ir.LiteralStructType([f64] * 2), [f64] * 4)
            res = builder.call(ir.InlineAsm(fnty, _MMA_F64, "=d,=d,d,d,d,d"), vals)
            parts = [builder.extract_value(res, i) for i in range(2)]
            return context.make_tuple(builder, signature.return_type, parts)

        return types.UniTuple(types.float64, 2)(*args), codegen

    def _f32_pair_asm(name, n_out, asm, constraints):
        """An intrinsic of two f32 operands computed by the inline PTX `asm` into n_out 32-bit
        words (one uint32, or a tuple of n_out)."""
        def typer(typingctx, x0, x1):
            if not all(isinstance(t, types.Float) for t in (x0, x1)):
                return None

            def codegen(context, builder, signature, args):
                vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)]
                i32 = ir.IntType(32)
                ret = i32 if n_out == 1 else ir.LiteralStructType([i32] * n_out)
                fnty = ir.FunctionType(ret, [ir.FloatType()] * 2)
                res = builder.call(ir.InlineAsm(fnty, asm, constraints), vals)
                if n_out == 1:
                    return res
                parts = [builder.extract_value(res, i) for i in range(n_out)]
                return context.make_tuple(builder, signature.return_type, parts)

            ret_type = types.uint32 if n_out == 1 else types.UniTuple(types.uint32, n_out)
            return ret_type(x0, x1), codegen

        typer.__name__ = name
        return intrinsic(typer)

    pack_f16x2 = _f32_pair_asm("pack_f16x2", 1, "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")
    split_f16x2 = _f32_pair_asm("split_f16x2", 2, ("{ .reg .b16 h0, h1; .reg .f32 y0, y1; "
                                                   "cvt.rn.f16x2.f32 $0, $3, $2; "
                                                   "mov.b32 {h0, h1}, $0; "
                                                   "cvt.f32.f16 y0, h0; cvt.f32.f16 y1, h1; "
                                                   "sub.rn.f32 y0, $2, y0; sub.rn.f32 y1, $3, y1; "
                                                   "cvt.rn.f16x2.f32 $1, y1, y0; }"), "=&r,=r,f,f")

    @intrinsic
    def ld_f32x4_pick(typingctx, a, b, pick_a, index):
        if not (isinstance(a, types.Array) and a == b and a.dtype == types.float32 and a.layout == "C"
                and isinstance(pick_a, types.Boolean) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            arr_t = signature.args[0]
            ary_a = context.make_array(arr_t)(context, builder, args[0])
            ary_b = context.make_array(arr_t)(context, builder, args[1])
            base = builder.select(args[2], ary_a.data, ary_b.data)
            idx = context.cast(builder, args[3], signature.args[3], types.int64)
            addr = builder.ptrtoint(builder.gep(base, [idx]), ir.IntType(64))
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [ir.IntType(64)])
            asm = ("{ .reg .u64 g; cvta.to.global.u64 g, $4; "
                   "ld.global.nc.v4.f32 {$0, $1, $2, $3}, [g]; }")
            res = builder.call(ir.InlineAsm(fnty, asm, "=f,=f,=f,=f,l"), [addr])
            parts = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, signature.return_type, parts)

        return types.UniTuple(types.float32, 4)(a, b, pick_a, index), codegen

    def _cp_async_at(nbytes, kind):
        def typer(typingctx, s, si, sk, a, base, off):
            if not (isinstance(s, types.Array) and isinstance(a, types.Array) and a.layout == "C"
                    and all(isinstance(t, types.Integer) for t in (si, sk, base, off))):
                return None

            def codegen(context, builder, signature, args):
                sary = context.make_array(signature.args[0])(context, builder, args[0])
                gary = context.make_array(signature.args[3])(context, builder, args[3])
                i64 = ir.IntType(64)
                si_ = context.cast(builder, args[1], signature.args[1], types.uint32)
                sk_ = context.cast(builder, args[2], signature.args[2], types.int64)
                sptr = builder.gep(sary.data, [builder.zext(si_, i64)])
                esz = context.get_abi_sizeof(context.get_value_type(signature.args[0].dtype))
                skb = builder.mul(sk_, ir.Constant(i64, esz))
                b = context.cast(builder, args[4], signature.args[4], types.int64)
                o = builder.zext(context.cast(builder, args[5], signature.args[5], types.uint32), i64)
                gptr = builder.gep(builder.gep(gary.data, [b]), [o])
                fnty = ir.FunctionType(ir.VoidType(), [i64, i64, i64])
                # sk's bytes as an immediate of the shared address ("n": a constant once the
                # caller is inlined and unrolled), so LLVM hoists one base, not one per copy
                asm = ("{ .reg .u64 s, g; .reg .u32 s32; cvta.to.shared.u64 s, $0; cvt.u32.u64 s32, s; "
                       f"cvta.to.global.u64 g, $1; cp.async.{kind}.shared.global [s32+$2], [g], {nbytes}; }}")
                builder.call(ir.InlineAsm(fnty, asm, "l,l,n,~{memory}", side_effect=True),
                             [builder.ptrtoint(sptr, i64), builder.ptrtoint(gptr, i64), skb])
                return context.get_dummy_value()

            return types.void(s, si, sk, a, base, off), codegen
        return intrinsic(typer)

    cp_async16_at = _cp_async_at(16, "cg")
    cp_async4_at = _cp_async_at(4, "ca")

    def _ld_vec(name, n):
        """An intrinsic: elements i .. i + n - 1 of a 32-bit array in one n*4-byte vector load."""
        def typer(typingctx, s, i):
            if not (isinstance(s, types.Array) and s.dtype.bitwidth == 32 and isinstance(i, types.Integer)):
                return None

            def codegen(context, builder, signature, args):
                ary = context.make_array(signature.args[0])(context, builder, args[0])
                el = context.get_value_type(signature.args[0].dtype)
                vt = ir.VectorType(el, n)
                idx = context.cast(builder, args[1], signature.args[1], types.int64)
                p = builder.bitcast(builder.gep(ary.data, [idx]), vt.as_pointer(ary.data.type.addrspace))
                v = builder.load(p, align=4 * n)
                parts = [builder.extract_element(v, ir.Constant(ir.IntType(32), k)) for k in range(n)]
                return context.make_tuple(builder, signature.return_type, parts)

            return types.UniTuple(s.dtype, n)(s, i), codegen

        typer.__name__ = name
        return intrinsic(typer)

    ld_pair = _ld_vec("ld_pair", 2)
    ld_quad = _ld_vec("ld_quad", 4)

    @intrinsic
    def ld_half(typingctx, s, i):
        if not (isinstance(s, types.Array) and s.dtype.bitwidth == 32 and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            i16 = ir.IntType(16)
            p16 = builder.bitcast(ary.data, i16.as_pointer(ary.data.type.addrspace))
            idx = context.cast(builder, args[1], signature.args[1], types.int64)
            v = builder.load(builder.gep(p16, [idx]))
            return builder.zext(v, ir.IntType(32))

        return types.uint32(s, i), codegen

    def _asm_stmt(text):
        def typer(typingctx):
            def codegen(context, builder, signature, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return types.void(), codegen
        return intrinsic(typer)

    cp_async_commit = _asm_stmt("cp.async.commit_group;")
    cp_async_wait1 = _asm_stmt("cp.async.wait_group 1;")

    @intrinsic
    def negate_bytes(typingctx, g, nibble):
        if not all(isinstance(t, types.Integer) for t in (g, nibble)):
            return None
        sig = types.uint32(g, nibble)

        def codegen(context, builder, signature, args):
            vals = [_i32(context, builder, v, t) for v, t in zip(args, signature.args)]
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 2)
            asm = ("{ .reg .b32 t, m, o; "
                   "mul.lo.u32 t, $2, 0x10204080; "      # bit k of the nibble -> bit 8k+7
                   "prmt.b32 m, t, 0, 0xBA98; "           # byte k = 0xFF if its top bit is set
                   "xor.b32 o, $1, m; "
                   "and.b32 m, m, 0x01010101; "
                   "add.u32 $0, o, m; }")
            return builder.call(ir.InlineAsm(fnty, asm, "=r,r,r"), vals)

        return sig, codegen

    @intrinsic
    def iq2_permute(typingctx, gsel, ssel, pos):
        if not all(isinstance(t, types.Integer) for t in (gsel, ssel, pos)):
            return None

        def codegen(context, builder, signature, args):
            vals = [_i32(context, builder, v, t) for v, t in zip(args, signature.args)]
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32, i32]), [i32] * 3)
            asm = ("{ .reg .b32 n, s, h; "
                   "mov.b32 n, 0xD5E7F800; "             # bytes 0, -8, -25, -43 (selector 4..7)
                   "or.b32 s, $2, $3; "
                   "shr.b32 h, s, 16; "
                   "prmt.b32 $0, $4, n, s; "
                   "prmt.b32 $1, $4, n, h; }")
            res = builder.call(ir.InlineAsm(fnty, asm, "=r,=r,r,r,r"), vals)
            parts = [builder.extract_value(res, i) for i in range(2)]
            return context.make_tuple(builder, signature.return_type, parts)

        return types.UniTuple(types.uint32, 2)(gsel, ssel, pos), codegen

    def _unary_asm(name, ret, asm, constraints="=r,r"):
        """An intrinsic of one 32-bit integer operand computed by the inline PTX `asm`
        ($0 the result, $1 the operand)."""
        def typer(typingctx, x):
            if not isinstance(x, types.Integer):
                return None

            def codegen(context, builder, signature, args):
                v = _i32(context, builder, args[0], signature.args[0])
                fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
                return builder.call(ir.InlineAsm(fnty, asm, constraints), [v])

            return ret(x), codegen

        typer.__name__ = name
        return intrinsic(typer)

    def _ternary_asm(name, ret, asm):
        """An intrinsic of three 32-bit integer operands computed by the inline PTX `asm` ($0 the
        result, $1..$3 the operands)."""
        def typer(typingctx, a, b, c):
            if not all(isinstance(t, types.Integer) for t in (a, b, c)):
                return None

            def codegen(context, builder, signature, args):
                vals = [_i32(context, builder, v, t) for v, t in zip(args, signature.args)]
                fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 3)
                return builder.call(ir.InlineAsm(fnty, asm, "=r,r,r,r"), vals)

            return ret(a, b, c), codegen

        typer.__name__ = name
        return intrinsic(typer)

    dp4a = _ternary_asm("dp4a", types.int32, "dp4a.s32.s32 $0, $1, $2, $3;")
    dp4a_us = _ternary_asm("dp4a_us", types.int32, "dp4a.u32.s32 $0, $1, $2, $3;")
    dp2a_lo = _ternary_asm("dp2a_lo", types.int32, "dp2a.lo.s32.u32 $0, $1, $2, $3;")
    dp2a_hi = _ternary_asm("dp2a_hi", types.int32, "dp2a.hi.s32.u32 $0, $1, $2, $3;")
    bfe = _ternary_asm("bfe", types.int32, "bfe.u32 $0, $1, $2, $3;")
    imad = _ternary_asm("imad", types.int32, "mad.lo.s32 $0, $1, $2, $3;")
    funnel_r = _ternary_asm("funnel_r", types.uint32, "shf.r.wrap.b32 $0, $1, $2, $3;")
    shr64_lo = _ternary_asm("shr64_lo", types.uint32,
                            "{ .reg .b64 v; mov.b64 v, {$1, $2}; shr.b64 v, v, $3; cvt.u32.u64 $0, v; }")

    def _binary_asm(name, ret, asm):
        """An intrinsic of two 32-bit integer operands computed by the inline PTX `asm` ($0 the
        result, $1 and $2 the operands)."""
        def typer(typingctx, a, b):
            if not all(isinstance(t, types.Integer) for t in (a, b)):
                return None

            def codegen(context, builder, signature, args):
                vals = [_i32(context, builder, v, t) for v, t in zip(args, signature.args)]
                fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 2)
                return builder.call(ir.InlineAsm(fnty, asm, "=r,r,r"), vals)
            return ret(a, b), codegen
        typer.__name__ = name
        return intrinsic(typer)

    halves_lo = _binary_asm("halves_lo", types.uint32, "prmt.b32 $0, $1, $2, 0x5410;")
    halves_hi = _binary_asm("halves_hi", types.uint32, "prmt.b32 $0, $1, $2, 0x7632;")
    byte_mask = _unary_asm("byte_mask", types.uint32,
                           "{ .reg .b32 t; mul.lo.u32 t, $1, 0x10204080; prmt.b32 $0, t, 0, 0xBA98; }")
    even_signs = _unary_asm("even_signs", types.int32,
                            "{ .reg .b32 p; popc.b32 p, $1; bfi.b32 $0, p, $1, 7, 1; }")

    mulhi = _binary_asm("mulhi", types.uint32, "mul.hi.u32 $0, $1, $2;")
    and_or = _ternary_asm("and_or", types.uint32, "{ .reg .b32 t; and.b32 t, $1, $2; or.b32 $0, t, $3; }")
    # a load: the memory clobber keeps it after the barrier that follows the table's fill
    lds32 = _unary_asm("lds32", types.uint32, "ld.shared.u32 $0, [$1];", constraints="=r,r,~{memory}")

    @intrinsic
    def shared_addr(typingctx, s):
        if not isinstance(s, types.Array):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.ptrtoint(ary.data, ir.IntType(64))
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(64)])
            asm = "{ .reg .u64 t; cvta.to.shared.u64 t, $1; cvt.u32.u64 $0, t; }"
            return builder.call(ir.InlineAsm(fnty, asm, "=r,l"), [ptr])

        return types.uint32(s), codegen

    @intrinsic
    def pdl_enter(typingctx):
        sig = types.void()

        def codegen(context, builder, signature, args):
            if _pdl_supported():
                fnty = ir.FunctionType(ir.VoidType(), [])
                asm = "griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;"
                builder.call(ir.InlineAsm(fnty, asm, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return sig, codegen

    # Fixed uuids: an intrinsic pickles with its uuid, by default a new uuid1 per process, and
    # numba-cuda's disk cache keys a kernel by a pickle of its closure, which reaches these
    # through the device functions it calls (kernels/cuda.py, _CACHE_KERNELS).
    from numba.cuda.extending import _Intrinsic

    for _name, _obj in list(globals().items()):
        if isinstance(_obj, _Intrinsic):
            _obj._set_uuid("ds4py.kernels.cuda_intrinsics." + _name)
