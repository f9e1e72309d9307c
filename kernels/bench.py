"""Kernel benchmark on the GPU: decode matvecs of the DeepSeek-V4-Flash shapes, the routed MoE,
one layer's decode kernels as one captured graph, and 2048-token prefill matmuls.

Method (see /work/.library/device/METHOD.md): the ceiling is a device-to-device copy measured in
the same run (bytes read + written). Every decode kernel is captured into a CUDA graph (cuda.core
GraphBuilder) and replayed, so launch overhead is gone; each graph runs the kernel over enough
distinct weight copies (>= 256 MB, several times the 50 MB L2) that replays read HBM, not L2.
Times are the median over replays, measured with CUDA events. Weights are random valid blocks
generated on the GPU (random bytes, sane f16 scales), activations random normal.
"""

import json
import math
import time

import numpy as np

from . import compat  # noqa: F401
from . import formats as F

ROT_BYTES = 256 << 20          # weight bytes per graph, to defeat the L2


def _cuda():
    from numba import cuda
    return cuda


# ------------------------------------------------------------------------------ GPU helpers

def _kernels():
    cuda = _cuda()
    from numba import uint32, uint64

    @cuda.jit
    def fill_random(a32, seed):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        for k in range(i, a32.size, stride):
            h = uint32((uint64(k) * uint64(2654435761) + uint64(seed)) & uint64(0xFFFFFFFF))
            h ^= h >> uint32(15)
            h = uint32((uint64(h) * uint64(0x2C1B3C6D)) & uint64(0xFFFFFFFF))
            h ^= h >> uint32(12)
            h = uint32((uint64(h) * uint64(0x297A2D39)) & uint64(0xFFFFFFFF))
            h ^= h >> uint32(15)
            a32[k] = h

    @cuda.jit
    def set_f16_fields(a16, first_h, n_blocks, block_h, field_h, bits):
        i = cuda.grid(1)
        if i < n_blocks:
            a16[first_h + i * block_h + field_h] = bits

    @cuda.jit
    def sane_f16(a16, first_h, n):
        # keep sign and mantissa, force the exponent to 2^-7: |w| in [1/128, 1/64)
        i = cuda.grid(1)
        if i < n:
            v = a16[first_h + i]
            a16[first_h + i] = (v & 0x83FF) | 0x2000

    @cuda.jit
    def copy16(src, dst):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        for k in range(i, src.size, stride):
            dst[k] = src[k]

    return fill_random, set_f16_fields, sane_f16, copy16


def _f16_bits(v):
    return int(np.array([v], np.float16).view(np.uint16)[0])


