"""The MoE decode variants of kernels/cuda.py in numba's CUDA simulator, no GPU needed: gate/up with
a compile-time step count (_CONST_STEPS_GATE_UP, chunks of _NCH_GATE_UP steps) and the slots down
kernel (_R_DOWN_SLOTS, with and without the HC-post epilogue) against the default kernels, bit for
bit; gate/up with the byte-permute weights (_IQ2_PERM_GATE_UP) and on repacked rows
(_IQ2_REPACKED_GATE_UP, iq2_xxs_relayout there and back); `... perm` runs those cases only.
The down kernel with a lane per super-block (_DOWN_SB) against moe_down_decode; `... down` runs those
only, `... halves` the gate/up halves kernel only (tests/test_moe_sim.py runs each).
Also the Q8_0 decode matvec on q8_0_relayout's rows (scales_last=True), and q8_0_pairs against
q8_0_rows on them; `... q8` runs those only.
This checks their indexing and operation order (both sides run the same simulated arithmetic:
the simulator's fma is a*b + c in f32); the device tests check the compiled kernels.

`... twins` runs the decode matvecs (Q8_0 rows and pairs, F16, IQ2_XXS, Q2_K, and the routed down
projection with its slot sums) against their CPU twins (kernels/cpu.py), which follow the kernels'
sum order: bit for bit, with the simulator's fma made a true fused multiply-add (the CPU twin's).
Their only f32 arithmetic is written out (no multiply-add for NVVM to fuse on its own:
check_cuda_compile.py --parity), so the simulated bits are the GPU's.

The simulator has no warp shuffles: shfl_xor_sync and shfl_sync are rendezvous of the warp's 32
threads. The
activations are quantized by the CPU twin (kernels/cpu.py, the same bits as quantize_q8_k).
Slow (Python threads): small shapes.

    python scripts/check_moe_decode_sim.py       (sets NUMBA_ENABLE_CUDASIM itself)
"""
import os
import sys
import threading

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"      # before numba is imported

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda.simulator import kernelapi  # noqa: E402

from ds4py.kernels import cpu, formats as F, testdata as TD  # noqa: E402
from ds4py.kernels import cuda as K  # noqa: E402

_lock = threading.Lock()
_warps = {}


