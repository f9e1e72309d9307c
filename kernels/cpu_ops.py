"""Numba CPU kernels for every non-matmul op of the DS4 forward (ds4-model.md §5, §6).

These are the CPU twins the GPU engine mirrors: f32 in, f32 out, with ds4's numerics where they
matter (Σx² of RMS norms in double, exact power-of-two QAT scales, round-half-even, f16-rounded
cache rows). The quantized matvecs live in kernels/cpu.py.

Every batched op takes a leading token axis `n`; decode is n = 1. Ops that loop over heads or rows
use prange only where the work is big enough to pay for the threads.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import numerics

NEG_INF = np.float32(-1e30)
EMPTY_WINDOW = np.float32(-5e29)
EXPERT_SUM_FLOOR = np.float32(2.0 ** -14)
FP8_MAX, FP8_AMAX_FLOOR, FP8_BLOCK = 448.0, 1e-4, 64
FP4_MAX, FP4_AMAX_FLOOR, FP4_BLOCK = 6.0, 7.052966104933725e-38, 32
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)

jit = njit(cache=True, fastmath=False, error_model="numpy")
pjit = njit(cache=True, fastmath=False, error_model="numpy", parallel=True)


# ---- scalars -----------------------------------------------------------------------------------

@jit
def f16_round(v):
    """v (f32) rounded to the nearest f16 value (ties to even), returned as f32; ±inf past 65504."""
    a = abs(v)
    if a != a or a == 0.0:
        return v
    if a >= 65520.0:
        return np.float32(math.copysign(math.inf, v))
    if a < 6.103515625e-05:                     # f16 subnormals: a fixed step of 2^-24
        step = 5.960464477539063e-08
    else:
        m, e = math.frexp(a)                    # a = m·2^e, m in [0.5, 1)
        step = math.ldexp(1.0, e - 11)          # 10 mantissa bits below the leading one
    return np.float32(math.copysign(np.rint(a / step) * step, v))


@jit
def pow2_ceil(y):
    """2^ceil(log2(y)) for y > 0, exact (frexp, no rounded log2)."""
    m, e = math.frexp(y)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


# ---- cache rows ------------------------------------------------------------------------------------

@jit
def f16_round_inplace(x):
    for i in range(x.size):
        x.flat[i] = f16_round(x.flat[i])


@jit
def fp8_e4m3_sim_inplace(x, n):
    """FP8 E4M3 simulation of x[:n] in blocks of 64 (§6.9): power-of-two block scale, nearest
    finite E4M3 value with ties to the even mantissa."""
    for b in range(0, n, FP8_BLOCK):
        amax = np.float32(0.0)
        for i in range(b, b + FP8_BLOCK):
            amax = max(amax, abs(x[i]))
        s = pow2_ceil(max(np.float32(amax), np.float32(FP8_AMAX_FLOOR)) / np.float32(FP8_MAX))
        for i in range(b, b + FP8_BLOCK):
            v = min(max(x[i] / s, -FP8_MAX), FP8_MAX)
            a = abs(v)
            if a > 0.0:
                m, e = math.frexp(a)
                step = math.ldexp(1.0, max(e - 1, -6) - 3)   # 3 mantissa bits; subnormal below 2^-6
                a = np.rint(a / step) * step
            x[i] = np.float32(math.copysign(a, v) * s)


@jit
def fp4_e2m1_sim_inplace(x):
    """FP4 E2M1 simulation in blocks of 32: nearest of {0,.5,1,1.5,2,3,4,6}, ties to even index."""
    for b in range(0, x.size, FP4_BLOCK):
        amax = np.float32(0.0)
        for i in range(b, b + FP4_BLOCK):
            amax = max(amax, abs(x[i]))
        s = pow2_ceil(max(np.float32(amax), np.float32(FP4_AMAX_FLOOR)) / np.float32(FP4_MAX))
        for i in range(b, b + FP4_BLOCK):
            v = min(max(x[i] / s, -FP4_MAX), FP4_MAX)
            a = abs(v)
            best, best_d = 0, abs(a - FP4_GRID[0])
            for k in range(1, 8):
                d = abs(a - FP4_GRID[k])
                if d < best_d or (d == best_d and k % 2 == 0):
                    best, best_d = k, d
            x[i] = np.float32(math.copysign(FP4_GRID[best], v) * s)


@jit
def hadamard_inplace(x):
    """Unnormalised Walsh–Hadamard butterfly (strides 1, 2, …, n/2), then × 1/√n."""
    n = x.size
    stride = 1
    while stride < n:
        for start in range(0, n, 2 * stride):
            for i in range(start, start + stride):
                a, b = x[i], x[i + stride]
                x[i], x[i + stride] = a + b, a - b
        stride *= 2
    scale = np.float32(1.0 / math.sqrt(n))
    for i in range(n):
        x[i] *= scale


@jit
def indexer_qat_rows(x):
    """Hadamard then FP4 on every row of x [rows, idx_dim] (indexer queries and rows)."""
    for r in range(x.shape[0]):
        hadamard_inplace(x[r])
        fp4_e2m1_sim_inplace(x[r])


# ---- norms -----------------------------------------------------------------------------------------

@jit
def rms_scale(x, eps):
    """ds4's RMS scale of x: Σx² in double, then rms_scale_of."""
    ss = 0.0
    for i in range(x.size):
        ss += np.float64(x[i]) * np.float64(x[i])
    return rms_scale_of(ss, x.size, eps)


