"""Numba CUDA kernels for everything in the DS4 forward that is not a quantized matvec.

Hyper-connections (mix, Sinkhorn, collapse, post), RMSNorm, RoPE with YaRN, the FP8/FP4/Hadamard
QAT simulations, the KV compressors, the indexer, sink attention, the router and the small glue
(embedding, SwiGLU, argmax). They follow ds4-model.md §5-§6 and mirror the CPU ops.

Decode-graph rules (kernels-and-numba.md §5.6): every per-token value (position, token id) is read
from a device buffer, never passed as a Python scalar, so a captured graph replays correctly for
every token; kernels whose work depends on the position (compressor emission, number of visible
rows) decide on the device.

Token dimension (batched prefill): per-token activations are 2-D device arrays [T, n] (the HC
state [T, n_hc, n_embd]) and positions / token ids are arrays of T values (pos_buf[t] = pos0 + t).
A kernel takes token t from cuda.blockIdx.y (blockIdx.z where x and y are taken); decode launches
the same kernels with T = 1 buffers and one block row. The one kernel whose state changes in token
order, compressor_step, loops over the T tokens in order inside its single block. Reductions use warp shuffles on the GPU and shared memory in the CUDA
simulator (which has no shuffles), so the same kernels are checked on machines without a GPU.

Weights arrive as typed views of a uint8 arena plus an element offset (`w16`/`w32` float16/float32
views of the same memory), which keeps one allocation per weight source.
"""

from __future__ import annotations

import math

import numpy as np

from ds4py.kernels import compat  # noqa: F401  (numpy>=2.5 shim before the first CUDA compile)
from numba import cuda, float32, float64, int32, int64, uint32, uint64
from numba.types import float16
from numba.cuda import config as numba_config
from ds4py.kernels import numerics
from ds4py.kernels.disk_cache import cached_jit
from ds4py.kernels.cuda_intrinsics import (add_rn, forceinline, halves_hi, halves_lo, ld_f32x4_pick, ld_quad,
                                           mma_f16_acc, mma_f64_acc, mul_rn, pack_f16x2, pdl_enter,
                                           split_f16x2)

BLOCK = 256              # threads for the single-block and per-head kernels
BLOCK2 = 2 * BLOCK       # the compressor's block (head_dim up to 512)
WIDE = 1024              # threads of the single-block vector kernels on the GPU (4 values each at
                         # n_embd 4096: their time is a chain of load latencies, so more threads)
MAX_SCORE_ROWS = 16384   # indexer rows the top-k selection handles in one block
HC_MAX = 4               # most HC streams hc_pre keeps in registers (DeepSeek-V4: 4)
HC_GRAM = HC_MAX * HC_MAX
NEG_INF = -1e30
FP8_MAX = 448.0
FP4_MAX = 6.0


# Warp shuffles exist on the GPU only; the simulator takes the shared-memory paths instead.
USE_SHUFFLES = not numba_config.ENABLE_CUDASIM
ALIGN16 = None if numba_config.ENABLE_CUDASIM else 16   # shared arrays read by 16-byte loads (the
                                                        # simulator refuses an alignment)


@cuda.jit(device=True)
def _warp_sync():
    """The warp's threads meet (the simulator has no syncwarp: there the block's threads, which
    must then all call it)."""
    if USE_SHUFFLES:
        cuda.syncwarp(0xFFFFFFFF)
    else:
        cuda.syncthreads()


def jit_for_threads(threads: int):
    """cuda.jit for a kernel launched with `threads` threads per block: they must share the SM's
    64K registers (a 512-thread block may use 128 each, a 1024-thread block 64), or the launch fails
    with LAUNCH_OUT_OF_RESOURCES; the simulator has no register limit to set (cached_jit drops it)."""
    return cached_jit(65536 // threads)


wide_jit = jit_for_threads(WIDE)


def wide_block() -> int:
    """Threads for the single-block kernels over n_embd / n_ff values (hc_pre, hc_head,
    swiglu_q8; measured: hc_pre 32 -> 17 us, while kv_finish and rmsnorm_q8 on 512 / 1024 values
    got slower and keep BLOCK): WIDE on the GPU, where their reductions use one scratch slot per
    warp; BLOCK in the simulator, whose shared-memory reductions use one slot per thread."""
    return WIDE if USE_SHUFFLES else BLOCK


# ---- block-level helpers (device functions) -----------------------------------------------------

@cuda.jit(device=True)
def warp_sum_f32(value):
    """Butterfly sum over the 32 lanes of a warp; every lane gets the total (f32 or f64)."""
    for offset in (16, 8, 4, 2, 1):
        value += cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
    return value


@cuda.jit(device=True)
def warp_max_f32(value):
    for offset in (16, 8, 4, 2, 1):
        value = max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, offset))
    return value


