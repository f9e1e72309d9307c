"""The non-quant CUDA ops checked in Numba's CUDA simulator against the float64 reference (and
moe_prefill's device grouping against its host form).

Run by test_cuda_ops_sim.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (the simulator must be
chosen before numba is imported). Each check draws fresh random inputs and compares with the
reference's functions (ds4py/reference.py), the oracle written from ds4-model.md.
"""

import math
import sys

import numpy as np
from numba import cuda

from ds4py import reference as ref
from ds4py.kernels import cpu_ops
from ds4py.kernels import cuda_ops as ops
from ds4py.kernels.cuda_intrinsics import SIMULATOR

rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
BLOCK = ops.BLOCK


def close(name, got, want, tol):
    err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    scale = float(np.max(np.abs(want))) or 1.0
    ok = err <= tol * scale
    print(f"{'ok ' if ok else 'BAD'} {name}: max|Δ| {err:.3g} (scale {scale:.3g}, tol {tol:g})")
    if not ok:
        raise SystemExit(1)


def equals_twin(name, got, want):
    """got (a kernel's output) equal to want (its CPU twin's, kernels/cpu_ops.py), element for element."""
    same = np.array_equal(got, want)
    print(f"{'ok ' if same else 'BAD'} {name}: the CPU twin's bits: {same}"
          + ("" if same else f" (max|Δ| {np.max(np.abs(np.asarray(got, np.float64) - want)):.3g})"))
    if not same:
        raise SystemExit(f"{name} differs from the CPU twin")