@jit
def rms_scale_of(ss, n, eps):
    """1/sqrtf((float)(ss/n) + eps) in f32, from Σx² = ss accumulated in double."""
    return np.float32(1.0) / np.float32(math.sqrt(np.float32(ss / n) + np.float32(eps)))


@jit
def rms_norm_rows(x, weight, eps):
    """out[t] = x[t]·scale(x[t])·weight for x [n, dim]."""
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        s = rms_scale(x[t], eps)
        for i in range(x.shape[1]):
            out[t, i] = x[t, i] * s * weight[i]
    return out


@jit
def rms_norm_heads_inplace(x, eps):
    """Weightless RMS norm of every head: x [n, n_head, head_dim]."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            s = rms_scale(x[t, h], eps)
            for i in range(x.shape[2]):
                x[t, h, i] *= s


# ---- RoPE (§6.7) -----------------------------------------------------------------------------------

_rotate_pair = jit(numerics.rotate_pair)     # the CUDA kernels' rotation (kernels/numerics.py)


@jit
def rope_tail_inplace(x, pos, freqs, inverse):
    """Rotate the interleaved pairs of the last 2·len(freqs) dims of every row of x [rows, dim] by
    θ = pos·freqs[k] (f64: numerics.rope_frequencies), −θ when inverse."""
    off = x.shape[1] - 2 * freqs.size
    for k in range(freqs.size):
        theta = np.float64(pos) * freqs[k]
        for r in range(x.shape[0]):
            x[r, off + 2 * k], x[r, off + 2 * k + 1] = _rotate_pair(x[r, off + 2 * k], x[r, off + 2 * k + 1],
                                                                   theta, inverse)


@jit
def rope_tokens_inplace(x, pos0, freqs, inverse):
    """x [n, rows, dim]: token t sits at position pos0 + t."""
    for t in range(x.shape[0]):
        rope_tail_inplace(x[t], pos0 + t, freqs, inverse)


# ---- hyper-connections (§6.2, §6.3, §6.12) ---------------------------------------------------------

_hc_mix_value = jit(numerics.hc_mix_value)     # the CUDA kernels' HC math (kernels/numerics.py)
_hc_logit = jit(numerics.hc_logit)
_hc_pre_gate = jit(numerics.hc_pre_gate)
_hc_post_gate = jit(numerics.hc_post_gate)
_hc_normed = jit(numerics.hc_normed)


@pjit
def hc_mix_rows(X, fn, eps):
    """The mixer values of X [n, n_hc, n_embd] with fn [rows, n_hc·n_embd] (f32 copies of the f16
    weights): (Σ fn·x in f64)·rs with rs the flat state's RMS scale, one rounding (numerics). The
    rows in parallel, each one's sum in index order."""
    n = X.shape[0]
    flat = X.reshape(n, X.shape[1] * X.shape[2])
    mix = np.empty((n, fn.shape[0]), dtype=np.float32)
    for t in range(n):
        rs = rms_scale(flat[t], eps)
        for r in prange(fn.shape[0]):
            dot = 0.0
            for i in range(flat.shape[1]):
                dot += np.float64(fn[r, i]) * np.float64(flat[t, i])
            mix[t, r] = _hc_mix_value(dot, rs)
    return mix


