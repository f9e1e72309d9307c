"""Compile every cuda_ops kernel to PTX for sm_90 with the engine's argument types, without a GPU.

Needs NVVM and NVRTC (`pip install "cuda-toolkit[nvvm,nvrtc,cudart]==13.0.*"`); catches typing
errors before any device time is spent: `python scripts/check_cuda_compile.py`. With `--ptxas`
(ptxas on PATH) each PTX is also assembled for sm_90 and its registers, spills and stack frame
are printed: a stack frame means a local array numba could not keep in registers (hc_pre had one).
With `--parity` each kernel is compiled twice, with NVVM's default fused multiply-add contraction
and with it off, and the report says what a CPU twin must reproduce to give the same bits: how
many f32 / f64 `a * b + c` NVVM fused on its own (the CPU's LLVM fuses none), and the operations
whose results IEEE does not fix (ex2.approx from expf, other .approx forms), which no CPU twin can
match bit for bit. sqrt.rn, div.rn and rcp.rn are correctly rounded, as on the CPU.

Imported (not run), it is the catalogue of kernels: `sigs` (cuda_ops) and `quant` (the factory
kernels of kernels/cuda.py), which tests/test_kernels.py reads."""
import sys

import numpy as np
from ds4py.kernels import cuda as qk, cuda_ops as ops
from numba import cuda, types
f32a = types.float32[::1]; f64a = types.float64[::1]; f32a2 = types.float32[:, ::1]; i32a = types.int32[::1]; i8a = types.int8[::1]
f16a = types.float16[::1]; u32a = types.uint32[::1]; i64a2 = types.int64[:, ::1]; i64a = types.int64[::1]
i64 = types.int64; f64 = types.float64; b1 = types.boolean
# token dimension: per-token activations [T, n]; views of pair outputs (a column range of a
# [T, rows_a + rows_b] matmul output) are strided ('A' layout)
f32A2 = types.float32[:, :]; f32a3 = types.float32[:, :, ::1]; f32A3 = types.float32[:, :, :]
f32a4 = types.float32[:, :, :, ::1]; i8a2 = types.int8[:, ::1]; i32a2 = types.int32[:, ::1]
u32a2 = types.uint32[:, ::1]; f64a2 = types.float64[:, ::1]; i64a3 = types.int64[:, :, ::1]
f64A3 = types.float64[:, :, :]; f64a3 = types.float64[:, :, ::1]; f64a4 = types.float64[:, :, :, ::1]
sigs = {
 "embed": (i32a, f16a, i64, i64, i64, f32a3),
 "hc_mix_partial": (f32a3, f16a, i64, i64, f64A3, f64a2, types.float64[:, :, ::1], b1),
 "hc_mix_tokens": (f32a3, f16a, i64, i64, b1, f64A3, f64a2, types.float64[:, :, ::1]),
 "hc_sinkhorn": (f64A3, f64a2, i64, f32a, i64, i64, i64, f64, f64, f32a2, f32a2),
 "hc_pre": (f32a3, f64A3, f64a2, types.float64[:, :, ::1], f32a, i64, i64, i64, f64, f64, f32a2, i8a2, f32a2),
 "hc_post": (f32a3, f32a2, f32a2, f32a2, f32a2),
 "hc_head": (f32a3, f64A3, f64a2, f32a, i64, i64, i64, f64, f64, f32a2, i8a2, f32a2),
 "rmsnorm_q8": (f32A2, f32a, i64, f64, f32a2, i8a2, f32a2),
 "kv_finish": (f32A2, f32a, i64, f64, i32a, f64a, i64, f32a2),
 "q_heads": (f32a2, i64, i64, f64, i32a, f64a),
 "compressor_step": (f32A2, f32A2, f16a, i64, f32a, i64, f64, i32a, i64, i64, i64, f64a, b1, f32a2, f32a2, f32a2),
 "compressor_chunk_stage": (f32A2, f32A2, f16a, i64, i64, i64, f32a2, f32a2, f32a2, f32a2),
 "compressor_chunk_rows": (f32a2, f32a2, i64, i64, i64, i64, f32a, i64, f64, i64, f64a, b1, f32a2),
 "compressor_chunk_carry": (f32a2, f32a2, i64, i64, i64, f32a2, f32a2),
 "indexer_q": (f32a2, i64, i64, i32a, f64a),
 "indexer_scores": (f32a2, f32a2, f64, f32a2, i32a, i64, i64, f32a2),
 "indexer_scores_rows": (f32a2, f32a2, f64, f32a2, i32a, i64, i64, i64, f32a2),
 "indexer_select": (u32a2, i32a, i64, i32a2, i32a),
 "attention_partial": (f32a2, f32a2, f32a2, i32a2, i32a, i32a, i64, i64, b1, i64, f64a3, f64a3, f64a4),
 # GPUs without full-rate f64 (--attention): f32 sums and partials
 "attention_partial_f32": (f32a2, f32a2, f32a2, i32a2, i32a, i32a, i64, i64, b1, i64, f32a3, f32a3, f32a4),
 "attention_partial_tc": (f32a2, f32a2, f32a2, i32a2, i32a, i32a, i64, i64, b1, i64, f64a3, f64a3, f64a4),
 # the prefill kernel's partials are f32 (its sums are; forward_cuda.prefill_attention_mma)
 "attention_prefill_mma": (f32a2, f32a2, f32a2, i32a2, i32a, i32a, i64, i64, b1, f32a3, f32a3, f32a4),
 "attention_prefill_mma_no_prefetch": (f32a2, f32a2, f32a2, i32a2, i32a, i32a, i64, i64, b1, f32a3, f32a3, f32a4),
 "attention_combine": (f64a3, f64a3, f64a4, f32a, i64, i32a, i64, i64, f64a, i64, f32a, i8a, f32a),
 "attention_combine_one": (f32a3, f32a3, f32a4, f32a, i64, i32a, i64, i64, f64a, i64, f32a, i8a, f32a),
 "route": (f32a2, i32a, f32a, i64, b1, i32a, i64, b1, i64, f64, i64a, i32a2, f32a2, i64a3),
 "swiglu_q8": (f32A2, f32A2, f64, f32a2, i8a2, f32a2),
 "groups_to_tokens": (f32a, i64, i64, f32a),
 "argmax_partial": (f32a, i32a, f32a, i32a),
 "argmax_finish": (f32a, i32a, i32a),
 "advance_token": (i32a, i32a, i32a),
}