def _exchange(value, source_of):
    """The value of lane source_of(lane) in the calling thread's warp (a rendezvous of its 32
    threads)."""
    t = threading.current_thread()
    b = t.blockIdx
    key = (b.x, b.y, b.z, t.thread_id // 32)
    with _lock:
        w = _warps.get(key)
        if w is None:
            w = _warps[key] = (threading.Barrier(32), [None] * 32)
    bar, vals = w
    lane = t.thread_id % 32
    vals[lane] = value
    bar.wait()
    v = vals[source_of(lane)]
    bar.wait()
    return v


def _shfl_xor_sync(self, mask, value, lane_mask):
    return _exchange(value, lambda lane: lane ^ int(lane_mask))


def _shfl_sync(self, mask, value, src_lane):
    return _exchange(value, lambda lane: int(src_lane) % 32)


kernelapi.FakeCUDAModule.shfl_xor_sync = _shfl_xor_sync
kernelapi.FakeCUDAModule.shfl_sync = _shfl_sync


def _views(arena):
    """_arena_views for the simulator's arrays (no is_cuda_array, no device-side view)."""
    h = arena.copy_to_host()
    n = h.size
    return (cuda.to_device(h[:n // 2 * 2].view(np.uint16)), cuda.to_device(h[:n // 4 * 4].view(np.uint32)),
            arena, cuda.to_device(h[:n // 8 * 8].view(np.uint64)))


K._arena_views = _views
K._as_i32 = lambda a: cuda.to_device(a.copy_to_host().reshape(-1).view(np.int32))


def _arena(parts, align=256):
    offs, pos = [], 0
    for w in parts:
        pos = (pos + align - 1) // align * align
        offs.append(pos)
        pos += w.size
    host = np.zeros(pos + 64, np.uint8)
    for w, o in zip(parts, offs):
        host[o:o + w.size] = w.reshape(-1)
    return cuda.to_device(host), offs


def _q8k(x):
    q, d, b = cpu.quantize_q8_k(np.ascontiguousarray(x, np.float32).reshape(-1))
    return cuda.to_device(q), cuda.to_device(d), cuda.to_device(b)


def _knobs(**kw):
    for n, v in kw.items():
        setattr(K, n, v)
    K._KERNELS.clear()
    K._ROWDOTS.clear()


def gate_up(n_embd, n_ff, n_used, seed, repacked=False):
    rng = np.random.default_rng(seed)
    gate = TD.random_weights(F.IQ2_XXS, (n_used, n_ff, n_embd), rng)
    up = TD.random_weights(F.IQ2_XXS, (n_used, n_ff, n_embd), rng)
    arena, (og, ou) = _arena([gate, up])
    if repacked:                  # the experts in iq2_xxs_relayout's layout, and back exactly
        before = arena.copy_to_host()
        for o in (og, ou):
            K.iq2_xxs_relayout(arena, o, n_used * n_ff, n_embd)
        moved = arena.copy_to_host()
        for o in (og, ou):
            K.iq2_xxs_relayout(arena, o, n_used * n_ff, n_embd, to_repacked=False)
        assert np.array_equal(arena.copy_to_host(), before), "relayout there and back changed bytes"
        assert not np.array_equal(moved, before)
        arena = cuda.to_device(moved)
    stride = gate.shape[1] * gate.shape[2]
    so = cuda.to_device(np.array([[og + k * stride, ou + k * stride, 0] for k in range(n_used)], np.int64))
    xq, xd, xbs = _q8k(rng.standard_normal(n_embd))
    rw = cuda.to_device(rng.uniform(0.05, 0.6, n_used).astype(np.float32))
    mid = cuda.device_array((n_used, n_ff), np.float32)
    K.moe_gate_up(arena, so, F.IQ2_XXS, n_embd, n_ff, xq, xd, rw, 10.0, mid, bsums=xbs)
    return (mid.copy_to_host(),)


def down(n_ff, n_embd, n_used, seed, hc=False, shift=0):
    """shift: the experts that many bytes (a multiple of 4) past the arena's 16-byte boundary."""
    rng = np.random.default_rng(seed)
    w = TD.random_weights(F.Q2_K, (n_used, n_embd, n_ff), rng)
    arena, (od,) = _arena([w])
    if shift:
        host = np.zeros(arena.size + shift, np.uint8)
        host[od + shift:od + shift + w.size] = w.reshape(-1)
        arena, od = cuda.to_device(host), od + shift
    stride = w.shape[1] * w.shape[2]
    so = cuda.to_device(np.array([[0, 0, od + k * stride] for k in range(n_used)], np.int64))
    mq, md, mbs = _q8k(rng.standard_normal(n_used * n_ff))
    out = cuda.device_array(n_embd, np.float32)
    hc_args = None
    if hc:
        hc_args = (cuda.to_device(rng.standard_normal((4, n_embd)).astype(np.float32)),
                   cuda.to_device(rng.standard_normal(n_embd).astype(np.float32)),
                   cuda.to_device(rng.standard_normal(4).astype(np.float32)),
                   cuda.to_device(rng.standard_normal(16).astype(np.float32)))
    K.moe_down(arena, so, F.Q2_K, n_ff, n_embd, mq, md, mbs, out, hc=hc_args)
    return (out.copy_to_host(),) + ((hc_args[0].copy_to_host(),) if hc else ())


def q8_0_scales_last_same(rows, Kd, seed=3):
    """matvec_q8_0 on rows that q8_0_relayout rewrote (scales_last=True) against the file layout,
    bit for bit, and the relayout back restores every byte."""
    rng = np.random.default_rng(seed)
    arena, (off,) = _arena([TD.random_weights(F.Q8_0, (rows, Kd), rng)])
    q, d = cpu.quantize_q8_0(rng.standard_normal(Kd).astype(np.float32))
    xq, xd = cuda.to_device(q), cuda.to_device(d)

    def run(scales_last):
        out = cuda.device_array(rows, np.float32)
        K.matvec_q8_0(arena, off, rows, Kd, xq, xd, out, scales_last=scales_last)
        return out.copy_to_host()

    want, before = run(False), arena.copy_to_host()
    K.q8_0_relayout(arena, off, rows, Kd)
    moved = not np.array_equal(arena.copy_to_host(), before)
    got = run(True)
    K.q8_0_relayout(arena, off, rows, Kd, to_repacked=False)
    return moved and np.array_equal(got, want) and np.array_equal(arena.copy_to_host(), before)


def q8_0_pairs_same(rows, Kd, U, seed=5):
    """q8_0_pairs (one warp per row, two lanes per block) against q8_0_rows on the same
    scales-last rows, bit for bit: one matrix, a pair of matrices, a grouped launch (2 groups)."""
    rng = np.random.default_rng(seed)
    rows_b = rows // 2 + 1
    arena, (oa, ob) = _arena([TD.random_weights(F.Q8_0, (rows, Kd), rng),
                              TD.random_weights(F.Q8_0, (rows_b, Kd), rng)])
    for o, r in ((oa, rows), (ob, rows_b)):
        K.q8_0_relayout(arena, o, r, Kd)
    q, d = cpu.quantize_q8_0(rng.standard_normal(2 * Kd).astype(np.float32))
    xq, xd = cuda.to_device(q[:Kd]), cuda.to_device(d[:Kd // 32])
    xgq, xgd = cuda.to_device(q), cuda.to_device(d)

    def run():
        one = cuda.device_array(rows, np.float32)
        K.matvec_q8_0(arena, oa, rows, Kd, xq, xd, one, scales_last=True)
        pair = cuda.device_array(rows + rows_b, np.float32)
        K.matvec_q8_0_pair(arena, oa, rows, ob, rows_b, Kd, xq, xd, pair, scales_last=True)
        grouped = cuda.device_array(rows, np.float32)
        K.matvec_q8_0_grouped(arena, oa, rows, Kd, 2, xgq, xgd, grouped, scales_last=True)
        return [a.copy_to_host() for a in (one, pair, grouped)]

    saved = {n: getattr(K, n) for n in ("_Q8_0_S1_ROWS", "_Q8_0_PAIRS", "_Q8_0_PAIRS_U")}
    _knobs(_Q8_0_S1_ROWS=1, _Q8_0_PAIRS=False)
    want = run()
    _knobs(_Q8_0_PAIRS=True, _Q8_0_PAIRS_U=U)
    got = run()
    _knobs(**saved)
    return all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, want))


def _exact_fma():
    """The simulator's cuda.fma as one rounding (the CPU twins' llvm.fma), not a*b + c; an f32 result
    (numba returns a Python float, and f64 sums after it would hide the kernel's f32 order)."""
    from numba import njit

    @njit
    def fma32(a, b, c):
        return cpu._fma32(a, b, c)
    kernelapi.FakeCUDAModule.fma = lambda self, a, b, c: np.float32(fma32(np.float32(a), np.float32(b), np.float32(c)))


def _same(name, got, want):
    ok = np.array_equal(np.asarray(got, np.float32).view(np.uint32), np.asarray(want, np.float32).view(np.uint32))
    print(f"{'ok ' if ok else 'BAD'} {name}: simulated kernel = CPU twin, bit for bit"
          + ("" if ok else f" (max |Δ| {np.max(np.abs(np.asarray(got) - np.asarray(want))):.3g})"), flush=True)
    return ok


def twins_checks():
    """The decode matvecs against the CPU twins: split-K 1, 2 and 4 warps per row (Q8_0: rows
    3 x K 256, 5 x 1280, 4 x 4096; F16: 3 x 64 (one step), 3 x 256, 5 x 330 (a partial step)),
    a Q8_0 pair launch (its rows set the split), the pairs kernel on scales-last rows, IQ2_XXS
    rows of 1, 5 and 16 super-blocks, Q2_K rows of 1, 3 and 8, Q4_K rows of 1 and 5, the routed
    gate/up with its SwiGLU (K 256 and 4608), and the routed down projection of 3 slots (K 256 and
    2048)."""
    _exact_fma()
    rng = np.random.default_rng(11)
    bad = 0
    for rows, Kd in ((3, 256), (5, 1280), (4, 4096)):
        w = TD.random_weights(F.Q8_0, (rows, Kd), rng)
        x = rng.standard_normal(Kd).astype(np.float32)
        q, d = cpu.quantize_q8_0(x)
        arena, (off,) = _arena([w])
        out = cuda.device_array(rows, np.float32)
        K.matvec_q8_0(arena, off, rows, Kd, cuda.to_device(q), cuda.to_device(d), out)
        S = K._q8_0_work(rows, Kd // 32)[0]
        bad += not _same(f"Q8_0 {rows} x {Kd} (split-K {S})", out.copy_to_host(), cpu.matvec(w, F.Q8_0, x))
    # a pair launch: 2 + 3 rows of K 1280 sum in the order of a 5-row launch; then the pairs
    # kernel (one warp per row, scales-last rows) on rows of 4096 rows' order (S = 1)
    wa, wb = TD.random_weights(F.Q8_0, (2, 1280), rng), TD.random_weights(F.Q8_0, (3, 1280), rng)
    x = rng.standard_normal(1280).astype(np.float32)
    q, d = cpu.quantize_q8_0(x)
    arena, (oa, ob) = _arena([wa, wb])
    out = cuda.device_array(5, np.float32)
    K.matvec_q8_0_pair(arena, oa, 2, ob, 3, 1280, cuda.to_device(q), cuda.to_device(d), out)
    want = np.concatenate([cpu.matvec(wa, F.Q8_0, x, order_rows=5), cpu.matvec(wb, F.Q8_0, x, order_rows=5)])
    bad += not _same("Q8_0 pair 2 + 3 x 1280", out.copy_to_host(), want)
    saved = {n: getattr(K, n) for n in ("_Q8_0_S1_ROWS", "_Q8_0_PAIRS")}
    _knobs(_Q8_0_S1_ROWS=1, _Q8_0_PAIRS=True)           # one warp per row: the order of >= 4096 rows
    w = TD.random_weights(F.Q8_0, (3, 768), rng)
    x = rng.standard_normal(768).astype(np.float32)
    q, d = cpu.quantize_q8_0(x)
    arena, (off,) = _arena([w])
    K.q8_0_relayout(arena, off, 3, 768)
    out = cuda.device_array(3, np.float32)
    K.matvec_q8_0(arena, off, 3, 768, cuda.to_device(q), cuda.to_device(d), out, scales_last=True)
    _knobs(**saved)
    bad += not _same("q8_0_pairs 3 x 768, scales-last rows", out.copy_to_host(), cpu.matvec(w, F.Q8_0, x, order_rows=4096))
    for rows, Kd in ((3, 64), (3, 256), (5, 330)):
        w = TD.random_weights(F.F16, (rows, Kd), rng)
        x = rng.standard_normal(Kd).astype(np.float32)
        arena, (off,) = _arena([w])
        out = cuda.device_array(rows, np.float32)
        K.matvec_f16(arena, off, rows, Kd, cuda.to_device(x), out)
        bad += not _same(f"F16 {rows} x {Kd} (split-K {K.orders.f16_split(rows, Kd)})", out.copy_to_host(),
                         cpu.matvec(w, F.F16, x))
    for wtype, shapes in ((F.IQ2_XXS, ((3, 256), (2, 1280), (2, 4096))), (F.Q2_K, ((3, 256), (2, 768), (2, 2048))),
                          (F.Q4_K, ((2, 256), (2, 1280)))):
        for rows, Kd in shapes:
            w = TD.random_weights(wtype, (rows, Kd), rng)
            x = rng.standard_normal(Kd).astype(np.float32)
            xq, xd, xbs = _q8k(x)
            arena, (off,) = _arena([w])
            out = cuda.device_array(rows, np.float32)
            K._matmul_q8k(wtype, arena, off, rows, Kd, 1, xq, xd, None if wtype == F.IQ2_XXS else xbs, out, 0)
            bad += not _same(f"{F.TYPE_NAMES[wtype]} {rows} x {Kd}", out.copy_to_host(), cpu.matvec(w, wtype, x))
    # the routed gate/up with its SwiGLU and route weight (kernels/numerics.py on both sides): the
    # halves kernel (K <= 4096) and moe_gate_up_decode (K 4608)
    for n_embd in (256, 4608):
        gate = TD.random_weights(F.IQ2_XXS, (2, 3, n_embd), rng)
        up = TD.random_weights(F.IQ2_XXS, (2, 3, n_embd), rng)
        arena, (og, ou) = _arena([gate, up])
        stride = gate.shape[1] * gate.shape[2]
        so = cuda.to_device(np.array([[og + k * stride, ou + k * stride, 0] for k in range(2)], np.int64))
        x = (4 * rng.standard_normal(n_embd)).astype(np.float32)
        xq, xd, xbs = _q8k(x)
        rw = rng.uniform(0.05, 0.6, 2).astype(np.float32)
        mid = cuda.device_array((2, 3), np.float32)
        K.moe_gate_up(arena, so, F.IQ2_XXS, n_embd, 3, xq, xd, cuda.to_device(rw), 10.0, mid, bsums=xbs)
        want = np.array([[cpu._swiglu(g, u, np.float32(10.0), rw[k])
                          for g, u in zip(cpu.matvec(gate[k], F.IQ2_XXS, x), cpu.matvec(up[k], F.IQ2_XXS, x))]
                         for k in range(2)], np.float32)
        bad += not _same(f"routed gate/up + SwiGLU, 2 slots, K {n_embd}", mid.copy_to_host(), want)
    # the routed down projection (the shipped decode kernel, moe_down_sb): slots added in order
    for n_ff, n_embd in ((256, 6), (2048, 9)):
        w = TD.random_weights(F.Q2_K, (3, n_embd, n_ff), rng)
        mid = rng.standard_normal((3, n_ff)).astype(np.float32)
        arena, (od,) = _arena([w])
        stride = w.shape[1] * w.shape[2]
        so = cuda.to_device(np.array([[0, 0, od + k * stride] for k in range(3)], np.int64))
        mq, md, mbs = _q8k(mid)
        out = cuda.device_array(n_embd, np.float32)
        K.moe_down(arena, so, F.Q2_K, n_ff, n_embd, mq, md, mbs, out)
        want = np.zeros(n_embd, np.float32)
        for k in range(3):
            want += cpu.matvec(w[k], F.Q2_K, mid[k])
        bad += not _same(f"routed down, 3 slots, K {n_ff}", out.copy_to_host(), want)
    return bad


def halves_checks():
    bad = 0
    # moe_gate_up_halves (_GU_HALVES) against moe_gate_up_decode: one super-block (256: one lane
    # pair busy), 3 (768: one chain step, partial), 5 (1280: a partial second step), 16 (4096:
    # the flash rows, a chain of 4); 3 rows of 2 slots, rows odd and even (both word alignments)
    for n_embd in (256, 768, 1280, 4096):
        _knobs(_GU_HALVES=False, _CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=0, _RPB_GATE_UP=2, _NW_GATE_UP=2,
               _X_REGS_GATE_UP=True, _IQ2_PERM_GATE_UP=True, _PRE_GATE_UP=True)
        ref = gate_up(n_embd, 3, 2, 7)
        _knobs(_GU_HALVES=True)
        ok = all(np.array_equal(a, b) for a, b in zip(gate_up(n_embd, 3, 2, 7), ref))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} gate/up halves = gate/up decode: K {n_embd}", flush=True)
        if n_embd in (768, 4096):      # the SwiGLU per unit (_GU_DEFER off): the same bits
            _knobs(_GU_DEFER=False)
            ok = all(np.array_equal(a, b) for a, b in zip(gate_up(n_embd, 3, 2, 7), ref))
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} gate/up halves, SwiGLU per unit: K {n_embd}", flush=True)
            _knobs(_GU_DEFER=True)
    # rows in iq2_xxs_relayout's layout (_IQ2_REPACKED_GATE_UP; 16-byte loads: rows of a multiple
    # of 8 super-blocks), against the file's layout
    for n_embd in (2048, 4096):
        _knobs(_GU_HALVES=True, _RPB_GATE_UP=2, _NW_GATE_UP=2, _IQ2_REPACKED_GATE_UP=False)
        ref = gate_up(n_embd, 3, 2, 7)
        _knobs(_IQ2_REPACKED_GATE_UP=True)
        ok = all(np.array_equal(a, b) for a, b in zip(gate_up(n_embd, 3, 2, 7, repacked=True), ref))
        _knobs(_IQ2_REPACKED_GATE_UP=False)
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} gate/up halves on repacked rows: K {n_embd}", flush=True)
    # the deferred SwiGLU's flushes: one warp of 80 units (two full passes of 32, then 16)
    _knobs(_GU_HALVES=True, _GU_DEFER=False, _RPB_GATE_UP=40, _NW_GATE_UP=1)
    ref = gate_up(256, 41, 2, 9)
    _knobs(_GU_DEFER=True)
    ok = all(np.array_equal(a, b) for a, b in zip(gate_up(256, 41, 2, 9), ref))
    bad += not ok
    print(f"{'ok ' if ok else 'BAD'} gate/up halves, deferred SwiGLU over 80 units a warp", flush=True)
    _knobs(_GU_HALVES=False)
    return bad


def down_sb_checks():
    bad = 0
    # moe_down_sb (_DOWN_SB): 8 super-blocks (2048, the flash rows: cp.async path), 4 (1024),
    # 3 (768: rows word by word), 1 (256); experts on and 4 bytes off 16 (word by word); rows
    # per block 4, 8 and 12 (three groups); a partial last block and group (n_embd 7, 10 or 26)
    for n_ff, n_embd, R, shift, hc in ((2048, 10, 8, 0, False), (1024, 7, 4, 0, True), (1024, 9, 8, 4, False),
                                       (768, 5, 4, 0, False), (256, 6, 4, 0, False), (768, 5, 4, 4, True),
                                       (2048, 26, 12, 0, False)):
        _knobs(_DOWN_SB=0, _R_DOWN_SLOTS=0, _NW_DOWN=2)
        ref = down(n_ff, n_embd, 3, 6, hc, shift)
        _knobs(_DOWN_SB=R)
        ok = all(np.array_equal(a, b) for a, b in zip(down(n_ff, n_embd, 3, 6, hc, shift), ref))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} down sb: K {n_ff}, {n_embd} rows, R {R}, experts {shift} bytes off 16"
              f"{', HC post' if hc else ''}", flush=True)
    # (those with the default _DOWN_EARLY 1: group 0's copies before pdl_enter) 2 of two groups
    # before it, or none, by cp.async and word by word
    for n_ff, n_embd, R, shift, hc, early in ((2048, 10, 8, 0, False, 2), (2048, 26, 12, 0, True, 0),
                                              (1024, 9, 8, 4, False, 0)):
        _knobs(_DOWN_SB=0, _R_DOWN_SLOTS=0, _NW_DOWN=2, _DOWN_EARLY=1)
        ref = down(n_ff, n_embd, 3, 6, hc, shift)
        _knobs(_DOWN_SB=R, _DOWN_EARLY=early)
        ok = all(np.array_equal(a, b) for a, b in zip(down(n_ff, n_embd, 3, 6, hc, shift), ref))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} down sb, {early} group{'' if early == 1 else 's'} before the wait: "
              f"K {n_ff}, {n_embd} rows, R {R}, experts {shift} bytes off 16{', HC post' if hc else ''}", flush=True)
    _knobs(_DOWN_SB=0, _DOWN_EARLY=1)
    return bad