@jit
def _normalize_rows(m, eps):
    """Each row of m divided by its sum (in index order) + eps, in place: a Sinkhorn pass."""
    for i in range(m.shape[0]):
        total = 0.0
        for j in range(m.shape[1]):
            total += m[i, j]
        for j in range(m.shape[1]):
            m[i, j] = m[i, j] / (total + eps)


@jit
def hc_gates_rows(mix, scale, base, n_hc, n_iter, eps):
    """mix [n, (2+n_hc)·n_hc] -> pre [n, n_hc], post [n, n_hc], comb [n, n_hc, n_hc] (comb[i, j]).
    The Sinkhorn matrix in f64 (the GPU's sinkhorn_comb: the same sums in the same order), rounded
    once: a row softmax + eps, a column pass, then n_iter - 1 row and column passes."""
    n = mix.shape[0]
    pre = np.empty((n, n_hc), dtype=np.float32)
    post = np.empty((n, n_hc), dtype=np.float32)
    comb = np.empty((n, n_hc, n_hc), dtype=np.float32)
    c = np.empty((n_hc, n_hc), dtype=np.float64)
    eps64 = np.float64(np.float32(eps))
    for t in range(n):
        for i in range(n_hc):
            pre[t, i] = _hc_pre_gate(mix[t, i], scale[0], base[i], eps)
            post[t, i] = _hc_post_gate(mix[t, n_hc + i], scale[1], base[n_hc + i])
        for i in range(n_hc):
            row_max = -math.inf
            for j in range(n_hc):
                c[i, j] = _hc_logit(mix[t, 2 * n_hc + i * n_hc + j], scale[2], base[2 * n_hc + i * n_hc + j])
                row_max = max(row_max, c[i, j])
            total = 0.0
            for j in range(n_hc):
                total += math.exp(c[i, j] - row_max)
            for j in range(n_hc):
                c[i, j] = math.exp(c[i, j] - row_max) / total + eps64
        for it in range(n_iter):
            if it > 0:
                _normalize_rows(c, eps64)
            _normalize_rows(c.T, eps64)           # the columns
        for i in range(n_hc):
            for j in range(n_hc):
                comb[t, i, j] = np.float32(c[i, j])
    return pre, post, comb


@jit
def hc_head_weights(mix, scale, base, eps):
    """Output-head collapse weights a[t, h] = sigmoid(mix·scale + base) + eps."""
    a = np.empty_like(mix)
    for t in range(mix.shape[0]):
        for h in range(mix.shape[1]):
            a[t, h] = _hc_pre_gate(mix[t, h], scale, base[h], eps)
    return a


@jit
def hc_collapse_norm_rows(weights, X, norm_w, eps):
    """x[t] = RMSNorm(Σ_h weights[t, h]·X[t, h])·norm_w: the collapse y in f64, Σy² from it, each
    value rounded once (numerics.hc_normed), as the GPU's hc_pre and hc_head."""
    n, n_hc, n_embd = X.shape
    x = np.empty((n, n_embd), dtype=np.float32)
    y = np.empty(n_embd, dtype=np.float64)
    for t in range(n):
        sumsq = 0.0
        for i in range(n_embd):
            acc = 0.0
            for h in range(n_hc):
                acc += np.float64(weights[t, h]) * np.float64(X[t, h, i])
            y[i] = acc
            sumsq += acc * acc
        scale = rms_scale_of(sumsq, n_embd, eps)
        for i in range(n_embd):
            x[t, i] = _hc_normed(y[i], scale, norm_w[i])
    return x


