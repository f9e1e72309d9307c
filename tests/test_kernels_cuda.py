"""CUDA kernels (ds4py.kernels.cuda) against their CPU twins. Run on the GPU machine: pytest -m gpu.

Tolerances: both implementations compute every block's integer dot product exactly (dp4a on the
GPU) and differ only in the order (and fma contraction) of the f32 sum over blocks. Each is
within f32_sum_bound = (n_terms + 8) * 2u * sum|w x| of the exact value, so they are within twice
that of each other. Activation quantizers are compared bit for bit (same f32 operations), and
GPU-vs-GPU checks (matmul rows vs matvec, prefill MoE vs decode MoE, graph replay vs eager) are
exact because the kernels run the same arithmetic per output by construction.
"""

import numpy as np
import pytest

from ds4py.kernels import compat, cpu, formats as F
from ds4py.kernels import testdata as TD

pytestmark = pytest.mark.gpu

if not compat.cuda_available():  # pragma: no cover - CPU-only machines
    pytest.skip("no CUDA GPU", allow_module_level=True)

from numba import cuda  # noqa: E402

from ds4py.kernels import cuda as K  # noqa: E402


def _rng(seed):
    return np.random.default_rng(seed)


def _arena(parts, align=256):
    """Upload byte arrays into one device arena; returns (arena, offsets). A part given as
    (bytes, extra) starts `extra` bytes past an aligned address (to test 2-mod-4 offsets)."""
    offs, pos = [], 0
    for p in parts:
        w, extra = p if isinstance(p, tuple) else (p, 0)
        pos = (pos + align - 1) // align * align + extra
        offs.append(pos)
        pos += w.size
    host = np.zeros(pos + 64, np.uint8)
    for p, o in zip(parts, offs):
        w = p[0] if isinstance(p, tuple) else p
        host[o:o + w.size] = w.reshape(-1)
    return cuda.to_device(host), offs


# ------------------------------------------------------------------------------- quantizers