@cuda.jit(device=True)
def block_sum(value, scratch):
    """Sum of one value per thread over the block, in the scratch's precision (float64 scratch for
    ds4's double Σx², float32 otherwise). Every thread gets the total. On the GPU: warp sums by
    shuffles, then the warp totals in warp order (two barriers instead of a log2 tree)."""
    tid = cuda.threadIdx.x
    if USE_SHUFFLES:
        total = warp_sum_f32(value)
        if tid % 32 == 0:
            scratch[tid // 32] = total
        cuda.syncthreads()
        total = scratch[0]
        for w in range(1, cuda.blockDim.x // 32):
            total += scratch[w]
        cuda.syncthreads()
        return total
    scratch[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] += scratch[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = scratch[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def block_max_f32(value, scratch):
    tid = cuda.threadIdx.x
    if USE_SHUFFLES:
        best = warp_max_f32(value)
        if tid % 32 == 0:
            scratch[tid // 32] = best
        cuda.syncthreads()
        best = scratch[0]
        for w in range(1, cuda.blockDim.x // 32):
            best = max(best, scratch[w])
        cuda.syncthreads()
        return best
    scratch[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] = max(scratch[tid], scratch[tid + stride])
        cuda.syncthreads()
        stride //= 2
    total = scratch[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def rms_scale(sumsq, n, eps):
    """ds4's RMSNorm scale: Σx² accumulated in double, then 1/sqrtf((float)(ss/n) + eps)."""
    return float32(1.0) / math.sqrt(float32(sumsq / n) + float32(eps))


# shared with the CPU twins (kernels/numerics.py)
swiglu = cuda.jit(device=True)(numerics.swiglu)
rotate_pair = cuda.jit(device=True)(numerics.rotate_pair)
hc_mix_value = cuda.jit(device=True)(numerics.hc_mix_value)
hc_logit = cuda.jit(device=True)(numerics.hc_logit)
hc_pre_gate = cuda.jit(device=True)(numerics.hc_pre_gate)
hc_post_gate = cuda.jit(device=True)(numerics.hc_post_gate)
hc_normed = cuda.jit(device=True)(numerics.hc_normed)
router_prob = cuda.jit(device=True)(numerics.router_prob)


@cuda.jit(device=True)
def pow2(e):
    return 2.0 ** e


@cuda.jit(device=True)
def ceil_log2(t):
    """Smallest integer e with 2^e >= t (t > 0), exact at powers of two."""
    e = int32(math.ceil(math.log2(t)))
    while pow2(e - 1) >= t:
        e -= 1
    while pow2(e) < t:
        e += 1
    return e


@cuda.jit(device=True)
def fp8_e4m3_round(a):
    """Nearest finite E4M3 magnitude to a >= 0 (a <= 448), ties to even mantissa."""
    if a < 0.015625:                 # below 2^-6: subnormals, spacing 2^-9
        spacing = 0.001953125
    else:
        e = ceil_log2(a)
        if pow2(e) > a:
            e -= 1                   # now 2^e <= a < 2^(e+1)
        spacing = pow2(e - 3)
    return float32(round(a / spacing) * spacing)


@cuda.jit(device=True)
def fp4_e2m1_round(a):
    """Nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} to a in [0, 6], ties to the even grid index."""
    if a <= 0.25:
        return float32(0.0)
    if a < 0.75:
        return float32(0.5)
    if a <= 1.25:
        return float32(1.0)
    if a < 1.75:
        return float32(1.5)
    if a <= 2.5:
        return float32(2.0)
    if a < 3.5:
        return float32(3.0)
    if a <= 5.0:
        return float32(4.0)
    return float32(6.0)


@cuda.jit(device=True)
def f16_round(x):
    return float32(np.float16(x))


@cuda.jit(device=True)
def q8_0_scale(amax):
    """ds4 §5.1: d = amax/127 kept as f32, and the multiplier id = 1/d (0 for an all-zero block)."""
    d = float32(amax / float32(127.0))
    return d, (float32(1.0) / d if d != 0 else float32(0.0))


@cuda.jit(device=True)
def q8_0_value(v, inv):
    return max(-128, min(127, int32(round(v * inv))))


@cuda.jit(device=True)
def quantize_q8_0_lane(v, block, lane, q_out, d_out):
    """Q8_0 of a 32-value block held one value per lane of a warp (GPU only): the amax comes from
    a shuffle reduction; lane i writes code i, lane 0 the scale."""
    d, inv = q8_0_scale(warp_max_f32(abs(v)))
    q_out[block * 32 + lane] = q8_0_value(v, inv)
    if lane == 0:
        d_out[block] = d


@cuda.jit(device=True)
def quantize_q8_0_warp(vals, block, lane, q_out, d_out):
    """Q8_0 of the 32 values vals[32·block:] by one warp (GPU only): one load per lane instead of
    64 serial ones."""
    quantize_q8_0_lane(vals[block * 32 + lane], block, lane, q_out, d_out)


@cuda.jit(device=True)
def quantize_q8_0_serial(vals, block, q_out, d_out):
    """The same block by one thread (the simulator's path)."""
    amax = float32(0.0)
    for i in range(32):
        amax = max(amax, abs(vals[block * 32 + i]))
    d, inv = q8_0_scale(amax)
    for i in range(32):
        q_out[block * 32 + i] = q8_0_value(vals[block * 32 + i], inv)
    d_out[block] = d


@cuda.jit(device=True)
def quantize_q8_0_block_values(vals, q_out, d_out):
    """Q8_0 activation quantization of a whole vector by one block (all threads call, after the
    values were written and the block synchronised)."""
    tid = cuda.threadIdx.x
    n_blocks = vals.shape[0] // 32
    if USE_SHUFFLES:
        for block in range(tid // 32, n_blocks, cuda.blockDim.x // 32):
            quantize_q8_0_warp(vals, block, tid % 32, q_out, d_out)
    else:
        for block in range(tid, n_blocks, cuda.blockDim.x):
            quantize_q8_0_serial(vals, block, q_out, d_out)


# ---- embedding and hyper-connections --------------------------------------------------------------

@cached_jit()
def embed(token_buf, w16, embd_off, n_embd, n_hc, state):
    """state[t, h] = f16->f32(token_embd[token t]) for every HC stream (§6.1); token t = blockIdx.y."""
    pdl_enter()
    t = cuda.blockIdx.y
    token = token_buf[t]
    for i in range(cuda.grid(1), n_embd, cuda.gridsize(1)):
        value = float32(w16[embd_off + token * n_embd + i])
        for h in range(n_hc):
            state[t, h, i] = value


HC_CHUNK = 1024          # most elements of the flattened HC state per hc_mix_partial block
HC_MIX_PRE = True        # hc_mix_partial loads its weights before pdl_enter() (they are never
                         # written while a graph replays, so the loads may overlap the grid before;
                         # H200, session 23, decode_ab: 7.881 / 7.866 ms per step against 7.927 / 7.923)
HC_PRE_VALS = 4          # weights per thread that hc_mix_partial loads first: a chunk of BLOCK x 4


def hc_chunk(n_embd: int) -> int:
    """Chunk length dividing n_embd, so that a chunk never straddles two streams."""
    return min(HC_CHUNK, n_embd)


@forceinline
def mixer_first_weights(w16, base, chunk_len, first):
    """hc_mix_partial's first HC_PRE_VALS weights of this thread (j = tid + k · blockDim, 0 past
    the chunk) into `first` (a local array indexed by constants: registers)."""
    for k in range(HC_PRE_VALS):
        j = cuda.threadIdx.x + k * cuda.blockDim.x
        first[k] = float32(w16[base + j]) if j < chunk_len else float32(0.0)


@cached_jit()
def hc_mix_partial(state, w16, fn_off, chunk_len, part_dot, part_sq, part_gram, PRE):
    """Partial mixer dots over one chunk of the flattened state: block (row, chunk, token). Chunks
    never straddle streams (hc_chunk), so there is no index division per element. The dots are
    f64 sums of exact products (kernels/numerics.py: the CPU twin adds them in another order).
    Row-0 blocks also write the chunk's Σx² (in double) for the RMS scale. state [T, n_hc, n_embd],
    part_dot [T, rows, chunks] (f64), part_sq [T, chunks].

    Each thread's first HC_PRE_VALS weights are loaded before the state (PRE, HC_MIX_PRE: before
    pdl_enter(), while the grid before may still run): the same products in the same order.

    Blocks past the mixer rows (grid rows + n_hc², for hc_pre) write the Gram matrix of the
    streams, G[h][h'] = Σ_d X_h[d]·X_h'[d], in double, as partials over n_chunks equal d-ranges
    (part_gram [T, n_hc², chunks]): with it hc_pre knows Σy² of y = Σ a_h X_h (= Σ a_h a_h' G)
    before it has y, so its collapse needs no block-wide reduction and spreads over many blocks."""
    if not PRE:
        pdl_enter()
    row = cuda.blockIdx.x
    chunk = cuda.blockIdx.y
    t = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    _, n_hc, n_embd = state.shape
    n_rows = part_dot.shape[1]
    start = chunk * chunk_len
    base = fn_off + row * n_hc * n_embd + start
    first = cuda.local.array(HC_PRE_VALS, float32)
    if PRE:
        if row < n_rows:                    # block-uniform: the mixer's weights only
            mixer_first_weights(w16, base, chunk_len, first)
        pdl_enter()                         # everything below may read what earlier grids wrote
    if row >= n_rows:                       # block-uniform: a Gram partial
        pair = row - n_rows
        h_a = pair // n_hc
        h_b = pair - h_a * n_hc
        span = n_embd // part_dot.shape[2]
        scratch_g = cuda.shared.array(BLOCK, float64)
        gram = float64(0.0)
        for d in range(chunk * span + tid, (chunk + 1) * span, cuda.blockDim.x):
            gram += float64(state[t, h_a, d]) * float64(state[t, h_b, d])
        total_gram = block_sum(gram, scratch_g)
        if tid == 0:
            part_gram[t, pair, chunk] = total_gram
        return
    stream = start // n_embd
    d0 = start - stream * n_embd
    scratch64 = cuda.shared.array(BLOCK, float64)
    scratch_dot = cuda.shared.array(BLOCK, float64)
    sumsq = float64(0.0)
    dot = float64(0.0)
    if not PRE:
        mixer_first_weights(w16, base, chunk_len, first)
    for k in range(HC_PRE_VALS):            # j = tid, tid + nt, ... in order, as one loop would
        j = tid + k * nt
        if j < chunk_len:
            v = state[t, stream, d0 + j]
            dot += float64(first[k]) * float64(v)
            sumsq += float64(v) * float64(v)
    for j in range(tid + HC_PRE_VALS * nt, chunk_len, nt):   # chunks longer than HC_PRE_VALS x nt
        v = state[t, stream, d0 + j]
        dot += float64(w16[base + j]) * float64(v)
        sumsq += float64(v) * float64(v)
    total_dot = block_sum(dot, scratch_dot)
    if row == 0:
        total_sq = block_sum(sumsq, scratch64)
        if tid == 0:
            part_sq[t, chunk] = total_sq
    if tid == 0:
        part_dot[t, row, chunk] = total_dot


HC_MIX_MAX = HC_MAX * (2 + HC_MAX)     # mixer rows with HC_MAX streams
MIX_PER_WARP = (HC_MIX_MAX + BLOCK // 32 - 1) // (BLOCK // 32)   # rows a warp sums (>= BLOCK threads)
GRAM_PER_WARP = (HC_GRAM + BLOCK // 32 - 1) // (BLOCK // 32)
HC_SUMS = HC_GRAM + 1                  # hc_mix_tokens' double sums: the Gram pairs, then Σx²
HC_MIX_VALS = 4                        # state values per thread in hc_mix_tokens: chunk <= 4 x block
BLOCK_WARPS = BLOCK // 32


@cuda.jit(device=True)
def warp_partial(value, slots, k, scratch_tree):
    """block_sum's first stage for value k of a block that reduces many: the warp's sum into
    slots[k, warp] (GPU); the finish, sum_warps, adds the slots in warp order after one barrier,
    so the total has block_sum's bits. The simulator's block_sum is a shared-memory tree instead:
    there the value's total is taken whole (the tree, with its barriers) and kept in slot 0."""
    if USE_SHUFFLES:
        total = warp_sum_f32(value)
        if cuda.threadIdx.x % 32 == 0:
            slots[k, cuda.threadIdx.x // 32] = total
    else:
        total = block_sum(value, scratch_tree)
        if cuda.threadIdx.x == 0:
            slots[k, 0] = total


@cuda.jit(device=True)
def warp_partials8(v, slots, k0, n, scratch_tree):
    """warp_partial of the 8 values v[0..7] into slots k0 .. k0 + 7 (those below n). On the GPU in
    one warp_sum8 (9 exchanges instead of 8 butterflies of 5): it pairs each value's lanes in the
    butterfly's order (lane xor 16, 8, 4, 2, 1), so every slot gets warp_partial's bits."""
    if USE_SHUFFLES:
        lane = cuda.threadIdx.x % 32
        total = warp_sum8(v, scratch_tree)
        k = k0 + ((lane >> 2) & 7)
        if lane % 4 == 0 and k < n:
            slots[k, cuda.threadIdx.x // 32] = total
    else:
        for i in range(8):
            if k0 + i < n:
                warp_partial(v[i], slots, k0 + i, scratch_tree)


@cuda.jit(device=True)
def sum_warps(slots, k):
    total = slots[k, 0]
    if USE_SHUFFLES:
        for w in range(1, cuda.blockDim.x // 32):
            total += slots[k, w]
    return total


HC_TOKENS = 2                          # tokens per hc_mix_tokens block (each weight loaded once for all;
                                       # ptxas sm_90: 114 registers, 2 blocks per SM; 4 tokens: 180, one)
HC_TOK_DOTS = HC_TOKENS * HC_MIX_MAX
HC_TOK_SUMS = HC_TOKENS * HC_SUMS
HC_TOK_VALS = HC_TOKENS * HC_MIX_VALS
HC_W8 = 8 * HC_MIX_VALS                # weight values of 8 mixer rows per thread
assert HC_MIX_MAX % 8 == 0 and HC_GRAM % 8 == 0


@cached_jit()
def hc_mix_tokens(state, w16, fn_off, chunk_len, with_gram, part_dot, part_sq, part_gram):
    """hc_mix_partial for a prefill chunk: block (chunk, token group) writes all of the chunk's
    partials for HC_TOKENS tokens (every mixer row, Σx², and the Gram pairs when with_gram) from
    one pass over their state slices, with one barrier for all of them. hc_mix_partial's grid of
    (rows + n_hc²) x chunks x tokens small blocks was 18 % of a 512-token prefill (1.8 ms per
    launch, ncu on the H200); one block per (chunk, token) was still 0.36 ms per launch (each mixer
    row waited for its weight loads from L2, per token): a weight value now serves HC_TOKENS
    tokens, whose warp sums are independent. The same per-thread order and block_sum's
    warp-then-warp-order sums, so the partials equal hc_mix_partial's bit for bit (decode keeps
    that kernel: one token needs its wider grid). Launch grid (chunks, ceil(T / HC_TOKENS))."""
    pdl_enter()
    chunk = cuda.blockIdx.x
    t0 = cuda.blockIdx.y * HC_TOKENS
    tid = cuda.threadIdx.x
    nthr = cuda.blockDim.x
    n_tok, n_hc, n_embd = state.shape
    n_rows = part_dot.shape[1]
    start = chunk * chunk_len
    stream = start // n_embd
    d0 = start - stream * n_embd
    dots = cuda.shared.array((HC_TOK_DOTS, BLOCK_WARPS), float64)      # [token][row]
    sums64 = cuda.shared.array((HC_TOK_SUMS, BLOCK_WARPS), float64)    # [token][pair, then Σx²]
    tree64 = cuda.shared.array(BLOCK, float64)                          # simulator only
    # the thread's state values (j = tid, tid + nthr, ...: the order of its sums), read once for
    # Σx² and all the mixer rows; ncu showed the kernel issue-bound when it re-read them per row.
    # A group past the last token repeats it (its partials are not written).
    vals = cuda.local.array(HC_TOK_VALS, float32)
    for tt in range(HC_TOKENS):
        srow = state[min(t0 + tt, n_tok - 1), stream]
        sumsq = float64(0.0)
        for k in range(HC_MIX_VALS):
            j = tid + k * nthr
            vals[tt * HC_MIX_VALS + k] = srow[d0 + j] if j < chunk_len else float32(0.0)
            if j < chunk_len:
                sumsq += float64(vals[tt * HC_MIX_VALS + k]) * float64(vals[tt * HC_MIX_VALS + k])
        warp_partial(sumsq, sums64, tt * HC_SUMS + HC_GRAM, tree64)
    # mixer rows 8 at a time: their weights loaded once for the tokens, the 8 dots of a token
    # summed over the warp together (warp_partials8)
    w = cuda.local.array(HC_W8, float32)
    v = cuda.local.array(8, float64)
    for row0 in range(0, n_rows, 8):
        for i in range(8):
            wrow = fn_off + min(row0 + i, n_rows - 1) * n_hc * n_embd + start
            for k in range(HC_MIX_VALS):
                j = tid + k * nthr
                w[i * HC_MIX_VALS + k] = float32(w16[wrow + j]) if j < chunk_len else float32(0.0)
        for tt in range(HC_TOKENS):
            for i in range(8):
                dot = float64(0.0)
                for k in range(HC_MIX_VALS):
                    if tid + k * nthr < chunk_len:
                        dot += float64(w[i * HC_MIX_VALS + k]) * float64(vals[tt * HC_MIX_VALS + k])
                v[i] = dot
            warp_partials8(v, dots, tt * HC_MIX_MAX + row0, tt * HC_MIX_MAX + n_rows, tree64)
    n_pairs = n_hc * n_hc if with_gram else 0
    if n_pairs:
        span = n_embd // part_dot.shape[2]
        gram = cuda.local.array(HC_GRAM, float64)
        v64 = cuda.local.array(8, float64)
        x_h = cuda.local.array(HC_MAX, float32)
        for tt in range(HC_TOKENS):
            t = min(t0 + tt, n_tok - 1)
            for pair in range(HC_GRAM):
                gram[pair] = float64(0.0)
            # loops swapped against hc_mix_partial (d outside, pairs inside): each pair still adds
            # its products in increasing d, so the same sums; the n_hc values at d are read once
            for d in range(chunk * span + tid, (chunk + 1) * span, nthr):
                for h in range(HC_MAX):
                    if h < n_hc:
                        x_h[h] = state[t, h, d]
                for pair in range(HC_GRAM):
                    if pair < n_pairs:
                        h_a = pair // n_hc
                        h_b = pair - h_a * n_hc
                        gram[pair] += float64(x_h[h_a]) * float64(x_h[h_b])
            for p0 in range(0, HC_GRAM, 8):
                for i in range(8):
                    v64[i] = gram[p0 + i]
                warp_partials8(v64, sums64, tt * HC_SUMS + p0, tt * HC_SUMS + n_pairs, tree64)
    cuda.syncthreads()
    for tt in range(HC_TOKENS):
        t = t0 + tt
        if t < n_tok:
            if tid < n_rows:
                part_dot[t, tid, chunk] = sum_warps(dots, tt * HC_MIX_MAX + tid)
            elif tid < n_rows + n_pairs:
                part_gram[t, tid - n_rows, chunk] = sum_warps(sums64, tt * HC_SUMS + tid - n_rows)
            elif tid == n_rows + n_pairs:
                part_sq[t, chunk] = sum_warps(sums64, tt * HC_SUMS + HC_GRAM)


@cached_jit()
def hc_post(state, f_a, f_b, post, comb):
    """X_new[j] = post[j]·(f_a + f_b) + Σ_i C[i][j]·X_old[i] (§6.3), in place; f_b may be zeros.
    Token t = blockIdx.y: state [T, n_hc, n_embd], f_a/f_b [T, n_embd], post [T, n_hc], comb
    [T, n_hc²]. (Fused with the next mixer's partial dots it was slower, twice: 17 us per launch
    against 5.5 + 6 (session 2), and an out-of-place version over the mixer's grid 15.9 us against
    5.4 + 7.8, whole step +0.3 ms (session 3); ncu and leave-one-out on the H200. The decode step
    runs it instead in the epilogue of the kernel that writes f_a: hc_post_dim.)"""
    pdl_enter()
    t = cuda.blockIdx.y
    n_embd = state.shape[2]
    for d in range(cuda.grid(1), n_embd, cuda.gridDim.x * cuda.blockDim.x):
        hc_post_dim(state[t], d, f_a[t, d] + f_b[t, d], post[t], comb[t])


@cuda.jit(device=True)
def hc_post_dim(state, d, f, post, comb):
    """hc_post for one dim d of one token, in place: X_new[j][d] = post[j]·f + Σ_i C[i][j]·X_old[i][d]
    (state [n_hc, n_embd], post [n_hc], comb [n_hc²], f = f_a[d] + f_b[d]). hc_post and the decode
    epilogues of the Q8_0 matvec and the MoE down kernel (the sublayer's output written, the post
    done by the same thread, one launch fewer per HC site) share it, so their bits agree."""
    n_hc = state.shape[0]
    old = cuda.local.array(HC_MAX, float32)      # constant trip counts: kept in registers
    for i in range(HC_MAX):
        if i < n_hc:
            old[i] = state[i, d]
    for j in range(HC_MAX):
        if j < n_hc:
            # Every product and sum rounded on its own, as the CPU engine's hc_post_rows does:
            # written as `acc += comb·old`, NVVM contracted post·f with the first product
            # (fma(post, f, comb·old)), last-bit changes in the state that moved the tiny model's
            # decode logits from corr 0.99989 to 0.9934 against the CPU engine (H200, session 9).
            acc = mul_rn(post[j], f)
            for i in range(HC_MAX):
                if i < n_hc:
                    acc = add_rn(acc, mul_rn(comb[i * n_hc + j], old[i]))
            state[j, d] = acc


@cuda.jit(device=True)
def sum_chunk_rows(part, vals, scale, out):
    """out[row] = (Σ_chunk part[row, chunk]) · scale for every row, f64 sums rounded once to out's
    type (GPU path; all threads call): a
    warp per row, its lanes the chunks (at most 32), shuffle sums. Warp w takes rows w, w + n_warps,
    ... and loads the partials of len(vals) of them (vals: the caller's local array, of a constant
    length, so the loops unroll) before the first sum: one L2 round trip, not one per row."""
    tid = cuda.threadIdx.x
    lane = tid % 32
    n_warps = cuda.blockDim.x // 32
    n_rows, n_chunks = part.shape
    per_warp = vals.shape[0]
    for first in range(tid // 32, n_rows, per_warp * n_warps):     # one pass with >= BLOCK threads
        for k in range(per_warp):
            row = first + k * n_warps
            vals[k] = 0
            if row < n_rows and lane < n_chunks:
                vals[k] = part[row, lane]
        for k in range(per_warp):
            row = first + k * n_warps
            total = warp_sum_f32(vals[k])
            if lane == 0 and row < n_rows:
                out[row] = total * scale        # f64; stored to f32 mix: numerics.hc_mix_value


@cuda.jit(device=True)
def hc_mix_values(part_dot, part_sq, n, eps, mix):
    """mix[row] = (Σ_chunk f64 partial dots) · rsqrt(mean(flat²) + eps) (§6.2) into shared memory,
    then a barrier: the consumers (hc_pre, hc_head) finish the mix themselves instead of a
    separate launch. On the GPU a warp takes a row, its lanes the chunks (one load each, shuffle
    sums; at most 32 chunks); in the simulator a thread takes a row."""
    tid = cuda.threadIdx.x
    n_rows, n_chunks = part_dot.shape
    if USE_SHUFFLES:
        lane = tid % 32
        sq = warp_sum_f32(part_sq[lane] if lane < n_chunks else float64(0.0))
        dots = cuda.local.array(MIX_PER_WARP, float64)
        sum_chunk_rows(part_dot, dots, rms_scale(sq, n, eps), mix)
    elif tid < n_rows:
        sq = float64(0.0)
        for c in range(n_chunks):
            sq += part_sq[c]
        dot = float64(0.0)
        for c in range(n_chunks):
            dot += part_dot[tid, c]
        mix[tid] = hc_mix_value(dot, rms_scale(sq, n, eps))
    cuda.syncthreads()


# The Sinkhorn matrix in f64 from the f32 mix (the CPU twin, cpu_ops.hc_gates_rows, adds the same
# values in the same order), rounded once when written out.

@cuda.jit(device=True)
def sinkhorn_pass(comb, n_hc, by_row, eps64):
    """Simulator path: divide each comb element by its row sum (by_row) or its column sum, + eps;
    the sums run in index order. Thread k < n_hc² owns element (k // n_hc, k % n_hc)."""
    tid = cuda.threadIdx.x
    i = tid // n_hc
    j = tid - i * n_hc
    value = float64(0.0)
    if tid < n_hc * n_hc:
        total = float64(0.0)
        for k in range(n_hc):
            total += comb[i * n_hc + k] if by_row else comb[k * n_hc + j]
        value = comb[tid] / (total + eps64)
    cuda.syncthreads()
    if tid < n_hc * n_hc:
        comb[tid] = value
    cuda.syncthreads()


@cuda.jit(device=True)
def comb_logit(mix, w32, scale_off, base_off, n_hc, k):
    return hc_logit(mix[2 * n_hc + k], w32[scale_off + 2], w32[base_off + 2 * n_hc + k])


@cuda.jit(device=True)
def sinkhorn_shared(mix, w32, scale_off, base_off, n_hc, n_iter, eps64, comb):
    """Simulator path of sinkhorn_comb: the matrix in shared memory, a barrier per pass."""
    tid = cuda.threadIdx.x
    nn = n_hc * n_hc
    i = tid // n_hc
    if tid < nn:
        comb[tid] = comb_logit(mix, w32, scale_off, base_off, n_hc, tid)
    cuda.syncthreads()
    value = float64(0.0)
    if tid < nn:                                   # softmax over j, + eps
        row_max = float64(-math.inf)
        for jj in range(n_hc):
            row_max = max(row_max, comb[i * n_hc + jj])
        row_sum = float64(0.0)
        for jj in range(n_hc):
            row_sum += math.exp(comb[i * n_hc + jj] - row_max)
        value = math.exp(comb[tid] - row_max) / row_sum + eps64
    cuda.syncthreads()
    if tid < nn:
        comb[tid] = value
    cuda.syncthreads()
    for it in range(n_iter):
        if it > 0:                                 # rows, then columns, n_iter - 1 times
            sinkhorn_pass(comb, n_hc, True, eps64)
        sinkhorn_pass(comb, n_hc, False, eps64)


@cuda.jit(device=True)
def sinkhorn_warp(mix, w32, scale_off, base_off, n_hc, n_iter, eps64, comb):
    """GPU path of sinkhorn_comb, by warp 0 alone with no barrier: lane k < n_hc² holds element
    (k // n_hc, k % n_hc) in a register; each row or column sum gathers its n_hc values by
    shuffles, in index order (the same sums as the shared-memory path)."""
    lane = cuda.threadIdx.x
    i = lane // n_hc
    j = lane - i * n_hc
    value = comb_logit(mix, w32, scale_off, base_off, n_hc, lane) if lane < n_hc * n_hc else float64(0.0)
    row_max = float64(-math.inf)
    for k in range(n_hc):
        row_max = max(row_max, cuda.shfl_sync(0xFFFFFFFF, value, min(i * n_hc + k, 31)))
    row_sum = float64(0.0)
    for k in range(n_hc):
        row_sum += math.exp(cuda.shfl_sync(0xFFFFFFFF, value, min(i * n_hc + k, 31)) - row_max)
    value = math.exp(value - row_max) / row_sum + eps64
    for it in range(n_iter):
        if it > 0:
            total = float64(0.0)
            for k in range(n_hc):
                total += cuda.shfl_sync(0xFFFFFFFF, value, min(i * n_hc + k, 31))
            value = value / (total + eps64)
        total = float64(0.0)
        for k in range(n_hc):
            total += cuda.shfl_sync(0xFFFFFFFF, value, min(k * n_hc + j, 31))
        value = value / (total + eps64)
    if lane < n_hc * n_hc:
        comb[lane] = float32(value)


@cuda.jit(device=True)
def sinkhorn_comb(mix, w32, scale_off, base_off, n_hc, n_iter, eps, post, comb):
    """The post gates and the doubly-normalised comb matrix from the mixer values (§6.2): row
    softmax + eps, then column and row normalisations (n_iter column passes). Written to global
    post/comb for hc_post. All threads of the block call."""
    tid = cuda.threadIdx.x
    eps64 = float64(float32(eps))
    if tid < n_hc:
        post[tid] = hc_post_gate(mix[n_hc + tid], w32[scale_off + 1], w32[base_off + n_hc + tid])
    if USE_SHUFFLES:
        if tid < 32:
            sinkhorn_warp(mix, w32, scale_off, base_off, n_hc, n_iter, eps64, comb)
    else:
        work = cuda.shared.array(256, float64)
        sinkhorn_shared(mix, w32, scale_off, base_off, n_hc, n_iter, eps64, work)
        if tid < n_hc * n_hc:
            comb[tid] = float32(work[tid])


@cuda.jit(device=True)
def pre_gate(mix, w32, scale_off, base_off, h, eps):
    """The weight of HC stream h in a sublayer's input (hc_pre) or the head's (hc_head), §6.2:
    sigmoid(mix[h]·scale + base[h]) + eps (kernels/numerics.py)."""
    return hc_pre_gate(mix[h], w32[scale_off], w32[base_off + h], eps)


@cuda.jit(device=True)
def collapse_norm_q8(state, gates, w32, norm_off, eps, x_out, xq, xd, scratch64):
    """x = RMSNorm(Σ_h gates[h]·X[h])·w, and its Q8_0 quantization (every block thread calls):
    the input of a sublayer (HC pre) and of the output head (HC head collapse). y in f64, Σy² from
    it, y recomputed for the normed value (numerics.hc_normed), as the CPU's hc_collapse_norm_rows."""
    tid = cuda.threadIdx.x
    n_hc, n_embd = state.shape
    sumsq = float64(0.0)
    for i in range(tid, n_embd, cuda.blockDim.x):
        y = float64(0.0)
        for h in range(n_hc):
            y += float64(gates[h]) * float64(state[h, i])
        sumsq += y * y
    scale = rms_scale(block_sum(sumsq, scratch64), n_embd, eps)
    for i in range(tid, n_embd, cuda.blockDim.x):
        y = float64(0.0)
        for h in range(n_hc):
            y += float64(gates[h]) * float64(state[h, i])
        x_out[i] = hc_normed(y, scale, w32[norm_off + i])
    cuda.syncthreads()
    quantize_q8_0_block_values(x_out, xq, xd)


@cuda.jit(device=True)
def gram_values(part_gram, gram):
    """gram[k] = Σ_chunk part_gram[k, chunk] (double) into shared memory, then a barrier; a warp
    per entry on the GPU (lanes = chunks, at most 32), a thread per entry in the simulator."""
    tid = cuda.threadIdx.x
    n_pairs, n_chunks = part_gram.shape
    if USE_SHUFFLES:
        parts = cuda.local.array(GRAM_PER_WARP, float64)
        sum_chunk_rows(part_gram, parts, float64(1.0), gram)
    elif tid < n_pairs:
        total = float64(0.0)
        for c in range(n_chunks):
            total += part_gram[tid, c]
        gram[tid] = total
    cuda.syncthreads()


@cached_jit()
def hc_sinkhorn(part_dot, part_sq, n, w32, scale_off, base_off, n_iter, hc_eps, rms_eps, post_out,
                comb_out):
    """The post gates and the Sinkhorn comb matrix of one sublayer from its mixer partials (one
    block of BLOCK threads per token, grid (1, T)); n = n_hc·n_embd. Only the sublayer's HC post
    reads them, so the engine runs this beside hc_pre on a side stream: 20 Sinkhorn iterations on
    one warp are a chain of shuffles that was hc_pre's longest block (ncu on the H200)."""
    pdl_enter()
    t = cuda.blockIdx.y
    mix = cuda.shared.array(64, float32)
    hc_mix_values(part_dot[t], part_sq[t], n, rms_eps, mix)
    sinkhorn_comb(mix, w32, scale_off, base_off, post_out.shape[1], n_iter, hc_eps, post_out[t], comb_out[t])


@cached_jit()
def hc_pre(state, part_dot, part_sq, part_gram, w32, scale_off, base_off, norm_off, hc_eps, rms_eps,
           x_out, xq, xd):
    """HC reduce for one sublayer: grid (n_embd/BLOCK, T) blocks of BLOCK threads, each taking BLOCK
    values of the collapse: the pre gates a_h, y = Σ a_h X_h, x = y · rsqrt(Σy²/n + eps) · w (Σy² =
    Σ a_h a_h' G[h][h'] from the mixer's Gram partials), and x quantized to Q8_0, a warp per
    32-value block. A thread's state and norm loads are issued before it waits for the mixer sums.
    (The post gates and comb matrix: hc_sinkhorn.) Per-token rows: state[t], part_dot[t], x_out[t]..."""
    pdl_enter()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    _, n_hc, n_embd = state.shape
    mix = cuda.shared.array(64, float32)
    i = cuda.blockIdx.x * cuda.blockDim.x + tid
    inside = i < n_embd                                # warp-uniform: n_embd % 32 == 0
    # loops over the constant HC_MAX (guarded by n_hc) unroll, so these stay in registers
    values = cuda.local.array(HC_MAX, float32)
    norm_w = float32(0.0)
    if inside:
        for h in range(HC_MAX):
            if h < n_hc:
                values[h] = state[t, h, i]
        norm_w = w32[norm_off + i]
    gram = cuda.shared.array(HC_GRAM, float64)
    hc_mix_values(part_dot[t, :n_hc], part_sq[t], n_hc * n_embd, rms_eps, mix)   # the pre rows only
    gram_values(part_gram[t], gram)
    gates = cuda.local.array(HC_MAX, float32)
    for h in range(HC_MAX):
        gates[h] = pre_gate(mix, w32, scale_off, base_off, h, hc_eps) if h < n_hc else float32(0.0)
    sumsq = float64(0.0)
    for h in range(HC_MAX):
        if h < n_hc:
            row = float64(0.0)
            for h2 in range(HC_MAX):
                if h2 < n_hc:
                    row += float64(gates[h2]) * gram[h * n_hc + h2]
            sumsq += float64(gates[h]) * row
    scale = rms_scale(sumsq, n_embd, rms_eps)
    # y in f64 (exact products, added in h order as the CPU twin), rounded once after the norm
    y = float64(0.0)
    for h in range(HC_MAX):
        if h < n_hc:
            y += float64(gates[h]) * float64(values[h])
    x = hc_normed(y, scale, norm_w)
    if inside:
        x_out[t, i] = x
    if USE_SHUFFLES:
        if inside:
            quantize_q8_0_lane(x, i // 32, tid % 32, xq[t], xd[t])
    else:
        cuda.syncthreads()
        block = i // 32
        if tid % 32 == 0 and inside:
            quantize_q8_0_serial(x_out[t], block, xq[t], xd[t])


@wide_jit
def hc_head(state, part_dot, part_sq, w32, scale_off, base_off, norm_off, hc_eps, rms_eps, x_out, xq, xd):
    """Output-head collapse (§6.12): a_h = sigmoid(pre_h·scale + base_h) + eps, e = Σ a_h X[h],
    z = RMSNorm(e)·output_norm, quantized to Q8_0 for the output matvec. Token t = blockIdx.y
    (prefill runs it on the last token only, as a T = 1 view of the state)."""
    pdl_enter()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    _, n_hc, n_embd = state.shape
    gate = cuda.shared.array(16, float32)
    scratch64 = cuda.shared.array(BLOCK, float64)
    mix = cuda.shared.array(64, float32)
    hc_mix_values(part_dot[t], part_sq[t], n_hc * n_embd, rms_eps, mix)
    if tid < n_hc:
        gate[tid] = pre_gate(mix, w32, scale_off, base_off, tid, hc_eps)
    cuda.syncthreads()
    collapse_norm_q8(state[t], gate, w32, norm_off, rms_eps, x_out[t], xq[t], xd[t], scratch64)


RMS_VALS = 8             # values per thread rmsnorm_q8 keeps in registers (n <= RMS_VALS x threads)


@cached_jit()
def rmsnorm_q8(x, w32, norm_off, eps, x_out, xq, xd):
    """x_out = RMSNorm(x)·w, plus its Q8_0 quantization: one block per token (grid (1, T)), on
    rows x[t] of [T, n] arrays."""
    pdl_enter()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    n = x.shape[1]
    nthr = cuda.blockDim.x
    scratch64 = cuda.shared.array(BLOCK, float64)
    if USE_SHUFFLES and n <= RMS_VALS * nthr and n % 32 == 0:        # block-uniform
        # the thread's values and norm weights in registers, loaded together; warp w's 32 values
        # of a pass are one Q8_0 block, quantized by shuffles (no barrier, no re-read): the
        # loads-then-sum loops cost one memory round trip each (the q norm sits on the critical
        # path of every layer). The same sums and products as the loop below.
        vals = cuda.local.array(RMS_VALS, float32)
        norm_w = cuda.local.array(RMS_VALS, float32)
        for k in range(RMS_VALS):
            i = tid + k * nthr
            if i < n:
                vals[k] = x[t, i]
                norm_w[k] = w32[norm_off + i]
        sumsq = float64(0.0)
        for k in range(RMS_VALS):
            if tid + k * nthr < n:
                sumsq += float64(vals[k]) * float64(vals[k])
        scale = rms_scale(block_sum(sumsq, scratch64), n, eps)
        for k in range(RMS_VALS):
            i = tid + k * nthr
            if i < n:                            # warp-uniform: n % 32 == 0
                value = vals[k] * scale * norm_w[k]
                x_out[t, i] = value
                quantize_q8_0_lane(value, i // 32, tid % 32, xq[t], xd[t])
        return
    sumsq = float64(0.0)
    for i in range(tid, n, nthr):
        sumsq += float64(x[t, i]) * float64(x[t, i])
    scale = rms_scale(block_sum(sumsq, scratch64), n, eps)
    for i in range(tid, n, nthr):
        x_out[t, i] = x[t, i] * scale * w32[norm_off + i]
    cuda.syncthreads()
    quantize_q8_0_block_values(x_out[t], xq[t], xd[t])


# ---- RoPE and the QAT simulations ------------------------------------------------------------------

@cuda.jit(device=True)
def rope_tail(vec, base, n_nope, n_rot, pos, freqs, inverse):
    """Rotate the interleaved tail pairs of vec[base : base+n_nope+n_rot] by pos·freqs[k] (§6.7;
    freqs float64, the angle and the rotation in f64: kernels/numerics.py, as the CPU twin).
    Called by all threads of a block; each thread takes pairs k = tid, tid+blockDim, ..."""
    for k in range(cuda.threadIdx.x, n_rot // 2, cuda.blockDim.x):
        i = base + n_nope + 2 * k
        vec[i], vec[i + 1] = rotate_pair(vec[i], vec[i + 1], float64(pos) * freqs[k], inverse)


@cuda.jit(device=True)
def qat_round(v, scale, vmax, fp8):
    """One value through the QAT simulation: v/scale clamped to ±vmax, rounded to the nearest FP8
    E4M3 (fp8) or FP4 E2M1 value, scaled back."""
    x = min(max(v / scale, -vmax), vmax)
    r = fp8_e4m3_round(abs(x)) if fp8 else fp4_e2m1_round(abs(x))
    return float32((r if x >= 0 else -r) * scale)


@cuda.jit(device=True)
def scaled_block_sim(vec, base, n, block, vmax, amax_floor, fp8, scratch32):
    """The QAT simulations of §6.9 on vec[base:base+n], in blocks (all block threads call, with
    blockDim >= block): a power-of-two scale 2^ceil(log2(amax/vmax)) per block, then qat_round
    (FP8 E4M3 with block 64 and max 448, or FP4 E2M1 with block 32 and max 6). On the GPU each
    warp takes whole blocks (block/32 values per lane, amax by shuffles), all blocks at once."""
    tid = cuda.threadIdx.x
    if USE_SHUFFLES:
        lane = tid % 32
        per_lane = block // 32
        for blk in range(tid // 32, n // block, cuda.blockDim.x // 32):
            first = base + blk * block + lane
            amax = float32(0.0)
            for e in range(per_lane):
                amax = max(amax, abs(vec[first + 32 * e]))
            amax = max(warp_max_f32(amax), float32(amax_floor))
            scale = pow2(ceil_log2(amax / vmax))
            for e in range(per_lane):
                vec[first + 32 * e] = qat_round(vec[first + 32 * e], scale, vmax, fp8)
        cuda.syncthreads()
        return
    for blk in range(n // block):
        v = abs(vec[base + blk * block + tid]) if tid < block else float32(0.0)
        amax = max(block_max_f32(v, scratch32), float32(amax_floor))
        scale = pow2(ceil_log2(amax / vmax))
        if tid < block:
            i = base + blk * block + tid
            vec[i] = qat_round(vec[i], scale, vmax, fp8)
        cuda.syncthreads()


@cuda.jit(device=True)
def fp8_sim_blocks(vec, base, n, scratch32):
    """FP8 E4M3 simulation of vec[base:base+n] in 64-value blocks, amax floor 1e-4."""
    scaled_block_sim(vec, base, n, 64, FP8_MAX, 1e-4, True, scratch32)


@cuda.jit(device=True)
def hadamard_fp4(vec, base, n, scratch32):
    """Indexer QAT: unnormalised Walsh-Hadamard butterfly (strides 1..n/2), × 1/sqrt(n), then the
    FP4 E2M1 simulation in 32-value blocks (§6.9). All block threads call; n ≤ blockDim."""
    tid = cuda.threadIdx.x
    h = 1
    while h < n:
        if tid < n // 2:
            pair = tid // h
            i = base + pair * 2 * h + tid % h
            a = vec[i]
            b = vec[i + h]
            vec[i] = a + b
            vec[i + h] = a - b
        cuda.syncthreads()
        h *= 2
    if tid < n:
        vec[base + tid] = vec[base + tid] * float32(1.0 / math.sqrt(n))
    cuda.syncthreads()
    scaled_block_sim(vec, base, n, 32, FP4_MAX, 7.052966104933725e-38, False, scratch32)


@cached_jit()
def kv_finish(kv_all, w32, norm_off, eps, pos_buf, freqs, n_rot, raw_cache):
    """The new KV row (§6.4): RMSNorm·w, RoPE on the tail, FP8 on the nope dims, f16 rounding,
    pushed into the raw ring at pos mod capacity. One block per token (grid (1, T)): row kv[t] at
    position pos_buf[t] (kv [T, head_dim] is normalised in place)."""
    pdl_enter()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    kv = kv_all[t]
    n = kv.shape[0]
    pos = pos_buf[t]
    scratch64 = cuda.shared.array(BLOCK, float64)
    scratch32 = cuda.shared.array(BLOCK, float32)
    sumsq = float64(0.0)
    for i in range(tid, n, cuda.blockDim.x):
        sumsq += float64(kv[i]) * float64(kv[i])
    scale = rms_scale(block_sum(sumsq, scratch64), n, eps)
    for i in range(tid, n, cuda.blockDim.x):
        kv[i] = kv[i] * scale * w32[norm_off + i]
    cuda.syncthreads()
    rope_tail(kv, 0, n - n_rot, n_rot, pos, freqs, False)
    cuda.syncthreads()
    fp8_sim_blocks(kv, 0, n - n_rot, scratch32)
    row = pos % raw_cache.shape[0]
    for i in range(tid, n, cuda.blockDim.x):
        raw_cache[row, i] = f16_round(kv[i])


Q_HEADS_THREADS = 64      # q_heads' block (one (head, token) each); fewer threads put more of the
                          # small blocks on an SM at once (the Σx² association changes, in f64).
                          # H200, session 16, 2,048-token prefill: 256 threads 2,510 tok/s, 64: 2,581


@cached_jit()
def q_heads(q_all, head_dim, n_rot, eps, pos_buf, freqs):
    """Per-head RMSNorm without weight, then RoPE on the tail (§6.4). Block (head, token): q_all
    is [T, n_head·head_dim], token t at position pos_buf[t]."""
    pdl_enter()
    head = cuda.blockIdx.x
    t = cuda.blockIdx.y
    q = q_all[t]
    tid = cuda.threadIdx.x
    base = head * head_dim
    scratch64 = cuda.shared.array(BLOCK, float64)
    sumsq = float64(0.0)
    for i in range(tid, head_dim, cuda.blockDim.x):
        sumsq += float64(q[base + i]) * float64(q[base + i])
    scale = rms_scale(block_sum(sumsq, scratch64), head_dim, eps)
    for i in range(tid, head_dim, cuda.blockDim.x):
        q[base + i] = q[base + i] * scale
    cuda.syncthreads()
    rope_tail(q, base, head_dim - n_rot, n_rot, pos_buf[t], freqs, False)


# ---- compressors (§6.8) -----------------------------------------------------------------------------

@cuda.jit(device=True)
def pool_column(kv, sc, win_rows, tid, ratio, head_dim):
    """Softmax-pooled value of column tid over a compressor window: entry r of the window is row
    win_rows[r] of kv / sc (scores with the APE added). Ratio 4 windows have 8 entries, the previous
    window's 4 tokens on the first head_dim columns, then the current window's on the second;
    other ratios have `ratio` entries on one set of columns. The softmax and sums in f64, rounded
    once (the CPU twin's cpu_ops.compressor_pool: the same sums in the same order)."""
    best = float32(NEG_INF)
    n = 8 if ratio == 4 else ratio
    for r in range(n):
        col = head_dim + tid if ratio == 4 and r >= 4 else tid
        best = max(best, sc[win_rows[r], col])
    total = float64(0.0)
    acc = float64(0.0)
    for r in range(n):
        col = head_dim + tid if ratio == 4 and r >= 4 else tid
        e = math.exp(float64(sc[win_rows[r], col]) - float64(best))
        total += e
        acc += e * float64(kv[win_rows[r], col])
    return float32(acc / total) if best > -5e29 else float32(0.0)


@cuda.jit(device=True)
def compressor_row(pooled, w32, norm_off, eps, pos, ratio, head_dim, n_rot, freqs, indexer_lane, cache,
                   scratch64, scratch32):
    """The pooled row of the window ending at position pos into its cache row: RMSNorm·w, RoPE on
    the tail, then FP8 on the nope dims (attention lane) or Hadamard + FP4 (indexer lane), f16."""
    tid = cuda.threadIdx.x
    sumsq = float64(0.0)
    if tid < head_dim:
        sumsq = float64(pooled[tid]) * float64(pooled[tid])
    scale = rms_scale(block_sum(sumsq, scratch64), head_dim, eps)
    if tid < head_dim:
        pooled[tid] = pooled[tid] * scale * w32[norm_off + tid]
    cuda.syncthreads()
    rope_tail(pooled, 0, head_dim - n_rot, n_rot, pos + 1 - ratio, freqs, False)
    cuda.syncthreads()
    if indexer_lane:
        hadamard_fp4(pooled, 0, head_dim, scratch32)
    else:
        fp8_sim_blocks(pooled, 0, head_dim - n_rot, scratch32)
    out_row = (pos + 1) // ratio - 1
    if tid < head_dim:
        cache[out_row, tid] = f16_round(pooled[tid])
    cuda.syncthreads()


@cuda.jit(device=True)
def compressor_token(kv_t, sc_t, w16, ape_off, w32, norm_off, eps, pos, ratio, head_dim, n_rot,
                     freqs, indexer_lane, kv_state, score_state, cache, pooled, win_rows, scratch64,
                     scratch32):
    """One token at position pos into a compressor lane (all block threads call); emits a pooled
    row when (pos + 1) % ratio == 0. Ends with a barrier, so the next token sees the state.
    win_rows holds 0, 1, ..: the window's entries are the state rows in order."""
    tid = cuda.threadIdx.x
    coff = 2 if ratio == 4 else 1
    width = coff * head_dim
    row = 4 + pos % 4 if ratio == 4 else pos % ratio
    phase = pos % ratio
    for j in range(tid, width, cuda.blockDim.x):
        kv_state[row, j] = kv_t[j]
        score_state[row, j] = sc_t[j] + float32(w16[ape_off + phase * width + j])
    cuda.syncthreads()
    if (pos + 1) % ratio != 0:
        return
    if tid < head_dim:
        pooled[tid] = pool_column(kv_state, score_state, win_rows, tid, ratio, head_dim)
    cuda.syncthreads()
    compressor_row(pooled, w32, norm_off, eps, pos, ratio, head_dim, n_rot, freqs, indexer_lane, cache,
                   scratch64, scratch32)
    if ratio == 4:                     # the current window becomes the previous one
        for j in range(tid, width, cuda.blockDim.x):
            for r in range(4):
                kv_state[r, j] = kv_state[4 + r, j]
                score_state[r, j] = score_state[4 + r, j]
        cuda.syncthreads()


COMP_MAX_RATIO = 128     # window entries the pooling kernels index through shared memory


@jit_for_threads(BLOCK2)
def compressor_step(kv_t, sc_t, w16, ape_off, w32, norm_off, eps, pos_buf, ratio, head_dim,
                    n_rot, freqs, indexer_lane, kv_state, score_state, cache):
    """The T tokens of kv_t / sc_t ([T, width]: the lane's kv and gate projections) into a
    compressor lane, in token order (token t at position pos_buf[t]); emits a pooled row every
    `ratio` tokens. Single block with blockDim >= head_dim. The attention lane ends with FP8 on
    the nope dims, the indexer lane with Hadamard + FP4 on the whole row; both round the row to
    f16 before caching it. (The decode step's form; a prefill chunk uses the three compressor_chunk
    kernels, which give the same rows and state.)"""
    pdl_enter()
    pooled = cuda.shared.array(512, float32)
    win_rows = cuda.shared.array(COMP_MAX_RATIO, int32)
    scratch64 = cuda.shared.array(BLOCK2, float64)
    scratch32 = cuda.shared.array(BLOCK2, float32)
    for r in range(cuda.threadIdx.x, COMP_MAX_RATIO, cuda.blockDim.x):
        win_rows[r] = r
    cuda.syncthreads()
    for t in range(kv_t.shape[0]):
        compressor_token(kv_t[t], sc_t[t], w16, ape_off, w32, norm_off, eps, pos_buf[t], ratio,
                         head_dim, n_rot, freqs, indexer_lane, kv_state, score_state, cache, pooled,
                         win_rows, scratch64, scratch32)


# A prefill chunk (T tokens from position pos0, known on the host) through a compressor lane in
# parallel instead of token by token (compressor_step on 512 tokens: 1.7 ms, 13 % of a prefill
# chunk, ncu on the H200). The lane's state rows (S = kv_state.shape[0]) and the chunk's rows are
# staged into one table ext [S + T, width]; position p lives at ext row S + p - pos0 when p >= pos0,
# else at its state row. Then every window that ends in the chunk is pooled by its own block, and
# the state is set to what the token-by-token kernel leaves. Same arithmetic, same bits.

@cuda.jit(device=True)
def chunk_row_of(p, pos0, n_state, ratio):
    """Row of ext holding position p (p >= the previous window's start)."""
    if p >= pos0:
        return n_state + p - pos0
    if ratio == 4:
        return 4 + p % 4 if p // 4 == pos0 // 4 else p % 4
    return p % ratio


@cached_jit()
def compressor_chunk_stage(kv_t, sc_t, w16, ape_off, pos0, ratio, kv_state, score_state, ext_kv, ext_sc):
    """Block i: ext row i = state row i (i < S), or chunk token i - S with its APE added."""
    pdl_enter()
    i = cuda.blockIdx.x
    n_state, width = kv_state.shape
    for j in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        if i < n_state:
            ext_kv[i, j] = kv_state[i, j]
            ext_sc[i, j] = score_state[i, j]
        else:
            t = i - n_state
            phase = (pos0 + t) % ratio
            ext_kv[i, j] = kv_t[t, j]
            ext_sc[i, j] = sc_t[t, j] + float32(w16[ape_off + phase * width + j])


@jit_for_threads(BLOCK2)
def compressor_chunk_rows(ext_kv, ext_sc, n_state, pos0, ratio, head_dim, w32, norm_off, eps, n_rot, freqs,
                          indexer_lane, cache):
    """Block k pools the k-th window ending in the chunk (at position e0 + k·ratio) into its cache
    row, as compressor_token does."""
    pdl_enter()
    pooled = cuda.shared.array(512, float32)
    win_rows = cuda.shared.array(COMP_MAX_RATIO, int32)
    scratch64 = cuda.shared.array(BLOCK2, float64)
    scratch32 = cuda.shared.array(BLOCK2, float32)
    tid = cuda.threadIdx.x
    pos = (pos0 + ratio) // ratio * ratio - 1 + cuda.blockIdx.x * ratio
    start = pos + 1 - ratio
    n = 8 if ratio == 4 else ratio
    for r in range(tid, n, cuda.blockDim.x):
        p = start - 4 + r if ratio == 4 else start + r          # ratio 4: previous window first
        win_rows[r] = chunk_row_of(p, pos0, n_state, ratio)
    cuda.syncthreads()
    if tid < head_dim:
        pooled[tid] = pool_column(ext_kv, ext_sc, win_rows, tid, ratio, head_dim)
    cuda.syncthreads()
    compressor_row(pooled, w32, norm_off, eps, pos, ratio, head_dim, n_rot, freqs, indexer_lane, cache,
                   scratch64, scratch32)


@cached_jit()
def compressor_chunk_carry(ext_kv, ext_sc, pos0, n_tok, ratio, kv_state, score_state):
    """The state the token-by-token kernel leaves after the chunk: the current window's rows hold
    its tokens so far, the rest the window before (for ratio 4 also copied to rows 0..3 when it
    ended in the chunk). Thread per column; reads only ext, so no ordering hazard."""
    pdl_enter()
    j = cuda.grid(1)
    n_state, width = kv_state.shape
    if j >= width:
        return
    last = pos0 + n_tok - 1
    cur = (last + 1) // ratio * ratio              # first position of the window open after the chunk
    base = 4 if ratio == 4 else 0
    for r in range(ratio):
        p = cur + r if cur + r <= last else cur + r - ratio
        if p >= pos0:                               # else the state row already holds it
            src = chunk_row_of(p, pos0, n_state, ratio)
            kv_state[base + r, j] = ext_kv[src, j]
            score_state[base + r, j] = ext_sc[src, j]
    if ratio == 4 and cur - 1 >= pos0:              # the window before ended in the chunk
        for r in range(4):
            src = chunk_row_of(cur - 4 + r, pos0, n_state, ratio)
            kv_state[r, j] = ext_kv[src, j]
            score_state[r, j] = ext_sc[src, j]


# ---- indexer (§6.10) ---------------------------------------------------------------------------------

@cached_jit()
def indexer_q(iq_all, idx_dim, n_rot, pos_buf, freqs):
    """Indexer query heads: RoPE on the tail, then Hadamard + FP4. Block (head, token) on
    iq_all [T, n_ihead·idx_dim]."""
    pdl_enter()
    head = cuda.blockIdx.x
    t = cuda.blockIdx.y
    iq = iq_all[t]
    scratch32 = cuda.shared.array(BLOCK, float32)
    rope_tail(iq, head * idx_dim, idx_dim - n_rot, n_rot, pos_buf[t], freqs, False)
    cuda.syncthreads()
    hadamard_fp4(iq, head * idx_dim, idx_dim, scratch32)


ISC_ROWS = 32                 # compressed rows per indexer_scores_rows (prefill) block
ISC_SUB = 4                   # a thread's scores: ISC_SUB tokens x ISC_SUB rows
ISC_WARP_TOKENS = 32 // (ISC_ROWS // ISC_SUB) * ISC_SUB   # a warp's tokens (16: all rows each)
ISC_WARPS = 2                 # warps per block
ISC_TOKENS = ISC_WARPS * ISC_WARP_TOKENS                  # tokens per block
ISC_THREADS = 32 * ISC_WARPS
ISC_DIM = 128                 # largest idx_dim of indexer_scores_rows (its tiles in shared memory)
ISC_PAD = 4                   # the tiles' strides (rows + 4, tokens + 4): 16-byte aligned loads
ISC_RS = ISC_ROWS + ISC_PAD
ISC_QS = ISC_WARP_TOKENS + ISC_PAD
ISC_ROWS_TILE = ISC_DIM * ISC_RS                     # the block's rows, dim-major
ISC_Q_TILE = ISC_WARPS * ISC_DIM * ISC_QS            # per warp: one head's queries of its tokens
ISC_TILE = ISC_SUB * ISC_SUB                         # a thread's scores
ISC_HEADS = 64                # most indexer heads (ds4: 64)
ISC_IQ = 64 * 128             # most n_ihead·idx_dim values of a token's queries in shared memory
ISC_MAX_DIM = 512             # largest idx_dim of the decode kernel (the engine allows ISC_DIM)

# Both indexer score kernels compute score_c = Σ_h w_h·scale·max(0, icomp_c · iq_h) with the dims
# added in order and the heads added in order (the CPU twin's order), so decode and prefill give
# the same scores bit for bit. Keep the expressions in the same form too (dot += row·q, total +=
# w·dot): NVVM contracts a product feeding an add into one FMA, and a product stored to memory
# first would round twice. iq_all [T, n_ihead·idx_dim], head_w_all [T, n_ihead], scores_all
# [T, rows]; rows past those the token's position has emitted are not written.


ISD_ROWS = 4                  # compressed rows per indexer_scores (decode) block
ISD_THREADS = ISD_ROWS * ISC_HEADS
ISD_IQ = ISC_IQ + ISC_MAX_DIM  # the transposed queries: idx_dim x (n_ihead + 1) values
ISD_Q_LOADS = ISC_IQ // ISD_THREADS              # query values a thread stages
ISD_ROW_VALS = ISD_ROWS * ISC_MAX_DIM           # the staged rows, row-major
ISD_ROW_LOADS = ISD_ROW_VALS // ISD_THREADS
ISD_UNROLL = 8                # dims per step of the score dot (idx_dim must be a multiple)


def indexer_decode_blocks(n_rows: int) -> int:
    """Blocks of indexer_scores (decode) for n_rows rows."""
    return (n_rows + ISD_ROWS - 1) // ISD_ROWS


@cuda.jit(device=True)
def _add_head(total, w, dot):
    """total + w·dot when the head's dot is positive: the one place both score kernels add a head.
    total is f64 and w·dot (two f32) exact in it, so NVVM's contraction of the product into the add
    changes no bit and the CPU twin (cpu_ops.indexer_scores) gets the same sum; the score is
    rounded once. (The dots themselves are exact in f32: FP4 rows times FP4 queries.)"""
    if dot > float32(0.0):
        total += float64(w) * float64(dot)
    return total


@cuda.jit(device=True)
def _heads_total(dots, w_s, n_ihead):
    """score = Σ_h w_s[h]·dots[h] over the heads with a positive dot, in head order (f64, rounded once)."""
    total = float64(0.0)
    for h in range(n_ihead):
        total = _add_head(total, w_s[h], dots[h])
    return float32(total)


@cuda.jit(device=True)
def _next_pair(h, i, step_h, step_i, dim):
    """(h, i) of k + step for k = h·dim + i, step = step_h·dim + step_i (i, step_i < dim)."""
    i += step_i
    h += step_h
    if i >= dim:
        i -= dim
        h += 1
    return h, i


@cached_jit()
def indexer_scores(iq_all, head_w_all, weight_scale, icache, pos_buf, n_ihead, idx_dim, scores_all):
    """Decode form: block (ISD_ROWS rows, token t) of ISD_THREADS threads, thread (row r, head h);
    the heads' terms meet in shared memory and one thread per row adds them in order. The token's
    queries are staged once per block, transposed (dim-major, stride n_ihead + 1: conflict-free
    both ways), so a warp's 32 heads read 32 consecutive words. A thread issues all its staging
    loads before its first shared store (loops over constants unroll), so they are in flight
    together. (A block per row with the queries read from global 128 floats apart took 34.7 us
    per layer at 512 rows, ncu on the H200.) One token has too few rows to fill the GPU with a
    thread per row (indexer_scores_rows took the step from 9.8 to 11.6 ms)."""
    pdl_enter()
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n_rows = (pos_buf[t] + 1) // 4
    first = cuda.blockIdx.x * ISD_ROWS
    if first >= n_rows:                          # block-uniform
        return
    iq_t = cuda.shared.array(ISD_IQ, float32)
    rows = cuda.shared.array(ISD_ROW_VALS, float32)
    terms = cuda.shared.array((ISD_ROWS, ISC_HEADS), float32)
    w_s = cuda.shared.array(ISC_HEADS, float32)
    iq = iq_all[t]
    n_q = n_ihead * idx_dim
    stride = n_ihead + 1
    q_vals = cuda.local.array(ISD_Q_LOADS, float32)
    row_vals = cuda.local.array(ISD_ROW_LOADS, float32)
    for u in range(ISD_Q_LOADS):
        k = tid + u * ISD_THREADS
        q_vals[u] = iq[k] if k < n_q else float32(0.0)
    # (h, i) of k = tid + u·ISD_THREADS = h·idx_dim + i, stepped without a division per value:
    # numba does integer arithmetic in 64 bits, and a 64-bit division is a ~70-instruction subroutine
    # (ncu: ~7k instructions per warp when this kernel divided per staged value)
    step_h = ISD_THREADS // idx_dim
    step_i = ISD_THREADS - step_h * idx_dim
    h0 = tid // idx_dim
    i0 = tid - h0 * idx_dim
    h = h0
    i = i0
    for u in range(ISD_ROW_LOADS):            # here h counts rows
        c = first + h
        row_vals[u] = icache[c, i] if h < ISD_ROWS and c < n_rows else float32(0.0)
        h, i = _next_pair(h, i, step_h, step_i, idx_dim)
    if tid < n_ihead:
        w_s[tid] = head_w_all[t, tid] * float32(weight_scale)
    h = h0
    i = i0
    for u in range(ISD_Q_LOADS):
        if h < n_ihead:
            iq_t[i * stride + h] = q_vals[u]
        h, i = _next_pair(h, i, step_h, step_i, idx_dim)
    for u in range(ISD_ROW_LOADS):
        k = tid + u * ISD_THREADS
        if k < ISD_ROWS * idx_dim:
            rows[k] = row_vals[u]
    cuda.syncthreads()
    r = tid // ISC_HEADS
    h = tid - r * ISC_HEADS
    if h < n_ihead:
        # dims in order, ISD_UNROLL at a time (idx_dim % ISD_UNROLL == 0, the engine checks): the
        # inner loop over a constant unrolls, and unsigned indices skip numba's negative-index code
        dot = float32(0.0)
        at_row = uint64(r * idx_dim)
        at_q = uint64(h)
        step_q = uint64(stride)
        for _ in range(idx_dim // ISD_UNROLL):
            for j in range(ISD_UNROLL):
                dot += rows[at_row + uint64(j)] * iq_t[at_q + uint64(j) * step_q]
            at_row += uint64(ISD_UNROLL)
            at_q += uint64(ISD_UNROLL) * step_q
        terms[r, h] = dot
    cuda.syncthreads()
    c = first + tid
    if tid < ISD_ROWS and c < n_rows:
        scores_all[t, c] = _heads_total(terms[tid], w_s, n_ihead)


def indexer_score_grid(n_rows: int, n_tok: int) -> tuple:
    """Blocks of indexer_scores_rows for n_rows rows and n_tok tokens."""
    return (n_rows + ISC_ROWS - 1) // ISC_ROWS, (n_tok + ISC_TOKENS - 1) // ISC_TOKENS


@cached_jit()
def indexer_scores_rows(iq_all, head_w_all, weight_scale, icache, pos_buf, n_ihead, idx_dim, n_tok, scores_all):
    """Prefill form: block (ISC_ROWS rows, ISC_TOKENS tokens) of ISC_WARPS warps, a thread per
    ISC_SUB x ISC_SUB (token, row) scores, register-tiled as a matmul: the block stages its rows
    dim-major once for all heads; per head, each warp stages its own ISC_WARP_TOKENS tokens'
    queries dim-major (16-byte loads, a lane per token: conflict-free stores; warps never wait on
    each other), and per dim a thread reads its 4 queries and 4 rows with two 16-byte loads for 16
    FMAs. Each score's dots still run over the dims in order and its heads in order, in the
    expression forms of the decode kernel (dot += q·row, total += w·dot): the same bits. (A thread
    per row with the token's queries broadcast from shared memory, one shared load per FMA, took
    6.46 ms per layer of a 512-token chunk at 14k tokens on the H200, 39 % of the chunk's kernel
    time.) iq_all C-contiguous; idx_dim <= ISC_DIM and a multiple of 8 (the engine checks)."""
    pdl_enter()
    tid = cuda.threadIdx.x
    warp = tid // 32
    lane = tid - 32 * warp
    t0 = cuda.blockIdx.y * ISC_TOKENS
    first = cuda.blockIdx.x * ISC_ROWS
    rows_s = cuda.shared.array(ISC_ROWS_TILE, float32, alignment=ALIGN16)    # [dim][row]
    q_s = cuda.shared.array(ISC_Q_TILE, float32, alignment=ALIGN16)          # [warp][dim][token]
    most = cuda.shared.array(1, int32)
    if tid == 0:                                 # rows the block's last-emitting token sees
        seen = 0
        for tt in range(ISC_TOKENS):
            if t0 + tt < n_tok:
                seen = max(seen, (pos_buf[t0 + tt] + 1) // 4)
        most[0] = seen
    cuda.syncthreads()
    if first >= most[0]:                         # block-uniform
        return
    cap = icache.shape[0]
    for i0 in range(0, idx_dim, ISC_THREADS // ISC_ROWS):   # a thread per row: conflict-free stores
        i = i0 + tid // ISC_ROWS
        r = tid % ISC_ROWS
        c = first + r
        if i < idx_dim:
            rows_s[i * ISC_RS + r] = icache[c, i] if c < cap else float32(0.0)
    cuda.syncthreads()
    tg = lane // (ISC_ROWS // ISC_SUB)           # the warp's tokens 4 tg .. 4 tg + 3
    rg = lane - tg * (ISC_ROWS // ISC_SUB)       # rows 4 rg .. 4 rg + 3
    wt0 = t0 + warp * ISC_WARP_TOKENS            # the warp's first token
    q_w = warp * (ISC_DIM * ISC_QS)
    row_len = iq_all.shape[1]
    st_tok = lane % ISC_WARP_TOKENS              # staging: lane (quad half, token)
    st_t = wt0 + st_tok
    dots = cuda.local.array(ISC_TILE, float32)
    totals = cuda.local.array(ISC_TILE, float64)      # _add_head's f64 sums, rounded once
    w = cuda.local.array(ISC_SUB, float32)
    for k in range(ISC_TILE):
        totals[k] = float64(0.0)
    for h in range(n_ihead):
        _warp_sync()                             # the warp's reads of the previous head are done
        src = st_t * row_len + h * idx_dim
        for q4 in range(lane // ISC_WARP_TOKENS, idx_dim // 4, 32 // ISC_WARP_TOKENS):
            if st_t < n_tok:
                v0, v1, v2, v3 = ld_quad(iq_all, src + 4 * q4)
            else:
                v0 = v1 = v2 = v3 = float32(0.0)
            at = q_w + 4 * q4 * ISC_QS + st_tok
            q_s[at] = v0
            q_s[at + ISC_QS] = v1
            q_s[at + 2 * ISC_QS] = v2
            q_s[at + 3 * ISC_QS] = v3
        for a in range(ISC_SUB):
            t = wt0 + ISC_SUB * tg + a
            w[a] = head_w_all[t, h] * float32(weight_scale) if t < n_tok else float32(0.0)
        _warp_sync()
        for k in range(ISC_TILE):
            dots[k] = float32(0.0)
        at_q = uint32(q_w + ISC_SUB * tg)
        at_row = uint32(ISC_SUB * rg)
        for _ in range(idx_dim):
            q0, q1, q2, q3 = ld_quad(q_s, at_q)
            r0, r1, r2, r3 = ld_quad(rows_s, at_row)
            dots[0] += q0 * r0
            dots[1] += q0 * r1
            dots[2] += q0 * r2
            dots[3] += q0 * r3
            dots[4] += q1 * r0
            dots[5] += q1 * r1
            dots[6] += q1 * r2
            dots[7] += q1 * r3
            dots[8] += q2 * r0
            dots[9] += q2 * r1
            dots[10] += q2 * r2
            dots[11] += q2 * r3
            dots[12] += q3 * r0
            dots[13] += q3 * r1
            dots[14] += q3 * r2
            dots[15] += q3 * r3
            at_q += uint32(ISC_QS)
            at_row += uint32(ISC_RS)
        for a in range(ISC_SUB):                 # this head's terms, in head order
            for b in range(ISC_SUB):
                totals[ISC_SUB * a + b] = _add_head(totals[ISC_SUB * a + b], w[a], dots[ISC_SUB * a + b])
    for a in range(ISC_SUB):
        t = wt0 + ISC_SUB * tg + a
        if t < n_tok:
            n_rows = (pos_buf[t] + 1) // 4
            for b in range(ISC_SUB):
                c = first + ISC_SUB * rg + b
                if c < n_rows:
                    scores_all[t, c] = float32(totals[ISC_SUB * a + b])


@cuda.jit(device=True)
def block_exclusive_scan(value, scratch):
    """Exclusive prefix sum of one int32 per thread over the block, in thread order; also returns
    the block total. All threads call; scratch: shared int32[blockDim]. On the GPU: each warp's
    inclusive scan by shuffles, one barrier for the warp totals (two barriers in all, where a
    log-step scan in shared memory takes two per step); the simulator takes that log-step scan."""
    tid = cuda.threadIdx.x
    if USE_SHUFFLES:
        lane = tid % 32
        warp = tid // 32
        inclusive = value
        for offset in (1, 2, 4, 8, 16):
            lower = cuda.shfl_up_sync(0xFFFFFFFF, inclusive, offset)
            if lane >= offset:
                inclusive += lower
        if lane == 31:
            scratch[warp] = inclusive
        cuda.syncthreads()
        before = 0
        total = 0
        for w in range(cuda.blockDim.x // 32):
            warp_total = scratch[w]
            if w < warp:
                before += warp_total
            total += warp_total
        cuda.syncthreads()                 # scratch free for the caller's next scan
        return before + inclusive - value, total
    scratch[tid] = value
    cuda.syncthreads()
    offset = 1
    while offset < cuda.blockDim.x:
        add = scratch[tid - offset] if tid >= offset else 0
        cuda.syncthreads()
        scratch[tid] += add
        cuda.syncthreads()
        offset *= 2
    inclusive = scratch[tid]
    total = scratch[cuda.blockDim.x - 1]
    cuda.syncthreads()
    return inclusive - value, total


@cuda.jit(device=True)
def order_key(bits):
    """Map float32 bits to a uint32 whose unsigned order is the float order."""
    if bits & np.uint32(0x80000000):
        return ~bits
    return bits | np.uint32(0x80000000)


SELECT_CACHE = 4096      # indexer rows whose keys indexer_select keeps in shared memory (16 KB: 16k context)


@cached_jit()
def indexer_select(score_bits_all, pos_buf, top_k, selected_all, n_selected):
    """The top_k indexer rows by score (ties → lower index), written ascending into `selected`;
    every row when there are at most top_k (§6.10). One BLOCK-thread block per token (grid (1, T))
    on rows [t] of score_bits_all [T, rows] and selected_all [T, top_k], count n_selected[t].

    A radix select of the k-th largest key, 8 bits per pass from the top: a shared histogram of
    the digits of the keys that match the prefix so far, then a block scan of the bins from the
    highest (thread i holds bin 255 - i) finds the bin where the count reaches top_k. It stops
    early once every key of that bin is a winner (a pass or two for real scores, not four). Then
    one block scan places the winners in index order: keys above the prefix, and the first
    `remaining` keys equal to it. (With one thread scanning the 256 bins, four full passes and
    log-step scans this took 35.7 us per launch at 4k context, on the critical path of the 21
    ratio-4 layers: ncu on the H200.)"""
    pdl_enter()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    score_bits = score_bits_all[t]
    selected = selected_all[t]
    n_rows = (pos_buf[t] + 1) // 4
    hist = cuda.shared.array(256, int32)
    scan = cuda.shared.array(BLOCK, int32)
    pick = cuda.shared.array(3, int32)
    keys = cuda.shared.array(SELECT_CACHE, uint32)
    if n_rows <= top_k:
        for c in range(tid, n_rows, cuda.blockDim.x):
            selected[c] = c
        if tid == 0:
            n_selected[t] = n_rows
        return
    cached = n_rows <= SELECT_CACHE
    if cached:
        for c in range(tid, n_rows, cuda.blockDim.x):
            keys[c] = order_key(score_bits[c])
    prefix = np.uint32(0)
    mask = np.uint32(0)
    remaining = int32(top_k)
    for shift in (24, 16, 8, 0):
        hist[tid] = 0                      # BLOCK == 256 bins
        cuda.syncthreads()
        for c in range(tid, n_rows, cuda.blockDim.x):
            key = keys[c] if cached else order_key(score_bits[c])
            if key & mask == prefix:
                cuda.atomic.add(hist, (key >> np.uint32(shift)) & np.uint32(255), 1)
        cuda.syncthreads()
        digit = 255 - tid
        count = hist[digit]
        above, _ = block_exclusive_scan(count, scan)
        if above < remaining and remaining <= above + count:
            pick[0] = digit
            pick[1] = above
            pick[2] = count
        cuda.syncthreads()
        prefix |= np.uint32(pick[0]) << np.uint32(shift)
        mask |= np.uint32(255) << np.uint32(shift)
        remaining -= pick[1]
        if pick[2] == remaining:           # the whole bin gets in: no further digit decides
            break
    # keys whose masked value is above the prefix win; of those equal to it, the first `remaining`
    chunk = (n_rows + cuda.blockDim.x - 1) // cuda.blockDim.x
    first = tid * chunk
    last = min(first + chunk, n_rows)
    n_above = 0
    n_equal = 0
    for c in range(first, last):
        key = (keys[c] if cached else order_key(score_bits[c])) & mask
        if key > prefix:
            n_above += 1
        elif key == prefix:
            n_equal += 1
    above_before, n_above_all = block_exclusive_scan(n_above, scan)
    equal_before, _ = block_exclusive_scan(n_equal, scan)
    out_at = above_before + min(equal_before, remaining)
    equal_rank = equal_before
    for c in range(first, last):
        key = (keys[c] if cached else order_key(score_bits[c])) & mask
        win = key > prefix
        if key == prefix:
            win = equal_rank < remaining
            equal_rank += 1
        if win:
            selected[out_at] = c
            out_at += 1
    if tid == 0:
        n_selected[t] = n_above_all + remaining


# ---- attention (§6.5, §6.6) ---------------------------------------------------------------------------
#
# Decode attention is MQA: all heads read the same K=V rows. attention_partial gives a block a
# group of ATTN_HEADS heads and one range of the visible rows (flash-decoding split); the block
# stages its rows in shared memory one tile at a time and scores every head of its group against
# each staged row, so a row crosses L2 once per head group instead of once per head. Per head it
# keeps the running max, Σexp and Σexp·row across its tiles (online softmax) and writes them as
# the split's partials; attention_combine merges the splits with the sink.
#
# Thread layout of a 256-thread block (8 warps):
#   scores:  warp w owns heads 4*(w//4) .. +3 of the group and tile rows t ≡ w (mod 4); lane l holds
#            q[head, l + 32j] (j < 16) in registers; warp_sum8 reduces 4 heads x 2 rows at once;
#   softmax: warp w is head w of the group, lane l is row l of the tile;
#   sums:    thread i owns heads 4*(i//128) .. +3 at dims i%128 + 128j (j < 4): 16 accumulators.
#
# The hot indices are cast to uint64 where they index: numba wraps negative indices around, and
# that select per access also keeps every address in its own register (spills at 128 registers).

ATTN_HEADS = 8           # heads per attention_partial block (one warp each in the softmax step)
ATTN_THREADS = 256       # attention_partial's block: 32 lanes per head of the group
ATTN_TILE = 32           # rows staged at once (one per lane in the softmax step)
ATTN_SPLITS = 24         # row ranges per head group, in whole tiles: 20 busy at 640 rows. At one f64 block
                         # per SM that is two waves, yet 16 splits (one wave, <= 2 tiles a block) decoded
                         # 0.7 % slower at 2k and 1.4 % at 8k (H100, ab_bench, session 34)
ATTN_MAX_DIM = 512       # largest head_dim: 16 dims per lane when scoring, 4 per thread when summing
ATTN_LANE_DIMS = ATTN_MAX_DIM // 32
ATTN_Q_REGS = 4 * ATTN_LANE_DIMS   # q values a lane holds: 4 heads x ATTN_LANE_DIMS dims
ATTN_MAX_ROWS = 32768    # rows per head the engine allows; correct beyond (tile loop), but slow
COMBINE_THREADS = 128    # attention_combine: one (head, 256 dims) per block, two dims per thread
# attention_partial's launch bounds (_attention_partial_kernel): in f64 (the CPU twin's numerics)
# it needs 245 registers, so one block per SM; capped at 128 for two it spilled 904 bytes (ptxas,
# scripts/check_cuda_compile.py --ptxas); in f32 two blocks per SM, 168 bytes spilled; in f64 on
# the tensor cores two blocks per SM, 128 registers, no spills. The simulator's jit takes no
# launch bounds.


@cuda.jit(device=True)
def lane_swap(value, offset, scratch):
    """The value of lane (lane ^ offset) in the same warp: a shuffle on the GPU, an exchange through
    shared memory in the simulator (where every thread of the block must make the same calls)."""
    if USE_SHUFFLES:
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
    tid = cuda.threadIdx.x
    scratch[tid] = value
    cuda.syncthreads()
    other = scratch[tid ^ offset]
    cuda.syncthreads()
    return other


@cuda.jit(device=True)
def lanes_max(value, scratch):
    """Max over the 32 lanes of a warp; every lane gets it."""
    for offset in (16, 8, 4, 2, 1):
        value = max(value, lane_swap(value, offset, scratch))
    return value


@cuda.jit(device=True)
def lanes_sum(value, scratch):
    """Sum over the 32 lanes of a warp; every lane gets the same bits (a+b == b+a)."""
    for offset in (16, 8, 4, 2, 1):
        value += lane_swap(value, offset, scratch)
    return value


@cuda.jit(device=True)
def warp_sum8(v, scratch):
    """Sums over the 32 lanes of eight values v[0..7] at once, in 9 exchanges instead of 8 x 5:
    in each of the first three halving steps a lane keeps half of its values and sends the partner
    the other half (the half the partner keeps). Lane l ends with the total of v[(l >> 2) & 7]."""
    lane = cuda.threadIdx.x % 32
    hi = (lane & 16) != 0                       # keep v[4..7] (else v[0..3])
    a0 = (v[4] if hi else v[0]) + lane_swap(v[0] if hi else v[4], 16, scratch)
    a1 = (v[5] if hi else v[1]) + lane_swap(v[1] if hi else v[5], 16, scratch)
    a2 = (v[6] if hi else v[2]) + lane_swap(v[2] if hi else v[6], 16, scratch)
    a3 = (v[7] if hi else v[3]) + lane_swap(v[3] if hi else v[7], 16, scratch)
    hi = (lane & 8) != 0                        # keep a2, a3 (else a0, a1)
    b0 = (a2 if hi else a0) + lane_swap(a0 if hi else a2, 8, scratch)
    b1 = (a3 if hi else a1) + lane_swap(a1 if hi else a3, 8, scratch)
    hi = (lane & 4) != 0                        # keep b1 (else b0)
    c = (b1 if hi else b0) + lane_swap(b0 if hi else b1, 4, scratch)
    c += lane_swap(c, 2, scratch)
    c += lane_swap(c, 1, scratch)
    return c


@cuda.jit(device=True)
def visible_rows(pos, n_swa, ratio, use_selected, n_selected):
    """§6.5: the raw window (rows 0 .. n_raw-1, positions first_raw ..) then the compressed rows
    (all emitted ones, or the indexer's n_selected). Returns (n_raw, first_raw, n_rows)."""
    n_raw = min(pos + 1, n_swa)
    n_comp = (pos + 1) // ratio if ratio > 0 else 0
    if use_selected:
        n_comp = n_selected
    return n_raw, pos + 1 - n_raw, n_raw + n_comp


@cuda.jit(device=True)
def row_source(r, n_raw, first_raw, cap, selected, use_selected):
    """Where visible row r lives (§6.5): (True, ring slot) for the raw window rows, which come first,
    else (False, compressed row), all of them in order or the indexer's selected ones."""
    if r < n_raw:
        return True, (first_raw + r) % cap
    if use_selected:
        return False, int64(selected[r - n_raw])
    return False, r - n_raw


@cuda.jit(device=True)
def stage_tile(rows, tile_begin, n_tile, n_raw, first_raw, raw_cache, comp_cache, selected,
               use_selected, head_dim):
    """Copy visible rows tile_begin .. +n_tile into the f16 tile (exact: the caches hold f16-rounded
    values, §6.4/§6.8). Warp w copies tile rows w, w+8, w+16, w+24, two per round; lanes read
    consecutive dims. Slots past n_tile repeat the last row and dims past head_dim repeat the last
    dim, so every slot holds finite values and the loads carry no condition (they issue back to
    back): the later steps use the padding with weight 0 and never write it out."""
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    cap = raw_cache.shape[0]
    for i in range(ATTN_TILE // 16):
        t0 = warp + 16 * i
        raw0, src0 = row_source(tile_begin + min(t0, n_tile - 1), n_raw, first_raw, cap, selected,
                                use_selected)
        raw1, src1 = row_source(tile_begin + min(t0 + 8, n_tile - 1), n_raw, first_raw, cap, selected,
                                use_selected)
        row0 = raw_cache[src0] if raw0 else comp_cache[src0]
        row1 = raw_cache[src1] if raw1 else comp_cache[src1]
        for j in range(ATTN_LANE_DIMS):
            d = min(lane + 32 * j, head_dim - 1)
            rows[uint64(t0), uint64(lane + 32 * j)] = float16(row0[uint64(d)])
            rows[uint64(t0 + 8), uint64(lane + 32 * j)] = float16(row1[uint64(d)])


@cuda.jit(device=True)
def load_q(q, group, head_dim, q_reg):
    """q of the warp's 4 scoring heads at the lane's dims (0 past head_dim and for heads past the
    last). Reloaded every tile (from L1) rather than kept live across the staging, whose loads in
    flight need the registers."""
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    n_head = q.shape[0] // head_dim
    head0 = group * ATTN_HEADS + 4 * (warp // 4)
    for hh in range(4):
        base = min(head0 + hh, n_head - 1) * head_dim
        for j in range(ATTN_LANE_DIMS):
            d = lane + 32 * j
            value = q[uint64(base + min(d, head_dim - 1))]
            q_reg[hh * ATTN_LANE_DIMS + j] = value if d < head_dim else float32(0.0)


@cuda.jit(device=True)
def store_acc(acc, part_acc, group, split, head_dim):
    """Write this thread's 16 sums (4 heads x 4 dims) to part_acc[:, split]."""
    n_head = part_acc.shape[0]
    head0 = group * ATTN_HEADS + 4 * (cuda.threadIdx.x // 128)
    for hh in range(4):
        if head0 + hh < n_head:
            out = part_acc[head0 + hh, split]
            for j in range(4):
                d = cuda.threadIdx.x % 128 + 128 * j
                if d < head_dim:
                    out[uint64(d)] = acc[4 * hh + j]


def _attention_partial_kernel(FT, TC=False):
    """attention_partial with its scores, softmax and sums in FT: float64, the CPU twin's numerics
    (the scores are f64 sums of exact products, so the engines differ by ~1e-16 before the one
    rounding in attention_combine), or float32 for GPUs whose f64 runs at 1/32-1/64 of f32
    (every GeForce and workstation card: there f64 scores cost ~2.8 ms a token at 640 rows;
    io/detect.decode_attention chooses). The combine reads either partials in f64.

    TC (float64 only): the scores and the sums on the f64 tensor cores (mma.m8n8k4, A 8 x 4 by
    B 4 x 8, the 8 rows the group's heads). The CUDA-core kernel converts every row value to f64
    four times a tile (twice in the scores, once per half of the heads; twice in the sums, once
    per quad) at 16 conversions a clock per SM, as many cycles as its DFMAs; here each value is
    converted once per phase and the products run at the tensor cores' rate. The sums meet in
    another order (each mma adds 4 products; the 8 warps' partial scores meet in a fixed tree):
    the same values to ~1e-16, as the CPU twin's."""
    assert FT == float64 or not TC
    blocks_per_sm = 1 if FT == float64 and not TC else 2       # see the launch bounds comment above
    jit_options = {} if numba_config.ENABLE_CUDASIM else {"launch_bounds": (ATTN_THREADS, blocks_per_sm)}
    # TC: the staged rows padded by 8 halves (16 bytes) and the score rows by one value, so that the
    # fragments' shared loads are free of bank conflicts; scratch holds the warps' partial scores
    ROWS_SHAPE = (ATTN_TILE, ATTN_MAX_DIM + 8) if TC else (ATTN_TILE, ATTN_MAX_DIM)
    SCORES_SHAPE = (ATTN_HEADS, ATTN_TILE + 1) if TC else (ATTN_HEADS, ATTN_TILE)
    SCRATCH_SIZE = 4 * 32 * 8 if TC else ATTN_THREADS     # TC: also the tree of partial scores

    @cuda.jit(device=True)
    def score_tile(rows, q, group, head_dim, inv_sqrt, scores, scratch):
        """scores[h, t] = q_h · row_t / sqrt(head_dim) for the group's 8 heads and the 32 tile slots
        (layout in the section comment; padded slots get scores the softmax ignores). Warp w takes
        slots w%4 + 8i and w%4 + 8i + 4 per round, so one warp_sum8 reduces 4 heads x 2 rows. In f64
        the dots are sums of exact products (f32 q times f16 rows), as the CPU twin's
        (cpu_ops.sink_attention): the two engines' scores then differ by ~1e-16, not by f32 roundings."""
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        q_reg = cuda.local.array(ATTN_Q_REGS, float32)
        load_q(q, group, head_dim, q_reg)
        part = cuda.local.array(8, FT)
        for i in range(ATTN_TILE // 8):
            t0 = warp % 4 + 8 * i
            for k in range(8):
                part[k] = FT(0.0)
            for j in range(ATTN_LANE_DIMS):
                x0 = FT(rows[uint64(t0), uint64(lane + 32 * j)])
                x1 = FT(rows[uint64(t0 + 4), uint64(lane + 32 * j)])
                for hh in range(4):
                    qv = FT(q_reg[hh * ATTN_LANE_DIMS + j])
                    part[hh] += qv * x0
                    part[4 + hh] += qv * x1
            total = warp_sum8(part, scratch)
            if lane % 4 == 0:       # lane holds value (lane >> 2) & 7: row (lane >> 4), head (lane >> 2) & 3
                scores[4 * (warp // 4) + (lane >> 2) % 4, t0 + 4 * (lane >> 4)] = total * inv_sqrt

    @cuda.jit(device=True)
    def softmax_tile(scores, n_tile, m_run, den_run, rescale, scratch):
        """Online softmax step of head `warp` of the group over the tile (lane = row): returns the new
        running max and Σexp; scores[head, :] becomes the rows' exp weights (0 on padded slots) and
        rescale[head] the factor for the sums so far."""
        head = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        s = scores[head, lane] if lane < n_tile else FT(NEG_INF)
        m_new = max(m_run, lanes_max(s, scratch))
        e = math.exp(s - m_new) if lane < n_tile else FT(0.0)
        scale = math.exp(m_run - m_new)
        den_new = den_run * scale + lanes_sum(e, scratch)
        scores[head, lane] = e
        if lane == 0:
            rescale[head] = scale
        return m_new, den_new

    @cuda.jit(device=True)
    def accumulate_tile(rows, weights, rescale, first, part_acc, group, split, head_dim):
        """part_acc[h, split, d] = previous value·rescale[h] + Σ_t weight[h, t]·row_t[d] for this
        thread's 4 heads x 4 dims, over all 32 slots (padded slots: weight 0, finite values). Between
        tiles the sums wait in part_acc (each thread reads back its own writes), so no registers stay
        live through the staging and scoring of the next tile."""
        n_head = part_acc.shape[0]
        quad = cuda.threadIdx.x // 128
        dim0 = cuda.threadIdx.x % 128
        head0 = group * ATTN_HEADS + 4 * quad
        acc = cuda.local.array(16, FT)
        for hh in range(4):
            out = part_acc[min(head0 + hh, n_head - 1), split]
            for j in range(4):
                d = dim0 + 128 * j
                acc[4 * hh + j] = FT(0.0)
                if not first and head0 + hh < n_head and d < head_dim:
                    acc[4 * hh + j] = out[uint64(d)] * rescale[4 * quad + hh]
        x = cuda.local.array(4, FT)
        for t in range(ATTN_TILE):
            for j in range(4):
                x[j] = FT(rows[uint64(t), uint64(dim0 + 128 * j)])
            for hh in range(4):
                w = weights[uint64(4 * quad + hh), uint64(t)]
                for j in range(4):
                    acc[4 * hh + j] += w * x[j]
        store_acc(acc, part_acc, group, split, head_dim)

    @cuda.jit(device=True)
    def load_q_frag(q, group, head_dim, q_frag):
        """TC: the scores' A fragments of this lane: q of head 8 group + lane / 4 at
        dims 64 w + 4 s + lane % 4 (s < 16; warp w takes dims 64 w .. 64 w + 63), in f64; 0 past the
        last head and past head_dim."""
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        n_head = q.shape[0] // head_dim
        head = group * ATTN_HEADS + (lane >> 2)
        for s in range(16):
            d = 64 * warp + 4 * s + (lane & 3)
            q_frag[s] = float64(0.0)
            if head < n_head and d < head_dim:
                q_frag[s] = float64(q[uint64(head * head_dim + d)])

    @cuda.jit(device=True)
    def score_tile_tc(rows, q, group, head_dim, inv_sqrt, scores, partial):
        """TC: scores[h, t] = q_h · row_t / sqrt(head_dim) (score_tile's arguments; `partial` is its
        scratch). Warp w: its 64 dims in 16 mma k-steps for
        each block of 8 slots (B = the rows' values: column = slot 8 rb + lane / 4, k = dim); lane
        (g, c) = (lane / 4, lane % 4) then holds head g at slots 8 rb + 2 c, + 1. The 8 warps' partial
        dots meet in a fixed tree through `partial` (w + 4, then w + 2, then w + 1 into w; [4, 32, 8]
        flat)."""
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g = lane >> 2
        c = lane & 3
        q_frag = cuda.local.array(16, float64)
        load_q_frag(q, group, head_dim, q_frag)
        acc = cuda.local.array(8, float64)
        for k in range(8):
            acc[k] = float64(0.0)
        for rb in range(ATTN_TILE // 8):
            for s in range(16):
                b = float64(rows[uint64(8 * rb + g), uint64(64 * warp + 4 * s + c)])
                acc[2 * rb], acc[2 * rb + 1] = mma_f64_acc(q_frag[s], b, acc[2 * rb], acc[2 * rb + 1])
        for half in (4, 2, 1):
            if half <= warp < 2 * half:
                for k in range(8):
                    partial[uint64(256 * (warp - half) + 8 * lane + k)] = acc[k]
            cuda.syncthreads()
            if warp < half:
                for k in range(8):
                    acc[k] += partial[uint64(256 * warp + 8 * lane + k)]
            cuda.syncthreads()
        if warp == 0:
            for rb in range(ATTN_TILE // 8):
                for i in range(2):
                    scores[g, 8 * rb + 2 * c + i] = acc[2 * rb + i] * inv_sqrt

    @cuda.jit(device=True)
    def store_acc_tc(acc, part_acc, group, split, head_dim):
        """TC: this lane's 16 sums (head 8 group + lane / 4 at dims 64 w + 8 nb + 2 (lane % 4), + 1)
        into part_acc[:, split]."""
        n_head = part_acc.shape[0]
        lane = cuda.threadIdx.x % 32
        head = group * ATTN_HEADS + (lane >> 2)
        if head < n_head:
            out = part_acc[head, split]
            for nb in range(8):
                for i in range(2):
                    d = 64 * (cuda.threadIdx.x // 32) + 8 * nb + 2 * (lane & 3) + i
                    if d < head_dim:
                        out[uint64(d)] = acc[2 * nb + i]

    @cuda.jit(device=True)
    def accumulate_tile_tc(rows, weights, rescale, first, part_acc, group, split, head_dim):
        """TC: part_acc[h, split, d] = previous value·rescale[h] + Σ_t weight[h, t]·row_t[d]. Warp w:
        its 64 dims as 8 column blocks, each over the 32 slots in 8 mma k-steps (A = the weights,
        rows = heads, k = slot; B = the rows' values, column = dim)."""
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g = lane >> 2
        c = lane & 3
        n_head = part_acc.shape[0]
        head = group * ATTN_HEADS + g
        out = part_acc[min(head, n_head - 1), split]
        acc = cuda.local.array(16, float64)
        for nb in range(8):
            for i in range(2):
                d = 64 * warp + 8 * nb + 2 * c + i
                acc[2 * nb + i] = float64(0.0)
                if not first and head < n_head and d < head_dim:
                    acc[2 * nb + i] = out[uint64(d)] * rescale[g]
        for ks in range(ATTN_TILE // 4):
            a = weights[uint64(g), uint64(4 * ks + c)]
            for nb in range(8):
                b = float64(rows[uint64(4 * ks + c), uint64(64 * warp + 8 * nb + g)])
                acc[2 * nb], acc[2 * nb + 1] = mma_f64_acc(a, b, acc[2 * nb], acc[2 * nb + 1])
        store_acc_tc(acc, part_acc, group, split, head_dim)

    score = score_tile_tc if TC else score_tile
    accumulate = accumulate_tile_tc if TC else accumulate_tile
    store_partial = store_acc_tc if TC else store_acc

    @cuda.jit(device=True)
    def attend_tiles(q, raw_cache, comp_cache, selected, use_selected, group, split, begin, end, n_raw,
                     first_raw, head_dim, part_acc, rows, scores, rescale, scratch):
        """The group's heads over visible rows begin .. end-1, tile by tile, with an online softmax:
        writes Σexp·row into part_acc and returns the max and Σexp of head `warp` of the group."""
        m_run = FT(NEG_INF)
        den_run = FT(0.0)
        inv_sqrt = FT(float32(1.0 / math.sqrt(head_dim)))     # the CPU engine's f32 attn_scale
        for tile_begin in range(begin, end, ATTN_TILE):
            n_tile = min(ATTN_TILE, end - tile_begin)
            stage_tile(rows, tile_begin, n_tile, n_raw, first_raw, raw_cache, comp_cache, selected,
                       use_selected, head_dim)
            cuda.syncthreads()
            score(rows, q, group, head_dim, inv_sqrt, scores, scratch)
            cuda.syncthreads()
            m_run, den_run = softmax_tile(scores, n_tile, m_run, den_run, rescale, scratch)
            cuda.syncthreads()
            accumulate(rows, scores, rescale, tile_begin == begin, part_acc, group, split, head_dim)
            cuda.syncthreads()
        return m_run, den_run

    @cuda.jit(device=True)
    def attention_range(q_all, raw_cache, comp_cache, selected_all, n_selected, pos_buf, n_swa, ratio,
                        use_selected, head_dim, part_max_all, part_den_all, part_acc_all, rows, scores,
                        rescale, scratch):
        """attention_partial's work for block (group, split, token), in the shared arrays it is given."""
        tid = cuda.threadIdx.x
        warp = tid // 32
        group = cuda.blockIdx.x
        split = cuda.blockIdx.y
        t = cuda.blockIdx.z
        q = q_all[t]
        selected = selected_all[t]
        part_max = part_max_all[t]
        part_den = part_den_all[t]
        part_acc = part_acc_all[t]
        n_raw, first_raw, n_rows = visible_rows(pos_buf[t], n_swa, ratio, use_selected, n_selected[t])
        n_tiles = (n_rows + ATTN_TILE - 1) // ATTN_TILE
        tiles_per_split = (n_tiles + cuda.gridDim.y - 1) // cuda.gridDim.y
        begin = min(split * tiles_per_split * ATTN_TILE, n_rows)
        end = min(begin + tiles_per_split * ATTN_TILE, n_rows)
        if head_dim == ATTN_MAX_DIM:
            # the model's heads: a copy of the tile loop where head_dim is a constant, so the padding
            # clamps fold away and each row's loads are constant offsets from one address
            m_run, den_run = attend_tiles(q, raw_cache, comp_cache, selected, use_selected, group, split,
                                          begin, end, n_raw, first_raw, ATTN_MAX_DIM, part_acc, rows,
                                          scores, rescale, scratch)
        else:
            m_run, den_run = attend_tiles(q, raw_cache, comp_cache, selected, use_selected, group, split,
                                          begin, end, n_raw, first_raw, head_dim, part_acc, rows,
                                          scores, rescale, scratch)
        n_head = part_max.shape[0]
        head = group * ATTN_HEADS + warp
        if tid % 32 == 0 and head < n_head:
            part_max[head, split] = m_run
            part_den[head, split] = den_run
        if begin == end:                   # empty range: neutral sums too
            zeros = cuda.local.array(16, FT)
            for k in range(16):
                zeros[k] = FT(0.0)
            store_partial(zeros, part_acc, group, split, head_dim)

    @cached_jit(**jit_options)
    def attention_partial(q_all, raw_cache, comp_cache, selected_all, n_selected, pos_buf, n_swa, ratio,
                          use_selected, head_dim, part_max_all, part_den_all, part_acc_all):
        """Sink attention, first half: block (group, split) takes heads group*8 .. +7 and one range of
        whole tiles of the visible rows (§6.5) and writes, per head, the range's max score, Σexp and
        Σexp·row (scores, softmax and sums in FT, rounded once in attention_combine). A block whose
        range is empty (short context) writes neutral partials (max NEG_INF, Σ 0, acc 0). Launch with
        ATTN_THREADS threads, grid (n_head // ATTN_HEADS, n_splits, T); head_dim <= ATTN_MAX_DIM.
        Token t = blockIdx.z: q_all [T, q_dim], selected_all [T, top_k], n_selected [T], partials
        [T, n_head, n_splits(, head_dim)] in FT; it sees the rows visible at pos_buf[t] (the raw ring
        must hold the chunk's rows without overwriting the window)."""
        pdl_enter()
        rows = cuda.shared.array(ROWS_SHAPE, float16)        # the staged tile
        scores = cuda.shared.array(SCORES_SHAPE, FT)         # then the exp weights
        rescale = cuda.shared.array(ATTN_HEADS, FT)
        scratch = cuda.shared.array(SCRATCH_SIZE, FT)        # lane_swap in the simulator (and TC's tree)
        attention_range(q_all, raw_cache, comp_cache, selected_all, n_selected, pos_buf, n_swa, ratio,
                        use_selected, head_dim, part_max_all, part_den_all, part_acc_all, rows, scores,
                        rescale, scratch)

    return attention_partial


attention_partial = _attention_partial_kernel(float64)        # the default: the CPU twin's numerics
attention_partial_f32 = _attention_partial_kernel(float32)    # GPUs without full-rate f64 (--attention)
attention_partial_tc = _attention_partial_kernel(float64, TC=True)    # f64 on the tensor cores: ATTN_TC
ATTN_TC = True   # f64 decode attention on the tensor cores (mma.m8n8k4.f64: every GPU the engine runs
                 # on, compute capability 8.0 on; H200, flash at 2k: decode_ab 7.211 / 7.221 ms per
                 # step against 7.335 / 7.354 on the CUDA cores, the same logits)
DECODE_ATTENTION_KERNELS = ("attention_partial", "attention_partial_tc", "attention_partial_f32")


def decode_attention_name(f64: bool) -> str:
    """The decode attention kernel (its name here) for --attention's arithmetic: f32, or f64 on
    the tensor cores unless ATTN_TC is off."""
    if not f64:
        return "attention_partial_f32"
    return "attention_partial_tc" if ATTN_TC else "attention_partial"


def decode_attention_kernel(f64: bool):
    return globals()[decode_attention_name(f64)]


# ---- prefill attention on the tensor cores -------------------------------------------------------
#
# attention_prefill_mma computes what attention_partial computes with one split, for head_dim 512,
# with mma.sync m16n8k16 (f16 in, f32 accumulate). Block = (16 heads, token): M = the 16 heads.
# The visible rows are exact in f16; q and the softmax weights p are f32, so each is split as
# hi + lo f16 (split_f16x2) and multiplied twice (S = q_hi·K + q_lo·K, acc += p_hi·V + p_lo·V):
# ~22 bits, like the f32 FMA kernel, not the same bits.
#
# 4 warps; warp w owns dims 128w .. 128w+127: its q fragments (hi and lo, 64 words) stay in
# registers for the whole block, and so do its 16 x 128 output sums (16 n-fragments x 4 f32).
# Per tile of ATTN_MMA_TILE rows:
#   stage: the rows as f16, 4 dims to a 64-bit word, row stride ATTN_MMA_WORDS words (264 32-bit
#          words: conflict-free 64-bit loads per half-warp below);
#   S:     warp w's partial S over its dims: per k-step of 16 dims one 64-bit load gives b0 and b1.
#          The k order inside a step is permuted (logical k 2c, 2c+1 / 2c+8, 2c+9 = dims 4c .. 4c+3)
#          and q's fragments use the same order, so the dot is unchanged. Column n of S fragment f
#          is tile row 8f + mma_row_perm(n) (a permutation that keeps the P·V loads below free of
#          bank conflicts);
#   sum:   the 4 partials through shared memory, added in warp order by every warp, so all warps
#          hold the same S bits (and the same max, weights and Σexp);
#   softmax in registers: S's C fragments (head g / g+8, two columns) are P's A fragments; the
#          max per head over the quad's lanes (shuffles xor 1, 2);
#   P·V:   B = rows x dims: for a lane, dims 4j .. 4j+3 of two rows are two 64-bit words, and byte
#          permutes give the b0 of four n-fragments at once (fragment q of group m: column n is
#          dim 4(32w + 8m + n) + q), so lane (g, c) holds dims 128w + 32m + 8c + q (c0) and + 4 (c1).
# Three barriers per tile; the first staging round of the next tile is in flight during P·V.
# Padded slots of the last tile repeat the last row (finite) and get weight 0.

ATTN_PREFILL_MMA = True      # the engine's prefill (T > 1, head_dim 512) takes attention_prefill_mma
ATTN_MMA_HEADS = 16          # heads per block (the MMA's M)
ATTN_MMA_WARPS = 4
ATTN_MMA_THREADS = 32 * ATTN_MMA_WARPS
ATTN_MMA_DIM = 512           # the one head_dim it handles (128 dims per warp)
ATTN_MMA_TILE = 32           # rows per tile (a multiple of 16)
ATTN_MMA_NF = ATTN_MMA_TILE // 8       # S n-fragments per tile
ATTN_MMA_KK = ATTN_MMA_TILE // 16      # P·V k-steps per tile
ATTN_MMA_WORDS = ATTN_MMA_DIM // 4 + 4  # 64-bit words per staged row, 4 of them padding
ATTN_MMA_S = 4 * ATTN_MMA_NF          # S values a thread holds (4 per fragment)
ATTN_MMA_SRED = ATTN_MMA_WARPS * ATTN_MMA_S * 32
# <= 255 registers for two blocks per SM (shared memory: 41 KB per block)
ATTN_MMA_JIT = {} if numba_config.ENABLE_CUDASIM else {"launch_bounds": (ATTN_MMA_THREADS, 2)}


@cuda.jit(device=True)
def mma_row_perm(n):
    """The tile row (within its 8) of column n of an S fragment: n for n < 4, n ^ 1 above. The P·V
    loads of a half-warp then hit rows of 4 different residues mod 4: distinct banks."""
    return n ^ ((n >> 2) & 1)


@cuda.jit(device=True)
def mma_row_source(v, n_raw, raw_base, cap, selected, use_selected):
    """row_source without branches (so that a group of rows' loads can issue together): (True,
    ring slot) for visible row v < n_raw, else (False, compressed row). raw_base = first_raw % cap
    (v < n_raw <= cap); the selection is read at a clamped index either way."""
    slot = raw_base + v
    if slot >= cap:
        slot -= cap
    k = v - n_raw
    chosen = int64(selected[uint64(min(max(k, 0), selected.shape[0] - 1))])
    comp_row = chosen if use_selected else k
    raw = v < n_raw
    return raw, slot if raw else comp_row


ATTN_MMA_GROUP = 4                          # rows a warp loads at once when staging (64 loads in flight)
ATTN_MMA_GROUP_VALS = ATTN_MMA_GROUP * ATTN_MMA_DIM // 32
ATTN_MMA_ROUNDS = ATTN_MMA_TILE // (ATTN_MMA_WARPS * ATTN_MMA_GROUP)


@cuda.jit(device=True)
def tile_sources_mma(src_at, src_raw, tile_begin, n_tile, n_raw, raw_base, cap, selected, use_selected):
    """Warp 0: lane r finds where tile row r lives (slots past n_tile repeat the last row) and
    writes its first element's flat index in its cache and whether that is the raw ring."""
    if cuda.threadIdx.x < ATTN_MMA_TILE:
        r = cuda.threadIdx.x
        raw, src = mma_row_source(tile_begin + min(r, n_tile - 1), n_raw, raw_base, cap, selected,
                                  use_selected)
        src_at[uint64(r)] = src * ATTN_MMA_DIM
        src_raw[uint64(r)] = 1 if raw else 0


@cuda.jit(device=True)
def load_round_mma(vals, h, src_at, src_raw, raw_cache, comp_cache):
    """Round h of staging a tile: this thread's values of tile rows w + 4(4h + i), i < 4 (warp w),
    words l + 32j (lane l), into vals (registers): 16 loads of 16 bytes, from the rows' sources
    (tile_sources_mma)."""
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    for i in range(ATTN_MMA_GROUP):
        r = uint64(warp + ATTN_MMA_WARPS * (ATTN_MMA_GROUP * h + i))
        at = uint64(src_at[r] + 4 * lane)
        raw = src_raw[r] != 0
        for j in range(ATTN_MMA_DIM // 128):
            v = 16 * i + 4 * j
            vals[v], vals[v + 1], vals[v + 2], vals[v + 3] = ld_f32x4_pick(
                raw_cache, comp_cache, raw, at + uint64(128 * j))


@cuda.jit(device=True)
def store_round_mma(tile, vals, h):
    """Round h's values (load_round_mma) as f16 (exact), 4 dims per 64-bit word of the tile."""
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    for i in range(ATTN_MMA_GROUP):
        r = warp + ATTN_MMA_WARPS * (ATTN_MMA_GROUP * h + i)
        for j in range(ATTN_MMA_DIM // 128):
            v = 16 * i + 4 * j
            lo = pack_f16x2(vals[v], vals[v + 1])
            hi = pack_f16x2(vals[v + 2], vals[v + 3])
            tile[uint64(r), uint64(lane + 32 * j)] = uint64(lo) | (uint64(hi) << uint64(32))


@cuda.jit(device=True)
def lo_word(w):
    return uint32(w & uint64(0xFFFFFFFF))


@cuda.jit(device=True)
def hi_word(w):
    return uint32(w >> uint64(32))


def _attention_prefill_mma_kernel(PREFETCH):
    """attention_prefill_mma; PREFETCH: the next tile's first staging round is loaded during this
    tile's P·V (255 registers, 8 bytes spilled outside the tile loop), else at the tile's start
    with the others (240 registers, no spill)."""

    @cached_jit(**ATTN_MMA_JIT)
    def attention_prefill_mma(q_all, raw_cache, comp_cache, selected_all, n_selected, pos_buf, n_swa, ratio,
                              use_selected, part_max_all, part_den_all, part_acc_all):
        """attention_partial's partials with one split (part_max/part_den [T, n_head, 1], part_acc
        [T, n_head, 1, 512]) on the tensor cores, head_dim 512 only (layout in the section comment).
        Grid (n_head // ATTN_MMA_HEADS, 1, T), ATTN_MMA_THREADS threads; n_head % 16 == 0. A token with
        no visible rows gets neutral partials (max NEG_INF, Σ 0, acc 0)."""
        pdl_enter()
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g = lane >> 2
        tig = lane & 3
        head0 = cuda.blockIdx.x * ATTN_MMA_HEADS
        t = cuda.blockIdx.z
        n_raw, first_raw, n_rows = visible_rows(pos_buf[t], n_swa, ratio, use_selected, n_selected[t])
        selected = selected_all[t]
        tile = cuda.shared.array((ATTN_MMA_TILE, ATTN_MMA_WORDS), uint64)
        sred = cuda.shared.array(ATTN_MMA_SRED, float32)
        scratch = cuda.shared.array(ATTN_MMA_THREADS, float32)    # lane_swap in the simulator only
        # q's A fragments, hi and lo: a0/a1 heads g/g+8 at logical k 2c, 2c+1 (dims 4c, 4c+1 of the
        # step), a2/a3 at k 2c+8, 2c+9 (dims 4c+2, 4c+3)
        qh = cuda.local.array(32, uint32)
        ql = cuda.local.array(32, uint32)
        for ks in range(8):
            d = 128 * warp + 16 * ks + 4 * tig
            for hh in range(2):
                base = uint64(t * q_all.shape[1] + (head0 + g + 8 * hh) * ATTN_MMA_DIM + d)
                x0, x1, x2, x3 = ld_f32x4_pick(q_all, q_all, True, base)
                h01, l01 = split_f16x2(x0, x1)
                h23, l23 = split_f16x2(x2, x3)
                qh[4 * ks + hh] = h01
                ql[4 * ks + hh] = l01
                qh[4 * ks + 2 + hh] = h23
                ql[4 * ks + 2 + hh] = l23
        acc = cuda.local.array(64, float32)
        for i in range(64):
            acc[i] = float32(0.0)
        s = cuda.local.array(ATTN_MMA_S, float32)
        m_run = cuda.local.array(2, float32)
        den = cuda.local.array(2, float32)
        for hh in range(2):
            m_run[hh] = float32(NEG_INF)
            den[hh] = float32(0.0)
        inv_sqrt = float32(1.0 / math.sqrt(ATTN_MMA_DIM))
        # this lane's S rows (tile rows of its C columns 2c, 2c+1 in fragment 0) and its P·V B rows
        row_a = mma_row_perm(2 * tig)
        row_b = mma_row_perm(2 * tig + 1)
        raw_base = first_raw % raw_cache.shape[0]
        # the tile's rows as f16 in shared memory (stage rounds of 4 rows per warp). Warp 0 finds the
        # next tile's row sources during this tile's S (read after the S barrier); round 0 of the next
        # tile is loaded into registers before this tile's P·V, whose MMAs hide its latency, and stored
        # after it; the other rounds load and store between the barriers.
        src_at = cuda.shared.array(ATTN_MMA_TILE, int64)
        src_raw = cuda.shared.array(ATTN_MMA_TILE, int32)
        cap = raw_cache.shape[0]
        tile_sources_mma(src_at, src_raw, 0, min(ATTN_MMA_TILE, n_rows), n_raw, raw_base, cap, selected,
                         use_selected)
        cuda.syncthreads()
        vals = cuda.local.array(ATTN_MMA_GROUP_VALS, float32)
        if PREFETCH and n_rows > 0:
            load_round_mma(vals, 0, src_at, src_raw, raw_cache, comp_cache)
        for tile_begin in range(0, n_rows, ATTN_MMA_TILE):
            n_tile = min(ATTN_MMA_TILE, n_rows - tile_begin)
            next_begin = tile_begin + ATTN_MMA_TILE
            if not PREFETCH:
                load_round_mma(vals, 0, src_at, src_raw, raw_cache, comp_cache)
            store_round_mma(tile, vals, 0)
            for h in range(1, ATTN_MMA_ROUNDS):
                load_round_mma(vals, h, src_at, src_raw, raw_cache, comp_cache)
                store_round_mma(tile, vals, h)
            cuda.syncthreads()
            if next_begin < n_rows:
                tile_sources_mma(src_at, src_raw, next_begin, min(ATTN_MMA_TILE, n_rows - next_begin), n_raw,
                                 raw_base, cap, selected, use_selected)
            for i in range(4 * ATTN_MMA_NF):
                s[i] = float32(0.0)
            krow = mma_row_perm(g)
            for ks in range(8):
                for nf in range(ATTN_MMA_NF):
                    w = tile[uint64(8 * nf + krow), uint64(32 * warp + 4 * ks + tig)]
                    b0 = lo_word(w)
                    b1 = hi_word(w)
                    c0, c1, c2, c3 = mma_f16_acc(qh[4 * ks], qh[4 * ks + 1], qh[4 * ks + 2], qh[4 * ks + 3],
                                                 b0, b1, s[4 * nf], s[4 * nf + 1], s[4 * nf + 2], s[4 * nf + 3])
                    c0, c1, c2, c3 = mma_f16_acc(ql[4 * ks], ql[4 * ks + 1], ql[4 * ks + 2], ql[4 * ks + 3],
                                                 b0, b1, c0, c1, c2, c3)
                    s[4 * nf] = c0
                    s[4 * nf + 1] = c1
                    s[4 * nf + 2] = c2
                    s[4 * nf + 3] = c3
            for i in range(4 * ATTN_MMA_NF):
                sred[uint64((warp * 4 * ATTN_MMA_NF + i) * 32 + lane)] = s[i]
            cuda.syncthreads()
            for i in range(4 * ATTN_MMA_NF):
                v = sred[uint64(i * 32 + lane)]
                for w_ in range(1, ATTN_MMA_WARPS):
                    v += sred[uint64((w_ * 4 * ATTN_MMA_NF + i) * 32 + lane)]
                s[i] = v * inv_sqrt
            # online softmax of heads g (hh 0: c0, c1) and g + 8 (hh 1: c2, c3)
            for hh in range(2):
                mx = float32(NEG_INF)
                for nf in range(ATTN_MMA_NF):
                    if 8 * nf + row_a < n_tile:
                        mx = max(mx, s[4 * nf + 2 * hh])
                    if 8 * nf + row_b < n_tile:
                        mx = max(mx, s[4 * nf + 2 * hh + 1])
                mx = max(mx, lane_swap(mx, 1, scratch))
                mx = max(mx, lane_swap(mx, 2, scratch))
                m_new = max(m_run[hh], mx)
                scale = math.exp(m_run[hh] - m_new)
                m_run[hh] = m_new
                total = float32(0.0)
                for nf in range(ATTN_MMA_NF):
                    # padded slots: exp(NEG_INF - m) = 0, without a branch
                    x0 = s[4 * nf + 2 * hh] if 8 * nf + row_a < n_tile else float32(NEG_INF)
                    x1 = s[4 * nf + 2 * hh + 1] if 8 * nf + row_b < n_tile else float32(NEG_INF)
                    e0 = math.exp(x0 - m_new)
                    e1 = math.exp(x1 - m_new)
                    s[4 * nf + 2 * hh] = e0
                    s[4 * nf + 2 * hh + 1] = e1
                    total += e0 + e1
                den[hh] = den[hh] * scale + total
                for j in range(16):
                    acc[4 * j + 2 * hh] *= scale
                    acc[4 * j + 2 * hh + 1] *= scale
            if PREFETCH and next_begin < n_rows:
                load_round_mma(vals, 0, src_at, src_raw, raw_cache, comp_cache)
            # acc += P·V, P = the weights as hi + lo f16 A fragments
            for kk in range(ATTN_MMA_KK):
                f0 = 4 * (2 * kk)
                f1 = 4 * (2 * kk + 1)
                ph0, pl0 = split_f16x2(s[f0], s[f0 + 1])
                ph1, pl1 = split_f16x2(s[f0 + 2], s[f0 + 3])
                ph2, pl2 = split_f16x2(s[f1], s[f1 + 1])
                ph3, pl3 = split_f16x2(s[f1 + 2], s[f1 + 3])
                r0 = uint64(16 * kk + row_a)
                r1 = uint64(16 * kk + row_b)
                r2 = uint64(16 * kk + 8 + row_a)
                r3 = uint64(16 * kk + 8 + row_b)
                for m in range(4):
                    col = uint64(32 * warp + 8 * m + g)
                    x0 = tile[r0, col]
                    x1 = tile[r1, col]
                    y0 = tile[r2, col]
                    y1 = tile[r3, col]
                    for qd in range(4):
                        if qd < 2:
                            xa, xb, ya, yb = lo_word(x0), lo_word(x1), lo_word(y0), lo_word(y1)
                        else:
                            xa, xb, ya, yb = hi_word(x0), hi_word(x1), hi_word(y0), hi_word(y1)
                        if qd % 2 == 0:
                            b0 = halves_lo(xa, xb)
                            b1 = halves_lo(ya, yb)
                        else:
                            b0 = halves_hi(xa, xb)
                            b1 = halves_hi(ya, yb)
                        j = 4 * (4 * m + qd)
                        c0, c1, c2, c3 = mma_f16_acc(pl0, pl1, pl2, pl3, b0, b1,
                                                     acc[j], acc[j + 1], acc[j + 2], acc[j + 3])
                        c0, c1, c2, c3 = mma_f16_acc(ph0, ph1, ph2, ph3, b0, b1, c0, c1, c2, c3)
                        acc[j] = c0
                        acc[j + 1] = c1
                        acc[j + 2] = c2
                        acc[j + 3] = c3
            cuda.syncthreads()
        for hh in range(2):
            d_ = den[hh]
            d_ += lane_swap(d_, 1, scratch)
            d_ += lane_swap(d_, 2, scratch)
            den[hh] = d_
        part_max = part_max_all[t]
        part_den = part_den_all[t]
        part_acc = part_acc_all[t]
        if warp == 0 and tig == 0:
            for hh in range(2):
                part_max[head0 + g + 8 * hh, 0] = m_run[hh]
                part_den[head0 + g + 8 * hh, 0] = den[hh]
        for hh in range(2):
            out = part_acc[head0 + g + 8 * hh, 0]
            for m in range(4):
                d0 = 128 * warp + 32 * m + 8 * tig
                for qd in range(4):
                    j = 4 * (4 * m + qd)
                    out[uint64(d0 + qd)] = acc[j + 2 * hh]
                    out[uint64(d0 + 4 + qd)] = acc[j + 2 * hh + 1]

    return attention_prefill_mma


attention_prefill_mma = _attention_prefill_mma_kernel(True)
attention_prefill_mma_no_prefetch = _attention_prefill_mma_kernel(False)   # for scripts/bench_attention.py



@cuda.jit(device=True)
def finish_pair(x0, x1, inside, d, head, t, n_tok, pos_buf, head_dim, n_rot, freqs, heads_per_group,
                out, out_q, out_d):
    """Merged output dims (d, d + 1) of `head` for token t: the inverse RoPE of the tail (§6.7),
    the write into the group-major `out` and its Q8_0 quantization (16 consecutive lanes hold one
    32-value block; every lane calls, `inside` False for lanes past the head's dims)."""
    at = 0
    if inside:
        n_nope = head_dim - n_rot
        if d >= n_nope:
            x0, x1 = rotate_pair(x0, x1, float64(pos_buf[t]) * freqs[(d - n_nope) // 2], True)
        g = head // heads_per_group
        at = ((g * n_tok + t) * heads_per_group + head - g * heads_per_group) * head_dim + d
        out[at] = x0
        out[at + 1] = x1
    if USE_SHUFFLES:
        amax = max(abs(x0), abs(x1))
        for offset in (8, 4, 2, 1):          # within each half warp: one Q8_0 block
            amax = max(amax, cuda.shfl_xor_sync(0xFFFFFFFF, amax, offset))
        scale, inv = q8_0_scale(amax)
        if inside:
            out_q[at] = q8_0_value(x0, inv)
            out_q[at + 1] = q8_0_value(x1, inv)
            if cuda.threadIdx.x % 16 == 0:
                out_d[at // 32] = scale
    else:
        cuda.syncthreads()
        if inside and d % 32 == 0:
            quantize_q8_0_serial(out, at // 32, out_q, out_d)


def _attention_combine_kernel(SPLITS):
    """attention_combine for at most SPLITS row ranges per head (its per-thread arrays hold
    SPLITS values each: 143 registers for the decode's 24, which a prefill of one split does not
    need; the one-split kernel runs at full occupancy)."""

    @cached_jit()
    def attention_combine(part_max_all, part_den_all, part_acc_all, w32, sinks_off, pos_buf, head_dim,
                          n_rot, freqs, n_group, out, out_q, out_d):
        """Sink attention, second half: merge the splits of each head with its sink logit, which joins
        the denominator only, then the inverse RoPE of the output tail (§6.6, §6.7). Block (head, part,
        token) with COMBINE_THREADS threads; each thread finishes one pair of dims (2i, 2i+1), so the
        RoPE needs no second pass. Empty splits (Σ 0) are skipped. `out` is flat and group-major,
        [n_group, T, heads per group · head_dim], so that each output group's input rows are
        contiguous for its matmul (with T = 1 it is simply the heads in order). The output's Q8_0
        quantization (out_q, out_d: what the output projection reads) is done here too: 16 lanes hold
        one 32-value block (head_dim % 32 == 0), which saves a launch on the critical path."""
        pdl_enter()
        head = cuda.blockIdx.x
        t = cuda.blockIdx.z
        n_tok = cuda.gridDim.z
        part_max = part_max_all[t]
        part_den = part_den_all[t]
        part_acc = part_acc_all[t]
        n_splits = part_max.shape[1]                   # <= SPLITS
        # every split's values are loaded first, in loops over the constant SPLITS that unroll,
        # so the loads are in flight together; loops over n_splits with the sums in between waited
        # for one L2 round trip per split (13 us per launch, ncu on the H200). Same sums, same order.
        s_max = cuda.local.array(SPLITS, float64)       # f64 partials (attention_partial; the
        s_den = cuda.local.array(SPLITS, float64)       # prefill's MMA kernel stores its f32 values)
        s_acc0 = cuda.local.array(SPLITS, float64)
        s_acc1 = cuda.local.array(SPLITS, float64)
        d = 2 * (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x)
        inside = d < head_dim              # whole 16-lane groups: head_dim % 32 == 0
        for s_ in range(SPLITS):
            if s_ < n_splits:
                s_max[s_] = part_max[head, s_]
                s_den[s_] = part_den[head, s_]
                if inside:
                    s_acc0[s_] = part_acc[head, s_, d]
                    s_acc1[s_] = part_acc[head, s_, d + 1]
        sink = float64(w32[sinks_off + head])
        m = sink
        for s_ in range(SPLITS):
            if s_ < n_splits:
                m = max(m, s_max[s_])
        den = math.exp(sink - m)
        for s_ in range(SPLITS):          # each split's weight: 0 for empty splits (Σ 0)
            if s_ < n_splits:
                s_max[s_] = math.exp(s_max[s_] - m) if s_den[s_] > 0 else float64(0.0)
                den += s_max[s_] * s_den[s_]
        x0 = float32(0.0)
        x1 = float32(0.0)
        if inside:
            acc0 = float64(0.0)
            acc1 = float64(0.0)
            for s_ in range(SPLITS):
                if s_ < n_splits:
                    w = s_max[s_]
                    if w != 0:
                        acc0 += w * s_acc0[s_]
                        acc1 += w * s_acc1[s_]
            x0 = float32(acc0 / den)         # the one rounding (the CPU twin's too), then the RoPE
            x1 = float32(acc1 / den)
        finish_pair(x0, x1, inside, d, head, t, n_tok, pos_buf, head_dim, n_rot, freqs,
                    part_max_all.shape[1] // n_group, out, out_q, out_d)

    return attention_combine


attention_combine = _attention_combine_kernel(ATTN_SPLITS)     # decode: the flash-decoding splits
attention_combine_one = _attention_combine_kernel(1)            # prefill: one row range per head group


def combine_kernel(n_splits: int):
    """The attention_combine kernel for n_splits row ranges per head."""
    return attention_combine_one if n_splits == 1 else attention_combine


# ---- router and FFN glue (§6.11) -----------------------------------------------------------------------

@cuda.jit(device=True)
def warp_argmax(value, index):
    """(max value, its lowest index) over the 32 lanes of a warp; every lane gets it."""
    for offset in (16, 8, 4, 2, 1):
        other_val = cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
        other_idx = cuda.shfl_xor_sync(0xFFFFFFFF, index, offset)
        if other_val > value or (other_val == value and other_idx < index):
            value = other_val
            index = other_idx
    return value, index


@cuda.jit(device=True)
def block_argmax(value, index, best_val, best_idx):
    """(max value, its lowest index) over one (value, index) per thread; all threads get it."""
    tid = cuda.threadIdx.x
    if USE_SHUFFLES:
        value, index = warp_argmax(value, index)
        if tid % 32 == 0:
            best_val[tid // 32] = value
            best_idx[tid // 32] = index
        cuda.syncthreads()
        value, index = best_val[0], best_idx[0]
        for w in range(1, cuda.blockDim.x // 32):
            if best_val[w] > value or (best_val[w] == value and best_idx[w] < index):
                value, index = best_val[w], best_idx[w]
        cuda.syncthreads()
        return value, index
    best_val[tid] = value
    best_idx[tid] = index
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            ov = best_val[tid + stride]
            oi = best_idx[tid + stride]
            if ov > best_val[tid] or (ov == best_val[tid] and oi < best_idx[tid]):
                best_val[tid] = ov
                best_idx[tid] = oi
        cuda.syncthreads()
        stride //= 2
    result_val = best_val[0]
    result_idx = best_idx[0]
    cuda.syncthreads()
    return result_val, result_idx


@cached_jit()
def route(logits_all, token_buf, w32, bias_off, has_bias, i32, hash_off, is_hash, n_used,
          weight_scale, base_offsets, expert_ids, route_w, slot_offsets):
    """Expert selection and weights (single block of BLOCK threads, n_exp <= 1024): hash layers
    take tid2eid[token], the others the top-n_used of sqrt(softplus(l)) + bias (ties → lower
    index); the weights use the unbiased probabilities, normalised (floor 2^-14) and scaled.
    Also writes each selected expert's gate/up/down byte offsets for the MoE kernels:
    base_offsets = (gate, up, down, gate stride, up stride, down stride) in bytes.
    One block per token (grid (1, T)): logits_all [T, n_exp], token_buf[t], expert_ids and
    route_w [T, n_used], slot_offsets [T, n_used, 3]."""
    pdl_enter()
    t = cuda.blockIdx.y
    logits = logits_all[t]
    n_exp = logits.shape[0]
    tid = cuda.threadIdx.x
    probs = cuda.shared.array(1024, float32)
    keys = cuda.shared.array(1024, float32)
    taken = cuda.shared.array(64, int32)
    best_val = cuda.shared.array(BLOCK, float32)
    best_idx = cuda.shared.array(BLOCK, int32)
    gate0, up0, down0 = base_offsets[0], base_offsets[1], base_offsets[2]     # before the first store
    gate_stride, up_stride, down_stride = base_offsets[3], base_offsets[4], base_offsets[5]
    for e in range(tid, n_exp, cuda.blockDim.x):
        probs[e] = router_prob(logits[e])
        keys[e] = probs[e] + (w32[bias_off + e] if has_bias else float32(0.0))
    cuda.syncthreads()
    if is_hash:
        if tid < n_used:
            taken[tid] = i32[hash_off + token_buf[t] * n_used + tid]
    else:
        for k in range(n_used):
            if USE_SHUFFLES and tid >= 32:
                continue                            # warp 0 alone picks, no barrier per pick
            mine = float32(-3.4e38)
            mine_idx = int32(0x7FFFFFFF)
            for e in range(tid, n_exp, 32 if USE_SHUFFLES else cuda.blockDim.x):
                if keys[e] > mine:
                    mine = keys[e]
                    mine_idx = e
            if USE_SHUFFLES:
                _, winner = warp_argmax(mine, mine_idx)
            else:
                _, winner = block_argmax(mine, mine_idx, best_val, best_idx)
            if tid == 0:
                taken[k] = winner
                keys[winner] = float32(-3.4e38)
            _warp_sync()
    cuda.syncthreads()
    # Thread k writes slot k, each thread adding the same total in the same order: one thread
    # writing every slot reloaded base_offsets after each store it might alias, a chain of global
    # round trips (ncu, H200: route 8.2 us per layer on the decode chain).
    if tid < n_used:
        total = float32(0.0)
        for k in range(n_used):
            total += probs[taken[k]]
        total = max(total, float32(6.103515625e-5))
        e = taken[tid]
        expert_ids[t, tid] = e
        route_w[t, tid] = probs[e] / total * float32(weight_scale)
        slot_offsets[t, tid, 0] = gate0 + e * gate_stride
        slot_offsets[t, tid, 1] = up0 + e * up_stride
        slot_offsets[t, tid, 2] = down0 + e * down_stride


@wide_jit
def swiglu_q8(gate, up, clamp, mid, xq, xd):
    """Shared expert activation: silu(min(g, c))·clamp(u, ±c), then Q8_0. One block per token
    (grid (1, T)) on rows [t] of [T, n_ff] arrays."""
    pdl_enter()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    n = gate.shape[1]
    for i in range(tid, n, cuda.blockDim.x):
        mid[t, i] = swiglu(gate[t, i], up[t, i], float32(clamp), float32(1.0))
    cuda.syncthreads()
    quantize_q8_0_block_values(mid[t], xq[t], xd[t])


@cached_jit()
def groups_to_tokens(src, n_group, width, dst):
    """dst[t·n_group·width + g·width + i] = src[(g·T + t)·width + i] (both flat): the grouped
    output projection's results (group-major, one matmul per group) as the token rows the next
    projection reads. Grid (x, T)."""
    pdl_enter()
    t = cuda.blockIdx.y
    n_tok = cuda.gridDim.y
    for k in range(cuda.grid(1), n_group * width, cuda.gridDim.x * cuda.blockDim.x):
        g = k // width
        dst[t * n_group * width + k] = src[(g * n_tok + t) * width + k - g * width]


ARGMAX_BLOCKS = 128       # blocks of the first argmax pass (enough loads in flight over 129k logits)


@cached_jit()
def argmax_partial(logits, forbid, part_val, part_idx):
    """Greedy pick, first pass: block b finds the first maximal index of its strided share of the
    logits, skipping token forbid[0] (EOS in bench probes; -1 for none)."""
    pdl_enter()
    tid = cuda.threadIdx.x
    best_val = cuda.shared.array(BLOCK, float32)
    best_idx = cuda.shared.array(BLOCK, int32)
    v = float32(-3.4e38)
    idx = int32(0x7FFFFFFF)
    skip = forbid[0]
    for i in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        if logits[i] > v and i != skip:
            v = logits[i]
            idx = i
    value, winner = block_argmax(v, idx, best_val, best_idx)
    if tid == 0:
        part_val[cuda.blockIdx.x] = value
        part_idx[cuda.blockIdx.x] = winner


@cached_jit()
def advance_token(next_token, token_buf, pos_buf):
    """The end of a decode step: its greedy pick becomes the next step's token and the position
    moves on, on the device, so a greedy loop can launch step k + 1 before it reads token k
    (CudaEngine.decode_greedy_run). The last node of the step: nothing after it reads them."""
    pdl_enter()
    if cuda.threadIdx.x == 0:
        token_buf[0] = next_token[0]
        pos_buf[0] = pos_buf[0] + 1


@cached_jit()
def argmax_finish(part_val, part_idx, out_token):
    """Greedy pick, second pass (one block of >= part_val.size threads): the first maximal index
    over the blocks' winners."""
    pdl_enter()
    tid = cuda.threadIdx.x
    best_val = cuda.shared.array(BLOCK, float32)
    best_idx = cuda.shared.array(BLOCK, int32)
    v = part_val[tid] if tid < part_val.shape[0] else float32(-3.4e38)
    idx = part_idx[tid] if tid < part_val.shape[0] else int32(0x7FFFFFFF)
    _, winner = block_argmax(v, idx, best_val, best_idx)
    if tid == 0:
        out_token[0] = winner