@jit
def hc_post_rows(f, X, post, comb):
    """X_new[t, j] = post[t, j]·f[t] + Σ_i comb[t, i, j]·X[t, i]."""
    n, n_hc, n_embd = X.shape
    out = np.empty_like(X)
    for t in range(n):
        for j in range(n_hc):
            for d in range(n_embd):
                acc = post[t, j] * f[t, d]
                for i in range(n_hc):
                    acc += comb[t, i, j] * X[t, i, d]
                out[t, j, d] = acc
    return out


# ---- attention (§6.5, §6.6) -----------------------------------------------------------------------

@pjit
def sink_attention(q, raw, raw_start, n_raw, comp, comp_ids, sinks, scale):
    """q [n_head, hd] over the raw ring rows raw[(raw_start + r) % cap], r < n_raw, and the
    compressed rows comp[comp_ids]. K = V = the row; the sink joins the denominator only. Scores,
    softmax and sums in f64 (the rows are f16 values: q·row's products are exact), each output
    rounded once, as the GPU's attention_partial + attention_combine (in another order)."""
    n_head, hd = q.shape
    cap = raw.shape[0]
    n_rows = n_raw + comp_ids.size
    out = np.empty((n_head, hd), dtype=np.float32)
    for h in prange(n_head):
        scores = np.empty(n_rows, dtype=np.float64)
        m = np.float64(sinks[h])
        for r in range(n_rows):
            row = raw[(raw_start + r) % cap] if r < n_raw else comp[comp_ids[r - n_raw]]
            acc = 0.0
            for i in range(hd):
                acc += np.float64(q[h, i]) * np.float64(row[i])
            scores[r] = acc * np.float64(scale)
            m = max(m, scores[r])
        den = math.exp(np.float64(sinks[h]) - m)
        acc_o = np.zeros(hd, dtype=np.float64)
        for r in range(n_rows):
            row = raw[(raw_start + r) % cap] if r < n_raw else comp[comp_ids[r - n_raw]]
            e = math.exp(scores[r] - m)
            den += e
            for i in range(hd):
                acc_o[i] += e * np.float64(row[i])
        for i in range(hd):
            out[h, i] = np.float32(acc_o[i] / den)
    return out


# ---- compressor (§6.8) -----------------------------------------------------------------------------

@jit
def compressor_store(kv_state, score_state, kv_t, sc_t, ape_row, ratio, pos):
    """Write this token's kv and score (+ absolute position embedding) into its state row."""
    row = 4 + pos % 4 if ratio == 4 else pos % ratio
    for i in range(kv_t.size):
        kv_state[row, i] = kv_t[i]
        score_state[row, i] = sc_t[i] + ape_row[i]


@jit
def compressor_pool(kv_state, score_state, ratio, dim):
    """Softmax-pool the window per dim (ratio 4: 4 previous rows through the first half of the
    columns + 4 current rows through the second half). An all-masked dim pools to 0."""
    pooled = np.empty(dim, dtype=np.float32)
    n_cand = 8 if ratio == 4 else ratio
    for j in range(dim):
        m = NEG_INF
        for r in range(n_cand):
            col = j + dim if (ratio == 4 and r >= 4) else j
            m = max(m, score_state[r, col])
        if m <= EMPTY_WINDOW:
            pooled[j] = 0.0
            continue
        den = 0.0                   # f64, rounded once: the GPU's pool_column
        acc = 0.0
        for r in range(n_cand):
            col = j + dim if (ratio == 4 and r >= 4) else j
            e = math.exp(np.float64(score_state[r, col]) - np.float64(m))
            den += e
            acc += e * np.float64(kv_state[r, col])
        pooled[j] = np.float32(acc / den)
    return pooled


