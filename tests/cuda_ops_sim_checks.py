"""The non-quant CUDA ops checked in Numba's CUDA simulator against the float64 reference.

Run by test_cuda_ops_sim.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (the simulator must be
chosen before numba is imported). Each check draws fresh random inputs and compares with the
reference's functions (ds4py/reference.py), the oracle written from ds4-model.md.
"""

import math
import sys

import numpy as np
from numba import cuda

from ds4py import reference as ref
from ds4py.kernels import cuda_ops as ops

rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
BLOCK = ops.BLOCK


def close(name, got, want, tol):
    err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    scale = float(np.max(np.abs(want))) or 1.0
    ok = err <= tol * scale
    print(f"{'ok ' if ok else 'BAD'} {name}: max|Δ| {err:.3g} (scale {scale:.3g}, tol {tol:g})")
    if not ok:
        raise SystemExit(1)


def check_hc():
    n_hc, n_embd = 4, 256
    mix_rows = (2 + n_hc) * n_hc
    state = rng.normal(0, 1, (n_hc, n_embd)).astype(np.float32)
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
    d_state = cuda.to_device(state)
    chunk = 128                                    # two chunks per stream
    n_chunks = n_hc * n_embd // chunk
    part_dot = cuda.device_array((mix_rows, n_chunks), np.float32)
    part_sq = cuda.device_array(n_chunks, np.float64)
    ops.hc_mix_partial[(mix_rows, n_chunks), 64](d_state, d_arena.view(np.float16), 0, chunk, part_dot, part_sq)

    def mix_of(part_dot, part_sq, flat):
        pd, ps = part_dot.copy_to_host().astype(np.float64), part_sq.copy_to_host()
        close("Σx² partials", ps.sum(), np.sum(flat ** 2), 1e-6)
        return pd.sum(1) / np.sqrt(ps.sum() / flat.size + 1e-6)

    flat = state.reshape(-1).astype(np.float64)
    want_mix = fn.astype(np.float64) @ (flat / np.sqrt(np.mean(flat ** 2) + 1e-6))
    close("hc_mix partials", mix_of(part_dot, part_sq, flat), want_mix, 1e-5)
    post, comb = cuda.device_array(n_hc, np.float32), cuda.device_array(n_hc * n_hc, np.float32)
    x, xq, xd = cuda.device_array(n_embd, np.float32), cuda.device_array(n_embd, np.int8), cuda.device_array(n_embd // 32, np.float32)
    ops.hc_pre[2, BLOCK](d_state, part_dot, part_sq, d_arena.view(np.float32), off32, off32 + 3, off32 + 3 + mix_rows,
                         20, 1e-6, 1e-6, post, comb, x, xq, xd)
    m = want_mix
    pre_w = ref.sigmoid(m[:n_hc] * scale[0] + base[:n_hc]) + 1e-6
    post_w = 2 * ref.sigmoid(m[n_hc:2 * n_hc] * scale[1] + base[n_hc:2 * n_hc])
    comb_w = ref.sinkhorn((m[2 * n_hc:] * scale[2] + base[2 * n_hc:]).reshape(n_hc, n_hc), 20, 1e-6)
    close("hc post gates", post.copy_to_host(), post_w, 1e-6)
    close("hc sinkhorn", comb.copy_to_host(), comb_w.reshape(-1), 1e-5)
    y = (pre_w[:, None] * state).sum(0)
    close("hc_pre x", x.copy_to_host(), ref.rms_norm(y, norm, 1e-6), 1e-5)
    q, d = xq.copy_to_host(), xd.copy_to_host()
    close("q8_0 of x", (q.reshape(-1, 32) * d[:, None]).reshape(-1), ref.q8_0_activation(x.copy_to_host()), 1e-6)
    # hc_post: X_new[j] = post[j] (f_a + f_b) + Σ_i C[i][j] X_old[i], in place
    f_a = rng.normal(0, 1, n_embd).astype(np.float32)
    f_b = rng.normal(0, 1, n_embd).astype(np.float32)
    want = ref.hc_post((f_a + f_b).astype(np.float64), state.astype(np.float64), post.copy_to_host(),
                       comb.copy_to_host().reshape(n_hc, n_hc))
    ops.hc_post[4, 64](d_state, cuda.to_device(f_a), cuda.to_device(f_b), post, comb)
    close("hc_post", d_state.copy_to_host(), want, 1e-5)


def check_qat_and_rope():
    head_dim, n_rot = 128, 64
    # FP8 on the nope dims of a kv row via kv_finish, with RoPE and f16 rounding
    kv = rng.normal(0, 1, head_dim).astype(np.float32) * np.float32(3.0)
    norm = (1 + rng.uniform(-0.1, 0.1, head_dim)).astype(np.float32)
    pos = 37
    spec = type("S", (), dict(n_rot=n_rot, rope_freq_base=10000.0))()
    freqs = (10000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)).astype(np.float32)
    raw = cuda.device_array((8, head_dim), np.float32)
    ops.kv_finish[1, BLOCK](cuda.to_device(kv.copy()), cuda.to_device(norm), 0, 1e-6,
                            cuda.to_device(np.array([pos], np.int32)), cuda.to_device(freqs), n_rot, raw)
    rope = ref.Rope(n_rot, 10000.0, False)
    want = rope.apply(ref.rms_norm(kv.astype(np.float64), norm, 1e-6)[None, :], pos)[0]
    want[:head_dim - n_rot] = ref.fp8_e4m3_sim(want[:head_dim - n_rot])
    close("kv_finish (norm, rope, fp8, f16)", raw.copy_to_host()[pos % 8], ref.f16_round(want), 2e-3)
    # Hadamard + FP4 on indexer heads (rope first)
    n_ihead, idx_dim = 2, 64
    iq = rng.normal(0, 1, n_ihead * idx_dim).astype(np.float32)
    d_iq = cuda.to_device(iq.copy())
    ops.indexer_q[n_ihead, 64](d_iq, idx_dim, n_rot, cuda.to_device(np.array([pos], np.int32)), cuda.to_device(freqs))
    want = np.concatenate([ref.indexer_qat(rope.apply(h[None, :], pos)[0]) for h in iq.reshape(n_ihead, idx_dim).astype(np.float64)])
    close("indexer_q (rope, hadamard, fp4)", d_iq.copy_to_host(), want, 1e-5)