def check_hc(n_tok):
    """Mixer partials, hc_pre (post gates, Sinkhorn, collapse + norm + Q8_0), hc_post for n_tok
    tokens at once ([T, ...] buffers, token = blockIdx.y/z), each against the reference."""
    n_hc, n_embd = 4, 256
    mix_rows = (2 + n_hc) * n_hc
    states = rng.normal(0, 1, (n_tok, n_hc, n_embd)).astype(np.float32)
    fn = (rng.normal(0, 1 / math.sqrt(n_hc * n_embd), (mix_rows, n_hc * n_embd))).astype(np.float16)
    scale = np.array([1.05, 0.95, 1.1], np.float32)
    base = rng.normal(0, 0.1, mix_rows).astype(np.float32)
    norm = (1 + rng.uniform(-0.1, 0.1, n_embd)).astype(np.float32)
    # one uint8 arena holding every weight, as a weight source would
    arena = np.zeros(fn.nbytes + 4096, np.uint8)
    arena[:fn.nbytes] = fn.view(np.uint8).ravel()
    off32 = fn.nbytes // 4
    w32_host = arena.view(np.float32)
    w32_host[off32:off32 + 3] = scale
    w32_host[off32 + 3:off32 + 3 + mix_rows] = base
    w32_host[off32 + 3 + mix_rows:off32 + 3 + mix_rows + n_embd] = norm
    d_arena = cuda.to_device(arena)
    d_state = cuda.to_device(states)
    chunk = 128                                    # two chunks per stream
    n_chunks = n_hc * n_embd // chunk
    part_dot = cuda.device_array((n_tok, mix_rows, n_chunks), np.float64)
    part_sq = cuda.device_array((n_tok, n_chunks), np.float64)
    part_gram = cuda.device_array((n_tok, n_hc * n_hc, n_chunks), np.float64)
    ops.hc_mix_partial[(mix_rows + n_hc * n_hc, n_chunks, n_tok), 64](
        d_state, d_arena.view(np.float16), 0, chunk, part_dot, part_sq, part_gram, True)
    # weights loaded after pdl_enter (PRE False) against before it, with blocks of 64 threads (the
    # launch above) and of 16 (128 > 4 x 16: half the chunk in the loop after the first four
    # values per thread)
    def mix_partials(threads, pre):
        parts = tuple(cuda.device_array(a.shape, a.dtype) for a in (part_dot, part_sq, part_gram))
        ops.hc_mix_partial[(mix_rows + n_hc * n_hc, n_chunks, n_tok), threads](
            d_state, d_arena.view(np.float16), 0, chunk, *parts, pre)
        return parts

    for threads in (64, 16):
        before = (part_dot, part_sq, part_gram) if threads == 64 else mix_partials(threads, True)
        after = mix_partials(threads, False)
        same = all(np.array_equal(a.copy_to_host(), b.copy_to_host()) for a, b in zip(before, after))
        print(("ok " if same else "BAD") + f" hc_mix_partial, {threads} threads: weights before pdl_enter "
              f"bitwise equal to after: {same}")
        if not same:
            raise SystemExit("hc_mix_partial's weight prologue changed its partials")
    # the prefill form (block per chunk and token) gives the same partials, bit for bit
    tok_dot, tok_sq, tok_gram = (cuda.device_array(a.shape, a.dtype) for a in (part_dot, part_sq, part_gram))
    ops.hc_mix_tokens[(n_chunks, (n_tok + ops.HC_TOKENS - 1) // ops.HC_TOKENS), 64](d_state, d_arena.view(np.float16), 0, chunk, True, tok_dot,
                                             tok_sq, tok_gram)
    for name, a, b in (("dots", part_dot, tok_dot), ("Σx²", part_sq, tok_sq), ("Gram", part_gram, tok_gram)):
        same = np.array_equal(a.copy_to_host(), b.copy_to_host())
        print(("ok " if same else "BAD") + f" hc_mix_tokens {name} [T={n_tok}]: bitwise equal to hc_mix_partial: {same}")
        if not same:
            raise SystemExit(f"hc_mix_tokens {name} differs from hc_mix_partial")
    post = cuda.device_array((n_tok, n_hc), np.float32)
    comb = cuda.device_array((n_tok, n_hc * n_hc), np.float32)
    x = cuda.device_array((n_tok, n_embd), np.float32)
    xq, xd = cuda.device_array((n_tok, n_embd), np.int8), cuda.device_array((n_tok, n_embd // 32), np.float32)
    x_blocks = (n_embd + 64 - 1) // 64               # blocks of 64 threads: 4 collapse blocks
    ops.hc_sinkhorn[(1, n_tok), 64](part_dot, part_sq, n_hc * n_embd, d_arena.view(np.float32), off32, off32 + 3,
                                    20, 1e-6, 1e-6, post, comb)
    ops.hc_pre[(x_blocks, n_tok), 64](d_state, part_dot, part_sq, part_gram, d_arena.view(np.float32), off32,
                                      off32 + 3, off32 + 3 + mix_rows, 1e-6, 1e-6, x, xq, xd)
    head_x = cuda.device_array((n_tok, n_embd), np.float32)     # the output head's collapse, same mixer rows
    head_q, head_d = cuda.device_array((n_tok, n_embd), np.int8), cuda.device_array((n_tok, n_embd // 32), np.float32)
    ops.hc_head[(1, n_tok), 64](d_state, part_dot[:, :n_hc], part_sq, d_arena.view(np.float32), off32, off32 + 3,
                                off32 + 3 + mix_rows, 1e-6, 1e-6, head_x, head_q, head_d)
    f_a = rng.normal(0, 1, (n_tok, n_embd)).astype(np.float32)
    f_b = rng.normal(0, 1, (n_tok, n_embd)).astype(np.float32)
    post_h, comb_h = post.copy_to_host(), comb.copy_to_host()
    pd_all, ps_all = part_dot.copy_to_host(), part_sq.copy_to_host()
    pg_all = part_gram.copy_to_host()
    d_fa, d_fb = cuda.to_device(f_a), cuda.to_device(f_b)
    ops.hc_post[(4, n_tok), 64](d_state, d_fa, d_fb, post, comb)
    new_state = d_state.copy_to_host()
    x_h, q_h, d_h = x.copy_to_host(), xq.copy_to_host(), xd.copy_to_host()
    # the CPU engine's HC ops (kernels/cpu_ops.py) give the same bits: f64 sums, one rounding each
    cpu_mix = cpu_ops.hc_mix_rows(states, fn.astype(np.float32), 1e-6)
    cpu_pre, cpu_post, cpu_comb = cpu_ops.hc_gates_rows(cpu_mix, scale, base, n_hc, 20, np.float32(1e-6))
    cpu_x = cpu_ops.hc_collapse_norm_rows(cpu_pre, states, norm, 1e-6)
    cpu_head = cpu_ops.hc_collapse_norm_rows(cpu_ops.hc_head_weights(cpu_mix[:, :n_hc], scale[0], base[:n_hc],
                                                                      np.float32(1e-6)), states, norm, 1e-6)
    for name, got, want in (("post gates", post_h, cpu_post), ("Sinkhorn", comb_h, cpu_comb.reshape(n_tok, -1)),
                            ("x", x_h, cpu_x), ("head x", head_x.copy_to_host(), cpu_head)):
        equals_twin(f"hc {name} [T={n_tok}]", got, want)
    for t in range(n_tok):
        tag = f" [T={n_tok} t={t}]"
        state = states[t]
        flat = state.reshape(-1).astype(np.float64)
        close("Σx² partials" + tag, ps_all[t].sum(), np.sum(flat ** 2), 1e-6)
        close("Gram partials" + tag, pg_all[t].sum(1), (state.astype(np.float64) @ state.T.astype(np.float64)).reshape(-1), 1e-9)
        want_mix = fn.astype(np.float64) @ (flat / np.sqrt(np.mean(flat ** 2) + 1e-6))
        close("hc_mix partials" + tag, pd_all[t].sum(1) / np.sqrt(ps_all[t].sum() / flat.size + 1e-6), want_mix, 1e-5)
        m = want_mix
        pre_w = ref.sigmoid(m[:n_hc] * scale[0] + base[:n_hc]) + 1e-6
        post_w = 2 * ref.sigmoid(m[n_hc:2 * n_hc] * scale[1] + base[n_hc:2 * n_hc])
        comb_w = ref.sinkhorn((m[2 * n_hc:] * scale[2] + base[2 * n_hc:]).reshape(n_hc, n_hc), 20, 1e-6)
        close("hc post gates" + tag, post_h[t], post_w, 1e-6)
        close("hc sinkhorn" + tag, comb_h[t], comb_w.reshape(-1), 1e-5)
        y = (pre_w[:, None] * state).sum(0)
        close("hc_pre x" + tag, x_h[t], ref.rms_norm(y, norm, 1e-6), 1e-5)
        close("q8_0 of x" + tag, (q_h[t].reshape(-1, 32) * d_h[t][:, None]).reshape(-1), ref.q8_0_activation(x_h[t]), 1e-6)
        # hc_post: X_new[j] = post[j] (f_a + f_b) + Σ_i C[i][j] X_old[i], in place
        want = ref.hc_post((f_a[t] + f_b[t]).astype(np.float64), state.astype(np.float64), post_h[t],
                           comb_h[t].reshape(n_hc, n_hc))
        close("hc_post" + tag, new_state[t], want, 1e-5)


def check_qat_and_rope(n_tok):
    head_dim, n_rot = 128, 64
    # FP8 on the nope dims of a kv row via kv_finish, with RoPE and f16 rounding; token t at
    # position 37 + 3t into a ring of 8 rows
    kv = rng.normal(0, 1, (n_tok, head_dim)).astype(np.float32) * np.float32(3.0)
    norm = (1 + rng.uniform(-0.1, 0.1, head_dim)).astype(np.float32)
    pos = np.array([37 + 3 * t for t in range(n_tok)], np.int32)
    freqs = 10000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)      # float64, as the engine passes them
    raw = cuda.device_array((8, head_dim), np.float32)
    # kv as the engine passes it: a column range of a wider [T, q_lora + head_dim] buffer
    wide = np.zeros((n_tok, 32 + head_dim), np.float32)
    wide[:, 32:] = kv
    d_wide = cuda.to_device(wide)
    ops.kv_finish[(1, n_tok), BLOCK](d_wide[:, 32:], cuda.to_device(norm), 0, 1e-6, cuda.to_device(pos),
                                     cuda.to_device(freqs), n_rot, raw)
    rope = ref.Rope(n_rot, 10000.0, False)
    raw_h = raw.copy_to_host()
    for t in range(n_tok):
        want = rope.apply(ref.rms_norm(kv[t].astype(np.float64), norm, 1e-6)[None, :], int(pos[t]))[0]
        want[:head_dim - n_rot] = ref.fp8_e4m3_sim(want[:head_dim - n_rot])
        close(f"kv_finish (norm, rope, fp8, f16) [T={n_tok} t={t}]", raw_h[pos[t] % 8], ref.f16_round(want), 2e-3)
    # Hadamard + FP4 on indexer heads (rope first)
    n_ihead, idx_dim = 2, 64
    iq = rng.normal(0, 1, (n_tok, n_ihead * idx_dim)).astype(np.float32)
    d_iq = cuda.to_device(iq.copy())
    ops.indexer_q[(n_ihead, n_tok), 64](d_iq, idx_dim, n_rot, cuda.to_device(pos), cuda.to_device(freqs))
    got = d_iq.copy_to_host()
    for t in range(n_tok):
        want = np.concatenate([ref.indexer_qat(rope.apply(h[None, :], int(pos[t]))[0])
                               for h in iq[t].reshape(n_ihead, idx_dim).astype(np.float64)])
        close(f"indexer_q (rope, hadamard, fp4) [T={n_tok} t={t}]", got[t], want, 1e-5)
    # q_heads: per-head RMSNorm, RoPE
    n_head = 3
    q = rng.normal(0, 1, (n_tok, n_head * head_dim)).astype(np.float32)
    d_q = cuda.to_device(q.copy())
    ops.q_heads[(n_head, n_tok), BLOCK](d_q, head_dim, n_rot, 1e-6, cuda.to_device(pos), cuda.to_device(freqs))
    got = d_q.copy_to_host()
    twin = q.reshape(n_tok, n_head, head_dim).copy()        # the CPU engine's steps for q
    cpu_ops.rms_norm_heads_inplace(twin, 1e-6)
    for t in range(n_tok):
        cpu_ops.rope_tokens_inplace(twin[t:t + 1], int(pos[t]), freqs, False)
    same = np.array_equal(got.view(np.uint32), twin.reshape(n_tok, -1).view(np.uint32))
    print(f"{'ok ' if same else 'BAD'} q_heads [T={n_tok}] = the CPU twin (RMS norm, f64 RoPE), bit for bit")
    if not same:
        raise SystemExit(1)
    for t in range(n_tok):
        want = np.concatenate([rope.apply((h / np.sqrt(np.mean(h ** 2) + 1e-6))[None, :], int(pos[t]))[0]
                               for h in q[t].reshape(n_head, head_dim).astype(np.float64)])
        close(f"q_heads (rms, rope) [T={n_tok} t={t}]", got[t], want, 1e-5)


def attention_case(name, n_head, head_dim, n_swa, positions, ratio, n_comp_rows, selected, n_splits,
                   n_group=1, cap=None, f32=False, tc=False):
    """attention_partial + attention_combine for len(positions) tokens in one launch (token t at
    positions[t], sharing the caches), each against the float64 sink attention of the reference.
    The caches hold f16-rounded values, as kv_finish and compressor_step leave them (the kernel
    stages rows in f16). The output is group-major [n_group, T, heads per group · head_dim].
    f32: attention_partial_f32 (f32 scores and sums, f32 partials; GPUs without full-rate f64),
    against the reference only (the CPU twin's bits are the f64 kernel's). tc: attention_partial_tc
    (f64 on the tensor cores, its sums in another order), against the reference within 1e-6."""
    n_rot = 64
    n_tok = len(positions)
    cap = cap or n_swa
    raw = rng.normal(0, 1, (cap, head_dim)).astype(np.float16).astype(np.float32)
    comp = rng.normal(0, 1, (max(n_comp_rows, 1), head_dim)).astype(np.float16).astype(np.float32)
    q = rng.normal(0, 1, (n_tok, n_head * head_dim)).astype(np.float32)
    sinks = rng.normal(0, 0.5, n_head).astype(np.float32)
    freqs = 10000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)      # float64, as the engine passes them
    out = cuda.device_array(n_tok * n_head * head_dim, np.float32)
    out_q = cuda.device_array(n_tok * n_head * head_dim, np.int8)
    out_d = cuda.device_array(n_tok * n_head * head_dim // 32, np.float32)
    use_selected = selected is not None
    sels = [np.asarray(sl, np.int32) for sl in selected] if use_selected else [np.zeros(1, np.int32)] * n_tok
    width = max(len(sl) for sl in sels)
    sel = np.zeros((n_tok, width), np.int32)
    for t, sl in enumerate(sels):
        sel[t, :len(sl)] = sl
    part_t = np.float32 if f32 else np.float64
    part_max = cuda.device_array((n_tok, n_head, n_splits), part_t)
    part_den = cuda.device_array((n_tok, n_head, n_splits), part_t)
    part_acc = cuda.device_array((n_tok, n_head, n_splits, head_dim), part_t)
    d_pos = cuda.to_device(np.asarray(positions, np.int32))
    grid = ((n_head + ops.ATTN_HEADS - 1) // ops.ATTN_HEADS, n_splits, n_tok)
    kernel = ops.attention_partial_f32 if f32 else ops.attention_partial_tc if tc else ops.attention_partial
    kernel[grid, ops.ATTN_THREADS](
        cuda.to_device(q), cuda.to_device(raw), cuda.to_device(comp), cuda.to_device(sel),
        cuda.to_device(np.array([len(sl) for sl in sels], np.int32)), d_pos, n_swa, ratio, use_selected, head_dim,
        part_max, part_den, part_acc)
    ops.combine_kernel(n_splits)[(n_head, head_dim // (2 * ops.COMBINE_THREADS) or 1, n_tok), ops.COMBINE_THREADS](
        part_max, part_den, part_acc, cuda.to_device(sinks), 0, d_pos, head_dim, n_rot, cuda.to_device(freqs),
        n_group, out, out_q, out_d)
    flat = out.copy_to_host()
    close(f"q8_0 of the attention output, {name}", (out_q.copy_to_host().reshape(-1, 32) *
          out_d.copy_to_host()[:, None]).reshape(-1), ref.q8_0_activation(flat), 1e-6)
    got = flat.reshape(n_group, n_tok, -1).transpose(1, 0, 2).reshape(n_tok, -1)
    rope = ref.Rope(n_rot, 10000.0, False)
    for t, pos in enumerate(positions):
        n_raw = min(pos + 1, n_swa)
        comp_rows = sels[t] if use_selected else np.arange((pos + 1) // ratio if ratio else 0)
        rows = np.concatenate([raw[[(pos + 1 - n_raw + i) % cap for i in range(n_raw)]], comp[comp_rows]]).astype(np.float64)
        want = [rope.apply(ref.sink_attention(q[t].reshape(n_head, head_dim)[h].astype(np.float64)[None, :], rows,
                                              sinks[h:h + 1].astype(np.float64), head_dim), pos, inverse=True)[0]
                for h in range(n_head)]
        close(f"sink attention, {name} (T={n_tok} t={t}, {len(rows)} rows)", got[t], np.concatenate(want),
              1e-6 if tc else 1e-5)
        if f32 or tc:
            continue
        # the CPU engine's twin (f64 scores and sums, one rounding, then the f64 inverse RoPE): same bits
        twin = cpu_ops.sink_attention(q[t].reshape(n_head, head_dim), raw, (pos + 1 - n_raw) % cap, n_raw, comp,
                                      np.asarray(comp_rows, np.int64), sinks, np.float32(1.0 / math.sqrt(head_dim)))
        cpu_ops.rope_tail_inplace(twin, pos, freqs, True)
        equals_twin(f"sink attention, {name} (T={n_tok} t={t})", got[t], twin.reshape(-1))


def check_attention():
    # the indexer's selection (ratio 4), uneven tiles over splits, heads not a multiple of 8
    attention_case("selected", 3, 128, 8, [21], 4, 10, [[0, 2, 3]], 3)
    # few rows: most splits empty (neutral partials)
    attention_case("short context", 9, 128, 16, [4], 128, 0, None, 6)
    # more rows than one tile in a split (online softmax across tiles), the model's head_dim
    attention_case("several tiles", 8, 512, 40, [300], 4, 75, None, 2)
    # a prefill chunk: 3 tokens in one launch, each with its own window in a ring of n_swa + chunk
    # rows, its own compressed rows and selection; two output groups (group-major layout)
    attention_case("chunk", 4, 128, 8, [9, 10, 11], 4, 3, [[0, 1], [1], [0, 2]], 1, n_group=2, cap=11)
    attention_case("chunk, all rows", 8, 128, 6, [6, 7], 4, 2, None, 2, cap=8)
    # the f32 kernel (--attention f32): the selection over splits, a chunk
    attention_case("selected, f32", 3, 128, 8, [21], 4, 10, [[0, 2, 3]], 3, f32=True)
    attention_case("chunk, f32", 4, 128, 8, [9, 10, 11], 4, 3, [[0, 1], [1], [0, 2]], 1, n_group=2, cap=11, f32=True)
    # f64 on the tensor cores (ATTN_TC): the selection, several tiles of the model's head_dim, a chunk
    attention_case("selected, tensor cores", 3, 128, 8, [21], 4, 10, [[0, 2, 3]], 3, tc=True)
    attention_case("several tiles, tensor cores", 8, 512, 40, [300], 4, 75, None, 2, tc=True)
    attention_case("chunk, tensor cores", 4, 128, 8, [9, 10, 11], 4, 3, [[0, 1], [1], [0, 2]], 1, n_group=2,
                   cap=11, tc=True)


def check_attention_mma():
    """attention_prefill_mma (tensor cores; in the simulator its mma_f16_acc is computed from the
    PTX fragment layout) against the float64 reference: one block of 16 heads, 512 dims; token 0
    over two tiles (a partial last one) of the window and a selection, token 1 under one tile.
    hi + lo f16 splits of q and the weights: ~1e-6 of the scale, tolerance 1e-5."""
    from ds4py.kernels import testdata as TD
    n_head, head_dim = ops.ATTN_MMA_HEADS, ops.ATTN_MMA_DIM
    inp = TD.attention_inputs(rng, n_head, head_dim, 40, 44, 4, 12, [45, 6], [[0, 2, 3, 5, 7, 8, 9, 10, 11], [1]])
    n_tok = len(inp["pos"])
    part_max = cuda.device_array((n_tok, n_head, 1), np.float64)
    part_den = cuda.device_array((n_tok, n_head, 1), np.float64)
    part_acc = cuda.device_array((n_tok, n_head, 1, head_dim), np.float64)
    ops.attention_prefill_mma[(1, 1, n_tok), ops.ATTN_MMA_THREADS](
        *[cuda.to_device(inp[k]) for k in ("q", "raw", "comp", "selected", "n_selected", "pos")],
        inp["n_swa"], inp["ratio"], inp["use_selected"], part_max, part_den, part_acc)
    m = part_max.copy_to_host()[:, :, 0].astype(np.float64)
    den = part_den.copy_to_host()[:, :, 0].astype(np.float64)
    acc = part_acc.copy_to_host()[:, :, 0]
    lse, out = TD.attention_reference(inp, head_dim)
    for t in range(n_tok):
        close(f"attention_prefill_mma log Σexp, t={t}", m[t] + np.log(den[t]), lse[t], 1e-5)
        close(f"attention_prefill_mma output, t={t}", acc[t] / den[t][:, None], out[t], 1e-5)


def check_indexer_select():
    """One launch for three tokens (grid (1, T)), each with its own row count and top_k cut, as
    the rows of [T, rows] scores; every token must equal the stable top-k. 4500 rows: more keys
    than the kernel keeps in shared memory (SELECT_CACHE), read from global memory instead."""
    cases = ((40, 8), (200, 16), (97, 100), (ops.SELECT_CACHE + 404, 16))
    top_k = 16
    width = max(n for n, _ in cases)
    scores = np.full((len(cases), width), -9.0, np.float32)
    pos = np.zeros(len(cases), np.int32)
    for t, (n_rows, k) in enumerate(cases):
        pos[t] = 4 * n_rows - 1
        sc = rng.normal(0, 1, n_rows).astype(np.float32)
        sc[5] = sc[9] = sc[17] = np.sort(sc)[-min(top_k, n_rows)]  # ties at the threshold
        scores[t, :n_rows] = sc
    for n_tok in (1, len(cases)):
        for first in range(0, len(cases), n_tok):
            rows = slice(first, first + n_tok)
            sel = cuda.device_array((n_tok, top_k), np.int32)
            n_sel = cuda.device_array(n_tok, np.int32)
            ops.indexer_select[(1, n_tok), BLOCK](cuda.to_device(scores[rows]).view(np.uint32),
                                                  cuda.to_device(pos[rows]), top_k, sel, n_sel)
            got_all, n_all = sel.copy_to_host(), n_sel.copy_to_host()
            for t in range(n_tok):
                n_rows = cases[first + t][0]
                k = min(top_k, n_rows)
                want = np.sort(np.argsort(-scores[first + t, :n_rows].astype(np.float64), kind="stable")[:k])
                got = got_all[t, :n_all[t]]
                ok = n_all[t] == k and np.array_equal(got, want)
                print(f"{'ok ' if ok else 'BAD'} indexer_select n={n_rows} k={top_k} [T={n_tok} t={t}]")
                if not ok:
                    print(got, want)
                    raise SystemExit(1)


def check_indexer_scores(slow):
    """Both forms (decode: ISD_ROWS rows per block, a thread per (row, head); prefill: 4 x 4 scores
    a thread in blocks of ISC_TOKENS tokens x ISC_ROWS rows) against the reference, and against
    each other bit for bit (the same dims and heads order): a small indexer, ds4's 64 heads x 128
    dims, and a chunk of 37 consecutive positions (two token blocks, the second partial; rows in
    three row blocks, each token seeing its own count). ds4's shape takes ~3 minutes in the
    simulator (64 threads x 16 scores x 64 heads x 128 dims in Python): slow only."""
    check_indexer_scores_shape(4, 64, 80, [39, 30, 300])      # 10, 7, 75 rows emitted (three blocks)
    check_indexer_scores_shape(2, 32, 90, list(range(300, 337)), [0, 31, 32, 36])   # 75 .. 84 rows
    if slow:
        check_indexer_scores_shape(64, 128, 12, [41, 3])      # 10, 0 rows


def fp4_values(shape):
    """Random FP4 (e2m1) values with signs, scaled by 2^-2 .. 2^2."""
    return (cpu_ops.FP4_GRID[rng.integers(0, 8, shape)] * rng.choice([-1.0, 1.0], shape)
            * np.exp2(rng.integers(-2, 3, shape))).astype(np.float32)


def check_indexer_scores_shape(n_ihead, idx_dim, cap, positions, decode_tokens=None):
    """decode_tokens: the tokens the decode form runs for (all by default; a few of a long chunk,
    whose every token would take the simulator minutes)."""
    positions = np.array(positions, np.int32)         # rows past (pos + 1) // 4 stay untouched
    n_tok = len(positions)
    # FP4 values (the FP4 grid times powers of two), as indexer_q and the indexer compressor leave
    # queries and rows: their dots are exact in f32, so NVVM's fused multiply-adds change no bit
    iq = fp4_values((n_tok, n_ihead * idx_dim))
    head_w = rng.normal(0, 1, (n_tok, n_ihead)).astype(np.float32)
    icache = fp4_values((cap, idx_dim))
    scale = 1 / math.sqrt(idx_dim * n_ihead)
    args = (cuda.to_device(iq), cuda.to_device(head_w), scale, cuda.to_device(icache),
            cuda.to_device(positions), n_ihead, idx_dim)
    by_row = cuda.to_device(np.full((n_tok, cap), -7.0, np.float32))
    ops.indexer_scores_rows[ops.indexer_score_grid(cap, n_tok), ops.ISC_THREADS](*args, n_tok, by_row)
    dec = np.arange(n_tok) if decode_tokens is None else np.array(decode_tokens)
    by_head = cuda.to_device(np.full((len(dec), cap), -7.0, np.float32))
    ops.indexer_scores[(ops.indexer_decode_blocks(cap), len(dec)), ops.ISD_THREADS](
        cuda.to_device(iq[dec]), cuda.to_device(head_w[dec]), scale, cuda.to_device(icache),
        cuda.to_device(positions[dec]), n_ihead, idx_dim, by_head)
    got, got_head = by_row.copy_to_host(), by_head.copy_to_host()
    for t, pos in enumerate(positions):
        n = (pos + 1) // 4
        want = np.maximum(icache[:n].astype(np.float64) @ iq[t].reshape(n_ihead, idx_dim).T.astype(np.float64), 0) @ (head_w[t] * scale)
        close(f"indexer_scores [T={n_tok} t={t}]", got[t, :n], want, 1e-5)
        equals_twin(f"indexer_scores [T={n_tok} t={t}]", got[t, :n],
                    cpu_ops.indexer_scores(icache, n, iq[t].reshape(n_ihead, idx_dim), head_w[t] * np.float32(scale)))
        assert np.all(got[t, n:] == -7.0), "indexer_scores_rows wrote rows that were not emitted"
    for k, t in enumerate(dec):
        assert np.all(got_head[k, (positions[t] + 1) // 4:] == -7.0), "indexer_scores wrote rows that were not emitted"
    same = np.array_equal(got[dec].view(np.uint32), got_head.view(np.uint32))
    print(f"{'ok ' if same else 'BAD'} indexer_scores (decode) == indexer_scores_rows (prefill) == the CPU twin "
          f"bit for bit ({n_ihead} heads x {idx_dim})")
    if not same:
        raise SystemExit(1)


def check_route():
    n_exp, n_used, n_tok = 16, 6, 3
    logits = rng.normal(0, 2, (n_tok, n_exp)).astype(np.float32)
    bias = rng.normal(0, 2, n_exp).astype(np.float32)
    w32 = cuda.to_device(bias)
    ids, rw = cuda.device_array((n_tok, n_used), np.int32), cuda.device_array((n_tok, n_used), np.float32)
    offs = cuda.device_array((n_tok, n_used, 3), np.int64)
    bases = cuda.to_device(np.array([1000, 5000, 9000, 10, 10, 20], np.int64))
    ops.route[(1, n_tok), BLOCK](cuda.to_device(logits), cuda.to_device(np.zeros(n_tok, np.int32)), w32, 0, True,
                                 cuda.to_device(np.zeros(8, np.int32)), 0, False, n_used, 1.5, bases, ids, rw, offs)
    got_ids, got_w, o = ids.copy_to_host(), rw.copy_to_host(), offs.copy_to_host()
    for t in range(n_tok):
        p = np.sqrt(ref.softplus(logits[t].astype(np.float64)))
        want_ids = np.argsort(-(p + bias), kind="stable")[:n_used]
        want_w = p[want_ids] / max(p[want_ids].sum(), 6.103515625e-5) * 1.5
        if not np.array_equal(got_ids[t], want_ids):
            print("BAD route ids", t, got_ids[t], want_ids)
            raise SystemExit(1)
        close(f"route weights [T={n_tok} t={t}]", got_w[t], want_w, 1e-6)
        twin_ids = cpu_ops.router_topk(logits[t], bias, n_used)
        equals_twin(f"route ids [T={n_tok} t={t}]", got_ids[t], twin_ids)
        equals_twin(f"route weights [T={n_tok} t={t}]", got_w[t], cpu_ops.router_weights(logits[t], twin_ids, 1.5, True))
        assert np.array_equal(o[t, :, 0], 1000 + 10 * want_ids) and np.array_equal(o[t, :, 2], 9000 + 20 * want_ids)
    # hash routing: token t's ids are tid2eid[token_buf[t]]
    table = rng.integers(0, n_exp, (5, n_used)).astype(np.int32)
    toks = np.array([3, 0, 4], np.int32)
    ops.route[(1, n_tok), BLOCK](cuda.to_device(logits), cuda.to_device(toks), w32, 0, False,
                                 cuda.to_device(table.reshape(-1)), 0, True, n_used, 1.5, bases, ids, rw, offs)
    if not np.array_equal(ids.copy_to_host(), table[toks]):
        print("BAD hash route ids", ids.copy_to_host(), table[toks])
        raise SystemExit(1)
    print(f"ok  route ids and expert offsets, bias and hash routing [T={n_tok}]")


def compressor_twin(kv, sc, ape, norm, ratio, dim, n_rot, freqs, indexer_lane):
    """The CPU engine's compressor (forward_cpu's _compress) over every position of kv / sc."""
    coff = 2 if ratio == 4 else 1
    kv_state = np.zeros((coff * ratio, coff * dim), np.float32)
    score_state = np.full((coff * ratio, coff * dim), cpu_ops.NEG_INF, np.float32)
    rows = []
    for pos in range(len(kv)):
        cpu_ops.compressor_store(kv_state, score_state, kv[pos], sc[pos], ape[pos % ratio], ratio, pos)
        if (pos + 1) % ratio == 0:
            pooled = cpu_ops.compressor_pool(kv_state, score_state, ratio, dim)
            rows.append(cpu_ops.compressed_row(pooled, norm, 1e-6, pos + 1 - ratio, freqs, indexer_lane, dim - n_rot))
            if ratio == 4:
                cpu_ops.compressor_shift(kv_state, score_state)
    return np.array(rows)


def check_compressor():
    """Tokens fed one launch per token (T = 1) and in chunks of several tokens per launch (the
    kernel loops over them in order); both against the reference's rows."""
    n_rot = 64
    freqs_np = ref.Rope(n_rot, 160000.0, False)
    freqs = 160000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)     # float64
    for ratio, dim, lane, chunk in ((4, 128, "attn", 1), (4, 64, "index", 1), (8, 128, "attn", 1),
                                    (4, 128, "attn", 5), (4, 64, "index", 3), (8, 128, "attn", 7),
                                    (8, 128, "attn", 3), (4, 64, "index", 9)):
        coff = 2 if ratio == 4 else 1
        width = coff * dim
        ape = rng.normal(0, 0.1, (ratio, width)).astype(np.float16)
        norm = (1 + rng.uniform(-0.1, 0.1, dim)).astype(np.float32)
        w16 = cuda.to_device(ape.reshape(-1))
        w32 = cuda.to_device(norm)
        st = ref.CompressorState.new(ratio, dim)
        kv_state = cuda.to_device(np.zeros((coff * ratio, width), np.float32))
        score_state = cuda.to_device(np.full((coff * ratio, width), ops.NEG_INF, np.float32))
        cache = cuda.to_device(np.zeros((6, dim), np.float32))
        gate_diag = rng.uniform(0.5, 2.0, width)
        weights = {"c_kv.weight": np.eye(width), "c_gate.weight": np.diag(gate_diag),
                   "c_ape.weight": ape.astype(np.float64), "c_norm.weight": norm.astype(np.float64)}
        ref_w = type("W", (), dict(get=lambda self, name: weights[name]))()
        spec = type("S", (), dict(rms_eps=1e-6, n_nope=dim - n_rot))()
        want_rows = []
        n_pos = 3 * ratio
        xs = rng.normal(0, 1, (n_pos, width)).astype(np.float32)
        for pos in range(n_pos):
            row = ref.compressor_step(ref_w, spec, "c", st, xs[pos].astype(np.float64), pos, freqs_np,
                                      ("comp" if lane == "attn" else "index", 0))
            if row is not None:
                want_rows.append(row)
        # the prefill form (compressor_chunk_*) on its own copy of the state
        c_kv, c_sc, c_cache = (cuda.to_device(a.copy_to_host()) for a in (kv_state, score_state, cache))
        n_state = coff * ratio
        for first in range(0, n_pos, chunk):
            T = min(chunk, n_pos - first)
            # identity / diagonal projections: kv_t = x and sc_t = gate ⊙ x, as the two halves of
            # one [T, 2·width] pair output (strided views, as the engine passes them)
            pair = np.concatenate([xs[first:first + T], (gate_diag * xs[first:first + T]).astype(np.float32)], axis=1)
            d_pair = cuda.to_device(pair)
            ops.compressor_step[1, 256](d_pair[:, :width], d_pair[:, width:], w16, 0, w32, 0,
                                        1e-6, cuda.to_device(np.arange(first, first + T, dtype=np.int32)), ratio,
                                        dim, n_rot, cuda.to_device(freqs), lane == "index", kv_state, score_state, cache)
            if chunk > 1:
                ext_kv = cuda.device_array((n_state + T, width), np.float32)
                ext_sc = cuda.device_array((n_state + T, width), np.float32)
                ops.compressor_chunk_stage[n_state + T, 64](d_pair[:, :width], d_pair[:, width:], w16, 0, first,
                                                            ratio, c_kv, c_sc, ext_kv, ext_sc)
                n_rows = (first + T) // ratio - first // ratio
                if n_rows:
                    ops.compressor_chunk_rows[n_rows, 256](ext_kv, ext_sc, n_state, first, ratio, dim, w32, 0, 1e-6,
                                                           n_rot, cuda.to_device(freqs), lane == "index", c_cache)
                ops.compressor_chunk_carry[(width + 63) // 64, 64](ext_kv, ext_sc, first, T, ratio, c_kv, c_sc)
        got = cache.copy_to_host()[:len(want_rows)]
        close(f"compressor ratio {ratio} {lane} ({len(want_rows)} rows, {chunk} tokens per launch)", got,
              np.array(want_rows), 2e-3)
        equals_twin(f"compressor ratio {ratio} {lane} rows, {chunk} tokens per launch", got,
                    compressor_twin(xs, (gate_diag * xs).astype(np.float32), ape.astype(np.float32), norm, ratio,
                                    dim, n_rot, freqs, lane == "index"))
        if chunk > 1:
            for name, a, b in (("rows", cache, c_cache), ("kv state", kv_state, c_kv), ("score state", score_state, c_sc)):
                if not np.array_equal(a.copy_to_host(), b.copy_to_host()):
                    print(f"BAD compressor_chunk {name} (ratio {ratio}, {chunk} tokens): differs from compressor_step")
                    raise SystemExit(1)
            print(f"ok  compressor_chunk ratio {ratio} {lane}, {chunk} tokens per chunk: rows and state bitwise "
                  f"equal to compressor_step")


def check_glue():
    """RMSNorm + Q8_0 (an all-zero block included), SwiGLU + Q8_0, two-pass argmax. (The vector
    Q8_0 kernel is kernels/cuda.py's, checked bit for bit against the CPU twin on the GPU.)"""
    n = 512
    x = rng.normal(0, 1, n).astype(np.float32)
    x[64:96] = 0.0
    xq, xd = cuda.device_array(n, np.int8), cuda.device_array(n // 32, np.float32)

    def dequant():
        return (xq.copy_to_host().reshape(-1, 32).astype(np.float64) * xd.copy_to_host()[:, None]).reshape(-1)
    norm = (1 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)
    for n_tok in (1, 3):
        xs = rng.normal(0, 1, (n_tok, n)).astype(np.float32)
        xs[0, 64:96] = 0.0
        # the input as the engine passes it: a column range of a [T, n + 2·n] pair output
        pair = cuda.to_device(np.concatenate([xs, rng.normal(0, 1, (n_tok, 2 * n)).astype(np.float32)], axis=1))
        out = cuda.device_array((n_tok, n), np.float32)
        tq, td = cuda.device_array((n_tok, n), np.int8), cuda.device_array((n_tok, n // 32), np.float32)
        ops.rmsnorm_q8[(1, n_tok), BLOCK](pair[:, :n], cuda.to_device(norm), 0, 1e-6, out, tq, td)
        o, q, d = out.copy_to_host(), tq.copy_to_host(), td.copy_to_host()
        for t in range(n_tok):
            close(f"rmsnorm_q8 x [T={n_tok} t={t}]", o[t], ref.rms_norm(xs[t].astype(np.float64), norm, 1e-6), 1e-5)
            close(f"rmsnorm_q8 q8 [T={n_tok} t={t}]", (q[t].reshape(-1, 32) * d[t][:, None]).reshape(-1),
                  ref.q8_0_activation(o[t]), 1e-6)
        gate = rng.normal(0, 3, (n_tok, n)).astype(np.float32)
        up = rng.normal(0, 3, (n_tok, n)).astype(np.float32)
        gu = cuda.to_device(np.concatenate([gate, up], axis=1))
        ops.swiglu_q8[(1, n_tok), BLOCK](gu[:, :n], gu[:, n:], 2.5, out, tq, td)
        o, q, d = out.copy_to_host(), tq.copy_to_host(), td.copy_to_host()
        same = np.array_equal(o.view(np.uint32), cpu_ops.swiglu_clamped_rows(gate, up, 2.5).view(np.uint32))
        print(f"{'ok ' if same else 'BAD'} swiglu_q8 mid [T={n_tok}] = the CPU twin, bit for bit (kernels/numerics.py)")
        if not same:
            raise SystemExit(1)
        for t in range(n_tok):
            g = np.minimum(gate[t].astype(np.float64), 2.5)
            want = ref.silu(g) * np.clip(up[t], -2.5, 2.5)
            close(f"swiglu_q8 mid [T={n_tok} t={t}]", o[t], want, 1e-5)
            close(f"swiglu_q8 q8 [T={n_tok} t={t}]", (q[t].reshape(-1, 32) * d[t][:, None]).reshape(-1),
                  ref.q8_0_activation(o[t]), 1e-6)
    # group-major -> token-major (the grouped output projection's results)
    n_group, width, n_tok = 3, 40, 4
    src = rng.normal(0, 1, (n_group, n_tok, width)).astype(np.float32)
    dst = cuda.device_array(n_tok * n_group * width, np.float32)
    ops.groups_to_tokens[(1, n_tok), 64](cuda.to_device(src.reshape(-1)), n_group, width, dst)
    ok = np.array_equal(dst.copy_to_host().reshape(n_tok, n_group * width), src.transpose(1, 0, 2).reshape(n_tok, -1))
    print(f"{'ok ' if ok else 'BAD'} groups_to_tokens")
    if not ok:
        raise SystemExit(1)
    # embed: token t's row for every stream
    n_embd, n_hc = 64, 4
    table = rng.normal(0, 1, (10, n_embd)).astype(np.float16)
    toks = np.array([7, 2, 7], np.int32)
    state = cuda.device_array((3, n_hc, n_embd), np.float32)
    ops.embed[(2, 3), 32](cuda.to_device(toks), cuda.to_device(table.reshape(-1)), 0, n_embd, n_hc, state)
    ok = np.array_equal(state.copy_to_host(), np.repeat(table[toks].astype(np.float32)[:, None], n_hc, axis=1))
    print(f"{'ok ' if ok else 'BAD'} embed [T=3]")
    if not ok:
        raise SystemExit(1)
    logits = rng.normal(0, 1, 5000).astype(np.float32)
    top = int(np.argmax(logits))
    logits[4321] = logits[top]                     # a tie: the lower index wins
    n_blocks = ops.ARGMAX_BLOCKS if ops.USE_SHUFFLES else 4      # the simulator is slow per thread
    part_val = cuda.device_array(n_blocks, np.float32)
    part_idx = cuda.device_array(n_blocks, np.int32)
    token = cuda.device_array(1, np.int32)
    for forbid in (-1, min(top, 4321)):
        ops.argmax_partial[n_blocks, BLOCK](cuda.to_device(logits), cuda.to_device(np.array([forbid], np.int32)),
                                                   part_val, part_idx)
        ops.argmax_finish[1, BLOCK](part_val, part_idx, token)
        masked = logits.copy()
        if forbid >= 0:
            masked[forbid] = -np.inf
        got, want_tok = int(token.copy_to_host()[0]), int(np.argmax(masked))
        if got != want_tok:
            print(f"BAD argmax (forbid {forbid}): {got} != {want_tok}")
            raise SystemExit(1)
    print("ok  argmax (ties to the lower index, forbidden token skipped)")


def check_group_tiles():
    """kernels/cuda.py's one-block grouping (_tiles_on_device) against group_tiles on the host: the
    same tiles (expert offsets, counts), the same (token, slot) pairs per expert (their order inside
    an expert's group follows the atomics), zeros past each count, count 0 past the used tiles."""
    from ds4py.kernels import cuda as qk
    n_tok, n_used, n_exp = 37, 6, 40
    ids = np.stack([rng.choice(n_exp, n_used, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[:, 0] = 5                                  # one expert in every token: several full tiles
    table = np.arange(n_exp * 3, dtype=np.int64).reshape(n_exp, 3) * 1000
    for T in (4, 8, 16):
        off_h, tok_h, slot_h, cnt_h = qk.group_tiles(ids, table, T)
        off_d, tok_d, slot_d, cnt_d = (a.copy_to_host() for a in
                                       qk._tiles_on_device(cuda.to_device(ids), cuda.to_device(table), T, 0))
        n = len(cnt_h)
        ok = np.array_equal(cnt_d[:n], cnt_h) and not cnt_d[n:].any() and \
            np.array_equal(off_d[:3 * n].reshape(n, 3), off_h)
        tok_d, slot_d = tok_d[:n * T].reshape(n, T), slot_d[:n * T].reshape(n, T)
        for e in np.unique(ids):
            tiles = np.where(off_h[:, 0] == table[e, 0])[0]
            pairs_h = sorted((tok_h[r, j], slot_h[r, j]) for r in tiles for j in range(cnt_h[r]))
            pairs_d = sorted((tok_d[r, j], slot_d[r, j]) for r in tiles for j in range(cnt_d[r]))
            ok = ok and pairs_h == pairs_d and all(not tok_d[r, cnt_d[r]:].any() and not slot_d[r, cnt_d[r]:].any()
                                                   for r in tiles)
        print(f"{'ok ' if ok else 'BAD'} moe_prefill grouping on the device, tiles of {T}: {n} tiles "
              f"as group_tiles")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    import time
    t0 = time.time()
    check_glue()
    print(f"   ({time.time() - t0:.0f} s)")
    check_compressor()
    print(f"   ({time.time() - t0:.0f} s)")
    # the slow cases take minutes each in the simulator (attention_prefill_mma ~11: 128 threads x
    # 512 dims in Python): on the GPU always, in the simulator with --slow after the seed
    slow = not SIMULATOR or "--slow" in sys.argv
    check_hc(1)
    check_hc(2)
    if slow:                        # a whole group of hc_mix_tokens' HC_TOKENS tokens and a short one
        check_hc(5)
    check_qat_and_rope(1)
    check_qat_and_rope(3)
    print(f"   ({time.time() - t0:.0f} s)")
    check_attention()
    if slow:
        check_attention_mma()
    print(f"   ({time.time() - t0:.0f} s)")
    check_indexer_select()
    check_indexer_scores(slow)
    check_route()
    check_group_tiles()
    print("all cuda_ops simulator checks passed")