def compressed_row(pooled, norm_w, eps, pos, freqs, indexer_lane, n_nope):
    """A pooled compressor row finished for its cache (§6.8): RMSNorm·w, RoPE of the tail at the
    window's first position, then FP8 on the nope dims (attention lane) or Hadamard + FP4 (indexer
    lane), f16-rounded. (The GPU's compressor_row.)"""
    row = rms_norm_rows(pooled[None, :], norm_w, eps)
    rope_tail_inplace(row, pos, freqs, False)
    if indexer_lane:
        indexer_qat_rows(row)
    else:
        fp8_e4m3_sim_inplace(row[0], n_nope)
    f16_round_inplace(row)
    return row[0]


@jit
def compressor_shift(kv_state, score_state):
    """Ratio 4 after an emit: the current window (rows 4..7) becomes the previous one."""
    for r in range(4):
        for i in range(kv_state.shape[1]):
            kv_state[r, i] = kv_state[r + 4, i]
            score_state[r, i] = score_state[r + 4, i]


# ---- indexer (§6.10) -------------------------------------------------------------------------------

@pjit
def indexer_scores(rows, n_rows, iq, head_w):
    """score[c] = Σ_h head_w[h]·max(0, rows[c]·iq[h]) for c < n_rows: the dots in f32 (exact: FP4
    values), the heads' sum in f64 and rounded once (the GPU's _add_head)."""
    n_ihead, d = iq.shape
    scores = np.empty(n_rows, dtype=np.float32)
    for c in prange(n_rows):
        total = 0.0
        for h in range(n_ihead):
            acc = np.float32(0.0)
            for i in range(d):
                acc += rows[c, i] * iq[h, i]
            if acc > 0.0:
                total += np.float64(head_w[h]) * np.float64(acc)
        scores[c] = np.float32(total)
    return scores


@jit
def topk_desc(values, k):
    """Indices of the k largest values, largest first, ties to the lower index."""
    order = np.argsort(-values, kind="mergesort")     # stable: equal values keep index order
    return order[:k].copy()


# ---- router (§6.11) --------------------------------------------------------------------------------

_router_prob = jit(numerics.router_prob)      # the GPU's route (kernels/numerics.py)


@jit
def router_weights(logits, expert_ids, scale, normalize):
    """Unbiased sqrt-softplus probabilities of the chosen experts, normalised (floor 2^-14), scaled."""
    n_used = expert_ids.size
    w = np.empty(n_used, dtype=np.float32)
    total = np.float32(0.0)
    for k in range(n_used):
        w[k] = _router_prob(logits[expert_ids[k]])
        total += w[k]
    div = max(total, EXPERT_SUM_FLOOR) if normalize else np.float32(1.0)
    for k in range(n_used):
        w[k] = w[k] / div * np.float32(scale)
    return w


@jit
def router_topk(logits, bias, n_used):
    """Experts picked by sqrt-softplus probability + bias (bias empty: none)."""
    sel = np.empty(logits.size, dtype=np.float32)
    for e in range(logits.size):
        sel[e] = _router_prob(logits[e])
        if bias.size:
            sel[e] += bias[e]
    return topk_desc(sel, n_used).astype(np.int32)


# ---- FFN pieces ------------------------------------------------------------------------------------

_swiglu = jit(numerics.swiglu)       # the CUDA kernels' SwiGLU (kernels/numerics.py)


@jit
def swiglu_clamped_rows(g, u, clamp):
    """silu(min(g, clamp))·clamp(u, ±clamp), row-wise; the shared expert's middle."""
    out = np.empty_like(g)
    for t in range(g.shape[0]):
        for i in range(g.shape[1]):
            out[t, i] = _swiglu(g[t, i], u[t, i], np.float32(clamp), np.float32(1.0))
    return out
