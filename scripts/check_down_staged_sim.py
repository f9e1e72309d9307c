"""The staged Q2_K down kernel (_moe_down_tiles_staged_kernel) in numba's CUDA simulator, no GPU
needed: its staging, k order, fragment and bank indexing against a NumPy model of the decode
numerics, bit for bit.

The simulator has no tensor cores and no libdevice: mma_s8_acc is emulated by a rendezvous of the
warp's 32 threads (each deposits its fragments, the 16x32 A and 32x8 B are assembled with the PTX
fragment layout, each thread takes its four results), byte_perm and int_as_float in Python. The
simulator's fma is a*b + c in f32, and so is the model's. Slow (Python threads): a few shapes.

    NUMBA_ENABLE_CUDASIM is set here; run: python scripts/check_down_staged_sim.py [nsb,n_embd,n_tok,n_used,n_exp,base ...]
"""
import os
import sys
import threading

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"      # before numba is imported

import numpy as np  # noqa: E402

from ds4py.kernels import cuda as qk  # noqa: E402

_lock = threading.Lock()
_warps = {}


def _bytes(v):
    """The 4 signed bytes of a 32-bit register."""
    return np.array([int(v) & 0xFFFFFFFF], np.uint32).view(np.int8).astype(np.int64)


def mma_s8_acc(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma.m16n8k32 s8 for the calling thread's warp (see kernels/cuda_intrinsics.py)."""
    t = threading.current_thread()
    tid = int(t.threadIdx.x)
    key = (int(t.blockIdx.x), int(t.blockIdx.y), tid // 32)
    with _lock:
        st = _warps.get(key)
        if st is None:
            st = _warps[key] = (threading.Barrier(32), {})
    bar, slots = st
    lane = tid % 32
    slots[lane] = (a0, a1, a2, a3, b0, b1)
    bar.wait()
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for ln in range(32):
        g, tg = ln >> 2, ln & 3
        ra0, ra1, ra2, ra3, rb0, rb1 = slots[ln]
        A[g, 4 * tg:4 * tg + 4] = _bytes(ra0)
        A[g + 8, 4 * tg:4 * tg + 4] = _bytes(ra1)
        A[g, 16 + 4 * tg:16 + 4 * tg + 4] = _bytes(ra2)
        A[g + 8, 16 + 4 * tg:16 + 4 * tg + 4] = _bytes(ra3)
        B[4 * tg:4 * tg + 4, g] = _bytes(rb0)
        B[16 + 4 * tg:16 + 4 * tg + 4, g] = _bytes(rb1)
    C = A @ B
    bar.wait()
    g, tg = lane >> 2, lane & 3
    r = [C[g, 2 * tg], C[g, 2 * tg + 1], C[g + 8, 2 * tg], C[g + 8, 2 * tg + 1]]
    return tuple(np.int32(int(c) + int(x)) for c, x in zip((c0, c1, c2, c3), r))


class FakeLibdevice:
    """The libdevice functions the kernels call (PTX prmt, a bit cast)."""

    @staticmethod
    def byte_perm(x, y, s):
        v = ((int(y) & 0xFFFFFFFF) << 32) | (int(x) & 0xFFFFFFFF)
        out = 0
        for i in range(4):
            sel = (int(s) >> (4 * i)) & 7
            out |= ((v >> (8 * sel)) & 0xFF) << (8 * i)
        return np.int32(np.uint32(out).view(np.int32))

    @staticmethod
    def int_as_float(x):
        return np.array([int(x) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


qk.mma_s8_acc = mma_s8_acc
qk.libdevice = FakeLibdevice


def reference(arena, off, rows, nsb, mq, md, pair):
    """pair_out row of one pair, with the decode order and the simulator's fma (a*b + c)."""
    rb = 84 * nsb
    out = np.zeros(rows, np.float32)
    x = mq[pair * 256 * nsb:(pair + 1) * 256 * nsb].astype(np.int64)
    for r in range(rows):
        banks = [np.float32(0.0)] * 4
        for sb in range(nsb):
            blk = arena[off + r * rb + 84 * sb: off + r * rb + 84 * sb + 84]
            scales = blk[:16].astype(np.int64)
            qs = blk[16:80]
            d = np.float32(blk[80:82].view(np.float16)[0])
            dmin = np.float32(blk[82:84].view(np.float16)[0])
            i = np.arange(256)
            q = (qs[32 * (i // 128) + (i % 32)].astype(np.int64) >> (2 * ((i % 128) // 32))) & 3
            sub = i // 16
            xs = x[256 * sb:256 * sb + 256]
            isum = int(np.sum((scales[sub] & 15) * q * xs))
            summs = int(np.sum((scales[sub] >> 4) * xs))
            xdv = np.float32(md[pair * nsb + sb])
            term = (xdv * d) * np.float32(isum) + (-((xdv * dmin) * np.float32(summs)))
            banks[sb % 4] = banks[sb % 4] + np.float32(term)
        out[r] = (banks[0] + banks[2]) + (banks[1] + banks[3])
    return out


def run(nsb, n_embd, n_tok, n_used, n_exp, base, NH=2, seed=0):
    """Random Q2_K experts (expert e's down matrix at base + e·n_embd·84·nsb), Q8_K activations
    and expert ids; the kernel's pair_out against reference(); returns the pairs that differ."""
    rng = np.random.default_rng(seed)
    rb = 84 * nsb
    size = base + n_exp * n_embd * rb
    arena = rng.integers(0, 256, size + 64, dtype=np.uint8)
    for e in range(n_exp):
        for r in range(n_embd):
            for sb in range(nsb):
                o = base + (e * n_embd + r) * rb + 84 * sb
                arena[o + 80:o + 82] = np.array([rng.uniform(0.001, 0.01)], np.float16).view(np.uint8)
                arena[o + 82:o + 84] = np.array([rng.uniform(0.001, 0.01)], np.float16).view(np.uint8)
    table = np.stack([np.zeros(n_exp, np.int64), np.zeros(n_exp, np.int64),
                      base + np.arange(n_exp, dtype=np.int64) * n_embd * rb], axis=1)
    ids = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)
    n_pairs = n_tok * n_used
    mq = rng.integers(-127, 128, n_pairs * 256 * nsb).astype(np.int8)
    md = rng.uniform(0.01, 0.1, n_pairs * nsb).astype(np.float32)
    T = 8 * NH
    tile_off, tile_tok, tile_slot, tile_cnt = qk.group_tiles(ids, table, T)
    kern = qk._moe_down_tiles_staged_kernel(NH, nsb)
    pair_out = np.full(n_pairs * n_embd, np.nan, np.float32)
    grid = ((n_embd + 127) // 128, tile_cnt.size)
    print(f"staged nsb {nsb} n_embd {n_embd} base {base}: grid {grid}, tile counts {tile_cnt.tolist()}", flush=True)
    kern[grid, 256](arena.view(np.uint32)[: arena.size // 4], tile_off.reshape(-1), tile_tok.reshape(-1),
                    tile_slot.reshape(-1), tile_cnt, n_used, mq.view(np.int64), md, n_embd, pair_out)
    pair_out = pair_out.reshape(n_pairs, n_embd)
    bad = 0
    for p in range(n_pairs):
        e = ids[p // n_used, p % n_used]
        want = reference(arena, int(table[e, 2]), n_embd, nsb, mq, md, p)
        got = pair_out[p]
        same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
        if not same:
            bad += 1
            diff = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
            print(f"  pair {p}: {diff.size} rows differ, first {diff[:8]}, got {got[diff[:3]]} want {want[diff[:3]]}")
    print(f"  {n_pairs - bad}/{n_pairs} pairs bit-identical", flush=True)
    return bad


if __name__ == "__main__":
    # default: 3 super-blocks (odd), a short last row block, a 16-pair tile, offsets 4 mod 8
    cases = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or [(3, 136, 12, 2, 2, 36)]
    total = 0
    for nsb, n_embd, n_tok, n_used, n_exp, base in cases:
        total += run(nsb, n_embd, n_tok, n_used, n_exp, base)
    print("BAD" if total else "ALL OK")
    raise SystemExit(1 if total else 0)
