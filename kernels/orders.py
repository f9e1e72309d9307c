"""The order in which the CUDA kernels add the f32 terms of a row, shared with the CPU twins.

ds4's numerics fix every integer of a quantized dot product and leave one thing free: the order in
which a row's f32 terms (one per block or super-block, one per weight pair for F16) are added
(ds4-model.md §5.1). The CUDA kernels pick it from the launch's shape alone, so that the decode
matvecs, the prefill matmuls and the tensor-core kernels of one shape give the same bits; the
CPU twins (kernels/cpu.py) follow the same order, so that the two engines give the same bits too.
This file holds the part of that choice both sides need: how many warps split a row (split-K),
and how the Q8_0 blocks are chunked. Plain Python: the CPU engine imports it without numba.cuda.

The orders themselves, per type (W: the warps of a row, each taking every S-th chunk or step):
  * Q8_0: lane group g (of 8) accumulates fma(d_w·d_x, isum, acc) over blocks 8·step + g in
    increasing order, then the groups meet in a butterfly over g ^ 4, g ^ 2, g ^ 1; the S warp
    partials are added in warp order.
  * F16: lane l (of 32) accumulates fma(w, x, acc) over the weight pairs 32·step + l (the even
    weight, then the odd one), then a butterfly over l ^ 16, 8, 4, 2, 1; warps as Q8_0.
  * IQ2_XXS / Q2_K / Q4_K: group q (of 4) takes super-blocks 4·step + q in increasing order
    (IQ2_XXS: acc = fma(d_w·d_x, isum, acc); Q2_K / Q4_K: acc + fma(d_x·d, isum, −(d_x·dmin)·summs)),
    then a butterfly over q ^ 2, q ^ 1; IQ2_XXS scales the sum by 1/8 at the end.
"""

WARP = 32
Q8_0_STEP_BLOCKS = 8    # Q8_0 blocks per warp step: 8 lane groups of 4 lanes
Q8_0_U = 4              # warp steps per chunk (the weights a warp loads before it uses the first)
Q8_0_S1_ROWS = 4096     # from this many rows on, a Q8_0 launch gives each row one warp


def dense_split(rows: int, chunks: int) -> int:
    """Warps per row of a dense launch of `rows` rows (all matrices of the launch together) of
    `chunks` units of work: enough to fill the GPU when a launch has few rows, no more than the
    row has chunks."""
    S = 1 if rows >= 8192 else 2 if rows >= 4096 else 4 if rows >= 2048 else 8
    while S > 1 and S > chunks:
        S //= 2
    return S


def q8_0_order(rows: int, nb: int, U: int = Q8_0_U, s1_rows: int = Q8_0_S1_ROWS) -> tuple[int, int, int]:
    """(S warps per row, U steps per chunk, chunks per row) of a Q8_0 launch of `rows` rows of nb
    blocks: warp w takes chunks w, w + S, ..., each U steps of 8 blocks."""
    nchunks = ((nb + Q8_0_STEP_BLOCKS - 1) // Q8_0_STEP_BLOCKS + U - 1) // U
    S = 1 if rows >= s1_rows else dense_split(rows, nchunks)
    return S, U, nchunks


def f16_split(rows: int, K: int) -> int:
    """Warps per row of an F16 launch of `rows` rows of K weights (steps of 32 weight pairs)."""
    return dense_split(rows, (K // 2 + WARP - 1) // WARP)
