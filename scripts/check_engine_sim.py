"""The GPU engine's wiring, run in Numba's CUDA simulator against the CPU engine.

Run by hand (minutes on a laptop): `NUMBA_ENABLE_CUDASIM=1 python scripts/check_engine_sim.py [N]`
compares the first N positions (`--attention f32`: with the f32 decode attention);
`... check_engine_sim.py prefill [N] [CHUNK]` prefills N tokens
with the batched path (chunks of CHUNK) and compares the last logits with the CPU engine and with
N token-by-token decodes, then one decode after the prefill. The quantized matvecs use
dp4a intrinsics that the simulator cannot run, so they are replaced here by host computations
with the same numerics (kernels/cpu.py); everything else (the cuda_ops kernels, the engine's
buffers, offsets, segments and state) runs as written. The point is to catch wiring mistakes
(a wrong tensor, offset, buffer or position) before any GPU time is spent.
"""

import sys
import tempfile

import numpy as np

from ds4py import synth
from ds4py.io.gguf import GGML_F16, GGML_Q8_0
from ds4py.io.spec import open_model
from ds4py.kernels import cpu as ck
from ds4py.kernels import cuda_ops as ops
from numba import cuda

ops.BLOCK = 64                     # fewer simulated threads; every kernel loops over its data
ops.BLOCK2 = 128
ops.ATTN_SPLITS = 4                # decode attention row ranges (the tiny model's rows fit in few)
ops.Q_HEADS_THREADS = 64
import ds4py.forward_cuda as fc    # noqa: E402

fc.BLOCK = 64


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


_ARENAS = {}


def _host_arena(arena):
    """The weights arena on the host, copied once (weights never change during a run)."""
    key = id(arena)
    if key not in _ARENAS:
        _ARENAS[key] = (arena, _host(arena))
    return _ARENAS[key][1]