def main():
    bad = 0
    only = sys.argv[1] if len(sys.argv) > 1 else ""      # "perm" / "q8" / "down" / "halves" / "twins": those only
    # groups run on their own (twins: its exact fma stays patched in)
    groups = {"twins": twins_checks, "down": down_sb_checks, "halves": halves_checks}
    if only not in ("", "perm", "q8", *groups):
        print(f"unknown group {only!r}: name one of perm, q8, {', '.join(groups)}, or none for all")
        return 2
    if only in groups:
        bad = groups[only]()
        print("all MoE decode simulator checks passed" if not bad else f"{bad} FAILED")
        return 1 if bad else 0
    if only in ("", "q8"):
        # one chunk (K 256: one step), two chunks with a partial one (K 1280: 5 steps); 3 and 5
        # rows: split-K 1 and 2 warps per row
        for rows, Kd in ((3, 256), (5, 1280)):
            ok = q8_0_scales_last_same(rows, Kd)
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} Q8_0 scales-last rows: {rows} rows, K {Kd}", flush=True)
        # q8_0_pairs: half a step (K 256: blocks b + 8 past the row), one step (512), 1.5 steps
        # (768), two chunks of one step (U 1), 3 steps in chunks of 2 (1280: a partial chunk)
        for rows, Kd, U in ((4, 256, 4), (2, 512, 4), (4, 768, 4), (2, 1024, 1), (2, 1280, 2)):
            ok = q8_0_pairs_same(rows, Kd, U)
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} q8_0_pairs = q8_0_rows: {rows} rows, K {Kd}, U {U}", flush=True)
        if only == "q8":
            print("all Q8_0 simulator checks passed" if not bad else f"{bad} FAILED")
            return 1 if bad else 0
    bad += halves_checks()
    # (n_embd, chunk steps, x in registers): one step (1024), a partial one (768), 4 + a partial
    # step (4608: x staged, 2 or 5 chunks), 4 steps in chunks of 2 (x in registers or staged)
    # (n_embd, chunk steps, x in registers, byte-permute weights)
    cases = ((1024, 0, True, False), (768, 0, True, False), (4608, 0, True, False), (4608, 1, True, False),
             (4096, 2, True, False), (4096, 2, False, False), (1024, 0, True, True), (768, 0, True, True),
             (4608, 1, False, True))
    for n_embd, nch, x_regs, perm in cases:
        if only == "perm" and not perm:
            continue
        _knobs(_CONST_STEPS_GATE_UP=False, _NCH_GATE_UP=0, _RPB_GATE_UP=2, _NW_GATE_UP=2, _X_REGS_GATE_UP=True,
               _IQ2_PERM_GATE_UP=False)
        ref = gate_up(n_embd, 3, 2, 5)
        _knobs(_CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=nch, _X_REGS_GATE_UP=x_regs, _IQ2_PERM_GATE_UP=perm)
        ok = all(np.array_equal(a, b) for a, b in zip(gate_up(n_embd, 3, 2, 5), ref))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} gate/up const steps: K {n_embd}, nch {nch or 'auto'}, "
              f"x {'registers' if x_regs else 'shared'}{', byte-permute weights' if perm else ''}", flush=True)
    _knobs(_IQ2_PERM_GATE_UP=False)
    # the repacked rows (_IQ2_REPACKED_GATE_UP): one step (1024), 4 in chunks of 2 (2048 is 2 steps)
    for n_embd, nch, x_regs in ((1024, 0, True), (2048, 1, True), (4096, 2, False)):
        _knobs(_CONST_STEPS_GATE_UP=False, _NCH_GATE_UP=0, _RPB_GATE_UP=2, _NW_GATE_UP=2, _X_REGS_GATE_UP=True,
               _IQ2_PERM_GATE_UP=False, _IQ2_REPACKED_GATE_UP=False)
        ref = gate_up(n_embd, 3, 2, 5)
        _knobs(_CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=nch, _X_REGS_GATE_UP=x_regs, _IQ2_PERM_GATE_UP=True,
               _IQ2_REPACKED_GATE_UP=True)
        ok = all(np.array_equal(a, b) for a, b in zip(gate_up(n_embd, 3, 2, 5, repacked=True), ref))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} gate/up repacked rows: K {n_embd}, nch {nch or 'auto'}, "
              f"x {'registers' if x_regs else 'shared'}, byte-permute weights", flush=True)
    _knobs(_IQ2_PERM_GATE_UP=False, _IQ2_REPACKED_GATE_UP=False)
    # the tables filled before pdl_enter (_PRE_GATE_UP)
    for n_embd, perm in ((1024, True), (768, False)):
        _knobs(_CONST_STEPS_GATE_UP=False, _NCH_GATE_UP=0, _RPB_GATE_UP=2, _NW_GATE_UP=2, _X_REGS_GATE_UP=True,
               _IQ2_PERM_GATE_UP=False, _PRE_GATE_UP=False)
        ref = gate_up(n_embd, 3, 2, 5)
        _knobs(_CONST_STEPS_GATE_UP=True, _IQ2_PERM_GATE_UP=perm, _PRE_GATE_UP=True)
        ok = all(np.array_equal(a, b) for a, b in zip(gate_up(n_embd, 3, 2, 5), ref))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} gate/up tables before pdl_enter: K {n_embd}"
              f"{', byte-permute weights' if perm else ''}", flush=True)
    _knobs(_IQ2_PERM_GATE_UP=False, _PRE_GATE_UP=False, _GU_HALVES=True)
    if only == "perm":
        print("all MoE decode simulator checks passed" if not bad else f"{bad} FAILED")
        return 1 if bad else 0
    # (n_ff, n_embd rows, R rows per block, HC epilogue): a partial step (256), 2 steps (512: 2
    # super-blocks; 2048: 8), 3 steps (768); partial last blocks
    for n_ff, n_embd, R, hc in ((256, 5, 2, False), (512, 7, 3, False), (2048, 3, 2, False),
                                (768, 4, 4, False), (512, 7, 3, True)):
        _knobs(_DOWN_SB=0, _R_DOWN_SLOTS=0, _NW_DOWN=2)
        ref = down(n_ff, n_embd, 3, 6, hc)
        _knobs(_R_DOWN_SLOTS=R)
        ok = all(np.array_equal(a, b) for a, b in zip(down(n_ff, n_embd, 3, 6, hc), ref))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} down slots: K {n_ff}, {n_embd} rows, R {R}{', HC post' if hc else ''}",
              flush=True)
    bad += down_sb_checks()
    print("all MoE decode simulator checks passed" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
