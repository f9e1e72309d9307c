"""The few GPU instructions numba-cuda does not expose, as inline-PTX intrinsics.

Kept in one small module on purpose: numba-cuda is in maintenance mode and its successor
(numba-cuda-mlir) has no llvmlite ``@intrinsic``; this is the only file to port.

* ``dp4a(a, b, c)``: c + sum of the four signed byte products of a and b (PTX dp4a.s32.s32).
* ``f16_bits_to_f32(bits)``: the IEEE half in the low 16 bits of an int, as f32 (exact).

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) custom intrinsics cannot run, so plain-Python
versions with the same results are used instead.
"""

from . import compat  # noqa: F401  (numpy shim before numba.cuda loads)

import numpy as np
from numba import cuda

SIMULATOR = bool(getattr(cuda.config, "ENABLE_CUDASIM", False))

if SIMULATOR:  # pragma: no cover - exercised only under the simulator

    def dp4a(a, b, c):
        ab = np.array([a], dtype=np.int64).astype(np.uint32).view(np.int8)
        bb = np.array([b], dtype=np.int64).astype(np.uint32).view(np.int8)
        return np.int32(int(c) + int((ab.astype(np.int32) * bb.astype(np.int32)).sum()))

    def f16_bits_to_f32(bits):
        return np.float32(np.array([int(bits) & 0xFFFF], np.uint16).view(np.float16)[0])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def dp4a(typingctx, a, b, c):
        if not all(isinstance(t, types.Integer) for t in (a, b, c)):
            return None
        sig = types.int32(a, b, c)

        def codegen(context, builder, signature, args):
            a_, b_, c_ = (context.cast(builder, v, t, types.int32)
                          for v, t in zip(args, signature.args))
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 3)
            asm = ir.InlineAsm(fnty, "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, [a_, b_, c_])

        return sig, codegen

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