def ptxas_summary(ptx: str, max_regs: int = 0) -> str:
    """Registers, spills and stack frame of the PTX as ptxas reports them for sm_90 (under the
    kernel's register cap, as the launch compiles it, when it has one)."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/k.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        cap = ["-maxrregcount", str(max_regs)] if max_regs else []
        r = subprocess.run(["ptxas", "-arch=sm_90", "-O3", "-v", src, "-o", f"{tmp}/k.cubin"] + cap,
                           capture_output=True, text=True)
    lines = [ln.split("info    :")[-1].strip() for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return "; ".join(lines) if lines else r.stderr.strip()[:200]


# the quant kernels of kernels/cuda.py (factories: one kernel per type and shape), as the engine
# launches them for the flash shapes (IQ2_XXS gate/up, Q2_K down)
IQ2, Q2K = qk.F.IQ2_XXS, qk.F.Q2_K
u16a = types.uint16[::1]; f32 = types.float32; u64a = types.uint64[::1]; u8a = types.uint8[::1]
tables = (u64a, u8a)          # the IQ2_XXS grid and sign table
moe_dec = (u16a, u32a, i64a, i64, i32a, f32a, i32a, i64, f32a, f32, i64, i64, i64, f32a) + tables
f16_rows = (u32a, i64, i64, i64, i64, types.complex64[::1], i64, f32a, i64, i64, i64)
f16_tiled = (u32a, i64, i64, i64, i64, u64a, i64, f32a, i64, i64, i64)
gu_mma = (u16a, i64a, i32a, i32a, i32a, i64, i64a, f32a, i64, f32a, f32, i64, i64, f32a) + tables
dn_mma = (u32a, i64a, i32a, i32a, i32a, i64, i64a, f32a, i32a, i64, i64, i64, f32a)
dn_staged = (u32a, i64a, i32a, i32a, i32a, i64, i64a, f32a, i64, f32a)
hc_epi = (b1, f32a2, f32a, f32a, f32a)        # the HC-post epilogue (on, state, f_b, post, comb)
q8_rows = (u16a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64, i64) + hc_epi
q8_pairs = (u32a, i64, i64, i64, i64, i64, i32a, f32a, f32a, i64, i64, i64) + hc_epi
moe_down = (u16a, u32a, i64a, i64, i32a, f32a, i32a, i64, i64, i64, f32a) + tables + hc_epi
tiles = (u16a, u32a, i64a, i32a, i32a, i32a, i64, i32a, f32a, i32a, i64, f32a, f32, i64, i64, f32a) + tables
quant = {
 "moe_gate_up_decode IQ2_XXS (x in registers)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 4, qk._REGS_GATE_UP, True), moe_dec),
 "moe_gate_up_decode IQ2_XXS (x staged)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 2, 0, False), moe_dec),
 # _CONST_STEPS_GATE_UP: rows of 16 super-blocks (K = 4096) as a compile-time constant
 "moe_gate_up_decode IQ2_XXS (x in registers, const steps)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 4, 0, True, 16), moe_dec),
 "moe_gate_up_decode IQ2_XXS (x in registers, const steps, chunks of 2)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 2, 0, True, 16), moe_dec),
 "moe_gate_up_decode IQ2_XXS (x in registers, const steps, chunks of 1)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 1, 0, True, 16), moe_dec),
 "moe_gate_up_decode IQ2_XXS (x in registers, const steps, cap 96)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 4, 96, True, 16), moe_dec, 96),
 "moe_gate_up_decode IQ2_XXS (x in registers, const steps, cap 80)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 4, 80, True, 16), moe_dec, 80),
 "moe_gate_up_decode IQ2_XXS (x staged, const steps, chunks of 1)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 1, 0, False, 16), moe_dec),
 # _IQ2_PERM_GATE_UP: the weights from byte-permute selector tables (uint32[256], uint32[128])
 "moe_gate_up_decode IQ2_XXS (x in registers, const steps, byte-permute)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 4, 0, True, 16, True), moe_dec[:-2] + (u32a, u32a)),
 # _PRE_GATE_UP: the tables filled before pdl_enter()
 "moe_gate_up_decode IQ2_XXS (byte-permute, tables before pdl_enter)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 4, 0, True, 16, True, False, True), moe_dec[:-2] + (u32a, u32a)),
 "moe_gate_up_decode IQ2_XXS (x staged, tables before pdl_enter)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 2, 0, False, 0, False, False, True), moe_dec),
 # _IQ2_REPACKED_GATE_UP: the rows in iq2_xxs_relayout's layout (one aligned 8-byte load per sub-block)
 "scales-last relayout (IQ2_XXS, Q8_0)": (lambda: qk._scales_last_relayout_kernel, (u8a, i64, i64, i64, i64, i64, b1)),
 "moe_gate_up_decode IQ2_XXS (x in registers, const steps, byte-permute, repacked rows)": (lambda: qk._moe_gate_up_decode_kernel(IQ2, 4, 0, True, 16, True, True), moe_dec[:-2] + (u32a, u32a)),
 "moe_gate_up_halves IQ2_XXS (16 super-blocks)": (lambda: qk._moe_gate_up_halves_kernel(16), moe_dec[:-2] + (u32a, u32a)),
 "moe_gate_up_halves IQ2_XXS (16 super-blocks, SwiGLU per unit)": (lambda: qk._moe_gate_up_halves_kernel(16, True, False), moe_dec[:-2] + (u32a, u32a)),
 "moe_gate_up_halves IQ2_XXS (5 super-blocks, tables after pdl_enter)": (lambda: qk._moe_gate_up_halves_kernel(5, False), moe_dec[:-2] + (u32a, u32a)),
 "q8_0_rows (decode)": (lambda: qk._q8_0_kernel(1, 1), q8_rows),
 "q8_0_rows (decode, split-K 4)": (lambda: qk._q8_0_kernel(4, 1), q8_rows),
 # scales_last: the rows in q8_0_relayout's layout (what the GPU sources keep), through the uint32 view
 "q8_0_rows (decode, scales-last rows)": (lambda: qk._q8_0_kernel(1, 1, scales_last=True), (u32a,) + q8_rows[1:]),
 "q8_0_rows (decode, split-K 4, scales-last rows)": (lambda: qk._q8_0_kernel(4, 1, scales_last=True), (u32a,) + q8_rows[1:]),
 # _Q8_0_PRE: the first chunk of weights loaded before pdl_enter()
 "q8_0_rows (decode, scales-last rows, weight prologue)": (lambda: qk._q8_0_kernel(1, 1, scales_last=True, PRE=True), (u32a,) + q8_rows[1:]),
 "q8_0_rows (decode, split-K 4, scales-last rows, weight prologue)": (lambda: qk._q8_0_kernel(4, 1, scales_last=True, PRE=True), (u32a,) + q8_rows[1:]),
 "q8_0_rows (decode, weight prologue)": (lambda: qk._q8_0_kernel(1, 1, PRE=True), q8_rows),
 # _Q8_0_PAIRS: one token, one warp per row, scales-last rows, two lanes per block
 "q8_0_pairs (decode, weight prologue)": (lambda: qk._q8_0_pairs_kernel(4, True), q8_pairs),
 "q8_0_pairs (decode)": (lambda: qk._q8_0_pairs_kernel(4, False), q8_pairs),
 "q8_0_pairs (decode, steps of 2)": (lambda: qk._q8_0_pairs_kernel(2, True), q8_pairs),
 # _Q8_0_PAIRS_ONE: rows of one chunk (q_b)
 "q8_0_pairs (decode, steps of 2, one chunk)": (lambda: qk._q8_0_pairs_kernel(2, True, 0, True), q8_pairs),
 "q8_0_rows_mma (prefill, split-K 2)": (lambda: qk._q8_0_mma_kernel(2, qk._Q8_0_U),
                                        (u16a, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64)),
 # the 8-byte loads (what unaligned launches take), then the knobs named below one at a time, then
 # the engine's settings (magic C and the lean cp.async staging)
 "q8_0_rows_mma_staged (prefill, split-K 4)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, magic_c=False, cpa=False),
                                               (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64)),
 # _MMA_ST_MAGIC_C (cap _MMA_ST_REGS as the launch builds it)
 "q8_0_rows_mma_staged (prefill, split-K 4, cap)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, magic_c=False, cpa=False),
                                                    (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64), qk._MMA_ST_REGS),
 "q8_0_rows_mma_staged (prefill, split-K 4, magic C)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, magic_c=True, cpa=False),
                                                        (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64), qk._MMA_ST_REGS),
 # _MMA_ST_CPASYNC: the lean cp.async staging (cap 128: no spills)
 "q8_0_rows_mma_staged (prefill, split-K 4, lean cp.async)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, magic_c=False, cpa=True),
                                                             (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64), qk._MMA_ST_REGS),
 "q8_0_rows_mma_staged (prefill, split-K 4, magic C, lean cp.async)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, magic_c=True, cpa=True),
                                                                       (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64), qk._MMA_ST_REGS),
 "q8_0_rows_mma_staged (prefill, split-K 4, magic C, lean cp.async, scales-last rows)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, magic_c=True, cpa=True, scales_last=True),
                                                                                         (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64), qk._MMA_ST_REGS),
 "q8_0_rows_mma_staged (prefill, split-K 4, magic C, scales-last rows)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, magic_c=True, cpa=False, scales_last=True),
                                                                          (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64), qk._MMA_ST_REGS),
 "q8_0_rows_mma_staged (prefill, split-K 4, magic C, lean cp.async, 64x16)": (lambda: qk._q8_0_mma_staged_kernel(4, qk._Q8_0_U, MT=4, NT=2, magic_c=True, cpa=True),
                                                                              (u64a, i64, i64, i64, i64, i64, i64a, f32a, i64, f32a, i64, i64, i64), qk._MMA_ST_REGS),
 "f16_rows (decode)": (lambda: qk._f16_kernel(1, 1, 1),
                       f16_rows),
 # _F16_CONST_DECODE: rows of 16 whole steps (K = 1024, the indexer's q_b)
 "f16_rows (decode, 16 constant steps)": (lambda: qk._f16_kernel(1, 1, 1, 16), f16_rows),
 "f16_rows (prefill, 4 rows per warp)": (lambda: qk._f16_kernel(1, 8, qk._F16_R),
                                         f16_rows),
 "f16_rows (prefill, split-K 4)": (lambda: qk._f16_kernel(4, 8, qk._F16_R),
                                   f16_rows),
 # _F16_TILED: R x T sums per lane, the row length (K = 4096: 2048 pairs) a compile-time constant
 "f16_rows_tiled (prefill, 8x8, split-K 8)": (lambda: qk._f16_tiled_kernel(8, 2048, 8, 8), f16_tiled),
 "f16_rows_tiled (prefill, 8x8, split-K 4)": (lambda: qk._f16_tiled_kernel(4, 2048, 8, 8), f16_tiled),
 "f16_rows_tiled (prefill, 8x8, one warp per row, K 1024)": (lambda: qk._f16_tiled_kernel(1, 512, 8, 8), f16_tiled),
 "f16_rows_tiled (prefill, 8x8, split-K 8, K 1000)": (lambda: qk._f16_tiled_kernel(8, 500, 8, 8), f16_tiled),
 "f16_rows_tiled (prefill, 8x8, split-K 8, prefetch)": (lambda: qk._f16_tiled_kernel(8, 2048, 8, 8, 0, True), f16_tiled),
 "f16_rows_tiled (prefill, 8x8, split-K 4, prefetch, cap 128)": (lambda: qk._f16_tiled_kernel(4, 2048, 8, 8, 128, True), f16_tiled, 128),
 "f16_rows_tiled (prefill, 8x8, split-K 8, K 1000, prefetch)": (lambda: qk._f16_tiled_kernel(8, 500, 8, 8, 0, True), f16_tiled),
 "f16_rows_tiled (prefill, 4x16, split-K 8)": (lambda: qk._f16_tiled_kernel(8, 2048, 4, 16), f16_tiled),
 "f16_rows_tiled (prefill, 4x16, split-K 8, prefetch)": (lambda: qk._f16_tiled_kernel(8, 2048, 4, 16, 0, True), f16_tiled),
 "f16_rows_tiled (prefill, 4x8, split-K 8, prefetch)": (lambda: qk._f16_tiled_kernel(8, 2048, 4, 8, 0, True), f16_tiled),
 "moe_down_decode Q2_K": (lambda: qk._moe_down_decode_kernel(Q2K, 2, qk._NW_DOWN, qk._REGS_DOWN),
                          moe_down, qk._REGS_DOWN),
 # _R_DOWN_SLOTS: one warp per slot, R rows per block (K = 2048: 8 super-blocks)
 "moe_down_decode_slots Q2_K (8 rows)": (lambda: qk._moe_down_decode_slots_kernel(Q2K, 8, 8), moe_down),
 "moe_down_decode_slots Q2_K (16 rows)": (lambda: qk._moe_down_decode_slots_kernel(Q2K, 8, 16), moe_down),
 "moe_down_decode_slots Q2_K (16 rows, cap 80)": (lambda: qk._moe_down_decode_slots_kernel(Q2K, 8, 16, 80), moe_down, 80),
 "moe_down_sb Q2_K (8 rows)": (lambda: qk._moe_down_sb_kernel(8, 8), moe_down),
 "moe_down_sb Q2_K (3 super-blocks, 4 rows)": (lambda: qk._moe_down_sb_kernel(3, 4), moe_down),
 "moe_down_sb Q2_K (8 rows, copies after the wait)": (lambda: qk._moe_down_sb_kernel(8, 8, 0), moe_down),
 "q8k_rows IQ2_XXS (4 tokens)": (lambda: qk._q8k_dense_kernel(IQ2, 4, 2, 4),
                                 (u16a, u32a, i64, i64, i64, i64, i32a, f32a, i32a, i64, f32a, i64) + tables),
 "moe_gate_up_tiles IQ2_XXS": (lambda: qk._moe_gate_up_tiles_kernel(IQ2, 4, 4), tiles),
 "moe_gate_up_tiles_mma IQ2_XXS (8-pair tiles)": (lambda: qk._moe_gate_up_tiles_mma_kernel(1),
                                   gu_mma),
 "moe_gate_up_tiles_mma IQ2_XXS (16-pair tiles)": (lambda: qk._moe_gate_up_tiles_mma_kernel(2),
                                   gu_mma),
 # the staged gate/up (the byte-permute decode)
 "moe_gate_up_tiles_staged IQ2_XXS (16-pair tiles)": (lambda: qk._moe_gate_up_tiles_staged_kernel(2),
                                                    (u32a,) + gu_mma[1:-2] + (u32a, u32a), qk._GU_ST_REGS),
 "moe_down_tiles_mma Q2_K (8-pair tiles)": (lambda: qk._moe_down_tiles_mma_kernel(1),
                                            dn_mma),
 "moe_down_tiles_mma Q2_K (16-pair tiles)": (lambda: qk._moe_down_tiles_mma_kernel(2),
                                             dn_mma),
 "moe_down_tiles_staged Q2_K (16-pair tiles)": (lambda: qk._moe_down_tiles_staged_kernel(2, 8),
                                                dn_staged, qk._DN_ST_REGS),
}


def _without_contraction():
    """NVVM's compile_ir with fma contraction off (numba-cuda passes fma=1 only under fastmath,
    and NVVM contracts by default), for --parity's second compile."""
    from numba.cuda.cudadrv import nvvm
    compile_ir = nvvm.compile_ir

    def no_fma(llvmir, **options):
        return compile_ir(llvmir, **dict(options, fma=False))
    return nvvm, compile_ir, no_fma