def test_quantizers_bit_identical_to_cpu():
    rng = _rng(1)
    X = (rng.standard_normal((5, 2048)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    X[1, 256:512] = 0                                    # zero blocks
    X[2, :32] = np.float32(127) * (np.arange(32) % 2)    # exact ties: d = 1
    X[2, 32:40] = [2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 4.5, -4.5]
    X[3, 512 + 7], X[3, 512 + 100] = -9.0, 9.0           # Q8_K signed-max tie
    dX = cuda.to_device(X)
    q = cuda.device_array(X.size, np.int8)
    d = cuda.device_array(X.size // 32, np.float32)
    K.quantize_q8_0(dX, q, d)
    qk = cuda.device_array(X.size, np.int8)
    dk = cuda.device_array(X.size // 256, np.float32)
    bs = cuda.device_array(X.size // 16, np.int32)
    K.quantize_q8_k(dX, qk, dk, bs)
    for t in range(5):
        q0, d0 = cpu.quantize_q8_0(X[t])
        assert np.array_equal(q.copy_to_host()[t * 2048:(t + 1) * 2048], q0)
        assert np.array_equal(d.copy_to_host()[t * 64:(t + 1) * 64], d0)
        q1, d1, b1 = cpu.quantize_q8_k(X[t])
        assert np.array_equal(qk.copy_to_host()[t * 2048:(t + 1) * 2048], q1)
        assert np.array_equal(dk.copy_to_host()[t * 8:(t + 1) * 8], d1)
        assert np.array_equal(bs.copy_to_host()[t * 128:(t + 1) * 128], b1)


# ---------------------------------------------------------------------------- dense / matvec

def _prepare(t, X):
    """Device activation for type t from host f32 X[n_tok, K]: (xq, xd, bsums) or (X,)."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    n_tok, Kd = X.shape
    dX = cuda.to_device(X)
    if t == F.Q8_0:
        xq = cuda.device_array(X.size, np.int8)
        xd = cuda.device_array(X.size // 32, np.float32)
        K.quantize_q8_0(dX, xq, xd)
        return xq, xd, None, dX
    if t in (F.IQ2_XXS, F.Q2_K, F.Q4_K):
        xq = cuda.device_array(X.size, np.int8)
        xd = cuda.device_array(X.size // 256, np.float32)
        bs = cuda.device_array(X.size // 16, np.int32)
        K.quantize_q8_k(dX, xq, xd, bs)
        return xq, xd, bs, dX
    return None, None, None, dX


def _gpu_matmul(t, arena, off, rows, Kd, X, single=False):
    n_tok = X.shape[0]
    xq, xd, bs, dX = _prepare(t, X)
    out = cuda.device_array((n_tok, rows), np.float32)
    if single:
        assert n_tok == 1
        if t == F.Q8_0:
            K.matvec_q8_0(arena, off, rows, Kd, xq, xd, out)
        elif t == F.F16:
            K.matvec_f16(arena, off, rows, Kd, dX, out)
        elif t == F.IQ2_XXS:
            K.matvec_iq2_xxs(arena, off, rows, Kd, xq, xd, out)
        elif t == F.Q2_K:
            K.matvec_q2_k(arena, off, rows, Kd, xq, xd, bs, out)
        else:
            K.matvec_q4_k(arena, off, rows, Kd, xq, xd, bs, out)
    else:
        if t == F.Q8_0:
            K.matmul_q8_0(arena, off, rows, Kd, n_tok, xq, xd, out)
        elif t == F.F16:
            K.matmul_f16(arena, off, rows, Kd, n_tok, dX, out)
        elif t == F.IQ2_XXS:
            K.matmul_iq2_xxs(arena, off, rows, Kd, n_tok, xq, xd, out)
        elif t == F.Q2_K:
            K.matmul_q2_k(arena, off, rows, Kd, n_tok, xq, xd, bs, out)
        else:
            K.matmul_q4_k(arena, off, rows, Kd, n_tok, xq, xd, bs, out)
    return out.copy_to_host()


GPU_TYPES = [F.Q8_0, F.F16, F.IQ2_XXS, F.Q2_K, F.Q4_K]

# (type, rows, K, extra offset): small odd shapes, split-K shapes, Flash shapes, output head
MATVEC_CASES = [
    (F.Q8_0, 37, 96, 2), (F.Q8_0, 100, 4096, 2), (F.Q8_0, 1024, 4096, 0),
    (F.Q8_0, 32768, 1024, 0), (F.Q8_0, 512, 4096, 0), (F.Q8_0, 4096, 8192, 0),
    (F.Q8_0, 2048, 4096, 0), (F.Q8_0, 4096, 2048, 0), (F.Q8_0, 129280, 4096, 0),
    (F.F16, 37, 66, 0), (F.F16, 256, 4096, 0), (F.F16, 9000, 512, 0),
    (F.IQ2_XXS, 37, 768, 2), (F.IQ2_XXS, 2048, 4096, 0),
    (F.Q2_K, 37, 768, 0), (F.Q2_K, 4096, 2048, 0),
    (F.Q4_K, 37, 768, 0), (F.Q4_K, 2048, 4096, 0),
]


@pytest.mark.parametrize("t,rows,Kd,extra", MATVEC_CASES,
                         ids=[f"{F.TYPE_NAMES[c[0]]}-{c[1]}x{c[2]}+{c[3]}" for c in MATVEC_CASES])
def test_matvec_matches_cpu(t, rows, Kd, extra):
    rng = _rng(rows + Kd + t)
    w = TD.random_weights(t, (rows, Kd), rng)
    arena, (off,) = _arena([(w, extra)])
    x = rng.standard_normal(Kd).astype(np.float32)
    y = _gpu_matmul(t, arena, off, rows, Kd, x[None, :], single=True)[0]
    y_cpu = cpu.matvec(w, t, x)
    sel = np.arange(rows) if rows <= 4096 else np.sort(rng.choice(rows, 256, replace=False))
    _, mag = TD.reference_matvec(w, t, x, sel)
    tol = 2 * TD.f32_sum_bound(t, Kd, mag)
    err = np.abs(y[sel].astype(np.float64) - y_cpu[sel])
    assert np.all(err <= tol), f"max err/tol {np.max(err / tol):.3g}"
    assert np.all(np.isfinite(y))
    # every row, bit for bit: the CPU twin sums in the kernel's order (kernels/orders.py); the
    # simulator shows the same (scripts/check_moe_decode_sim.py twins), this the compiled kernel
    differ = np.flatnonzero(y.view(np.uint32) != y_cpu.view(np.uint32))
    assert differ.size == 0, (f"{differ.size} of {rows} rows differ from the CPU twin, e.g. row {differ[0]}: "
                              f"{y[differ[0]]!r} vs {y_cpu[differ[0]]!r}")


@pytest.mark.parametrize("t", GPU_TYPES, ids=[F.TYPE_NAMES[t] for t in GPU_TYPES])
@pytest.mark.parametrize("rows", [100, 9000])       # split-K (S = 8) and one warp per row
def test_matmul_rows_equal_matvec(t, rows):
    rng = _rng(20 + t + rows)
    Kd = 1024 if t != F.F16 else 1000
    w = TD.random_weights(t, (rows, Kd), rng)
    arena, (off,) = _arena([w])
    X = rng.standard_normal((11, Kd)).astype(np.float32)
    X[3] *= 40
    Y = _gpu_matmul(t, arena, off, rows, Kd, X)
    for i in range(len(X)):
        y1 = _gpu_matmul(t, arena, off, rows, Kd, X[i:i + 1], single=True)[0]
        assert np.array_equal(Y[i], y1), f"token {i}"


# (rows, K, tokens): split-K S = 8, 4, 2, 1, a K whose pairs are not a multiple of 32 (the tail
# step), short row groups and token tiles
F16_CASES = [(1024, 4096, 40), (2100, 1000, 17), (4100, 2048, 9), (8200, 256, 33), (37, 4096, 70), (3, 96, 5)]


@pytest.mark.parametrize("rows,Kd,n_tok", F16_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in F16_CASES])
def test_f16_matmul_equals_matvec(rows, Kd, n_tok):
    """The F16 prefill matmul gives every token the matvec's bits, in every split-K regime."""
    rng = _rng(80 + rows + Kd)
    w = TD.random_weights(F.F16, (rows, Kd), rng)
    arena, (off,) = _arena([w])
    X = rng.standard_normal((n_tok, Kd)).astype(np.float32)
    Y = _gpu_matmul(F.F16, arena, off, rows, Kd, X)
    for i in sorted({0, n_tok // 2, n_tok - 1}):
        y1 = _gpu_matmul(F.F16, arena, off, rows, Kd, X[i:i + 1], single=True)[0]
        assert np.array_equal(Y[i], y1), f"token {i}: max |Δ| {np.max(np.abs(Y[i] - y1)):.3g}"


# (rows, K, tokens, extra offset): every split-K regime (S = 8, 4, 2, 1), short row and token
# tiles, a K with fewer than 8 blocks (empty lane groups), a 2-mod-4 weight offset, short last
# chunks (K = 1280: 5 steps of 8 blocks, chunks of 4; K = 2304: the short chunk inside pass 0)
MMA_CASES = [(37, 4096, 37, 2), (2100, 1024, 40, 0), (4100, 2048, 20, 0), (8200, 256, 33, 0),
             (64, 96, 17, 0), (1024, 4096, 64, 0), (300, 8192, 45, 0), (70, 2048, 100, 4),
             (1500, 1280, 70, 0), (600, 2304, 50, 0)]


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("rows,Kd,n_tok,extra", MMA_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}+{c[3]}" for c in MMA_CASES])
def test_q8_0_mma_matches_matvec(rows, Kd, n_tok, extra, staged):
    """The tensor-core Q8_0 matmuls (fragments from global memory, or staged in shared memory where
    K is a multiple of 256 and the offset a multiple of 8) equal the dp4a matmul and the matvec
    bit for bit."""
    rng = _rng(60 + rows + n_tok)
    w = TD.random_weights(F.Q8_0, (rows, Kd), rng)
    arena, (off,) = _arena([(w, extra)])
    X = rng.standard_normal((n_tok, Kd)).astype(np.float32)
    X[n_tok // 2] *= 40
    xq, xd, _, _ = _prepare(F.Q8_0, X)
    out = cuda.device_array((n_tok, rows), np.float32)
    K.matmul_q8_0_mma(arena, off, rows, Kd, n_tok, xq, xd, out, staged=staged)
    got = out.copy_to_host()
    dp4a = cuda.device_array((n_tok, rows), np.float32)
    K._launch_q8_0(arena, [(off, rows)], Kd, n_tok, xq, xd, dp4a, 0, mma=False)
    want = dp4a.copy_to_host()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"max |Δ| {np.max(np.abs(got - want)):.3g} at {np.unravel_index(np.argmax(np.abs(got - want)), got.shape)}"
    for i in (0, n_tok // 2, n_tok - 1):
        y1 = _gpu_matmul(F.Q8_0, arena, off, rows, Kd, X[i:i + 1], single=True)[0]
        assert np.array_equal(got[i], y1), f"token {i}"


@pytest.mark.parametrize("rows_a,rows_b", [(1024, 512), (100, 37)])
def test_q8_0_mma_pair_matches_matvec_pair(rows_a, rows_b):
    """Two matrices in one tensor-core launch (a tile may straddle them) equal the matvec pair."""
    rng = _rng(70 + rows_a)
    Kd, n_tok = 4096, 40
    wa = TD.random_weights(F.Q8_0, (rows_a, Kd), rng)
    wb = TD.random_weights(F.Q8_0, (rows_b, Kd), rng)
    arena, (off_a, off_b) = _arena([wa, wb])
    X = rng.standard_normal((n_tok, Kd)).astype(np.float32)
    xq, xd, _, _ = _prepare(F.Q8_0, X)
    out = cuda.device_array((n_tok, rows_a + rows_b), np.float32)
    K.matmul_q8_0_pair(arena, off_a, rows_a, off_b, rows_b, Kd, n_tok, xq, xd, out)
    got = out.copy_to_host()
    for i in (0, 17, n_tok - 1):
        xq1, xd1, _, _ = _prepare(F.Q8_0, X[i:i + 1])
        one = cuda.device_array(rows_a + rows_b, np.float32)
        K.matvec_q8_0_pair(arena, off_a, rows_a, off_b, rows_b, Kd, xq1, xd1, one)
        assert np.array_equal(got[i].view(np.uint32), one.copy_to_host().view(np.uint32)), f"token {i}"


# ---------------------------------------------------------------------------------------- MoE

N_EMBD, N_FF, N_EXP, N_USED = 4096, 2048, 16, 6


@pytest.fixture(scope="module")
def experts():
    rng = _rng(5)
    gate = TD.random_weights(F.IQ2_XXS, (N_EXP, N_FF, N_EMBD), rng)
    up = TD.random_weights(F.IQ2_XXS, (N_EXP, N_FF, N_EMBD), rng)
    down = TD.random_weights(F.Q2_K, (N_EXP, N_EMBD, N_FF), rng)
    arena, (og, ou, od) = _arena([gate, up, down])
    stride_gu = gate.shape[1] * gate.shape[2]
    stride_d = down.shape[1] * down.shape[2]
    table = np.array([[og + e * stride_gu, ou + e * stride_gu, od + e * stride_d]
                      for e in range(N_EXP)], np.int64)
    return dict(gate=gate, up=up, down=down, arena=arena, table=table, og=og, ou=ou, od=od,
                stride_gu=stride_gu, stride_d=stride_d)


def _moe_decode_gpu(ex, x, ids, rw, clamp, ws=None, use_offsets_kernel=True):
    ws = ws or K.MoEWorkspace(N_USED, N_EMBD, N_FF)
    d_ids = cuda.to_device(ids.astype(np.int32))
    slot_off = cuda.device_array((N_USED, 3), np.int64)
    if use_offsets_kernel:
        K.expert_offsets(d_ids, ex["og"], ex["ou"], ex["od"], ex["stride_gu"], ex["stride_d"],
                         slot_off)
    else:
        slot_off = cuda.to_device(ex["table"][ids])
    out = cuda.device_array(N_EMBD, np.float32)
    K.moe_decode(ex["arena"], slot_off, F.IQ2_XXS, F.Q2_K, cuda.to_device(x),
                 cuda.to_device(rw.astype(np.float32)), clamp, out, ws)
    return out.copy_to_host(), slot_off.copy_to_host()


@pytest.mark.parametrize("clamp", [10.0, 0.4])
def test_moe_decode_matches_cpu(experts, clamp):
    """2e-3 of the norm: f32-level differences in g/u can flip a rounding tie of mid's Q8_K."""
    rng = _rng(6)
    x = rng.standard_normal(N_EMBD).astype(np.float32)
    ids = rng.choice(N_EXP, N_USED, replace=False).astype(np.int32)
    rw = rng.uniform(0.05, 0.6, N_USED).astype(np.float32)
    y, slot_off = _moe_decode_gpu(experts, x, ids, rw, clamp)
    assert np.array_equal(slot_off, experts["table"][ids])
    y_cpu = cpu.moe(experts["gate"], experts["up"], experts["down"], F.IQ2_XXS, F.Q2_K, x, ids,
                    rw, clamp)
    assert np.linalg.norm(y - y_cpu) <= 2e-3 * np.linalg.norm(y_cpu)
    y2, _ = _moe_decode_gpu(experts, x, ids, rw, clamp, use_offsets_kernel=False)
    assert np.array_equal(y, y2)


@pytest.mark.parametrize("x_regs,split", [(True, False), (False, True), (False, False)])
def test_moe_gate_up_variants_give_the_same_bits(experts, moe_knobs, x_regs, split):
    """The gate/up decode kernel with x in registers or staged in shared memory and with either
    IQ2_XXS sign arithmetic (negated bytes, or dot(g, x) - 2 dot(g & m, x)): the same integers and
    the same f32 order, so the same bits as the shipped settings."""
    _assert_moe_decode_bits_unchanged(experts, moe_knobs, 11, _X_REGS_GATE_UP=x_regs,
                                      _IQ2_SPLIT_SIGNS=split)


# the first MoE decode kernels (one gate/up kernel for any row length, 8 rows x 8 warps; down one
# warp per output row): the reference the later variants are held to, bit for bit
_FIRST_MOE_DECODE = dict(_CONST_STEPS_GATE_UP=False, _NCH_GATE_UP=0, _RPB_GATE_UP=8, _NW_GATE_UP=8,
                         _X_REGS_GATE_UP=True, _IQ2_SPLIT_SIGNS=False, _R_DOWN_SLOTS=0,
                         _IQ2_PERM_GATE_UP=False, _PRE_GATE_UP=False, _GU_HALVES=False, _DOWN_SB=0)


def _assert_moe_decode_bits_unchanged(experts, moe_knobs, seed, **variant):
    """mid and the MoE output of one decode step with the first MoE decode kernels, then again
    with the variant's knobs: bitwise equal."""
    moe_knobs(**_FIRST_MOE_DECODE)
    rng = _rng(seed)
    x = rng.standard_normal(N_EMBD).astype(np.float32)
    ids = rng.choice(N_EXP, N_USED, replace=False).astype(np.int32)
    rw = rng.uniform(0.05, 0.6, N_USED).astype(np.float32)
    ws = K.MoEWorkspace(N_USED, N_EMBD, N_FF)
    y_ref, _ = _moe_decode_gpu(experts, x, ids, rw, 10.0, ws)
    mid_ref = ws.mid.copy_to_host()
    moe_knobs(**variant)
    y, _ = _moe_decode_gpu(experts, x, ids, rw, 10.0, ws)
    assert np.array_equal(ws.mid.copy_to_host(), mid_ref)
    assert np.array_equal(y, y_ref)


@pytest.fixture
def moe_knobs():
    """Set MoE decode knobs of kernels/cuda.py for one test (kernel caches cleared, restored after)."""
    saved = {}

    def set_knobs(**kw):
        for n, v in kw.items():
            saved.setdefault(n, getattr(K, n))
            setattr(K, n, v)
        K._KERNELS.clear()
        K._ROWDOTS.clear()

    yield set_knobs
    for n, v in saved.items():
        setattr(K, n, v)
    K._KERNELS.clear()
    K._ROWDOTS.clear()


def _gate_up_mid(n_embd, n_ff, n_used, seed, extra=0):
    """mid of moe_gate_up for random IQ2_XXS experts of n_embd columns (fresh weights, x, routes);
    the experts start `extra` bytes past a 256-byte boundary."""
    rng = _rng(seed)
    gate = TD.random_weights(F.IQ2_XXS, (n_used, n_ff, n_embd), rng)
    up = TD.random_weights(F.IQ2_XXS, (n_used, n_ff, n_embd), rng)
    arena, (og, ou) = _arena([(gate, extra), (up, extra)])
    stride = gate.shape[1] * gate.shape[2]
    slot_off = cuda.to_device(np.array([[og + k * stride, ou + k * stride, 0] for k in range(n_used)],
                                       np.int64))
    xq, xd, xbs, _ = _prepare(F.IQ2_XXS, rng.standard_normal((1, n_embd)))
    rw = cuda.to_device(rng.uniform(0.05, 0.6, n_used).astype(np.float32))
    mid = cuda.device_array((n_used, n_ff), np.float32)
    K.moe_gate_up(arena, slot_off, F.IQ2_XXS, n_embd, n_ff, xq, xd, rw, 10.0, mid, bsums=xbs)
    return mid.copy_to_host()


# (chunk steps, rows per block, warps per block, x in registers): rows of 4 steps (K = 4096) in
# 1, 2 or 4 chunks
_CONST_STEPS_VARIANTS = [(0, 8, 8, True), (2, 8, 8, True), (1, 4, 4, True), (0, 4, 4, True),
                         (2, 8, 8, False), (0, 4, 6, True)]     # the last: the shipped settings


@pytest.mark.parametrize("nch,rpb,nw,x_regs", _CONST_STEPS_VARIANTS,
                         ids=[f"nch{v[0]}-rpb{v[1]}-nw{v[2]}-x{'regs' if v[3] else 'shared'}"
                              for v in _CONST_STEPS_VARIANTS])
def test_moe_gate_up_const_steps_same_bits(experts, moe_knobs, nch, rpb, nw, x_regs):
    """_CONST_STEPS_GATE_UP (the row's step count a compile-time constant, chunks of nch steps)
    against the shipped gate/up kernel: the same loads, integers and f32 order, so mid and the MoE
    output are the same bits."""
    _assert_moe_decode_bits_unchanged(experts, moe_knobs, 13, _CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=nch,
                                      _RPB_GATE_UP=rpb, _NW_GATE_UP=nw, _X_REGS_GATE_UP=x_regs)


@pytest.mark.parametrize("nch,x_regs", [(0, True), (2, True), (1, False)])
def test_moe_gate_up_byte_permute_same_bits(experts, moe_knobs, nch, x_regs):
    """_IQ2_PERM_GATE_UP (each IQ2_XXS grid entry as signed bytes from the byte-permute selector
    tables, one dp4a per word) against the first gate/up kernel: the same integer dots, so mid
    and the MoE output are the same bits."""
    _assert_moe_decode_bits_unchanged(experts, moe_knobs, 17, _CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=nch,
                                      _RPB_GATE_UP=4, _NW_GATE_UP=6, _X_REGS_GATE_UP=x_regs,
                                      _IQ2_PERM_GATE_UP=True)


@pytest.mark.parametrize("perm,nch", [(True, 0), (True, 2), (False, 0)])
def test_moe_gate_up_tables_before_pdl_enter_same_bits(experts, moe_knobs, perm, nch):
    """_PRE_GATE_UP (the gate/up decode kernel fills its IQ2_XXS tables before pdl_enter) against
    the first gate/up kernel: the same table words, so mid and the output are the same bits."""
    _assert_moe_decode_bits_unchanged(experts, moe_knobs, 19, _CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=nch,
                                      _RPB_GATE_UP=4, _NW_GATE_UP=6, _X_REGS_GATE_UP=True,
                                      _IQ2_PERM_GATE_UP=perm, _PRE_GATE_UP=True)


@pytest.mark.parametrize("n_embd", [768, 1024, 4608])
@pytest.mark.parametrize("nch", [0, 1])
def test_moe_gate_up_const_steps_short_steps(moe_knobs, n_embd, nch):
    """The const-steps gate/up kernel on rows whose last step is partial (768: 3 super-blocks,
    4608: 18 = 4 full steps + 2; x staged in shared memory there, 2 chunks or 5 with nch 1) or one full step
    (1024), against the shipped kernel bit for bit; n_ff 20 (the last block's rows partial)."""
    moe_knobs(**_FIRST_MOE_DECODE)
    ref = _gate_up_mid(n_embd, 20, 3, 14)
    moe_knobs(_CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=nch)
    assert np.array_equal(_gate_up_mid(n_embd, 20, 3, 14), ref)
    moe_knobs(_IQ2_PERM_GATE_UP=True)               # the byte-permute weights on the same rows
    assert np.array_equal(_gate_up_mid(n_embd, 20, 3, 14), ref)
    moe_knobs(_PRE_GATE_UP=True)                     # the tables filled before pdl_enter
    assert np.array_equal(_gate_up_mid(n_embd, 20, 3, 14), ref)


# (rows per block, warps per block, tables before pdl_enter)
_HALVES_VARIANTS = [(4, 6, True), (8, 4, False), (8, 8, True), (4, 6, False)]


@pytest.mark.parametrize("rpb,nw,pre", _HALVES_VARIANTS,
                         ids=[f"rpb{v[0]}-nw{v[1]}-pre{int(v[2])}" for v in _HALVES_VARIANTS])
def test_moe_gate_up_halves_same_bits(experts, moe_knobs, rpb, nw, pre):
    """moe_gate_up_halves (a lane per half super-block, _GU_HALVES, its table lookups and shifts
    on the FMA pipe) against the first gate/up kernel on the flash rows (16 super-blocks): the
    same integers and the same f32 order, so mid and the MoE output are the same bits."""
    _assert_moe_decode_bits_unchanged(experts, moe_knobs, 23, _GU_HALVES=True, _RPB_GATE_UP=rpb,
                                      _NW_GATE_UP=nw, _PRE_GATE_UP=pre)


@pytest.mark.parametrize("defer", [True, False])
def test_moe_gate_up_halves_deferred_swiglu_same_bits(experts, moe_knobs, defer):
    """moe_gate_up_halves with the SwiGLU of 32 units at once (_GU_DEFER, the default) and with one
    lane's per unit: the same sums into the same function, so the same mid and MoE output bits."""
    _assert_moe_decode_bits_unchanged(experts, moe_knobs, 29, _GU_HALVES=True, _GU_DEFER=defer,
                                      _RPB_GATE_UP=4, _NW_GATE_UP=6)


@pytest.mark.parametrize("extra", [0, 2])
def test_moe_gate_up_halves_deferred_flushes(moe_knobs, extra):
    """The deferred SwiGLU over more than 32 units a warp (one warp per block, 40 rows of 2 slots:
    two full passes, then 16), on rows 2 bytes off a word too, against the first gate/up kernel."""
    moe_knobs(**_FIRST_MOE_DECODE)
    ref = _gate_up_mid(1280, 80, 2, 31, extra)
    moe_knobs(_GU_HALVES=True, _GU_DEFER=True, _RPB_GATE_UP=40, _NW_GATE_UP=1)
    assert np.array_equal(_gate_up_mid(1280, 80, 2, 31, extra), ref)


@pytest.mark.parametrize("n_embd", [256, 768, 1280, 3840, 4096])
@pytest.mark.parametrize("extra", [0, 2])
def test_moe_gate_up_halves_short_rows(moe_knobs, n_embd, extra):
    """moe_gate_up_halves on rows of 1, 3, 5, 15 and 16 super-blocks (idle lanes, partial chain
    steps; rows of 198 and 330 bytes start on both word alignments, and all of them do with the
    experts 2 bytes off a word) and n_ff 20 (a partial last block), against the first gate/up
    kernel bit for bit."""
    moe_knobs(**_FIRST_MOE_DECODE)
    ref = _gate_up_mid(n_embd, 20, 3, 25, extra)
    moe_knobs(_GU_HALVES=True, _RPB_GATE_UP=4, _NW_GATE_UP=6)
    assert np.array_equal(_gate_up_mid(n_embd, 20, 3, 25, extra), ref)


@pytest.mark.parametrize("n_embd,nch,x_regs", [(1024, 0, True), (4096, 0, True), (4096, 2, True), (4096, 1, False)])
def test_moe_gate_up_repacked_rows_same_bits(moe_knobs, n_embd, nch, x_regs):
    """_IQ2_REPACKED_GATE_UP (the byte-permute kernel, and moe_gate_up_halves on rows of a multiple
    of 8 super-blocks, reading rows that iq2_xxs_relayout rewrote: each super-block's 64 grid/sign
    bytes first, then the scales) against the decode kernel on the file's layout, bit for bit;
    iq2_xxs_relayout there and back restores every byte."""
    rng = _rng(21)
    n_used, n_ff = 3, 20
    gate = TD.random_weights(F.IQ2_XXS, (n_used, n_ff, n_embd), rng)
    up = TD.random_weights(F.IQ2_XXS, (n_used, n_ff, n_embd), rng)
    arena, (og, ou) = _arena([gate, up])
    stride = gate.shape[1] * gate.shape[2]
    slot_off = cuda.to_device(np.array([[og + k * stride, ou + k * stride, 0] for k in range(n_used)], np.int64))
    xq, xd, xbs, _ = _prepare(F.IQ2_XXS, rng.standard_normal((1, n_embd)))
    rw = cuda.to_device(rng.uniform(0.05, 0.6, n_used).astype(np.float32))

    def mid():
        out = cuda.device_array((n_used, n_ff), np.float32)
        K.moe_gate_up(arena, slot_off, F.IQ2_XXS, n_embd, n_ff, xq, xd, rw, 10.0, out, bsums=xbs)
        return out.copy_to_host()

    # moe_gate_up_decode first (the halves kernel, the default, takes these rows too: below)
    moe_knobs(_CONST_STEPS_GATE_UP=True, _NCH_GATE_UP=nch, _X_REGS_GATE_UP=x_regs, _IQ2_PERM_GATE_UP=True,
              _IQ2_REPACKED_GATE_UP=False, _GU_HALVES=False)
    want, before = mid(), arena.copy_to_host()
    for o in (og, ou):
        K.iq2_xxs_relayout(arena, o, n_used * n_ff, n_embd)
    assert not np.array_equal(arena.copy_to_host(), before)
    moe_knobs(_IQ2_REPACKED_GATE_UP=True)
    assert np.array_equal(mid(), want)
    moe_knobs(_PRE_GATE_UP=True)                     # the tables filled before pdl_enter
    assert np.array_equal(mid(), want)
    if F.row_bytes(F.IQ2_XXS, n_embd) % 16 == 0:      # moe_gate_up_halves' rule for repacked rows
        moe_knobs(_GU_HALVES=True)
        assert np.array_equal(mid(), want), "moe_gate_up_halves on repacked rows"
    for o in (og, ou):
        K.iq2_xxs_relayout(arena, o, n_used * n_ff, n_embd, to_repacked=False)
    assert np.array_equal(arena.copy_to_host(), before)


class _Q8Pair:
    """Two random Q8_0 matrices (rows and rows // 2 + 1 rows of Kd) in one arena, one token's
    activation and a grouped one (4 groups where rows divides, else 1)."""

    def __init__(self, rng, rows, Kd):
        self.rows, self.Kd = rows, Kd
        self.wa = TD.random_weights(F.Q8_0, (rows, Kd), rng)
        self.wb = TD.random_weights(F.Q8_0, (rows // 2 + 1, Kd), rng)
        self.arena, (self.oa, self.ob) = _arena([self.wa, self.wb])
        self.xq, self.xd, _, _ = _prepare(F.Q8_0, rng.standard_normal((1, Kd)))
        self.n_groups = 4 if rows % 4 == 0 else 1
        self.xgq, self.xgd, _, _ = _prepare(F.Q8_0, rng.standard_normal((1, Kd * self.n_groups)))

    def matrices(self):
        return ((self.oa, self.wa), (self.ob, self.wb))

    def decode_outputs(self, sl):
        """The one-token launches: one matrix, the pair, the grouped projection."""
        rows, Kd, rows_b = self.rows, self.Kd, self.wb.shape[0]
        one = cuda.device_array(rows, np.float32)
        K.matvec_q8_0(self.arena, self.oa, rows, Kd, self.xq, self.xd, one, scales_last=sl)
        pair = cuda.device_array(rows + rows_b, np.float32)
        K.matvec_q8_0_pair(self.arena, self.oa, rows, self.ob, rows_b, Kd, self.xq, self.xd, pair, scales_last=sl)
        grouped = cuda.device_array(rows, np.float32)
        K.matvec_q8_0_grouped(self.arena, self.oa, rows, Kd, self.n_groups, self.xgq, self.xgd, grouped,
                              scales_last=sl)
        return [a.copy_to_host() for a in (one, pair, grouped)]


@pytest.mark.parametrize("rows,Kd", [(37, 256), (300, 1280), (4100, 4096), (64, 8192)])
def test_q8_0_weight_prologue_same_bits(moe_knobs, rows, Kd):
    """_Q8_0_PRE (q8_0_rows reads its first chunk of weights before pdl_enter()) changes no bit:
    one matrix, a pair, a grouped launch, on the file's rows and scales-last ones, split-K from 8
    (37 rows) to 1 (4100), a partial last chunk (1280: 5 steps of U 4)."""
    q8 = _Q8Pair(_rng(29), rows, Kd)
    for sl in (False, True):
        if sl:
            for o, w in q8.matrices():
                K.q8_0_relayout(q8.arena, o, w.shape[0], Kd)
        moe_knobs(_Q8_0_PRE=False)
        want = q8.decode_outputs(sl)
        moe_knobs(_Q8_0_PRE=True)
        for got, exp, what in zip(q8.decode_outputs(sl), want, ("one", "pair", "grouped")):
            assert np.array_equal(got.view(np.uint32), exp.view(np.uint32)), f"{what}, scales-last {sl}"


@pytest.mark.parametrize("rows,Kd", [(40, 256), (36, 768), (64, 1024), (12, 4096), (8, 8192), (4100, 4096)])
@pytest.mark.parametrize("U", [1, 2, 4])
def test_q8_0_pairs_same_bits_as_q8_0_rows(moe_knobs, rows, Kd, U):
    """q8_0_pairs (one token, one warp per row, two lanes per block) gives q8_0_rows' bits on
    scales-last rows: one matrix, a pair, a grouped launch, the weight prologue on and off, under
    a register cap, with and without the one-chunk kernel (rows of <= U steps); half a step (256: blocks b + 8 past the row) to 16 steps (8192). With
    _Q8_0_S1_ROWS = 1 every row count takes one warp per row (the shape the pairs kernel serves);
    then the HC-post epilogue on a matrix of rows x Kd."""
    moe_knobs(_Q8_0_S1_ROWS=1)
    rng = _rng(31)
    q8 = _Q8Pair(rng, rows, Kd)
    for o, w in q8.matrices():
        K.q8_0_relayout(q8.arena, o, w.shape[0], Kd)
    moe_knobs(_Q8_0_PAIRS=False)
    want = q8.decode_outputs(True)
    for pre, regs, one in ((False, 0, True), (True, 0, True), (True, 48, True), (True, 0, False)):
        moe_knobs(_Q8_0_PAIRS=True, _Q8_0_PAIRS_U=U, _Q8_0_PRE=pre, _Q8_0_PAIRS_REGS=regs, _Q8_0_PAIRS_ONE=one)
        for got, exp, what in zip(q8.decode_outputs(True), want, ("one", "pair", "grouped")):
            assert np.array_equal(got.view(np.uint32), exp.view(np.uint32)), \
                f"{what}, prologue {pre}, cap {regs}, one-chunk kernel {one}"
    state, f_b, post, comb = _hc_inputs(rng, 4, rows)

    def with_hc(pairs):
        moe_knobs(_Q8_0_PAIRS=pairs)
        out = cuda.device_array((1, rows), np.float32)
        d_state = cuda.to_device(state)
        K.matmul_q8_0(q8.arena, q8.oa, rows, Kd, 1, q8.xq, q8.xd, out, scales_last=True,
                      hc=(d_state, cuda.to_device(f_b), cuda.to_device(post), cuda.to_device(comb)))
        return out.copy_to_host(), d_state.copy_to_host()

    (out_r, st_r), (out_p, st_p) = with_hc(False), with_hc(True)
    assert np.array_equal(out_p, out_r) and np.array_equal(st_p.view(np.uint32), st_r.view(np.uint32))
    assert not np.array_equal(st_p, state)


@pytest.mark.parametrize("rows,Kd", [(37, 256), (300, 1024), (2100, 4096), (64, 8192)])
def test_q8_0_scales_last_rows_same_bits(moe_knobs, rows, Kd):
    """Q8_0 rows that q8_0_relayout rewrote scales-last (formats.to_scales_last's bytes) give the
    file layout's results bit for bit: the decode matvec (one matrix, a pair, a grouped launch;
    split-K S = 8, 8, 2, 8 at these row counts) and the staged tensor-core prefill (cp.async and
    register staging, 40 tokens); the relayout back restores every byte."""
    rng = _rng(23)
    q8 = _Q8Pair(rng, rows, Kd)
    arena, oa, ob, wa, wb = q8.arena, q8.oa, q8.ob, q8.wa, q8.wb
    n_tok = 40
    xtq, xtd, _, _ = _prepare(F.Q8_0, rng.standard_normal((n_tok, Kd)))

    def outputs(sl):
        got = q8.decode_outputs(sl)
        for cpa in (True, False):
            moe_knobs(_MMA_ST_CPASYNC=cpa)
            many = cuda.device_array((n_tok, rows + wb.shape[0]), np.float32)
            K.matmul_q8_0_pair(arena, oa, rows, ob, wb.shape[0], Kd, n_tok, xtq, xtd, many, scales_last=sl)
            got.append(many.copy_to_host())
        return got

    want, before = outputs(False), arena.copy_to_host()
    for o, w in ((oa, wa), (ob, wb)):
        K.q8_0_relayout(arena, o, w.shape[0], Kd)
    after = arena.copy_to_host()
    for o, w in ((oa, wa), (ob, wb)):
        assert np.array_equal(after[o:o + w.size], F.to_scales_last(w.reshape(w.shape[0], -1)).reshape(-1))
    for got, exp in zip(outputs(True), want):
        assert np.array_equal(got, exp)
    for o, w in ((oa, wa), (ob, wb)):
        K.q8_0_relayout(arena, o, w.shape[0], Kd, to_repacked=False)
    assert np.array_equal(arena.copy_to_host(), before)


@pytest.mark.parametrize("slots_rows", [0, 1, 8, 10, 16])
@pytest.mark.parametrize("n_ff", [256, 2048, 5120])
def test_moe_down_decode_equals_slot_matvecs(n_ff, slots_rows, moe_knobs):
    """moe_down (one warp per output row, slots in order, the next (slot, chunk) loading while the
    current one is computed) against a Q2_K matvec per slot added in slot order, bit for bit: rows
    of one chunk (n_ff 256: one partial step, 2048: 2 steps) and of two (5120: 5 steps of 4
    super-blocks, chunks of 4 steps). slots_rows > 0: moe_down_decode_slots with that many rows per
    block (_R_DOWN_SLOTS; 10 leaves a partial last block of the 384 rows; at 5120 the launch falls
    back to moe_down_decode). moe_down_sb (the engine's, where it applies) off."""
    moe_knobs(_R_DOWN_SLOTS=slots_rows, _DOWN_SB=0)
    _assert_down_equals_slot_matvecs(n_ff)


@pytest.mark.parametrize("sb_rows,n_ff,extra", [(8, 2048, 0), (4, 2048, 4), (8, 1024, 0), (4, 768, 0),
                                                (12, 256, 0), (16, 2048, 0)])
def test_moe_down_sb_equals_slot_matvecs(sb_rows, n_ff, extra, moe_knobs):
    """moe_down_sb (_DOWN_SB: a lane per super-block, the rows through shared memory by cp.async)
    against a Q2_K matvec per slot added in slot order, bit for bit: the flash rows (2048: 8
    super-blocks) with the experts on a 16-byte boundary (cp.async) and 4 bytes off one (word
    copies), 4 and 3 super-blocks (768: word copies), one, and 4 to 16 rows per block (the 384
    rows: partial last blocks with 12 and 16)."""
    moe_knobs(_DOWN_SB=sb_rows)
    assert K.down_sb_applies(F.Q2_K, n_ff, 6, sb_rows)
    _assert_down_equals_slot_matvecs(n_ff, extra)


@pytest.mark.parametrize("early", [0, 2])
@pytest.mark.parametrize("n_ff,extra", [(2048, 0), (2048, 4), (768, 0)])
def test_moe_down_sb_early_copies_equal_slot_matvecs(early, n_ff, extra, moe_knobs):
    """moe_down_sb with none or 2 of its weight groups copied before pdl_enter (_DOWN_EARLY; the
    default, 1, is test_moe_down_sb_equals_slot_matvecs'), by cp.async and word by word, against a
    Q2_K matvec per slot added in slot order, bit for bit."""
    moe_knobs(_DOWN_SB=8, _DOWN_EARLY=early)
    _assert_down_equals_slot_matvecs(n_ff, extra)


def test_moe_decode_with_down_sb_same_bits(experts, moe_knobs):
    """One flash-shaped decode MoE with moe_down_sb and moe_gate_up_halves (the engine's decode
    MoE) against the first MoE decode kernels: mid and the output bit for bit."""
    _assert_moe_decode_bits_unchanged(experts, moe_knobs, 29, _GU_HALVES=True, _DOWN_SB=8, _R_DOWN_SLOTS=8)


def _assert_down_equals_slot_matvecs(n_ff, extra=0):
    rng = _rng(12)
    n_used, n_embd = 6, 384
    down = TD.random_weights(F.Q2_K, (n_used, n_embd, n_ff), rng)
    arena, (od,) = _arena([(down, extra)])
    stride = down.shape[1] * down.shape[2]
    slot_off = cuda.to_device(np.array([[0, 0, od + k * stride] for k in range(n_used)], np.int64))
    mq, md, mbs, _ = _prepare(F.Q2_K, rng.standard_normal((1, n_used * n_ff)))
    out = cuda.device_array(n_embd, np.float32)
    K.moe_down(arena, slot_off, F.Q2_K, n_ff, n_embd, mq, md, mbs, out)
    total = np.zeros(n_embd, np.float32)
    nsb = n_ff // 256
    for k in range(n_used):
        y = cuda.device_array((1, n_embd), np.float32)
        K.matvec_q2_k(arena, od + k * stride, n_embd, n_ff, mq[k * n_ff:(k + 1) * n_ff],
                      md[k * nsb:(k + 1) * nsb], mbs[k * 16 * nsb:(k + 1) * 16 * nsb], y)
        total = total + y.copy_to_host()[0]
    assert np.array_equal(out.copy_to_host(), total)


@pytest.fixture
def gate_up_kernel(request):
    """moe_prefill's gate/up kernel for one test: dp4a tiles, tensor-core tiles, or the staged
    tensor-core kernel (the knobs restored after)."""
    saved = K._MMA_STAGED_GU
    K._MMA_STAGED_GU = request.param == "staged"
    yield request.param != "dp4a"
    K._MMA_STAGED_GU = saved


@pytest.mark.parametrize("grouping", ["host", "device"])
@pytest.mark.parametrize("mma,staged_gu,staged_dn",
                         [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
                         ids=["dp4a", "tensor-cores", "staged-gate-up", "staged"])
def test_moe_prefill_tokens_equal_decode(experts, mma, staged_gu, staged_dn, grouping, monkeypatch):
    """Every token of moe_prefill equals moe_decode bit for bit; with the tensor cores, gate/up and
    down by the direct or the staged kernels (_MMA_STAGED_GU, _MMA_STAGED_DN)."""
    monkeypatch.setattr(K, "_MMA_STAGED_GU", staged_gu)
    monkeypatch.setattr(K, "_MMA_STAGED_DN", staged_dn)
    rng = _rng(7)
    n_tok = 19
    X = rng.standard_normal((n_tok, N_EMBD)).astype(np.float32)
    ids = np.stack([rng.choice(N_EXP, N_USED, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[:, 0] = 3                              # one expert shared by every token (> 1 tile of 4 or 8)
    rw = rng.uniform(0.05, 0.6, (n_tok, N_USED)).astype(np.float32)
    out = cuda.device_array((n_tok, N_EMBD), np.float32)
    out.copy_to_device(np.full((n_tok, N_EMBD), np.nan, np.float32))
    on_device = grouping == "device"          # ids and table on the device: grouped by a kernel
    K.moe_prefill(experts["arena"], cuda.to_device(experts["table"]) if on_device else experts["table"],
                  F.IQ2_XXS, F.Q2_K, N_EMBD, N_FF, cuda.to_device(X), cuda.to_device(ids) if on_device else ids,
                  cuda.to_device(rw), 10.0, out, mma=mma)
    Y = out.copy_to_host()
    ws = K.MoEWorkspace(N_USED, N_EMBD, N_FF)
    for t in range(n_tok):
        y, _ = _moe_decode_gpu(experts, X[t], ids[t], rw[t], 10.0, ws)
        assert np.array_equal(Y[t], y), f"token {t}"


def _moe_prefill_case(rng, n_embd, n_ff, n_tok, n_exp=8):
    """Random IQ2_XXS gate/up and Q2_K down experts in one arena, their offset table, n_tok
    activations, expert ids (slot 0 always expert 2: n_tok pairs of one expert, full tiles and a
    partial one) and route weights: (arena, table, X, ids, rw)."""
    gate = TD.random_weights(F.IQ2_XXS, (n_exp, n_ff, n_embd), rng)
    up = TD.random_weights(F.IQ2_XXS, (n_exp, n_ff, n_embd), rng)
    down = TD.random_weights(F.Q2_K, (n_exp, n_embd, n_ff), rng)
    arena, (og, ou, od) = _arena([gate, up, down])
    s_gu, s_d = n_ff * gate.shape[2], n_embd * down.shape[2]
    table = np.array([[og + e * s_gu, ou + e * s_gu, od + e * s_d] for e in range(n_exp)], np.int64)
    X = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(n_exp, N_USED, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[:, 0] = 2
    rw = rng.uniform(0.05, 0.6, (n_tok, N_USED)).astype(np.float32)
    return arena, table, X, ids, rw


def _assert_tokens_equal_decode(out, arena, table, X, ids, rw, n_ff):
    """Every token's moe_prefill output `out` equals moe_decode of that token, bit for bit."""
    n_tok, n_embd = X.shape
    ws = K.MoEWorkspace(N_USED, n_embd, n_ff)
    for t in range(n_tok):
        y = cuda.device_array(n_embd, np.float32)
        K.moe_decode(arena, cuda.to_device(table[ids[t]]), F.IQ2_XXS, F.Q2_K, cuda.to_device(X[t]),
                     cuda.to_device(rw[t]), 10.0, y, ws)
        assert np.array_equal(out[t], y.copy_to_host()), f"token {t}"


@pytest.mark.parametrize("n_embd,n_ff,n_tok", [(1536, 512, 23), (2048, 256, 23), (1024, 768, 37),
                                               (4096, 2048, 61)])
def test_moe_gate_up_staged_equals_tiles_mma(n_embd, n_ff, n_tok):
    """The staged gate/up kernel (byte-permute decode) against the tensor-core tile kernel, bit
    for bit (uint32 views of moe_prefill's output), on shapes whose step count is odd (1536: 3
    steps of 2 super-blocks, the sum banks end swapped) and even (1024: 2), the flash shape (4096
    -> 2048), tiles of 1 to 16 pairs (23 pairs of expert 2: tiles of 16 and 7); and against
    moe_decode for every token. (No short row group: the Q2_K down needs n_ff % 256 == 0.)"""
    arena, table, X, ids, rw = _moe_prefill_case(_rng(13), n_embd, n_ff, n_tok)
    ids[: n_tok // 3, 1] = 5
    outs = []
    saved = K._MMA_STAGED_GU
    try:
        for staged in (False, True):
            K._MMA_STAGED_GU = staged
            out = cuda.device_array((n_tok, n_embd), np.float32)
            K.moe_prefill(arena, table, F.IQ2_XXS, F.Q2_K, n_embd, n_ff, cuda.to_device(X), ids,
                          cuda.to_device(rw), 10.0, out, mma=True)
            outs.append(out.copy_to_host())
    finally:
        K._MMA_STAGED_GU = saved
    for o in outs[1:]:
        assert np.array_equal(outs[0].view(np.uint32), o.view(np.uint32))
    _assert_tokens_equal_decode(outs[1], arena, table, X, ids, rw, n_ff)


def _down_case(rng, n_ff, n_embd, n_tok):
    """Three random Q2_K down experts (the second at an offset of 4 mod 8), 2 slots per token (slot
    0 always expert 1: one tile shared by every token), Q8_K activations of every pair and the
    device tiles: (arena, table, ids, mq, md, mbs, tiles)."""
    n_exp, n_used = 3, 2
    down = TD.random_weights(F.Q2_K, (n_exp, n_embd, n_ff), rng)
    arena, offs = _arena([down[0], (down[1], 4), down[2]])
    assert offs[1] % 8 == 4
    table = np.array([[0, 0, o] for o in offs], np.int64)
    ids = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)
    ids[:, 0] = 1
    ids[:, 1] = np.where(ids[:, 1] == 1, 0, ids[:, 1])
    mq, md, mbs, _ = _prepare(F.Q2_K, rng.standard_normal((1, ids.size * n_ff)))
    tiles = K._tiles_to_device(ids, table, 8 * K._MMA_HALVES_DN, 0)
    return arena, table, ids, mq, md, mbs, tiles


def _assert_pairs_equal_moe_down(pair_rows, case, n_ff, n_embd):
    """Every (token, slot) pair's row equals moe_down of that slot alone (the decode kernel)."""
    arena, table, ids, mq, md, mbs, _ = case
    n_used, nsb = ids.shape[1], n_ff // 256
    out = cuda.device_array(n_embd, np.float32)
    for p in range(ids.size):
        slot_off = cuda.to_device(table[ids[p // n_used, p % n_used]][None, :])
        K.moe_down(arena, slot_off, F.Q2_K, n_ff, n_embd, mq[p * n_ff:(p + 1) * n_ff],
                   md[p * nsb:(p + 1) * nsb], mbs[p * 16 * nsb:(p + 1) * 16 * nsb], out)
        assert np.array_equal(pair_rows[p], out.copy_to_host()), f"pair {p}"


@pytest.mark.parametrize("n_ff,n_embd", [(256, 392), (768, 200), (1280, 136)])
def test_moe_down_tiles_staged_equals_decode(n_ff, n_embd):
    """The staged Q2_K down kernel on shapes the flash model does not have: rows of 1, 3 and 5
    super-blocks (an odd count: the bank and buffer schedule ends mid-round), n_embd not a multiple
    of 128 (a short last row block; 136: warps whose 16 rows are all past n_embd, 392 and 200: a
    warp with 8 of them), tiles of 16 pairs and fewer (one expert shared by every token), one
    expert at an offset of 4 mod 8 (only 4-byte alignment is assumed). Every pair's row equals
    moe_down of its slot alone (the decode kernel) and the direct tensor-core kernel, bit for
    bit."""
    case = _down_case(_rng(13), n_ff, n_embd, 13)
    arena, table, ids, mq, md, mbs, tiles = case
    n_pairs, n_used = ids.size, ids.shape[1]
    assert int(tiles[3].copy_to_host().max()) > 8        # a tile that fills both MMA column halves
    a32 = K._arena_views(arena)[1]
    results = {}
    for staged in (True, False):
        pair_out = cuda.to_device(np.full(n_pairs * n_embd, np.nan, np.float32))
        K._launch_moe_down_mma(a32, tiles, n_used, n_ff, n_embd, mq, md, mbs, pair_out, 0, staged)
        results[staged] = pair_out.copy_to_host().reshape(n_pairs, n_embd)
    assert np.array_equal(results[True], results[False])
    _assert_pairs_equal_moe_down(results[True], case, n_ff, n_embd)


def test_moe_decode_graph_replay_reads_device_buffers(experts):
    """Capture expert_offsets + moe_decode once; new ids / weights / x written into the same
    device buffers must give the eager result on replay (nothing per token is baked in)."""
    from cuda.core import Device

    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    rng = _rng(8)
    ws = K.MoEWorkspace(N_USED, N_EMBD, N_FF)
    d_ids = cuda.device_array(N_USED, np.int32)
    d_rw = cuda.device_array(N_USED, np.float32)
    d_x = cuda.device_array(N_EMBD, np.float32)
    slot_off = cuda.device_array((N_USED, 3), np.int64)
    out = cuda.device_array(N_EMBD, np.float32)
    ex = experts

    def step(s):
        K.expert_offsets(d_ids, ex["og"], ex["ou"], ex["od"], ex["stride_gu"], ex["stride_d"],
                         slot_off, s)
        K.moe_decode(ex["arena"], slot_off, F.IQ2_XXS, F.Q2_K, d_x, d_rw, 10.0, out, ws, s)

    d_ids.copy_to_device(np.arange(N_USED, dtype=np.int32))
    step(0)                                    # warm-up: compile everything before capture
    cuda.synchronize()
    gb = stream.create_graph_builder()
    gb.begin_building()
    step(gb)
    gb.end_building()
    graph = gb.complete()
    for _ in range(3):
        x = rng.standard_normal(N_EMBD).astype(np.float32)
        ids = rng.choice(N_EXP, N_USED, replace=False).astype(np.int32)
        rw = rng.uniform(0.05, 0.6, N_USED).astype(np.float32)
        d_ids.copy_to_device(ids)
        d_rw.copy_to_device(rw)
        d_x.copy_to_device(x)
        cuda.synchronize()
        graph.launch(stream)
        stream.sync()
        y_graph = out.copy_to_host()
        y_eager, _ = _moe_decode_gpu(ex, x, ids, rw, 10.0)
        assert np.array_equal(y_graph, y_eager)


# ------------------------------------------------------------------- fused launches (decode)

def test_pair_and_grouped_launches_match_cpu():
    """Two matrices in one launch (q_a+kv, shared gate+up, compressor kv+gate) and the grouped
    output projection (8 groups, each on its own slice of x) against the CPU matvec per part."""
    rng = _rng(77)
    for t, (rows_a, rows_b, Kd) in ((F.Q8_0, (1024, 512, 4096)), (F.Q8_0, (37, 100, 96)),
                                    (F.F16, (1024, 1024, 4096)), (F.F16, (37, 60, 66))):
        wa, wb = TD.random_weights(t, (rows_a, Kd), rng), TD.random_weights(t, (rows_b, Kd), rng)
        arena, (off_a, off_b) = _arena([wa, (wb, 2 if t == F.Q8_0 else 0)])     # b at a 2-mod-4 offset
        x = rng.standard_normal(Kd).astype(np.float32)
        xq, xd, _, dX = _prepare(t, x[None, :])
        out = cuda.device_array(rows_a + rows_b, np.float32)
        if t == F.Q8_0:
            K.matvec_q8_0_pair(arena, off_a, rows_a, off_b, rows_b, Kd, xq, xd, out)
        else:
            K.matvec_f16_pair(arena, off_a, rows_a, off_b, rows_b, Kd, dX, out)
        y = out.copy_to_host()
        for part, w, rows in ((y[:rows_a], wa, rows_a), (y[rows_a:], wb, rows_b)):
            _, mag = TD.reference_matvec(w, t, x, np.arange(rows))
            err = np.abs(part.astype(np.float64) - cpu.matvec(w, t, x))
            assert np.all(err <= 2 * TD.f32_sum_bound(t, Kd, mag)), f"{F.TYPE_NAMES[t]} pair"
    n_groups, per, Kd = 8, 1024, 4096
    w = TD.random_weights(F.Q8_0, (n_groups * per, Kd), rng)
    arena, (off,) = _arena([w])
    x = rng.standard_normal(n_groups * Kd).astype(np.float32)
    xq, xd, _, _ = _prepare(F.Q8_0, x[None, :])
    out = cuda.device_array(n_groups * per, np.float32)
    K.matvec_q8_0_grouped(arena, off, n_groups * per, Kd, n_groups, xq, xd, out)
    y = out.copy_to_host()
    for g in range(n_groups):
        wg, xg = w[g * per:(g + 1) * per], x[g * Kd:(g + 1) * Kd]
        _, mag = TD.reference_matvec(wg, F.Q8_0, xg, np.arange(per))
        err = np.abs(y[g * per:(g + 1) * per].astype(np.float64) - cpu.matvec(wg, F.Q8_0, xg))
        assert np.all(err <= 2 * TD.f32_sum_bound(F.Q8_0, Kd, mag)), f"group {g}"


# ------------------------------------------------------------------ HC-post epilogues (decode)

def _hc_inputs(rng, n_hc=4, n_embd=N_EMBD):
    state = rng.standard_normal((n_hc, n_embd)).astype(np.float32)
    f_b = rng.standard_normal(n_embd).astype(np.float32)
    post = rng.uniform(0.1, 2.0, n_hc).astype(np.float32)
    comb = rng.uniform(0.0, 1.0, n_hc * n_hc).astype(np.float32)
    return state, f_b, post, comb


def _hc_post_reference(state, f_a, f_b, post, comb):
    """The separate hc_post kernel on one token's state (a copy)."""
    from ds4py.kernels import cuda_ops as ops
    d_state = cuda.to_device(state[None])
    ops.hc_post[(16, 1), ops.BLOCK](d_state, cuda.to_device(f_a[None]), cuda.to_device(f_b[None]),
                                    cuda.to_device(post[None]), cuda.to_device(comb[None]))
    return d_state.copy_to_host()[0]


def test_hc_post_rounds_as_the_cpu_engine():
    """hc_post (and so the decode epilogues, which share hc_post_dim) gives the CPU engine's
    hc_post_rows bit for bit: each product and sum rounded on its own. An fma contracted by the
    compiler changes last bits, and the tiny model's logits follow them (corr 0.99989 -> 0.9934)."""
    from ds4py.kernels import cpu_ops
    rng = _rng(96)
    for n_hc, n_embd in ((4, N_EMBD), (2, 256)):
        state, f_b, post, comb = _hc_inputs(rng, n_hc, n_embd)
        f_a = rng.standard_normal(n_embd).astype(np.float32)
        got = _hc_post_reference(state, f_a, f_b, post, comb)
        want = cpu_ops.hc_post_rows((f_a + f_b)[None], state[None], post[None],
                                    comb.reshape(1, n_hc, n_hc))[0]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
            f"n_hc {n_hc}: {np.count_nonzero(got != want)} of {got.size} values differ"


@pytest.mark.parametrize("slots_rows,sb_rows", [(0, 0), (8, 0), (8, 8)], ids=["down", "down-slots", "down-sb"])
def test_hc_post_epilogues_equal_hc_post(experts, slots_rows, sb_rows, moe_knobs):
    """The HC post done by the thread that writes each output dim (out_b's Q8_0 matvec: split-K 2
    at the model's shape, 8 on a small one; the MoE down kernel, or moe_down_decode_slots with
    slots_rows > 0, or moe_down_sb with sb_rows > 0) leaves the outputs unchanged and the state bit
    for bit as hc_post."""
    moe_knobs(_R_DOWN_SLOTS=slots_rows, _DOWN_SB=sb_rows)
    rng = _rng(95)
    for n_embd, Kd, n_hc in ((N_EMBD, 8192, 4), (256, 1024, 4), (256, 512, 2)):
        w = TD.random_weights(F.Q8_0, (n_embd, Kd), rng)
        arena, (off,) = _arena([w])
        x = rng.standard_normal(Kd).astype(np.float32)
        xq, xd, _, _ = _prepare(F.Q8_0, x[None, :])
        state, f_b, post, comb = _hc_inputs(rng, n_hc, n_embd)
        plain = cuda.device_array((1, n_embd), np.float32)
        K.matmul_q8_0(arena, off, n_embd, Kd, 1, xq, xd, plain)
        f_a = plain.copy_to_host()[0]
        fused = cuda.device_array((1, n_embd), np.float32)
        d_state = cuda.to_device(state)
        K.matmul_q8_0(arena, off, n_embd, Kd, 1, xq, xd, fused,
                      hc=(d_state, cuda.to_device(f_b), cuda.to_device(post), cuda.to_device(comb)))
        assert np.array_equal(fused.copy_to_host()[0], f_a)
        want = _hc_post_reference(state, f_a, f_b, post, comb)
        assert not np.array_equal(want, state)
        assert np.array_equal(d_state.copy_to_host().view(np.uint32), want.view(np.uint32)), \
            f"Q8_0 epilogue, {n_embd} x {Kd}, n_hc {n_hc}"
    state, f_b, post, comb = _hc_inputs(rng)

    x = rng.standard_normal(N_EMBD).astype(np.float32)
    ids = rng.choice(N_EXP, N_USED, replace=False).astype(np.int32)
    rw = rng.uniform(0.05, 0.6, N_USED).astype(np.float32)
    y, slot_off = _moe_decode_gpu(experts, x, ids, rw, 10.0)
    ws = K.MoEWorkspace(N_USED, N_EMBD, N_FF)
    K.moe_decode_input(cuda.to_device(x), ws)
    out = cuda.device_array(N_EMBD, np.float32)
    d_state = cuda.to_device(state)
    calls = []
    K.moe_decode_experts(experts["arena"], cuda.to_device(slot_off), F.IQ2_XXS, F.Q2_K,
                         cuda.to_device(rw), 10.0, out, ws, before_down=lambda: calls.append(1),
                         hc=(d_state, cuda.to_device(f_b), cuda.to_device(post), cuda.to_device(comb)))
    assert calls == [1]
    assert np.array_equal(out.copy_to_host(), y)
    want = _hc_post_reference(state, y, f_b, post, comb)
    assert np.array_equal(d_state.copy_to_host().view(np.uint32), want.view(np.uint32)), "MoE down epilogue"


# ------------------------------------------------------------------ prefill attention (tensor cores)

def _attention_partials(inp, n_head, head_dim, mma):
    """(part_max, part_den, part_acc) of one split for every token of inp: attention_partial, or
    the tensor-core kernel named mma (attention_prefill_mma or its no-prefetch variant)."""
    from ds4py.kernels import cuda_ops as ops
    n_tok = len(inp["pos"])
    part_max = cuda.device_array((n_tok, n_head, 1), np.float64)
    part_den = cuda.device_array((n_tok, n_head, 1), np.float64)
    part_acc = cuda.device_array((n_tok, n_head, 1, head_dim), np.float64)
    args = [cuda.to_device(inp[k]) for k in ("q", "raw", "comp", "selected", "n_selected", "pos")]
    args += [inp["n_swa"], inp["ratio"], inp["use_selected"]]
    if mma:
        getattr(ops, mma)[(n_head // ops.ATTN_MMA_HEADS, 1, n_tok), ops.ATTN_MMA_THREADS](
            *args, part_max, part_den, part_acc)
    else:
        ops.attention_partial[((n_head + ops.ATTN_HEADS - 1) // ops.ATTN_HEADS, 1, n_tok), ops.ATTN_THREADS](
            *args, head_dim, part_max, part_den, part_acc)
    cuda.synchronize()
    return part_max.copy_to_host()[:, :, 0], part_den.copy_to_host()[:, :, 0], part_acc.copy_to_host()[:, :, 0]


@pytest.mark.parametrize("kernel", ["attention_prefill_mma", "attention_prefill_mma_no_prefetch"])
@pytest.mark.parametrize("case", ["short", "tiles", "selected", "dense", "ratio128"])
def test_attention_prefill_mma_matches_attention_partial(case, kernel):
    """attention_prefill_mma against attention_partial (one split) and the float64 reference, 64
    heads x 512 dims. Not the same bits: the tensor-core kernel multiplies hi + lo f16 splits of q
    and of the softmax weights (~22 bits each, the rows are exact in f16) and adds in another
    order. A numpy emulation of both at 400 rows gives output errors ~1e-7 (MMA) and ~4e-7 (f32
    FMA) against an output scale ~0.4; scores err by ~4e-7 / ~2e-6 at scale 4. The tolerance,
    1e-5 of the token's output scale (log Σexp: 1e-5 of 1 + |lse|), leaves room for the tensor
    core's truncating f32 accumulation and stays ~10x below what an f16-only product would give."""
    from ds4py.kernels import cuda_ops as ops
    rng = _rng(97)
    n_head, head_dim, n_swa = 64, ops.ATTN_MMA_DIM, 128
    cap = n_swa + 16                                    # a ring of the window plus a chunk: wraps around
    if case == "short":        # fewer rows than one tile (the first rows of a sequence)
        positions, ratio, n_comp, selected = [0, 1, 3, 7, 12, 30], 4, 8, None
    elif case == "tiles":      # several tiles, partial last tiles, window + all compressed rows
        positions, ratio, n_comp, selected = [127, 128, 300, 301, 302, 555, 1000, 2047], 4, 512, None
    elif case == "selected":   # the indexer's selection (counts 0, short, several tiles)
        positions, ratio, n_comp = [40, 400, 900, 2000, 2001], 4, 501
        counts = [0, 13, 100, 333, 500]
        selected = [np.sort(rng.choice((p + 1) // 4, c, replace=False)) for p, c in zip(positions, counts)]
    elif case == "dense":      # ratio 0: the raw window only
        positions, ratio, n_comp, selected = [5, 200, 1500], 0, 0, None
    else:                      # a ratio-128 lane
        positions, ratio, n_comp, selected = [5, 200, 1500], 128, 12, None
    inp = TD.attention_inputs(rng, n_head, head_dim, n_swa, cap, ratio, n_comp, positions, selected)
    lse_ref, out_ref = TD.attention_reference(inp, head_dim)
    results = {}
    for mma in (False, True):
        m, den, acc = _attention_partials(inp, n_head, head_dim, kernel if mma else None)
        assert np.all(np.isfinite(acc)) and np.all(den >= 1) and np.all(den <= 2048 + 1)
        results[mma] = (m + np.log(den.astype(np.float64)), acc / den[:, :, None].astype(np.float64), m)
    tol = 1e-5
    for t, pos in enumerate(positions):
        scale = float(np.max(np.abs(out_ref[t])))
        lse_scale = 1 + float(np.max(np.abs(lse_ref[t])))
        errs = {}
        for mma, (lse, out, m) in results.items():
            errs[mma] = (float(np.max(np.abs(out[t] - out_ref[t]))), float(np.max(np.abs(lse[t] - lse_ref[t]))))
        d_out = float(np.max(np.abs(results[True][1][t] - results[False][1][t])))
        d_max = float(np.max(np.abs(results[True][2][t] - results[False][2][t])))
        msg = (f"{case} t={t} pos {pos}: out err mma {errs[True][0]:.3g} fma {errs[False][0]:.3g} "
               f"(scale {scale:.3g}), lse err mma {errs[True][1]:.3g} fma {errs[False][1]:.3g}, "
               f"|mma - fma| out {d_out:.3g} max {d_max:.3g}")
        print(msg)
        assert errs[True][0] <= tol * scale and errs[True][1] <= tol * lse_scale, msg
        assert d_out <= tol * scale and d_max <= tol * lse_scale, msg


# ------------------------------------------------------------------------- tiled F16 prefill matmul

# (rows_a, rows_b, K, tokens): the engine's F16 prefill launches (router, the three compressor
# pairs, the indexer's proj and q_b; split-K S = 8, 4, 1) and odd ones: rows and rows_b not
# multiples of the tile, K with a partial last step (K = 1000: 15 steps + 20 pairs; K = 2118: 33
# + 3, the tail to warp 1 of 8), step counts not a multiple of S (K = 1000 at S = 4), token counts
# not multiples of T, and launches that fall back to f16_rows (5 tokens, 3 or 5 rows)
F16_TILED_CASES = [(256, 0, 4096, 512), (1024, 1024, 4096, 512), (512, 512, 4096, 100), (256, 256, 4096, 37),
                   (64, 0, 4096, 64), (8192, 0, 1024, 40), (37, 0, 66, 9), (100, 13, 1000, 17),
                   (2100, 0, 1000, 23), (4100, 0, 2048, 9), (9, 0, 2118, 8), (8200, 0, 256, 33),
                   (300, 0, 4096, 5), (3, 0, 96, 20), (40, 5, 512, 16)]
F16_TILED_VARIANTS = [(8, 8, 0, False), (8, 8, 0, True), (8, 8, 128, True), (4, 16, 0, False), (4, 8, 0, True)]


def _f16_launch(arena, offs, rows_ab, Kd, X):
    rows_a, rows_b = rows_ab
    n_tok = X.shape[0]
    dX = cuda.to_device(X)
    out = cuda.to_device(np.full((n_tok, rows_a + rows_b), np.nan, np.float32))
    if rows_b:                    # one token: the pair matvec (decode)
        K.matmul_f16_pair(arena, offs[0], rows_a, offs[1], rows_b, Kd, n_tok, dX, out)
    elif n_tok == 1:
        K.matvec_f16(arena, offs[0], rows_a, Kd, dX, out)
    else:
        K.matmul_f16(arena, offs[0], rows_a, Kd, n_tok, dX, out)
    return out.copy_to_host()


@pytest.mark.parametrize("rows_a,rows_b,Kd,n_tok", F16_TILED_CASES,
                         ids=[f"{c[0]}+{c[1]}x{c[2]}x{c[3]}" for c in F16_TILED_CASES])
def test_f16_tiled_equals_f16_rows(monkeypatch, rows_a, rows_b, Kd, n_tok):
    """f16_rows_tiled (_F16_TILED) gives every (row, token) the bits of f16_rows, under every tile
    shape, register cap and prefetch setting; a few tokens also against the decode matvec."""
    rng = _rng(90 + rows_a + rows_b + Kd + n_tok)
    ws = [TD.random_weights(F.F16, (r, Kd), rng) for r in (rows_a, rows_b) if r]
    arena, offs = _arena(ws)
    X = rng.standard_normal((n_tok, Kd)).astype(np.float32)
    X[n_tok // 2] *= 40
    monkeypatch.setattr(K, "_F16_TILED", False)
    want = _f16_launch(arena, offs, (rows_a, rows_b), Kd, X)
    assert not np.any(np.isnan(want))
    monkeypatch.setattr(K, "_F16_TILED", True)
    for R, T, regs, pf in F16_TILED_VARIANTS:
        for name, value in (("_F16_TILE_R", R), ("_F16_TILE_T", T), ("_F16_TILE_REGS", regs),
                            ("_F16_TILE_PREFETCH", pf)):
            monkeypatch.setattr(K, name, value)
        got = _f16_launch(arena, offs, (rows_a, rows_b), Kd, X)
        bad = ~np.equal(got.view(np.uint32), want.view(np.uint32))
        assert not bad.any(), (f"{R}x{T} regs {regs} prefetch {pf}: {bad.sum()} outputs differ, first "
                               f"(token, row) {tuple(np.argwhere(bad)[0])}")
    for i in sorted({0, n_tok // 2, n_tok - 1}):
        one = _f16_launch(arena, offs, (rows_a, rows_b), Kd, X[i:i + 1])[0]     # the decode kernel
        assert np.array_equal(one.view(np.uint32), got[i].view(np.uint32)), f"token {i}"


@pytest.mark.parametrize("rows,Kd", [(8192, 1024), (8200, 1000), (9000, 64), (8192, 2048)])
def test_f16_const_decode_equals_loop(monkeypatch, rows, Kd):
    """_F16_CONST_DECODE (one warp per row, the whole steps a compile-time constant, every step's
    weights loaded first) against the step loop, bit for bit: the indexer's q_b (1024 -> 8192), a
    partial last step (K = 1000: 15 steps + 20 pairs), one step (64), and 32 steps (2048)."""
    rng = _rng(70 + rows + Kd)
    arena, offs = _arena([TD.random_weights(F.F16, (rows, Kd), rng)])
    X = rng.standard_normal((1, Kd)).astype(np.float32)
    monkeypatch.setattr(K, "_F16_CONST_DECODE", False)
    want = _f16_launch(arena, offs, (rows, 0), Kd, X)
    assert not np.any(np.isnan(want))
    monkeypatch.setattr(K, "_F16_CONST_DECODE", True)
    got = _f16_launch(arena, offs, (rows, 0), Kd, X)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ------------------------------------------- Q8_0 staged MMA: magic-C accumulator, cp.async staging

# (rows, K, tokens, extra offset): the engine's prefill shapes at 512 tokens (q_b, out_b, q_a,
# kv, shared expert), short row and token tiles, every split-K regime, short last chunks, an
# 8-mod-16 weight offset (the cp.async staging falls back to the 8-byte loads)
STAGED_LEAN_CASES = [(32768, 1024, 512, 0), (4096, 8192, 512, 0), (1024, 4096, 512, 0),
                     (512, 4096, 512, 0), (2048, 4096, 512, 0), (4096, 2048, 512, 0),
                     (37, 4096, 37, 0), (2100, 1024, 40, 0), (8200, 256, 33, 0), (300, 8192, 45, 0),
                     (1500, 1280, 70, 0), (600, 2304, 50, 0), (70, 2048, 100, 8), (64, 256, 16, 0)]
STAGED_LEAN_VARIANTS = [(True, False), (False, True), (True, True)]    # (magic C, cp.async)
STAGED_DEFAULT = (True, True)              # the engine's settings: every case
# the other variants (the 8-byte loads with magic C, which unaligned launches take, and cp.async
# without it) over a short row and token tile, split-K, a short last chunk and the 8-mod-16
# offset (the fallback to the 8-byte loads): each variant compiles its own kernel
STAGED_SOME_CASES = [(1024, 4096, 512, 0), (37, 4096, 37, 0), (8200, 256, 33, 0), (1500, 1280, 70, 0),
                     (70, 2048, 100, 8)]
STAGED_LEAN_PARAMS = [case + STAGED_DEFAULT for case in STAGED_LEAN_CASES] + [
    case + variant for variant in STAGED_LEAN_VARIANTS if variant != STAGED_DEFAULT for case in STAGED_SOME_CASES]


@pytest.mark.parametrize("rows,Kd,n_tok,extra,magic_c,cpa", STAGED_LEAN_PARAMS,
                         ids=[f"{p[0]}x{p[1]}x{p[2]}+{p[3]}-magic{int(p[4])}-cpa{int(p[5])}"
                              for p in STAGED_LEAN_PARAMS])
def test_q8_0_mma_staged_lean_same_bits(rows, Kd, n_tok, extra, magic_c, cpa, monkeypatch):
    """The staged kernel with the magic-bits accumulator (_MMA_ST_MAGIC_C) or the lean cp.async
    staging (_MMA_ST_CPASYNC) gives the plain staged kernel's and the dp4a kernel's bits."""
    rng = _rng(90 + rows + n_tok)
    w = TD.random_weights(F.Q8_0, (rows, Kd), rng)
    arena, (off,) = _arena([(w, extra)])
    X = rng.standard_normal((n_tok, Kd)).astype(np.float32)
    X[n_tok // 2] *= 40
    X[n_tok - 1, :64] = 0                                # zero blocks
    xq, xd, _, _ = _prepare(F.Q8_0, X)
    want = cuda.device_array((n_tok, rows), np.float32)
    monkeypatch.setattr(K, "_MMA_ST_MAGIC_C", False)
    monkeypatch.setattr(K, "_MMA_ST_CPASYNC", False)
    K.matmul_q8_0_mma(arena, off, rows, Kd, n_tok, xq, xd, want, staged=True)
    dp4a = cuda.device_array((n_tok, rows), np.float32)
    K._launch_q8_0(arena, [(off, rows)], Kd, n_tok, xq, xd, dp4a, 0, mma=False)
    monkeypatch.setattr(K, "_MMA_ST_MAGIC_C", magic_c)
    monkeypatch.setattr(K, "_MMA_ST_CPASYNC", cpa)
    out = cuda.device_array((n_tok, rows), np.float32)
    K.matmul_q8_0_mma(arena, off, rows, Kd, n_tok, xq, xd, out, staged=True)
    got, ref = out.copy_to_host(), want.copy_to_host()
    assert np.array_equal(ref.view(np.uint32), dp4a.copy_to_host().view(np.uint32))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), \
        f"max |Δ| {np.max(np.abs(got - ref)):.3g} at {np.unravel_index(np.argmax(np.abs(got - ref)), got.shape)}"


@pytest.mark.parametrize("extra_b", [0, 8], ids=["aligned", "b-8-mod-16"])
@pytest.mark.parametrize("rows_a,rows_b", [(1024, 512), (100, 37)])
def test_q8_0_mma_staged_lean_pair_same_bits(rows_a, rows_b, extra_b, monkeypatch):
    """Two matrices in one launch (a tile straddles them) through the lean staged kernel."""
    rng = _rng(95 + rows_a + extra_b)
    Kd, n_tok = 4096, 40
    wa = TD.random_weights(F.Q8_0, (rows_a, Kd), rng)
    wb = TD.random_weights(F.Q8_0, (rows_b, Kd), rng)
    arena, (off_a, off_b) = _arena([wa, (wb, extra_b)])
    X = rng.standard_normal((n_tok, Kd)).astype(np.float32)
    xq, xd, _, _ = _prepare(F.Q8_0, X)
    outs = []
    for magic_c, cpa in [(False, False), (True, False), (True, True)]:
        monkeypatch.setattr(K, "_MMA_ST_MAGIC_C", magic_c)
        monkeypatch.setattr(K, "_MMA_ST_CPASYNC", cpa)
        out = cuda.device_array((n_tok, rows_a + rows_b), np.float32)
        K._launch_q8_0(arena, [(off_a, rows_a), (off_b, rows_b)], Kd, n_tok, xq, xd, out, 0,
                       mma=True, staged=True)
        outs.append(out.copy_to_host())
    for o in outs[1:]:
        assert np.array_equal(outs[0].view(np.uint32), o.view(np.uint32))


def test_compile_notice_hears_a_cuda_compile_and_small_grids_do_not_warn():
    """A CUDA kernel compiled at its first launch under CompileNotice makes it speak once and
    count seconds (numba-cuda reports no "numba:compile" event for it), and a one-block launch,
    the decode chain's kind, raises no NumbaPerformanceWarning (kernels/compat.py turns numba-cuda's
    low-occupancy warning off)."""
    import warnings
    from numba.core.errors import NumbaPerformanceWarning
    from ds4py.cli import CompileNotice

    @cuda.jit
    def fill(out, value):
        out[cuda.grid(1)] = value

    said = []
    notice = CompileNotice(said.append)
    out = cuda.device_array(32, np.float32)
    with notice.install(), warnings.catch_warnings():
        warnings.simplefilter("error", NumbaPerformanceWarning)
        fill[1, 32](out, np.float32(2.5))
        cuda.synchronize()
    assert np.all(out.copy_to_host() == 2.5)
    assert len(said) == 1 and "compiling kernels" in said[0] and notice.seconds > 0.0