class HostQuantKernels:
    """Stand-ins for kernels/cuda.py's matvecs and MoE with ds4's numerics, computed on the host."""

    class MoEWorkspace:
        def __init__(self, n_used, n_embd, n_ff):
            self.n_ff = n_ff

    @staticmethod
    def matvec_q8_0(arena, off, rows, K, xq, xd, out, stream=0, scales_last=False):
        w = _host_arena(arena)[off:off + rows * (K // 32) * 34].reshape(rows, K // 32, 34)
        wd = w[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        wq = w[:, :, 2:].copy().view(np.int8).astype(np.int32)
        q = _host(xq).astype(np.int32).reshape(K // 32, 32)
        d = _host(xd).astype(np.float32)
        dots = (wq * q[None]).sum(-1).astype(np.float32)
        out.copy_to_device((wd * d[None] * dots).sum(-1, dtype=np.float32).astype(np.float32))

    @staticmethod
    def matvec_f16(arena, off, rows, K, x, out, stream=0):
        w = _host_arena(arena)[off:off + rows * K * 2].copy().view(np.float16).reshape(rows, K).astype(np.float32)
        out.copy_to_device((w @ _host(x).astype(np.float32)).astype(np.float32))

    @staticmethod
    def quantize_q8_0(x, q, d, stream=0):
        codes, scales = ck.quantize_q8_0(_host(x).astype(np.float32))
        q.copy_to_device(codes)
        d.copy_to_device(scales)

    @staticmethod
    def matvec_q8_0_pair(arena, off_a, rows_a, off_b, rows_b, K, xq, xd, out, stream=0, scales_last=False):
        HostQuantKernels.matvec_q8_0(arena, off_a, rows_a, K, xq, xd, out[:rows_a])
        HostQuantKernels.matvec_q8_0(arena, off_b, rows_b, K, xq, xd, out[rows_a:rows_a + rows_b])

    @staticmethod
    def matvec_f16_pair(arena, off_a, rows_a, off_b, rows_b, K, x, out, stream=0):
        HostQuantKernels.matvec_f16(arena, off_a, rows_a, K, x, out[:rows_a])
        HostQuantKernels.matvec_f16(arena, off_b, rows_b, K, x, out[rows_a:rows_a + rows_b])

    @staticmethod
    def matvec_q8_0_grouped(arena, off, rows, K, n_groups, xq, xd, out, stream=0, scales_last=False):
        per = rows // n_groups
        for g in range(n_groups):
            HostQuantKernels.matvec_q8_0(arena, off + g * per * (K // 32) * 34, per, K, xq[g * K:(g + 1) * K],
                                         xd[g * K // 32:(g + 1) * K // 32], out[g * per:(g + 1) * per])

    @staticmethod
    def _q8_0_rows(arena, off, rows, K, xq, xd):
        """[n_tok, rows] = W · X[t] for each token t (the matvec's numerics, row by row)."""
        w = _host_arena(arena)[off:off + rows * (K // 32) * 34].reshape(rows, K // 32, 34)
        wd = w[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        wq = w[:, :, 2:].copy().view(np.int8).astype(np.int32)
        q = _host(xq).astype(np.int32).reshape(-1, K // 32, 32)
        d = _host(xd).astype(np.float32).reshape(-1, K // 32)
        out = np.empty((q.shape[0], rows), np.float32)
        for t in range(q.shape[0]):
            dots = (wq * q[t][None]).sum(-1).astype(np.float32)
            out[t] = (wd * d[t][None] * dots).sum(-1, dtype=np.float32)
        return out

    @staticmethod
    def _f16_rows(arena, off, rows, K, X):
        w = _host_arena(arena)[off:off + rows * K * 2].copy().view(np.float16).reshape(rows, K).astype(np.float32)
        x = _host(X).astype(np.float32).reshape(-1, K)
        return np.stack([(w @ x[t]).astype(np.float32) for t in range(x.shape[0])])

    @staticmethod
    def _put(out, host):
        out.copy_to_device(np.ascontiguousarray(host.reshape(out.shape), dtype=np.float32))

    @staticmethod
    def _hc_post(out, hc):
        """The HC-post epilogue (hc = (state, f_b, post, comb) of one token) as the engine's
        separate hc_post kernel, on the views it passed."""
        state, f_b, post, comb = hc
        n_hc, n_embd = state.shape
        ops.hc_post[(16, 1), ops.BLOCK](state.reshape(1, n_hc, n_embd), out.reshape(1, n_embd),
                                        f_b.reshape(1, n_embd), post.reshape(1, n_hc), comb.reshape(1, n_hc * n_hc))

    @staticmethod
    def matmul_q8_0(arena, off, rows, K, n_tok, xq, xd, out, stream=0, hc=None, scales_last=False):
        H = HostQuantKernels
        H._put(out, H._q8_0_rows(arena, off, rows, K, xq, xd))
        if hc is not None:
            H._hc_post(out, hc)

    @staticmethod
    def matmul_f16(arena, off, rows, K, n_tok, X, out, stream=0):
        H = HostQuantKernels
        H._put(out, H._f16_rows(arena, off, rows, K, X))

    @staticmethod
    def matmul_q8_0_pair(arena, off_a, rows_a, off_b, rows_b, K, n_tok, xq, xd, out, stream=0, scales_last=False):
        H = HostQuantKernels
        H._put(out, np.concatenate([H._q8_0_rows(arena, off_a, rows_a, K, xq, xd),
                                    H._q8_0_rows(arena, off_b, rows_b, K, xq, xd)], axis=1))

    @staticmethod
    def matmul_f16_pair(arena, off_a, rows_a, off_b, rows_b, K, n_tok, X, out, stream=0):
        H = HostQuantKernels
        H._put(out, np.concatenate([H._f16_rows(arena, off_a, rows_a, K, X),
                                    H._f16_rows(arena, off_b, rows_b, K, X)], axis=1))

    @staticmethod
    def _moe_token(a, offs, gate_type, down_type, xv, rw, clamp, n_ff):
        n_embd = xv.shape[0]
        gate_rb = ck.F.row_bytes(gate_type, n_embd)
        down_rb = ck.F.row_bytes(down_type, n_ff)
        acc = np.zeros(n_embd, np.float32)
        for k in range(offs.shape[0]):
            gate = a[offs[k, 0]:offs[k, 0] + n_ff * gate_rb].reshape(n_ff, gate_rb)
            up = a[offs[k, 1]:offs[k, 1] + n_ff * gate_rb].reshape(n_ff, gate_rb)
            down = a[offs[k, 2]:offs[k, 2] + n_embd * down_rb].reshape(n_embd, down_rb)
            g = np.minimum(ck.matvec(gate, gate_type, xv), np.float32(clamp))
            u = np.clip(ck.matvec(up, gate_type, xv), -np.float32(clamp), np.float32(clamp))
            mid = (g / (1 + np.exp(-g)) * u * rw[k]).astype(np.float32)
            acc += ck.matvec(down, down_type, mid)
        return acc

    @staticmethod
    def moe_prefill(arena, expert_table, gate_type, down_type, n_embd, n_ff, X, expert_ids, route_w,
                    clamp, out, stream=0):
        """Each token as moe_decode (the GPU kernel's rows are bitwise moe_decode's); ids and table
        on the host or (resident experts: grouped on the device) both on the device."""
        a = _host_arena(arena)
        table = _host(expert_table).astype(np.int64)
        ids = _host(expert_ids).astype(np.int32)
        x = _host(X).astype(np.float32).reshape(-1, n_embd)
        rw = _host(route_w).reshape(x.shape[0], -1)
        res = np.stack([HostQuantKernels._moe_token(a, table[ids[t]], gate_type, down_type, x[t], rw[t],
                                                    clamp, n_ff) for t in range(x.shape[0])])
        HostQuantKernels._put(out, res)

    @staticmethod
    def moe_decode(arena, slot_offsets, gate_type, down_type, x, route_w, clamp, out, ws, stream=0):
        HostQuantKernels.moe_decode_input(x, ws, stream)
        HostQuantKernels.moe_decode_experts(arena, slot_offsets, gate_type, down_type, route_w, clamp, out, ws)

    @staticmethod
    def moe_decode_input(x, ws, stream=0):
        ws.x = _host(x).astype(np.float32)

    @staticmethod
    def moe_decode_experts(arena, slot_offsets, gate_type, down_type, route_w, clamp, out, ws, stream=0,
                           before_down=None, hc=None):
        acc = HostQuantKernels._moe_token(_host_arena(arena), _host(slot_offsets), gate_type, down_type,
                                          ws.x, _host(route_w), clamp, ws.n_ff)
        if before_down is not None:
            before_down()
        out.copy_to_device(acc)
        if hc is not None:
            HostQuantKernels._hc_post(out, hc)


class HostHcMix:
    """Host stand-in for ops.hc_mix_partial in the prefill mode: the simulator spends most of a
    run in its (rows x chunks x tokens) blocks. Same launch interface and outputs (partial dots and
    Σx² per chunk, written into the views the engine passes), so the engine's wiring of the HC
    mixer is still exercised; the kernel itself is checked with T > 1 in cuda_ops_sim_checks.py."""

    def __getitem__(self, launch):
        def run(state, w16, fn_off, chunk_len, part_dot, part_sq, part_gram, pre):
            st = _host(state).astype(np.float64)
            n_tok, n_hc, n_embd = st.shape
            n_rows = part_dot.shape[1]
            flat = st.reshape(n_tok, n_hc * n_embd)
            w = _host_arena(w16)[fn_off:fn_off + n_rows * n_hc * n_embd].astype(np.float64)
            w = w.reshape(n_rows, -1)
            n_chunks = flat.shape[1] // chunk_len
            fc_ = flat.reshape(n_tok, n_chunks, chunk_len)
            dots = np.einsum("rcj,tcj->trc", w.reshape(n_rows, n_chunks, chunk_len), fc_)
            part_dot._ary[...] = dots
            part_sq._ary[...] = (fc_ ** 2).sum(-1)
            if launch[0][0] > n_rows:       # hc_pre's Gram partials over n_chunks d-ranges
                sr = st.reshape(n_tok, n_hc, n_chunks, n_embd // n_chunks)
                gram = np.einsum("tacj,tbcj->tabc", sr, sr).reshape(n_tok, n_hc * n_hc, n_chunks)
                part_gram._ary[:n_tok] = gram
        return run


class FileArenaSource:
    """The whole file as one device arena: dense tensors and experts at their file offsets."""

    def __init__(self, model):
        self.model = model
        self.arena = cuda.to_device(np.frombuffer(model.file.mm, dtype=np.uint8))
        self.expert_arena = self.arena
        self.scales_last = frozenset()   # the file's layout: the host stand-ins read it

    def dense(self, name):
        return self.arena, self.model.file.tensors[name].offset

    def experts_at_once(self):
        return None                      # every expert lives in the arena

    def expert_base(self, il):
        t = self.model.file.tensors
        g, u, d = (t[f"blk.{il}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        n_exp = g.ne[2]
        return (g.offset, u.offset, d.offset, g.nbytes // n_exp, u.nbytes // n_exp, d.nbytes // n_exp)


# scratch the engine fills itself and then only reads
KEEP = ("zeros", "pos", "token")


def poison_scratch(engine):
    """Fill every scratch buffer the step should write before it reads with NaN (ints: -1 << 30),
    so that a buffer read before it is written (on the GPU: whatever the allocator left there)
    shows up in the logits instead of passing as the simulator's zeroed memory."""
    sc = engine.scratch
    arrays = [a for name, a in sc.tok.items() if name not in KEEP] + [a for a, _ in sc.flat.values()]
    arrays += [sc.logits, sc.next_token, sc.argmax_val, sc.argmax_idx]
    if sc.moe_work is not None:
        arrays += [a for a in vars(sc.moe_work).values() if hasattr(a, "copy_to_device")]
    for a in arrays:
        fill = np.nan if a.dtype.kind == "f" else -(1 << 30) if a.dtype.itemsize >= 4 else -128
        a.copy_to_device(np.full(a.shape, fill, a.dtype))


def main(n_tokens, attention="auto"):
    fc.qk = HostQuantKernels
    from ds4py.forward_cpu import CpuEngine
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/tiny.gguf"
        synth.build_model(path, "tiny", "none", seed=7)
        model = open_model(path)
        rng = np.random.default_rng(11)
        tokens = [int(t) for t in rng.integers(0, 129_000, size=n_tokens)]
        cpu = CpuEngine(model, n_ctx=64)
        gpu = fc.CudaEngine(model, FileArenaSource(model), 64, attention=attention)
        print(f"decode attention in {'f64' if gpu.attention_f64 else 'f32'}", flush=True)
        poison_scratch(gpu)
        worst = 1.0
        for pos, tok in enumerate(tokens):
            want = np.asarray(cpu.decode(tok), np.float64)
            got = np.asarray(gpu.decode(tok), np.float64)
            std = np.std(want)
            corr = float(np.corrcoef(got, want)[0, 1])
            same_top1 = int(np.argmax(got)) == int(np.argmax(want))
            print(f"pos {pos}: max|Δ|/std {np.max(np.abs(got - want)) / std:.2e}, rms|Δ|/std "
                  f"{np.sqrt(np.mean((got - want) ** 2)) / std:.2e}, corr {corr:.6f}, top-1 "
                  f"{'same' if same_top1 else 'DIFFERENT'}", flush=True)
            worst = min(worst, corr)
            # Whole-model logits carry the Q8 rounding-tie noise of two f32 implementations
            # (ds4-model.md §12.5); the tight checks are stage-wise (cuda_ops_sim_checks.py).
            if not same_top1 or corr < 0.998:
                raise SystemExit(1)
        print(f"engine simulator check passed (lowest correlation {worst:.6f})")


def _compare(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    std = np.std(want)
    corr = float(np.corrcoef(got, want)[0, 1])
    same = int(np.argmax(got)) == int(np.argmax(want))
    return corr, same, (f"max|Δ|/std {np.max(np.abs(got - want)) / std:.2e}, rms|Δ|/std "
                        f"{np.sqrt(np.mean((got - want) ** 2)) / std:.2e}, corr {corr:.6f}, "
                        f"top-1 {'same' if same else 'DIFFERENT'}")


def main_prefill(n_tokens, chunk):
    """The batched prefill (chunks of `chunk` tokens) against the CPU engine's prefill and the GPU
    engine's own token-by-token decodes, on a smaller tiny model (n_swa 8, idx_topk 2: the window
    saturates and the indexer selects within a chunk or two; ratio-4 rows are emitted inside
    chunks), then one decode after the prefill on all three."""
    import dataclasses
    fc.qk = HostQuantKernels
    from ds4py.forward_cpu import CpuEngine
    ops.hc_mix_partial = HostHcMix()
    spec = dataclasses.replace(synth.preset_spec("tiny"), n_swa=8, idx_topk=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/small.gguf"
        synth.build_model(path, "tiny", "none", seed=7, spec=spec)
        model = open_model(path)
        rng = np.random.default_rng(13)
        tokens = [int(t) for t in rng.integers(0, 129_000, size=n_tokens + 1)]
        prompt, nxt = tokens[:-1], tokens[-1]
        cpu = CpuEngine(model, n_ctx=64)
        want = cpu.prefill(prompt)
        want_next = cpu.decode(nxt)
        source = FileArenaSource(model)
        batched = fc.CudaEngine(model, source, 64, prefill_chunk=chunk)
        got = batched.prefill(prompt)
        assert batched.n_past == n_tokens
        print(f"batched prefill vs CPU engine (first look): {_compare(got, want)[2]}", flush=True)
        got_next = batched.decode(nxt)
        by_token = fc.CudaEngine(model, source, 64, prefill_chunk=chunk)
        ref = by_token.prefill_by_token(prompt)
        ref_next = by_token.decode(nxt)
        worst = 1.0
        ok = True
        for name, a, b in (("batched prefill vs CPU engine", got, want),
                           ("batched prefill vs GPU token-by-token", got, ref),
                           ("GPU token-by-token vs CPU engine", ref, want),
                           ("decode after batched prefill vs CPU engine", got_next, want_next),
                           ("decode after batched prefill vs after token-by-token", got_next, ref_next)):
            corr, same, line = _compare(a, b)
            print(f"{name}: {line}", flush=True)
            worst = min(worst, corr)
            ok = ok and same and corr >= 0.998
        if not ok:
            raise SystemExit(1)
        print(f"engine simulator prefill check passed ({n_tokens} tokens, chunks of {chunk}; lowest "
              f"correlation {worst:.6f})")


if __name__ == "__main__":
    attention = "auto"
    if "--attention" in sys.argv:
        i = sys.argv.index("--attention")
        attention = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    if len(sys.argv) > 1 and sys.argv[1] == "prefill":
        main_prefill(int(sys.argv[2]) if len(sys.argv) > 2 else 20, int(sys.argv[3]) if len(sys.argv) > 3 else 8)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, attention)