def parity_summary(compile_ptx) -> str:
    """Fused f32 / f64 multiply-adds NVVM made on its own (default compile minus the compile with
    contraction off) and the PTX operations whose results IEEE leaves to the hardware."""
    import re
    from collections import Counter
    nvvm, compile_ir, no_fma = _without_contraction()
    counts, libdevice = [], set()
    for contract in (True, False):
        def compile_ir_seen(llvmir, **options):
            for mod in [llvmir] if isinstance(llvmir, str) else llvmir:
                libdevice.update(re.findall(r'call [^@]*@"?__nv_(\w+)', mod))
            return (compile_ir if contract else no_fma)(llvmir, **options)
        nvvm.compile_ir = compile_ir_seen
        try:
            ptx = compile_ptx()
        finally:
            nvvm.compile_ir = compile_ir
        counts.append(Counter(re.findall(r"^\s*(?:@%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)))
    fused = [counts[0][f"fma.rn.{t}"] - counts[1][f"fma.rn.{t}"] for t in ("f32", "f64")]
    approx = sorted(f"{op} x{n}" for op, n in counts[0].items() if ".approx" in op)
    return (f"implicit fma f32 {fused[0]}, f64 {fused[1]}; libdevice: {', '.join(sorted(libdevice)) or 'none'}; "
            f"approx: {', '.join(approx) or 'none'}")


def main() -> None:
    import numba.cuda.dispatcher as _disp
    _disp.get_current_device = lambda: type("Dev", (), {"compute_capability": (9, 0)})()   # no GPU here
    bad = 0
    report = "--ptxas" in sys.argv
    parity = "--parity" in sys.argv
    # --dump DIR: each kernel's PTX into DIR/<name>.ptx (a refactor meant to change no instruction:
    # dump before and after, then diff)
    dump = sys.argv[sys.argv.index("--dump") + 1] if "--dump" in sys.argv else None
    # a third element of a quant entry: the register cap the kernel is built with (_jit_capped)
    kernels = [(name, lambda n=name: getattr(ops, n).py_func, sig, 0) for name, sig in sigs.items()]
    kernels += [(name, lambda f=entry[0]: f().py_func, entry[1], entry[2] if len(entry) > 2 else 0)
                for name, entry in quant.items()]
    # a cuda_ops kernel's launch bounds (@cuda.jit(launch_bounds=...)) cap its registers as the launch
    # compiles it: the PTX carries them (.maxntid, .minnctapersm)
    bounds = {name: getattr(ops, name).targetoptions.get("launch_bounds") for name in sigs}
    # --only TEXT: just the kernels whose catalogue name contains TEXT
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for name, func, sig, max_regs in kernels:
        if only not in name:
            continue
        try:
            ptx, _ = cuda.compile_ptx(func(), sig, cc=(9, 0), launch_bounds=bounds.get(name))
            print("ok ", name, ptxas_summary(ptx, max_regs) if report else "")
            if parity:
                print("    parity:", parity_summary(
                    lambda: cuda.compile_ptx(func(), sig, cc=(9, 0), launch_bounds=bounds.get(name))[0]))
            if dump:
                import os
                os.makedirs(dump, exist_ok=True)
                with open(os.path.join(dump, name.replace(" ", "_").replace("/", "_") + ".ptx"), "w") as f:
                    f.write(ptx)
        except Exception as e:
            bad += 1
            print("BAD", name, str(e).splitlines()[0][:300])
    raise SystemExit(bad)


if __name__ == "__main__":
    main()