class Arena:
    """A device arena of random bytes; tensors get valid scale fields via `place`."""

    def __init__(self, nbytes, seed=1):
        cuda = _cuda()
        self.fill, self.set_fields, self.sane, _ = _kernels()
        self.nbytes = (nbytes + 4095) // 4096 * 4096
        self.buf = cuda.device_array(self.nbytes, np.uint8)
        a32 = self.buf.view(np.uint32)
        self.fill[1024, 256](a32, seed)
        self.a16 = self.buf.view(np.uint16)
        self.pos = 0

    def place(self, ggml_type, rows, K, sigma=None):
        """Reserve a (rows, K) tensor, make its scales sane; returns its byte offset."""
        nbytes = rows * F.row_bytes(ggml_type, K)
        off = (self.pos + 255) // 256 * 256
        if off + nbytes > self.nbytes:
            raise MemoryError("arena too small")
        self.pos = off + nbytes
        sigma = 1.0 / math.sqrt(K) if sigma is None else sigma
        h0 = off // 2
        if ggml_type == F.F16:
            n = rows * K
            self.sane[(n + 255) // 256, 256](self.a16, h0, n)
            return off
        fields = {F.Q8_0: ((0, 74.0),), F.IQ2_XXS: ((0, 55.0),), F.Q2_K: ((40, 12.0), (41, 8.0)),
                  F.Q4_K: ((0, 140.0), (1, 230.0))}[ggml_type]
        nblk = rows * (K // F.block_size(ggml_type))
        block_h = F.block_bytes(ggml_type) // 2
        for field_h, div in fields:
            self.set_fields[(nblk + 255) // 256, 256](self.a16, h0, nblk, block_h, field_h,
                                                      _f16_bits(sigma / div))
        return off


def _event_options():
    from cuda.core import EventOptions
    try:
        return EventOptions(timing_enabled=True)
    except TypeError:
        return EventOptions(enable_timing=True)


def _elapsed_ms(e0, e1):
    return float(e1 - e0)


class Timer:
    def __init__(self):
        from cuda.core import Device
        self.dev = Device()
        self.dev.set_current()
        self.stream = self.dev.create_stream()
        self.opt = _event_options()

    def graph(self, launch):
        """Capture launch(graph_builder) into an executable graph."""
        _cuda().synchronize()
        gb = self.stream.create_graph_builder()
        gb.begin_building()
        launch(gb)
        gb.end_building()
        g = gb.complete()
        g.upload(self.stream)
        return g

    def graph_pdl(self, launch):
        """launch(stream) captured with programmatic kernel -> kernel edges, as the engine's decode
        graph is (kernels/graph.py): each launch's blocks are resident and waiting in pdl_enter()
        when the one before it ends. Replayed by time_graph like graph()'s."""
        from numba import cuda
        from .graph import CapturedGraph
        stream = cuda.external_stream(int(self.stream.handle))
        captured = CapturedGraph(stream, programmatic=True)
        with captured:
            launch(stream)

        class Replay:
            def launch(self, _stream):
                captured.replay()

        return Replay()

    def time_graph(self, g, reps=30):
        g.launch(self.stream)                  # warm-up
        self.stream.sync()
        times = []
        for _ in range(reps):
            e0 = self.stream.record(options=self.opt)
            g.launch(self.stream)
            e1 = self.stream.record(options=self.opt)
            e1.sync()
            times.append(_elapsed_ms(e0, e1))
        return float(np.median(times)), float(np.min(times))

    def time_eager(self, launch, reps=5):
        launch(self.stream)
        self.stream.sync()
        times = []
        for _ in range(reps):
            e0 = self.stream.record(options=self.opt)
            launch(self.stream)
            e1 = self.stream.record(options=self.opt)
            e1.sync()
            times.append(_elapsed_ms(e0, e1))
        return float(np.median(times))


def copy_bandwidth(timer, nbytes=2 << 30):
    """Device-to-device copy through a Numba kernel (16-byte elements): (bytes read+written)/s."""
    cuda = _cuda()
    _, _, _, copy16 = _kernels()
    n = nbytes // 16
    src = cuda.device_array(n, np.complex128)
    dst = cuda.device_array(n, np.complex128)
    found = {}
    for blocks in (132 * 4, 132 * 8, 132 * 16):
        g = timer.graph(lambda s: copy16[blocks, 256, s](src, dst))
        med, _ = timer.time_graph(g, reps=10)
        found[f"numba copy kernel, {blocks} blocks"] = 2 * nbytes / (med * 1e-3)
    try:   # the driver's own device-to-device copy (cuMemcpyDtoDAsync)
        g = timer.graph(lambda s: dst.copy_to_device(
            src, stream=cuda.external_stream(int(s.stream.handle))))
        med, _ = timer.time_graph(g, reps=10)
        found["driver memcpy DtoD"] = 2 * nbytes / (med * 1e-3)
    except Exception as e:  # pragma: no cover - depends on the numba/cuda.core versions
        found[f"driver memcpy DtoD failed: {type(e).__name__}"] = 0.0
    del src, dst
    return max(found.values()), found


_READ_THREADS = 256


def _read_kernel(U):
    """A kernel that only reads: block (x, y) loads U 8-byte words per thread of region y
    (starts/counts in words), all U loads issued before the first is used, and stores nothing
    unless their XOR hits an impossible value (so the loads stay)."""
    cuda = _cuda()
    from numba import uint64

    @cuda.jit
    def read_regions(words, starts, counts, sink):
        region = cuda.blockIdx.y
        n = counts[region]
        base = cuda.blockIdx.x * (U * _READ_THREADS) + cuda.threadIdx.x
        if base >= n:
            return
        got = cuda.local.array(U, uint64)
        for j in range(U):
            k = base + j * _READ_THREADS
            got[j] = words[starts[region] + k] if k < n else uint64(0)
        acc = uint64(0)
        for j in range(U):
            acc ^= got[j]
        if acc == uint64(0x9E3779B97F4A7C15):
            sink[0] = acc

    return read_regions


_READ_KERNELS = {}


def read_ceiling_us(timer, buf, regions, n_launches):
    """The time per launch of the fastest plain read of the same byte regions [(byte offset, bytes),
    ...] per launch (n_launches launches of len(regions) // n_launches regions each, as the timed
    kernel reads them), from a graph with ordinary edges: what any kernel of these bytes could do
    here, ramp and tail included. Best of 4 and 8 words per thread."""
    per = len(regions) // n_launches
    launches = [_ReadLaunch(buf, regions[i * per:(i + 1) * per]) for i in range(n_launches)]
    best = None
    for U in (4, 8):
        def launch(s, U=U):
            for read in launches:
                read(U, s)

        launch(0)
        med, _ = timer.time_graph(timer.graph(launch))
        us = med * 1e3 / n_launches
        best = us if best is None else min(best, us)
    return best


class _ReadLaunch:
    """One launch of the plain-read kernel over byte regions [(offset, bytes), ...] of buf."""

    def __init__(self, buf, regions):
        cuda = _cuda()
        self.words = buf.view(np.uint64)
        self.starts = cuda.to_device(np.array([o // 8 for o, _ in regions], np.int64))
        self.counts = cuda.to_device(np.array([n // 8 for _, n in regions], np.int64))
        self.most = max(n // 8 for _, n in regions)
        self.sink = cuda.device_array(1, np.uint64)

    def __call__(self, U, stream=0):
        if U not in _READ_KERNELS:
            _READ_KERNELS[U] = _read_kernel(U)
        grid = ((self.most + U * _READ_THREADS - 1) // (U * _READ_THREADS), len(self.starts))
        _READ_KERNELS[U][grid, _READ_THREADS, stream](self.words, self.starts, self.counts, self.sink)


def _per_launch_us(timer, launch, n_launches, log):
    """Median us per launch of launch(stream)'s n_launches launches, replayed from a graph with
    ordinary edges and from one with programmatic edges (None where PDL is unavailable)."""
    from .graph import pdl_available
    med, _ = timer.time_graph(timer.graph(launch))
    us_pdl = None
    if pdl_available():
        try:
            med_pdl, _ = timer.time_graph(timer.graph_pdl(launch))
            us_pdl = med_pdl * 1e3 / n_launches
        except Exception as e:      # the ordinary figure stands; say why the other is missing
            log(f"  (no PDL-edge timing: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return med * 1e3 / n_launches, us_pdl


def _add_pdl(r, us_pdl, nbytes, copy_bw):
    if us_pdl is not None:
        r.update(us_pdl=us_pdl, pct_copy_pdl=100 * nbytes / (us_pdl * 1e-6) / copy_bw)


def _add_read(r, read_us, copy_bw, nbytes):
    """The plain read of the same bytes (read_ceiling_us) beside a kernel's time: its share of the
    copy bandwidth and the kernel's speed as a share of it."""
    r.update(read_us=read_us, read_pct_copy=100 * nbytes / (read_us * 1e-6) / copy_bw,
             pct_of_read=100 * read_us / r["us"])


def _read_text(r):
    return (f"  | plain read {r['read_us']:6.2f} us = {r['read_pct_copy']:5.1f} % of copy, "
            f"kernel at {r['pct_of_read']:5.1f} % of it")


def _pdl_text(r):
    return f"  | PDL edges {r['us_pdl']:8.2f} us {r['pct_copy_pdl']:5.1f} %" if "us_pdl" in r else ""


# ------------------------------------------------------------------------------------ shapes

DENSE_SHAPES = [
    # name, type, rows, K
    ("attn_q_a 4096->1024", F.Q8_0, 1024, 4096),
    ("attn_q_b 1024->32768", F.Q8_0, 32768, 1024),
    ("attn_kv 4096->512", F.Q8_0, 512, 4096),
    ("attn_out_a 4096->8192 (one launch)", F.Q8_0, 8192, 4096),
    ("attn_out_a group 4096->1024 (x8)", F.Q8_0, 1024, 4096),
    ("attn_out_b 8192->4096", F.Q8_0, 4096, 8192),
    ("shared gate/up 4096->2048", F.Q8_0, 2048, 4096),
    ("shared down 2048->4096", F.Q8_0, 4096, 2048),
    ("output head 4096->129280", F.Q8_0, 129280, 4096),
    ("router F16 4096->256", F.F16, 256, 4096),
    ("indexer q_b F16 1024->8192", F.F16, 8192, 1024),
    ("expert gate IQ2_XXS 4096->2048 (1 expert)", F.IQ2_XXS, 2048, 4096),
    ("expert down Q2_K 2048->4096 (1 expert)", F.Q2_K, 4096, 2048),
]


class _Act:
    """Device activation buffers for n_tok tokens of width K, quantized for type t."""

    def __init__(self, t, n_tok, K, rng):
        from . import cuda as CK
        cuda = _cuda()
        self.x = cuda.to_device(rng.standard_normal((n_tok, K)).astype(np.float32))
        self.xq = cuda.device_array(n_tok * K, np.int8)
        self.xd = cuda.device_array(n_tok * K // 32, np.float32)
        self.bs = cuda.device_array(max(1, n_tok * K // 16), np.int32)
        if t == F.Q8_0:
            CK.quantize_q8_0(self.x, self.xq, self.xd)
        elif t in (F.IQ2_XXS, F.Q2_K, F.Q4_K):
            self.xd = cuda.device_array(n_tok * K // 256, np.float32)
            CK.quantize_q8_k(self.x, self.xq, self.xd, self.bs)
        cuda.synchronize()


def _launch_matmul(t, arena, off, rows, K, n_tok, act, out, s, scales_last=False):
    from . import cuda as CK
    if t == F.Q8_0:
        CK.matmul_q8_0(arena, off, rows, K, n_tok, act.xq, act.xd, out, s, scales_last=scales_last)
    elif t == F.F16:
        CK.matmul_f16(arena, off, rows, K, n_tok, act.x, out, s)
    elif t == F.IQ2_XXS:
        CK.matmul_iq2_xxs(arena, off, rows, K, n_tok, act.xq, act.xd, out, s)
    elif t == F.Q2_K:
        CK.matmul_q2_k(arena, off, rows, K, n_tok, act.xq, act.xd, act.bs, out, s)
    else:
        CK.matmul_q4_k(arena, off, rows, K, n_tok, act.xq, act.xd, act.bs, out, s)


def bench_dense(timer, copy_bw, rng, log, shapes=DENSE_SHAPES, scales_last=True):
    """Time each decode matvec shape (graph-replayed, rotating copies so L2 holds none). scales_last:
    the Q8_0 matrices rewritten scales-last by q8_0_relayout (as the GPU sources keep them), whose
    output must equal the file layout's bit for bit ("same bits" / "BITS DIFFER")."""
    from . import cuda as CK
    cuda = _cuda()
    rows_out = []
    for name, t, rows, K in shapes:
        wbytes = rows * F.row_bytes(t, K)
        copies = max(1, math.ceil(ROT_BYTES / wbytes))
        arena = Arena(copies * (wbytes + 256) + 4096, seed=rows + K)
        offs = [arena.place(t, rows, K) for _ in range(copies)]
        act = _Act(t, 1, K, rng)
        out = cuda.device_array(rows, np.float32)

        sl = scales_last and t == F.Q8_0

        def launch(s):
            for off in offs:
                _launch_matmul(t, arena.buf, off, rows, K, 1, act, out, s, sl)

        _launch_matmul(t, arena.buf, offs[0], rows, K, 1, act, out, 0)   # compile outside capture
        bits = ""
        if sl:
            want = out.copy_to_host()
            for off in offs:
                CK.q8_0_relayout(arena.buf, off, rows, K)
            _launch_matmul(t, arena.buf, offs[0], rows, K, 1, act, out, 0, sl)
            bits = " same bits" if np.array_equal(out.copy_to_host(), want) else " BITS DIFFER"
        us, us_pdl = _per_launch_us(timer, launch, copies, log)
        gbs = wbytes / (us * 1e-6) / 1e9
        r = dict(name=name, type=F.TYPE_NAMES[t], rows=rows, K=K, weight_MB=wbytes / 1e6,
                 us=us, GBps=gbs, pct_copy=100 * gbs * 1e9 / copy_bw, copies=copies,
                 scales_last=bool(bits), same_bits=bits == " same bits")
        _add_pdl(r, us_pdl, wbytes, copy_bw)
        _add_read(r, read_ceiling_us(timer, arena.buf, [(o, wbytes) for o in offs], copies), copy_bw, wbytes)
        rows_out.append(r)
        log(f"  {name:44s} {us:8.2f} us {gbs:8.0f} GB/s {r['pct_copy']:5.1f} %"
            + _pdl_text(r) + _read_text(r) + (" scales-last" + bits if bits else ""))
        del arena
    return rows_out


def _q8_0_dense_under(timer, copy_bw, rng, log, variants):
    """bench_dense on the Q8_0 decode shapes once per (rep, knobs, scales_last, label) of
    variants, with kernels.cuda's knobs (a dict: name -> value) set; each result row gets rep and
    the knobs. The knobs are restored afterwards."""
    from . import cuda as CK
    shapes = [s for s in DENSE_SHAPES if s[1] == F.Q8_0]
    res = []
    names = {n for _, knobs, _, _ in variants for n in knobs}
    saved = {n: getattr(CK, n) for n in names}
    try:
        for rep, knobs, scales_last, label in variants:
            for n, v in {**saved, **knobs}.items():
                setattr(CK, n, v)
            log(f"  [{label}]")
            for r in bench_dense(timer, copy_bw, rng, log, shapes=shapes, scales_last=scales_last):
                r.update({"rep": rep, **knobs})
                res.append(r)
    finally:
        for n, v in saved.items():
            setattr(CK, n, v)
    return res


def bench_tune_q8(timer, copy_bw, rng, log):
    """The Q8_0 decode shapes in the file's layout and then in q8_0_relayout's (scales last, so a
    lane's 8 quant bytes are one aligned load), alternating twice, each checked bit for bit."""
    splits = ((0, 4, False), (0, 4, True), (1, 4, False), (1, 4, True), (0, 8, True), (0, 2, True))
    return _q8_0_dense_under(timer, copy_bw, rng, log,
                             [(rep, {"_Q8_0_U": U, "_Q8_0_PAIRS": False}, sl,
                               f"U={U}{' scales-last' if sl else ''}") for rep, U, sl in splits])


def bench_tune_pre(timer, copy_bw, rng, log):
    """The Q8_0 decode shapes (scales-last rows) with q8_0_rows' first chunk of weights read
    after pdl_enter() and before it (_Q8_0_PRE), alternating twice; ordinary and PDL-edge graphs
    (the prologue can only gain in the latter), each checked bit for bit."""
    return _q8_0_dense_under(timer, copy_bw, rng, log,
                             [(rep, {"_Q8_0_PRE": pre}, True, f"weight prologue {'before' if pre else 'after'} pdl_enter")
                              for rep, pre in ((0, False), (0, True), (1, False), (1, True))])


def bench_tune_pairs(timer, copy_bw, rng, log):
    """The Q8_0 decode shapes (scales-last rows) with the one-warp-per-row launches in q8_0_rows
    (8 blocks per warp step) and in q8_0_pairs (16, two lanes per block) under its steps per
    chunk, register caps and the one-chunk kernel, alternating twice; the same bits everywhere
    (bench_dense checks them)."""
    variants = []
    for rep in (0, 1):
        variants.append((rep, {"_Q8_0_PAIRS": False}, True, "q8_0_rows"))
        for U, regs, one in ((2, 0, True), (2, 0, False), (3, 0, True), (4, 0, True), (2, 40, True)):
            variants.append((rep, {"_Q8_0_PAIRS": True, "_Q8_0_PAIRS_U": U, "_Q8_0_PAIRS_REGS": regs,
                                   "_Q8_0_PAIRS_ONE": one}, True,
                             f"q8_0_pairs U={U} cap {regs or 'none'}{'' if one else ', chunk loop always'}"))
    return _q8_0_dense_under(timer, copy_bw, rng, log, variants)


def _moe_setup(rng, n_exp=256, n_embd=4096, n_ff=2048, gate_type=F.IQ2_XXS, down_type=F.Q2_K):
    gu_bytes = n_ff * F.row_bytes(gate_type, n_embd)
    d_bytes = n_embd * F.row_bytes(down_type, n_ff)
    arena = Arena(n_exp * (2 * gu_bytes + d_bytes) + 3 * 4096, seed=7)
    og = arena.place(gate_type, n_exp * n_ff, n_embd)
    ou = arena.place(gate_type, n_exp * n_ff, n_embd)
    od = arena.place(down_type, n_exp * n_embd, n_ff, sigma=1 / math.sqrt(n_ff))
    return dict(arena=arena, og=og, ou=ou, od=od, stride_gu=gu_bytes, stride_d=d_bytes,
                bytes_per_expert=2 * gu_bytes + d_bytes, n_exp=n_exp, n_embd=n_embd, n_ff=n_ff,
                gate_type=gate_type, down_type=down_type)


class _MoEStep:
    """Device buffers of one decode MoE call (its own expert ids, weights, x, output)."""

    def __init__(self, moe, rng, n_used=6):
        from . import cuda as CK
        cuda = _cuda()
        self.moe = moe
        ids = rng.choice(moe["n_exp"], n_used, replace=False).astype(np.int32)
        self.ids = cuda.to_device(ids)
        self.rw = cuda.to_device(rng.uniform(0.05, 0.5, n_used).astype(np.float32))
        self.x = cuda.to_device(rng.standard_normal(moe["n_embd"]).astype(np.float32))
        self.slot_off = cuda.device_array((n_used, 3), np.int64)
        self.out = cuda.device_array(moe["n_embd"], np.float32)
        self.ws = CK.MoEWorkspace(n_used, moe["n_embd"], moe["n_ff"])

    def offsets(self, s):
        from . import cuda as CK
        m = self.moe
        CK.expert_offsets(self.ids, m["og"], m["ou"], m["od"], m["stride_gu"], m["stride_d"],
                          self.slot_off, s)

    def full(self, s):
        from . import cuda as CK
        m = self.moe
        self.offsets(s)
        CK.moe_decode(m["arena"].buf, self.slot_off, m["gate_type"], m["down_type"], self.x,
                      self.rw, 10.0, self.out, self.ws, s)

    def gate_up(self, s):
        from . import cuda as CK
        m = self.moe
        CK.moe_gate_up(m["arena"].buf, self.slot_off, m["gate_type"], m["n_embd"], m["n_ff"],
                       self.ws.xq, self.ws.xd, self.rw, 10.0, self.ws.mid, s, bsums=self.ws.xbs)

    def down(self, s):
        from . import cuda as CK
        m = self.moe
        CK.moe_down(m["arena"].buf, self.slot_off, m["down_type"], m["n_ff"], m["n_embd"],
                    self.ws.mq, self.ws.md, self.ws.mbs, self.out, s)


def _step_regions(moe, steps):
    """The weight bytes [(byte offset, bytes), ...] the steps' launches read, by launch:
    "gate_up", "down", and "full" (both)."""
    regions = {"gate_up": [], "down": [], "full": []}
    for st in steps:
        ids = [int(e) for e in st.ids.copy_to_host()]
        gate_up = [(moe[m] + e * moe["stride_gu"], moe["stride_gu"]) for e in ids for m in ("og", "ou")]
        down = [(moe["od"] + e * moe["stride_d"], moe["stride_d"]) for e in ids]
        regions["gate_up"] += gate_up
        regions["down"] += down
        regions["full"] += gate_up + down
    return regions


def bench_moe(timer, copy_bw, rng, log, moe):
    steps = [_MoEStep(moe, rng) for _ in range(8)]
    for st in steps:
        st.full(0)                                  # compile + fill the workspaces
    _cuda().synchronize()
    n_used = 6
    gu_bytes = 2 * moe["stride_gu"] * n_used
    d_bytes = moe["stride_d"] * n_used
    regions = _step_regions(moe, steps)
    res = []
    for name, fn, nbytes in (("MoE decode total (offsets, Q8_K x, gate+up, Q8_K mid, down)",
                              "full", gu_bytes + d_bytes),
                             ("MoE gate+up fused, 6 experts (IQ2_XXS)", "gate_up", gu_bytes),
                             ("MoE down, 6 experts summed (Q2_K)", "down", d_bytes)):
        us, us_pdl = _per_launch_us(timer, lambda s: [getattr(st, fn)(s) for st in steps], len(steps), log)
        gbs = nbytes / (us * 1e-6) / 1e9
        r = dict(name=name, weight_MB=nbytes / 1e6, us=us, GBps=gbs,
                 pct_copy=100 * gbs * 1e9 / copy_bw)
        _add_pdl(r, us_pdl, nbytes, copy_bw)
        _add_read(r, read_ceiling_us(timer, moe["arena"].buf, regions[fn], len(steps)), copy_bw, nbytes)
        res.append(r)
        log(f"  {name:44s} {us:8.2f} us {gbs:8.0f} GB/s {r['pct_copy']:5.1f} %" + _pdl_text(r) + _read_text(r))
    return res


def bench_layer(timer, copy_bw, rng, log, moe):
    """One layer's decode kernels (activation quantizers, Q8_0 projections, router, shared expert,
    routed MoE) captured as one graph. Element-wise glue owned by other modules (norms, RoPE,
    attention, SwiGLU of the shared expert, HC mixing) is not included."""
    from . import cuda as CK
    cuda = _cuda()
    proj = [("q_a", F.Q8_0, 1024, 4096, "x"), ("q_b", F.Q8_0, 32768, 1024, "qa"),
            ("kv", F.Q8_0, 512, 4096, "x")] + \
           [(f"out_a{g}", F.Q8_0, 1024, 4096, f"attn{g}") for g in range(8)] + \
           [("out_b", F.Q8_0, 4096, 8192, "oa"), ("router", F.F16, 256, 4096, "xf"),
            ("sh_gate", F.Q8_0, 2048, 4096, "x"), ("sh_up", F.Q8_0, 2048, 4096, "x"),
            ("sh_down", F.Q8_0, 4096, 2048, "mid")]
    total = sum(r * F.row_bytes(t, k) for _, t, r, k, _ in proj)
    arena = Arena(total + 64 * 1024, seed=11)
    offs = {name: arena.place(t, r, k) for name, t, r, k, _ in proj}
    for name, t, r, k, _ in proj:          # the Q8_0 rows scales-last, as the GPU sources keep them
        if t == F.Q8_0:
            CK.q8_0_relayout(arena.buf, offs[name], r, k)

        x = cuda.to_device(rng.standard_normal(K).astype(np.float32))
        return x, cuda.device_array(K, np.int8), cuda.device_array(K // 32, np.float32)

    acts = {"x": qbuf(4096), "qa": qbuf(1024), "attn": qbuf(32768), "oa": qbuf(8192),
            "mid": qbuf(2048)}
    outs = {name: cuda.device_array(r, np.float32) for name, _, r, _, _ in proj}
    step = _MoEStep(moe, rng)
    step.full(0)

    def launch(s):
        for key in ("x", "qa", "attn", "oa", "mid"):
            x, q, d = acts[key]
            CK.quantize_q8_0(x, q, d, s)
        for name, t, r, k, src in proj:
            if t == F.F16:
                CK.matvec_f16(arena.buf, offs[name], r, k, acts["x"][0], outs[name], s)
                continue
            if src.startswith("attn"):
                g = int(src[4:])
                _, q, d = acts["attn"]
                q, d = q[g * 4096:(g + 1) * 4096], d[g * 128:(g + 1) * 128]
            else:
                _, q, d = acts[src]
            CK.matvec_q8_0(arena.buf, offs[name], r, k, q, d, outs[name], s, scales_last=True)
        step.full(s)

    launch(0)
    g = timer.graph(launch)
    med, best = timer.time_graph(g)
    n_exp_bytes = 6 * moe["bytes_per_expert"]
    nbytes = total + n_exp_bytes
    gbs = nbytes / (med * 1e-3) / 1e9
    n_launch = 5 + len(proj) + 5
    r = dict(name="one layer decode graph", weight_MB=nbytes / 1e6, us=med * 1e3, GBps=gbs,
             pct_copy=100 * gbs * 1e9 / copy_bw, launches=n_launch,
             ideal_us=nbytes / copy_bw * 1e6)
    log(f"  {'one layer (' + str(n_launch) + ' kernels, one graph)':44s} {med * 1e3:8.2f} us "
        f"{gbs:8.0f} GB/s {r['pct_copy']:5.1f} %  (43 layers: {43 * med:.2f} ms)")
    return r


def bench_prefill(timer, rng, log, moe, n_tok=2048):
    cuda = _cuda()
    res = []
    for name, t, rows, K in (("Q8_0 4096->2048", F.Q8_0, 2048, 4096),
                             ("F16 4096->256", F.F16, 256, 4096),
                             ("IQ2_XXS 4096->2048", F.IQ2_XXS, 2048, 4096),
                             ("Q2_K 2048->4096", F.Q2_K, 4096, 2048),
                             ("Q4_K 4096->2048", F.Q4_K, 2048, 4096)):
        arena = Arena(rows * F.row_bytes(t, K) + 4096, seed=3)
        off = arena.place(t, rows, K)
        act = _Act(t, n_tok, K, rng)
        out = cuda.device_array((n_tok, rows), np.float32)
        ms = timer.time_eager(lambda s: _launch_matmul(t, arena.buf, off, rows, K, n_tok, act, out, s))
        tops = 2 * n_tok * rows * K / (ms * 1e-3) / 1e12
        r = dict(name=f"matmul {name}", n_tok=n_tok, ms=ms, tok_per_s=n_tok / (ms * 1e-3),
                 TOPS=tops)
        res.append(r)
        log(f"  matmul {name:37s} {ms:8.3f} ms {r['tok_per_s']:10.0f} tok/s {tops:6.2f} TOPS")
    # the Q8_0 matmul on the int8 tensor cores (same numbers as the dp4a kernel above), also at the
    # engine's 512-token chunk
    from . import cuda as CK
    for name, rows, K, n in (("Q8_0 4096->2048", 2048, 4096, n_tok), ("Q8_0 1024->32768", 32768, 1024, n_tok),
                             ("Q8_0 4096->1536", 1536, 4096, 512), ("Q8_0 1024->32768", 32768, 1024, 512)):
        arena = Arena(rows * F.row_bytes(F.Q8_0, K) + 4096, seed=3)
        off = arena.place(F.Q8_0, rows, K)
        act = _Act(F.Q8_0, n, K, rng)
        out = cuda.device_array((n, rows), np.float32)
        ms = timer.time_eager(lambda s: CK.matmul_q8_0_mma(arena.buf, off, rows, K, n, act.xq, act.xd, out, s))
        tops = 2 * n * rows * K / (ms * 1e-3) / 1e12
        label = f"{name} x{n}, tensor cores"
        r = dict(name=f"matmul {label}", n_tok=n, ms=ms, tok_per_s=n / (ms * 1e-3), TOPS=tops)
        res.append(r)
        log(f"  matmul {label:37s} {ms:8.3f} ms {r['tok_per_s']:10.0f} tok/s {tops:6.2f} TOPS")
    # the F16 matmul at the engine's chunk (router 4096->256, compressor pair 4096->1024)
    for name, rows, K in (("F16 4096->256", 256, 4096), ("F16 4096->1024", 1024, 4096)):
        arena = Arena(rows * F.row_bytes(F.F16, K) + 4096, seed=3)
        off = arena.place(F.F16, rows, K)
        act = _Act(F.F16, 512, K, rng)
        out = cuda.device_array((512, rows), np.float32)
        ms = timer.time_eager(lambda s: _launch_matmul(F.F16, arena.buf, off, rows, K, 512, act, out, s))
        tflops = 2 * 512 * rows * K / (ms * 1e-3) / 1e12
        r = dict(name=f"matmul {name} x512", n_tok=512, ms=ms, tok_per_s=512 / (ms * 1e-3), TFLOPS=tflops)
        res.append(r)
        log(f"  matmul {name + ' x512':37s} {ms:8.3f} ms {r['tok_per_s']:10.0f} tok/s {tflops:6.2f} TFLOPS")
    # routed MoE prefill: tokens grouped by expert (host grouping + kernels, wall clock)
    X = cuda.to_device(rng.standard_normal((n_tok, moe["n_embd"])).astype(np.float32))
    ids = np.stack([rng.choice(moe["n_exp"], 6, replace=False) for _ in range(n_tok)]).astype(np.int32)
    rw = cuda.to_device(rng.uniform(0.05, 0.5, (n_tok, 6)).astype(np.float32))
    out = cuda.device_array((n_tok, moe["n_embd"]), np.float32)
    table = np.array([[moe["og"] + e * moe["stride_gu"], moe["ou"] + e * moe["stride_gu"],
                       moe["od"] + e * moe["stride_d"]] for e in range(moe["n_exp"])], np.int64)
    saved = (CK._MMA_HALVES_GU, CK._MMA_HALVES_DN, CK._MMA_STAGED_GU, CK._MMA_STAGED_DN)
    d_table = cuda.to_device(table)
    d_ids = cuda.to_device(ids)
    try:
        for n in (n_tok, 512):                 # 512: the engine's prefill chunk (~12 pairs per expert)
            # ids and table on the device: grouped by a kernel as in the engine, timed with events
            args = (moe["arena"].buf, d_table, moe["gate_type"], moe["down_type"], moe["n_embd"], moe["n_ff"],
                    X[:n], d_ids[:n], rw[:n], 10.0, out[:n])
            first_bits = None
            for mma, gu, dn, st_gu, st_dn, label in (
                    (False, 1, 1, False, False, ""),
                    (True, 2, 1, False, False, ", tc, 16-pair gate/up, 8-pair down tiles"),
                    (True, 2, 2, False, False, ", tc, 16-pair gate/up and down tiles"),
                    (True, 2, 2, True, False, ", tc, 16-pair tiles, staged gate/up"),
                    (True, 2, 2, True, True, ", tc, 16-pair tiles, staged gate/up and down")):
                CK._MMA_HALVES_GU, CK._MMA_HALVES_DN = gu, dn
                CK._MMA_STAGED_GU, CK._MMA_STAGED_DN = st_gu, st_dn
                ms = timer.time_eager(lambda s: CK.moe_prefill(*args, stream=s, mma=mma))
                bits = out[:n].copy_to_host().view(np.uint32)
                first_bits = bits if first_bits is None else first_bits
                same = bool(np.array_equal(bits, first_bits))
                r = dict(name=f"MoE prefill {n} tok (6 of 256 experts, grouped{label})", n_tok=n, ms=ms,
                         tok_per_s=n / (ms * 1e-3), same_bits=same)
                res.append(r)
                log(f"  {r['name']:44s} {ms:8.3f} ms {r['tok_per_s']:10.0f} tok/s"
                    f"{'' if same else '  DIFFERENT BITS from the dp4a kernels'}")
    finally:
        (CK._MMA_HALVES_GU, CK._MMA_HALVES_DN, CK._MMA_STAGED_GU, CK._MMA_STAGED_DN) = saved
    return res


def _moe_variant_sweep(timer, copy_bw, rng, log, moe, names, variants, describe):
    """Time bench_moe's decode launches under each variant (a value for each of the kernels.cuda
    knobs `names`), checking that every variant gives the bits of the first (mid and out of one
    step); describe(variant dict) labels a log line. A variant with _IQ2_REPACKED_GATE_UP set runs
    on the arena's gate and up experts rewritten by iq2_xxs_relayout (and back after it)."""
    from . import cuda as CK
    cuda = _cuda()
    res = []
    saved = tuple(getattr(CK, n) for n in names)
    n_rows = moe["n_exp"] * moe["n_ff"]
    repacked = False

    def relayout(to_repacked):
        for o in (moe["og"], moe["ou"]):
            CK.iq2_xxs_relayout(moe["arena"].buf, o, n_rows, moe["n_embd"], to_repacked)
        cuda.synchronize()

    first = None
    try:
        for v in variants:
            knobs = dict(zip(names, v))
            want = bool(knobs.get("_IQ2_REPACKED_GATE_UP", False))
            if want != repacked:
                relayout(want)
                repacked = want
            for n, value in knobs.items():
                setattr(CK, n, value)
            CK._KERNELS.clear()              # the sign variant is baked into the row-dot helpers
            CK._ROWDOTS.clear()
            step = _MoEStep(moe, np.random.default_rng(1))
            step.full(0)
            cuda.synchronize()
            bits = (step.ws.mid.copy_to_host(), step.out.copy_to_host())
            first = first or bits
            same = all(np.array_equal(a, b) for a, b in zip(bits, first))
            for r in bench_moe(timer, copy_bw, rng, lambda m: None, moe)[1:]:
                r["variant"] = knobs
                r["same_bits"] = same
                res.append(r)
                log(f"  [{describe(knobs)}] {r['name'][:30]:30s} {r['us']:8.2f} us "
                    f"{r['GBps']:6.0f} GB/s {r['pct_copy']:5.1f} %{_pdl_text(r)} "
                    f"{'same bits' if same else 'BITS DIFFER'}")
    finally:
        if repacked:
            relayout(False)
        for n, value in zip(names, saved):
            setattr(CK, n, value)
        CK._KERNELS.clear()
        CK._ROWDOTS.clear()
    return res


def bench_tune_moe(timer, copy_bw, rng, log, moe):
    """The routed-expert decode kernels under other launch parameters and code variants: gate/up
    rows per block, warps per block, register cap, x in registers or shared memory, the IQ2_XXS sign
    arithmetic (split: dot(g, x) - 2 dot(g & m, x)), a kernel per row length (const: the step count
    a compile-time constant, chunks of nch steps); down warps per block and register cap, or one
    warp per slot over R rows per block (moe_down_decode_slots). Every variant must give the same
    bits (checked: mid and out of one step against the first variant); only the time may change."""
    names = ("_RPB_GATE_UP", "_NW_GATE_UP", "_REGS_GATE_UP", "_X_REGS_GATE_UP", "_IQ2_SPLIT_SIGNS",
             "_NW_DOWN", "_REGS_DOWN", "_CONST_STEPS_GATE_UP", "_NCH_GATE_UP", "_R_DOWN_SLOTS",
             "_IQ2_PERM_GATE_UP", "_IQ2_REPACKED_GATE_UP")
    # (gate/up with x in registers: 128 registers, 2 blocks of 8 warps per SM; with x staged in
    # shared memory: 64 registers, 4 blocks; down: one warp per output row, 64 registers = 32
    # warps per SM)
    old = [(8, 8, 0, True, True, 4, 64), (8, 8, 0, True, False, 4, 64),
           (8, 8, 0, False, True, 4, 64), (16, 8, 0, False, True, 4, 64),
           (8, 16, 0, False, True, 4, 64), (4, 4, 0, False, True, 4, 64),
           (16, 16, 0, False, True, 4, 64), (8, 8, 0, True, True, 8, 64)]
    variants = [v + (False, 0, 0) for v in old]
    # const steps (ptxas, sm_90: 80 registers with chunks of 4 steps, 72 with 2 or 1, no spills,
    # against 128): 3 blocks of 8 warps, 4 of 6 or 6 of 4 per SM; rows x warps chosen so that the
    # 12,288 (row, slot) units of a flash layer are one wave of ~4 units per warp. Down slots (80
    # registers, 6-warp blocks, 4 per SM): R = 8 is one wave of 512 blocks on 132 SMs.
    variants += [(8, 8, 0, True, True, 4, 64, True, 0, 8), (6, 8, 0, True, True, 4, 64, True, 0, 16),
                 (4, 6, 0, True, True, 4, 64, True, 0, 4), (3, 4, 0, True, True, 4, 64, True, 0, 8),
                 (4, 6, 0, True, True, 4, 64, True, 2, 6), (4, 6, 0, True, True, 4, 64, True, 1, 8),
                 (4, 4, 0, True, True, 4, 64, True, 0, 0),
                 (4, 8, 0, False, True, 4, 64, True, 1, 8)]   # x staged, chunks of 1: 56 registers, 4 blocks
    variants = [v + (False,) for v in variants]
    # first (so that a time limit still leaves them): the defaults of session 15, then the same
    # with the byte-permute IQ2_XXS weights (_IQ2_PERM_GATE_UP; ptxas sm_90: 80 registers, 2,368
    # SASS instructions against 2,784)
    shipped = (4, 6, 0, True, True, 4, 64, True, 0, 8)
    variants = [shipped + (False,), shipped + (True,)] + variants
    # then the byte-permute kernel on rows in iq2_xxs_relayout's layout (_IQ2_REPACKED_GATE_UP: one
    # aligned 8-byte load and one 16-bit load per sub-block instead of five 16-bit loads; ptxas:
    # 2,336 SASS, 16 loads per (row, slot) unit instead of 40): the arena's gate and up experts are
    # rewritten for it and back after it
    variants = [v + (False,) for v in variants]
    variants[2:2] = [shipped + (True, True)]

    def describe(k):
        gu_const = ((f" const nch {k['_NCH_GATE_UP'] or 'auto'}" if k["_CONST_STEPS_GATE_UP"] else "")
                    + (" perm" if k["_IQ2_PERM_GATE_UP"] else "") + (" repacked" if k["_IQ2_REPACKED_GATE_UP"] else ""))
        dn = f"slots R {k['_R_DOWN_SLOTS']}" if k["_R_DOWN_SLOTS"] else f"warps {k['_NW_DOWN']} regs {k['_REGS_DOWN'] or '-'}"
        return (f"gu rows {k['_RPB_GATE_UP']} warps {k['_NW_GATE_UP']} regs {k['_REGS_GATE_UP'] or '-'} "
                f"x_regs {int(k['_X_REGS_GATE_UP'])} split {int(k['_IQ2_SPLIT_SIGNS'])}{gu_const}; down {dn}")

    # all of them on moe_gate_up_decode (moe_gate_up_halves is tune_halves') and the down kernels
    # before moe_down_sb (tune_down's)
    names += ("_GU_HALVES", "_DOWN_SB")
    variants = [v + (False, 0) for v in variants]
    return _moe_variant_sweep(timer, copy_bw, rng, log, moe, names, variants, describe)


def bench_tune_gu(timer, copy_bw, rng, log, moe):
    """The shipped IQ2_XXS gate/up decode kernel with its tables filled before or after
    pdl_enter (_PRE_GATE_UP), on the file's rows and on repacked ones, and with other rows / warps
    per block. Same bits checked against the first variant."""
    names = ("_PRE_GATE_UP", "_IQ2_REPACKED_GATE_UP", "_RPB_GATE_UP", "_NW_GATE_UP", "_GU_HALVES")
    variants = [(False, False, 4, 6), (True, False, 4, 6), (False, True, 4, 6), (True, True, 4, 6),
                (True, False, 8, 8), (True, False, 3, 4), (False, False, 4, 6), (True, False, 4, 6)]
    variants = [v + (False,) for v in variants]

    def describe(k):
        return (f"pre {int(k['_PRE_GATE_UP'])} repacked {int(k['_IQ2_REPACKED_GATE_UP'])} "
                f"rows {k['_RPB_GATE_UP']} warps {k['_NW_GATE_UP']}")

    return _moe_variant_sweep(timer, copy_bw, rng, log, moe, names, variants, describe)


def bench_tune_halves(timer, copy_bw, rng, log, moe):
    """moe_gate_up_halves (the shipped gate/up decode) with and without its deferred SwiGLU
    (_GU_DEFER), and other block shapes. Same bits checked against the first variant; the first
    comes again at the end (drift between the first and last minutes)."""
    names = ("_GU_DEFER", "_RPB_GATE_UP", "_NW_GATE_UP", "_REGS_GU_HALVES", "_IQ2_REPACKED_GATE_UP")
    # ptxas sm_90: 76 registers with the deferred SwiGLU (4 blocks of 6 warps per SM: 24 warps, and
    # the 512 blocks fill them), 72 without. Capped: 72 without spills (the same 24 warps); 64 (96
    # bytes spilled) fits 32 warps per SM, which rows 4 x warps 8 (512 blocks) and rows 2 x warps 4
    # (1,024) fill in one wave of 3 units per warp; 48 (200 bytes spilled) with rows 2 x warps 4:
    # 10 blocks per SM fit, the grid fills 31 warps
    # (H200, session 37: every cap slower, 64 -> 22.3-22.6 us against 19.4 with PDL edges).
    # Repacked: the experts in iq2_xxs_relayout's layout (a lane's 32 bytes two aligned 16-byte
    # loads, a warp's reads of a row 1 KB contiguous: ncu counts 5.2 of each 32-byte sector used
    # per thread on the file's layout, L1 82.7 % busy; ptxas: 76 registers, 1,824 SASS against 1,864;
    # H100, session 37: 19.05-19.11 us against 19.65, 3.2x fewer global sectors, L1 still ~80 % busy)
    # (the per-unit SwiGLU and rows x warps 4 x 8, 8 x 8 on repacked rows: slower on the H100,
    # session 37; a sub-block's lookups issued ahead of its permutes, L1 prefetches of the unit's up
    # row and the next unit's rows: no faster on the H100, session 43)
    # (session 44's x staged once per block and a warp per matrix: 2.3-7.1 us slower on the H100
    # with PDL edges, session 45; removed)
    variants = [(True, 4, 6, 0, False), (True, 4, 6, 0, True), (True, 4, 6, 0, False), (True, 4, 6, 0, True)]

    def describe(k):
        return (f"halves {'deferred' if k['_GU_DEFER'] else 'per-unit'} SwiGLU rows {k['_RPB_GATE_UP']} "
                f"warps {k['_NW_GATE_UP']} regs {k['_REGS_GU_HALVES'] or '-'}"
                + (" repacked" if k["_IQ2_REPACKED_GATE_UP"] else ""))

    return _moe_variant_sweep(timer, copy_bw, rng, log, moe, names, variants, describe)


def bench_tune_down(timer, copy_bw, rng, log, moe):
    """The Q2_K down decode: moe_down_sb (the shipped one, _DOWN_SB rows per block: a lane per
    super-block, the weights through shared memory by cp.async; ptxas sm_90: 43 registers, ~300
    SASS instructions per 4 rows and slot of 8 super-blocks against ~1,000 for
    moe_down_decode_slots; 71 registers with group 0's copies before the wait) with none, 1 (the
    default) or 2 of its weight groups copied before pdl_enter (_DOWN_EARLY), against
    moe_down_decode_slots (R rows per block). Same bits checked against the first variant; the
    first three come again at the end (drift)."""
    names = ("_DOWN_SB", "_R_DOWN_SLOTS", "_DOWN_EARLY")
    variants = [(8, 8, 0), (8, 8, 1), (8, 8, 2), (0, 8, 0), (16, 8, 1), (8, 8, 0), (8, 8, 1), (8, 8, 2)]

    def describe(k):
        return ((f"sb R {k['_DOWN_SB']}" if k["_DOWN_SB"] else f"slots R {k['_R_DOWN_SLOTS']}")
                + (f" early {k['_DOWN_EARLY']}" if k["_DOWN_EARLY"] else ""))

    return _moe_variant_sweep(timer, copy_bw, rng, log, moe, names, variants, describe)


def bench_scale_moe(timer, copy_bw, rng, log, moe, slot_counts=(1, 2, 3, 4, 6)):
    """The shipped MoE decode kernels at 1..6 routed slots (the same grid: fewer (row, slot) units
    a warp): us per launch with PDL edges against the slot count, and the least-squares line
    through them. Its intercept is what a launch costs whatever its work (launch, prologue, the
    first unit's latency, tail); its slope the cost of a slot's weights, set beside the plain
    read's slope over the same bytes."""
    res = []
    for n_used in slot_counts:
        steps = [_MoEStep(moe, rng, n_used=n_used) for _ in range(8)]
        for st in steps:
            st.full(0)
        _cuda().synchronize()
        regions = _step_regions(moe, steps)
        for fn, nbytes in (("gate_up", 2 * moe["stride_gu"] * n_used), ("down", moe["stride_d"] * n_used)):
            us, us_pdl = _per_launch_us(timer, lambda s: [getattr(st, fn)(s) for st in steps], len(steps), log)
            read_us = read_ceiling_us(timer, moe["arena"].buf, regions[fn], len(steps))
            r = dict(kernel=fn, n_used=n_used, weight_MB=nbytes / 1e6, us=us, read_us=read_us)
            _add_pdl(r, us_pdl, nbytes, copy_bw)
            res.append(r)
            log(f"  {fn:8s} slots {n_used}  {nbytes / 1e6:6.2f} MB  {us:7.2f} us{_pdl_text(r)}"
                f"  | plain read {read_us:6.2f} us")
    for fn in ("gate_up", "down"):
        for key in ("us_pdl", "us", "read_us"):
            pts = [(r["n_used"], r[key]) for r in res if r["kernel"] == fn and r.get(key) is not None]
            if len(pts) < 2:
                continue
            slope, icept = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
            res.append(dict(kernel=fn, fit=key, us_per_slot=float(slope), us_fixed=float(icept)))
            log(f"  {fn:8s} {key:8s} = {icept:6.2f} us + {slope:5.2f} us per slot")
    return res


# The engine's Q8_0 launches in one decode step: (name, rows of each matrix, K, x_groups)
Q8_0_LAUNCHES = (("attn_q_a + attn_kv 4096->1024+512", (1024, 512), 4096, 1),
                 ("attn_q_b 1024->32768", (32768,), 1024, 1),
                 ("attn_out_a grouped 8x(4096->1024)", (8192,), 4096, 8),
                 ("attn_out_b 8192->4096", (4096,), 8192, 1),
                 ("shared gate + up 4096->2048+2048", (2048, 2048), 4096, 1),
                 ("shared down 2048->4096", (4096,), 2048, 1),
                 ("output head 4096->129280", (129280,), 4096, 1))


def _q8_0_variants(nb):
    """Every (S, U) work split worth timing for rows of nb blocks: U steps per chunk up to the
    row's steps, S warps per row up to its chunks."""
    steps = (nb + 7) // 8
    out = []
    for U in (1, 2, 3, 4, 6, 8, 16):
        if U > steps:
            break
        chunks = (steps + U - 1) // U
        out += [(S, U) for S in (1, 2, 4, 8) if S <= chunks]
    return out


def bench_tune_split(timer, copy_bw, rng, log, prefill_tokens=512, prefill_top=2):
    """The engine's Q8_0 decode launches (scales-last rows, as the GPU sources keep them) under
    every work split (S warps per row, U steps per chunk; kernels.cuda._q8_0_work picks one per
    shape), graph-replayed over rotating copies; then the same launch at prefill_tokens tokens
    (the tensor-core matmul) for the prefill_top fastest decode splits and the shipped one. The
    split fixes the order of the sums, so the bits differ between splits; only times are compared."""
    from . import cuda as CK
    cuda = _cuda()
    shipped = CK._q8_0_work
    res = []
    try:
        for name, parts_rows, K, groups in Q8_0_LAUNCHES:
            nb = K // 32
            rows = sum(parts_rows)
            wbytes = rows * F.row_bytes(F.Q8_0, K)
            copies = max(1, math.ceil(ROT_BYTES / wbytes))
            arena = Arena(copies * (wbytes + 256 * len(parts_rows)) + 4096, seed=rows + K)
            offs = []
            for _ in range(copies):
                parts = [(arena.place(F.Q8_0, r, K), r) for r in parts_rows]
                for off, r in parts:
                    CK.q8_0_relayout(arena.buf, off, r, K)
                offs.append(parts)
            act = _Act(F.Q8_0, groups, K, rng)
            out = cuda.device_array(rows, np.float32)
            S0, U0, _ = shipped(rows, nb)
            timed = []
            for S, U in _q8_0_variants(nb):
                CK._q8_0_work = lambda r, n, S=S, U=U: (S, U, ((n + 7) // 8 + U - 1) // U)

                def launch(s):
                    for parts in offs:
                        CK._launch_q8_0(arena.buf, parts, K, 1, act.xq, act.xd, out, s, x_groups=groups,
                                        scales_last=True)

                launch(0)                                  # compile outside the capture
                med, _ = timer.time_graph(timer.graph(launch))
                us = med * 1e3 / copies
                pct = 100 * wbytes / (us * 1e-6) / copy_bw
                timed.append((us, S, U))
                res.append(dict(name=name, rows=rows, K=K, S=S, U=U, us=us, pct_copy=pct,
                                shipped=(S, U) == (S0, U0)))
                log(f"  {name:36s} S={S} U={U:<2d} {us:8.2f} us {pct:5.1f} %"
                    + ("  (shipped)" if (S, U) == (S0, U0) else ""))
            if groups > 1:
                continue                                   # grouped launches are decode only
            xp = _Act(F.Q8_0, prefill_tokens, K, rng)
            outp = cuda.device_array((prefill_tokens, rows), np.float32)
            for S, U in sorted({(S, U) for _, S, U in sorted(timed)[:prefill_top]} | {(S0, U0)}):
                CK._q8_0_work = lambda r, n, S=S, U=U: (S, U, ((n + 7) // 8 + U - 1) // U)
                ms = timer.time_eager(lambda s: CK._launch_q8_0(arena.buf, offs[0], K, prefill_tokens, xp.xq,
                                                                xp.xd, outp, s, scales_last=True))
                res.append(dict(name=name, rows=rows, K=K, S=S, U=U, prefill_ms=ms, n_tok=prefill_tokens,
                                shipped=(S, U) == (S0, U0)))
                log(f"  {name:36s} S={S} U={U:<2d} prefill x{prefill_tokens}: {ms:8.3f} ms"
                    + ("  (shipped)" if (S, U) == (S0, U0) else ""))
            del arena
    finally:
        CK._q8_0_work = shipped
    return res


def bench_tune_prefill(timer, rng, log):
    """The shared-memory Q8_0 tensor-core kernel's tile shapes, register caps, prefetch, the
    magic-C accumulator and the cp.async staging against the direct kernel, at the engine's
    prefill shapes; every variant's output must equal the direct kernel's bit for bit (a mismatch
    is logged and recorded)."""
    from . import cuda as CK
    cuda = _cuda()
    knobs = ("_MMA_ST_ROWS", "_MMA_ST_TOKS", "_MMA_ST_REGS", "_MMA_ST_PREFETCH", "_MMA_ST_MAGIC_C",
             "_MMA_ST_CPASYNC")
    saved = tuple(getattr(CK, k) for k in knobs)
    # (rows, tokens, register cap, prefetch, magic C, cp.async); the engine's: the first cp.async row
    variants = [(32, 32, 128, True, True, True), (32, 32, 128, True, False, True), (32, 32, 168, True, True, True),
                (64, 16, 128, True, True, True), (32, 16, 128, True, True, True),
                (32, 32, 128, True, False, False), (32, 32, 128, True, True, False), (64, 16, 128, True, True, False)]
    res = []
    try:
        for name, rows, K, n in (("Q8_0 4096->2048", 2048, 4096, 2048), ("Q8_0 4096->1536", 1536, 4096, 512),
                                 ("Q8_0 1024->32768", 32768, 1024, 512), ("Q8_0 8192->4096", 4096, 8192, 512),
                                 ("Q8_0 4096->1024", 1024, 4096, 512), ("Q8_0 2048->4096", 4096, 2048, 512)):
            arena = Arena(rows * F.row_bytes(F.Q8_0, K) + 4096, seed=3)
            off = arena.place(F.Q8_0, rows, K)
            act = _Act(F.Q8_0, n, K, rng)
            out = cuda.device_array((n, rows), np.float32)
            runs = [("direct", None)] + [
                (f"staged {R}x{T} regs={g or 'none'}{'' if pf else ' no-prefetch'}"
                 f"{' magicC' if mc else ''}{' cp.async' if cpa else ''}",
                 (R, T, g, pf, mc, cpa)) for R, T, g, pf, mc, cpa in variants]
            want = None
            for label, v in runs:
                if v is not None:
                    for k, x in zip(knobs, v):
                        setattr(CK, k, x)
                staged = v is not None
                ms = timer.time_eager(lambda s: CK.matmul_q8_0_mma(arena.buf, off, rows, K, n, act.xq, act.xd,
                                                                   out, s, staged=staged))
                got = out.copy_to_host()
                if want is None:
                    want = got
                same = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
                tops = 2 * n * rows * K / (ms * 1e-3) / 1e12
                r = dict(name=f"matmul {name} x{n}", variant=label, ms=ms, TOPS=tops, same_bits=same)
                res.append(r)
                log(f"  {name + ' x' + str(n):24s} {label:44s} {ms:8.3f} ms {tops:7.1f} TOPS"
                    + ("" if same else "  DIFFERENT BITS"))
    finally:
        for k, x in zip(knobs, saved):
            setattr(CK, k, x)
    return res


# the engine's F16 prefill matmuls (one 512-token chunk): (name, rows_a, rows_b, K); rows_b > 0 is a
# pair launch (the compressors' kv + gate)
F16_PREFILL_SHAPES = (("router 4096->256", 256, 0, 4096),
                      ("attn compressor ratio 4 4096->1024+1024", 1024, 1024, 4096),
                      ("attn compressor ratio 128 4096->512+512", 512, 512, 4096),
                      ("indexer compressor 4096->256+256", 256, 256, 4096),
                      ("indexer proj 4096->64", 64, 0, 4096),
                      ("indexer q_b 1024->8192", 8192, 0, 1024))


def bench_tune_f16(timer, rng, log, n_tok=512):
    """The tiled F16 prefill matmul (_F16_TILED: R x T sums per lane, compile-time row length)
    under its tile shapes, register caps and prefetch against f16_rows, at the engine's shapes and
    512 tokens; every variant's output must equal f16_rows' bit for bit (recorded as same_bits)."""
    from . import cuda as CK
    cuda = _cuda()
    names = ("_F16_TILED", "_F16_TILE_R", "_F16_TILE_T", "_F16_TILE_REGS", "_F16_TILE_PREFETCH")
    saved = tuple(getattr(CK, n) for n in names)
    # (R, T, register cap, prefetch); ptxas sm_90: 8x8 128 registers, with prefetch 168 (cap 128:
    # 56 bytes of spills), 4x16 120
    variants = [(8, 8, 0, False), (8, 8, 0, True), (8, 8, 128, True), (4, 16, 0, False), (4, 16, 0, True),
                (4, 8, 0, False), (4, 8, 0, True)]
    res = []
    try:
        for name, rows_a, rows_b, K in F16_PREFILL_SHAPES:
            rows = rows_a + rows_b
            arena = Arena(rows * F.row_bytes(F.F16, K) + 8192, seed=3)
            off_a = arena.place(F.F16, rows_a, K)
            off_b = arena.place(F.F16, rows_b, K) if rows_b else 0
            act = _Act(F.F16, n_tok, K, rng)
            out = cuda.device_array((n_tok, rows), np.float32)

            def launch(s):
                if rows_b:
                    CK.matmul_f16_pair(arena.buf, off_a, rows_a, off_b, rows_b, K, n_tok, act.x, out, s)
                else:
                    CK.matmul_f16(arena.buf, off_a, rows_a, K, n_tok, act.x, out, s)

            want = None
            for v in [None] + variants:
                CK._F16_TILED = v is not None
                if v is not None:
                    CK._F16_TILE_R, CK._F16_TILE_T, CK._F16_TILE_REGS, CK._F16_TILE_PREFETCH = v
                label = "f16_rows" if v is None else f"tiled {v[0]}x{v[1]} regs={v[2] or 'none'}" + (
                    " prefetch" if v[3] else "")
                out.copy_to_device(np.full(out.shape, np.nan, np.float32))   # every output written
                ms = timer.time_eager(launch, reps=20)
                got = out.copy_to_host()
                if want is None:
                    want = got
                same = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
                tflops = 2 * n_tok * rows * K / (ms * 1e-3) / 1e12
                r = dict(name=f"matmul F16 {name} x{n_tok}", variant=label, ms=ms, TFLOPS=tflops,
                         same_bits=same)
                res.append(r)
                log(f"  F16 {name + ' x' + str(n_tok):44s} {label:30s} {ms * 1e3:8.1f} us {tflops:6.2f} TFLOPS"
                    + ("" if same else "  DIFFERENT BITS"))
    finally:
        for n, value in zip(names, saved):
            setattr(CK, n, value)
    return res


def run_kernel_bench(out_path=None, log=print, parts=("dense", "moe", "layer", "prefill"), meta=None):
    """Run the benchmark; write JSON to out_path (if given) and return the results dict (meta's
    items among its keys)."""
    cuda = _cuda()
    rng = np.random.default_rng(0)
    timer = Timer()
    dev = cuda.get_current_device()
    res = dict(device=str(dev.name.decode() if isinstance(dev.name, bytes) else dev.name), **(meta or {}))
    t0 = time.time()
    copy_bw, variants = copy_bandwidth(timer)
    res["copy_GBps"] = copy_bw / 1e9
    res["copy_variants_GBps"] = {k: v / 1e9 for k, v in variants.items()}
    log(f"device {res['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write; best of "
        + ", ".join(f"{k}: {v / 1e9:.0f}" for k, v in variants.items()) + ")")
    log(f"  {'shape':44s} {'time':>11s} {'weights':>12s} {'of copy':>7s}")
    if "dense" in parts:
        res["dense"] = bench_dense(timer, copy_bw, rng, log)
    moe = (_moe_setup(rng) if {"moe", "layer", "prefill", "tune_moe", "tune_gu", "tune_halves", "tune_down", "scale_moe"} & set(parts)
           else None)
    if "moe" in parts:
        res["moe"] = bench_moe(timer, copy_bw, rng, log, moe)
    if "layer" in parts:
        res["layer"] = bench_layer(timer, copy_bw, rng, log, moe)
    if "prefill" in parts:
        res["prefill"] = bench_prefill(timer, rng, log, moe)
    if "tune_split" in parts:
        res["tune_split"] = bench_tune_split(timer, copy_bw, rng, log)
    if "tune_pre" in parts:
        res["tune_pre"] = bench_tune_pre(timer, copy_bw, rng, log)
    if "tune_q8" in parts:
        res["tune_q8"] = bench_tune_q8(timer, copy_bw, rng, log)
    if "tune_pairs" in parts:
        res["tune_pairs"] = bench_tune_pairs(timer, copy_bw, rng, log)
    if "tune_moe" in parts:
        res["tune_moe"] = bench_tune_moe(timer, copy_bw, rng, log, moe)
    if "tune_gu" in parts:
        res["tune_gu"] = bench_tune_gu(timer, copy_bw, rng, log, moe)
    if "tune_halves" in parts:
        res["tune_halves"] = bench_tune_halves(timer, copy_bw, rng, log, moe)
    if "tune_down" in parts:
        res["tune_down"] = bench_tune_down(timer, copy_bw, rng, log, moe)
    if "scale_moe" in parts:
        res["scale_moe"] = bench_scale_moe(timer, copy_bw, rng, log, moe)
    if "tune_prefill" in parts:
        res["tune_prefill"] = bench_tune_prefill(timer, rng, log)
    if "tune_f16" in parts:
        res["tune_f16"] = bench_tune_f16(timer, rng, log)
    res["bench_seconds"] = time.time() - t0
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


def profile_target():
    """A short run for a profiler (ncu): routed MoE decode, a Q8_0 matvec, warmed up first."""
    from . import cuda as CK
    cuda = _cuda()
    rng = np.random.default_rng(0)
    moe = _moe_setup(rng, n_exp=64)
    step = _MoEStep(moe, rng)
    arena = Arena(4096 * F.row_bytes(F.Q8_0, 8192) + 4096, seed=5)
    off = arena.place(F.Q8_0, 4096, 8192)
    act = _Act(F.Q8_0, 1, 8192, rng)
    out = cuda.device_array(4096, np.float32)
    for _ in range(3):
        step.full(0)
        CK.matvec_q8_0(arena.buf, off, 4096, 8192, act.xq, act.xd, out)
    cuda.synchronize()


def profile_read_gap(rows=32768, K=1024):
    """A short run for ncu: the Q8_0 matvec of one shape (q_b by default, scales-last as the GPU
    sources keep it) and read_ceiling_us's plain read of the same bytes, three launches each."""
    from . import cuda as CK
    cuda = _cuda()
    rng = np.random.default_rng(0)
    wbytes = rows * F.row_bytes(F.Q8_0, K)
    arena = Arena(wbytes + 4096, seed=5)
    off = arena.place(F.Q8_0, rows, K)
    CK.q8_0_relayout(arena.buf, off, rows, K)
    act = _Act(F.Q8_0, 1, K, rng)
    out = cuda.device_array(rows, np.float32)
    read = _ReadLaunch(arena.buf, [(off, wbytes)])
    for _ in range(3):
        CK.matvec_q8_0(arena.buf, off, rows, K, act.xq, act.xd, out, scales_last=True)
        read(8)
    cuda.synchronize()