def attention_case(name, n_head, head_dim, n_swa, pos, ratio, n_comp_rows, selected, n_splits):
    """attention_partial + attention_combine against the float64 sink attention of the reference.
    The caches hold f16-rounded values, as kv_finish and compressor_step leave them (the kernel
    stages rows in f16)."""
    n_rot = 64
    cap = n_swa
    raw = rng.normal(0, 1, (cap, head_dim)).astype(np.float16).astype(np.float32)
    comp = rng.normal(0, 1, (max(n_comp_rows, 1), head_dim)).astype(np.float16).astype(np.float32)
    q = rng.normal(0, 1, n_head * head_dim).astype(np.float32)
    sinks = rng.normal(0, 0.5, n_head).astype(np.float32)
    freqs = (10000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)).astype(np.float32)
    out = cuda.device_array(n_head * head_dim, np.float32)
    use_selected = selected is not None
    sel = np.asarray(selected if use_selected else [0], np.int32)
    part_max = cuda.device_array((n_head, n_splits), np.float32)
    part_den = cuda.device_array((n_head, n_splits), np.float32)
    part_acc = cuda.device_array((n_head, n_splits, head_dim), np.float32)
    d_pos = cuda.to_device(np.array([pos], np.int32))
    grid = ((n_head + ops.ATTN_HEADS - 1) // ops.ATTN_HEADS, n_splits)
    ops.attention_partial[grid, ops.ATTN_THREADS](
        cuda.to_device(q), cuda.to_device(raw), cuda.to_device(comp), cuda.to_device(sel),
        cuda.to_device(np.array([len(sel)], np.int32)), d_pos, n_swa, ratio, use_selected, head_dim,
        part_max, part_den, part_acc)
    ops.attention_combine[(n_head, head_dim // (2 * ops.COMBINE_THREADS) or 1), ops.COMBINE_THREADS](
        part_max, part_den, part_acc, cuda.to_device(sinks), 0, d_pos, head_dim, n_rot, cuda.to_device(freqs), out)
    n_raw = min(pos + 1, n_swa)
    comp_rows = sel if use_selected else np.arange((pos + 1) // ratio if ratio else 0)
    rows = np.concatenate([raw[[(pos + 1 - n_raw + i) % cap for i in range(n_raw)]], comp[comp_rows]]).astype(np.float64)
    rope = ref.Rope(n_rot, 10000.0, False)
    want = [rope.apply(ref.sink_attention(q.reshape(n_head, head_dim)[h].astype(np.float64)[None, :], rows,
                                          sinks[h:h + 1].astype(np.float64), head_dim), pos, inverse=True)[0]
            for h in range(n_head)]
    close(f"sink attention, {name} ({len(rows)} rows)", out.copy_to_host(), np.concatenate(want), 1e-5)


def check_attention():
    # the indexer's selection (ratio 4), uneven tiles over splits, heads not a multiple of 8
    attention_case("selected", 3, 128, 8, 21, 4, 10, [0, 2, 3], 3)
    # few rows: most splits empty (neutral partials)
    attention_case("short context", 9, 128, 16, 4, 128, 0, None, 6)
    # more rows than one tile in a split (online softmax across tiles), the model's head_dim
    attention_case("several tiles", 8, 512, 40, 300, 4, 75, None, 2)


def check_indexer_select():
    for n_rows, top_k in ((40, 8), (200, 16), (97, 100)):
        pos = 4 * n_rows - 1
        scores = rng.normal(0, 1, n_rows).astype(np.float32)
        scores[5] = scores[9] = scores[17] = np.sort(scores)[-min(top_k, n_rows)]  # ties at the threshold
        sel = cuda.device_array(top_k, np.int32)
        n_sel = cuda.device_array(1, np.int32)
        ops.indexer_select[1, BLOCK](cuda.to_device(scores).view(np.uint32), cuda.to_device(np.array([pos], np.int32)),
                                     top_k, sel, n_sel)
        k = min(top_k, n_rows)
        want = np.sort(np.argsort(-scores.astype(np.float64), kind="stable")[:k])
        got = sel.copy_to_host()[:n_sel.copy_to_host()[0]]
        ok = n_sel.copy_to_host()[0] == k and np.array_equal(got, want)
        print(f"{'ok ' if ok else 'BAD'} indexer_select n={n_rows} k={top_k}")
        if not ok:
            print(got, want)
            raise SystemExit(1)


def check_indexer_scores():
    n_ihead, idx_dim, cap, pos = 4, 64, 12, 39          # 10 rows emitted, 2 beyond untouched
    iq = rng.normal(0, 1, n_ihead * idx_dim).astype(np.float32)
    head_w = rng.normal(0, 1, n_ihead).astype(np.float32)
    icache = rng.normal(0, 1, (cap, idx_dim)).astype(np.float32)
    scores = cuda.to_device(np.full(cap, -7.0, np.float32))
    scale = 1 / math.sqrt(idx_dim * n_ihead)
    ops.indexer_scores[cap, 64](cuda.to_device(iq), cuda.to_device(head_w), scale, cuda.to_device(icache),
                                cuda.to_device(np.array([pos], np.int32)), n_ihead, idx_dim, scores)
    n = (pos + 1) // 4
    want = np.maximum(icache[:n].astype(np.float64) @ iq.reshape(n_ihead, idx_dim).T.astype(np.float64), 0) @ (head_w * scale)
    got = scores.copy_to_host()
    close("indexer_scores", got[:n], want, 1e-5)
    assert np.all(got[n:] == -7.0), "indexer_scores wrote rows that were not emitted"


def check_route():
    n_exp, n_used = 16, 6
    logits = rng.normal(0, 2, n_exp).astype(np.float32)
    bias = rng.normal(0, 2, n_exp).astype(np.float32)
    w32 = cuda.to_device(bias)
    ids, rw, offs = cuda.device_array(n_used, np.int32), cuda.device_array(n_used, np.float32), cuda.device_array((n_used, 3), np.int64)
    bases = cuda.to_device(np.array([1000, 5000, 9000, 10, 10, 20], np.int64))
    ops.route[1, BLOCK](cuda.to_device(logits), cuda.to_device(np.array([0], np.int32)), w32, 0, True,
                        cuda.to_device(np.zeros(8, np.int32)), 0, False, n_used, 1.5, bases, ids, rw, offs)
    p = np.sqrt(ref.softplus(logits.astype(np.float64)))
    want_ids = np.argsort(-(p + bias), kind="stable")[:n_used]
    want_w = p[want_ids] / max(p[want_ids].sum(), 6.103515625e-5) * 1.5
    got_ids = ids.copy_to_host()
    if not np.array_equal(got_ids, want_ids):
        print("BAD route ids", got_ids, want_ids)
        raise SystemExit(1)
    close("route weights", rw.copy_to_host(), want_w, 1e-6)
    o = offs.copy_to_host()
    assert np.array_equal(o[:, 0], 1000 + 10 * want_ids) and np.array_equal(o[:, 2], 9000 + 20 * want_ids)
    print("ok  route ids and expert offsets")


def check_compressor():
    n_rot = 64
    freqs_np = ref.Rope(n_rot, 160000.0, False)
    freqs = (160000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)).astype(np.float32)
    for ratio, dim, lane in ((4, 128, "attn"), (4, 64, "index"), (8, 128, "attn")):
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
        for pos in range(3 * ratio):
            # identity / diagonal projections: the kernel gets kv_t = x and sc_t = gate ⊙ x
            x = rng.normal(0, 1, width).astype(np.float32).astype(np.float64)
            row = ref.compressor_step(ref_w, spec, "c", st, x, pos, freqs_np, ("comp" if lane == "attn" else "index", 0))
            if row is not None:
                want_rows.append(row)
            ops.compressor_step[1, 256](cuda.to_device(x.astype(np.float32)),
                                        cuda.to_device((gate_diag * x).astype(np.float32)), w16, 0, w32, 0,
                                        1e-6, cuda.to_device(np.array([pos], np.int32)), ratio, dim, n_rot,
                                        cuda.to_device(freqs), lane == "index", kv_state, score_state, cache)
        got = cache.copy_to_host()[:len(want_rows)]
        close(f"compressor ratio {ratio} {lane} ({len(want_rows)} rows)", got, np.array(want_rows), 2e-3)


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
    out = cuda.device_array(n, np.float32)
    ops.rmsnorm_q8[1, BLOCK](cuda.to_device(x), cuda.to_device(norm), 0, 1e-6, out, xq, xd)
    close("rmsnorm_q8 x", out.copy_to_host(), ref.rms_norm(x.astype(np.float64), norm, 1e-6), 1e-5)
    close("rmsnorm_q8 q8", dequant(), ref.q8_0_activation(out.copy_to_host()), 1e-6)
    gate = rng.normal(0, 3, n).astype(np.float32)
    up = rng.normal(0, 3, n).astype(np.float32)
    ops.swiglu_q8[1, BLOCK](cuda.to_device(gate), cuda.to_device(up), 2.5, out, xq, xd)
    g = np.minimum(gate.astype(np.float64), 2.5)
    want = ref.silu(g) * np.clip(up, -2.5, 2.5)
    close("swiglu_q8 mid", out.copy_to_host(), want, 1e-5)
    close("swiglu_q8 q8", dequant(), ref.q8_0_activation(out.copy_to_host()), 1e-6)
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


if __name__ == "__main__":
    import time
    t0 = time.time()
    check_glue()
    print(f"   ({time.time() - t0:.0f} s)")
    check_compressor()
    check_hc()
    check_qat_and_rope()
    check_attention()
    check_indexer_select()
    check_indexer_scores()
    check_route()
    print("all cuda_ops simulator checks passed")
