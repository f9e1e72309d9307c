"""The few GPU instructions numba-cuda does not expose, as inline-PTX intrinsics.

Kept in one small module on purpose: numba-cuda is in maintenance mode and its successor
(numba-cuda-mlir) has no llvmlite ``@intrinsic``; this is the only file to port.

* ``dp4a(a, b, c)``: c + sum of the four signed byte products of a and b (PTX dp4a.s32.s32).
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
* ``negate_bytes(g, nibble)``: the 4 bytes of g, byte k negated where bit k of nibble is set.
  Exact for bytes < 0x80 (IQ2_XXS grid values): (g ^ m) + (m & 0x01010101), m from a
  multiply that moves bit k to bit 8k+7 and a sign-replicating byte permute.
* ``byte_mask(nibble)``: 0xFF in byte k where bit k of nibble is set, else 0 (the multiply and
  permute of negate_bytes alone).
* ``masked_negate(g, m)``: the bytes of g negated where the byte of m is 0xFF (m's bytes 0 or
  0xFF, from byte_mask): (g ^ m) + (m & 0x01010101) in three 32-bit instructions. Exact for bytes
  in 1..0x7F (IQ2_XXS grid values: no carry).
* ``even_signs(bits7)``: IQ2_XXS's 8 sign bits from the 7 stored ones: bit 7 makes the count of
  set bits even (the ksigns table of ggml, as popc and one bit insert instead of a lookup).
* ``funnel_r(lo, hi, n)``: the 32 bits of the 64-bit value hi:lo starting at bit n (0 <= n < 32;
  PTX shf.r.wrap.b32): a word at a 2-byte offset from two aligned ones, in one instruction.
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
versions with the same results are used instead.
"""

from . import compat  # noqa: F401  (numpy shim before numba.cuda loads)

import numpy as np
from numba import cuda

SIMULATOR = bool(getattr(cuda.config, "ENABLE_CUDASIM", False))


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

    def bfe(x, pos, n):
        return np.int32((int(x) & 0xFFFFFFFF) >> int(pos) & ((1 << int(n)) - 1))

    def imad(a, b, c):
        return np.int32(((int(a) * int(b) + int(c)) + 2**31) % 2**32 - 2**31)

    def mma_s8(a0, a1, a2, a3, b0, b1):
        raise NotImplementedError("mma_s8 is a warp-wide tensor-core instruction: no simulator version")

    def mma_s8_acc(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        raise NotImplementedError("mma_s8_acc is a warp-wide tensor-core instruction: no simulator version")

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

    def masked_negate(g, m):
        g, m = int(g) & 0xFFFFFFFF, int(m) & 0xFFFFFFFF
        return np.uint32(((g ^ m) + (m & 0x01010101)) & 0xFFFFFFFF)

    def even_signs(bits7):
        b = int(bits7) & 0x7F
        return np.int32(b | ((bin(b).count("1") & 1) << 7))

    def pdl_enter():
        return None

    def funnel_r(lo, hi, n):
        v = ((int(hi) & 0xFFFFFFFF) << 32) | (int(lo) & 0xFFFFFFFF)
        return np.uint32((v >> (int(n) & 31)) & 0xFFFFFFFF)

    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    def add_rn(a, b):
        return np.float32(np.float32(a) + np.float32(b))

else:
    from llvmlite import ir
    from numba import types
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

    def _unary_asm(name, ret, asm):
        """An intrinsic of one 32-bit integer operand computed by the inline PTX `asm`
        ($0 the result, $1 the operand)."""
        def typer(typingctx, x):
            if not isinstance(x, types.Integer):
                return None

            def codegen(context, builder, signature, args):
                v = _i32(context, builder, args[0], signature.args[0])
                fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
                return builder.call(ir.InlineAsm(fnty, asm, "=r,r"), [v])

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
    bfe = _ternary_asm("bfe", types.int32, "bfe.u32 $0, $1, $2, $3;")
    imad = _ternary_asm("imad", types.int32, "mad.lo.s32 $0, $1, $2, $3;")
    funnel_r = _ternary_asm("funnel_r", types.uint32, "shf.r.wrap.b32 $0, $1, $2, $3;")

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

    masked_negate = _binary_asm("masked_negate", types.uint32,
                                "{ .reg .b32 t, o; xor.b32 o, $1, $2; and.b32 t, $2, 0x01010101; "
                                "add.u32 $0, o, t; }")
    byte_mask = _unary_asm("byte_mask", types.uint32,
                           "{ .reg .b32 t; mul.lo.u32 t, $1, 0x10204080; prmt.b32 $0, t, 0, 0xBA98; }")
    even_signs = _unary_asm("even_signs", types.int32,
                            "{ .reg .b32 p; popc.b32 p, $1; bfi.b32 $0, p, $1, 7, 1; }")

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
