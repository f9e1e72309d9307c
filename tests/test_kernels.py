"""CPU kernels (ds4py.kernels.cpu) against gguf-py float64 references and ds4's §5.1 rules.

Tolerances: the kernels compute every block's integer dot product exactly and sum the blocks in
f32, so |kernel - exact| <= (n_terms + 8) * 2u * sum_i |w_i x_i| with u = 2^-24 (each block term
has two f32 roundings, then the running sum has one per term). The float64 reference uses the
same activation quantization (part of ds4's numerics), so that bound is the tolerance: tight
enough that one wrong sign, scale or index in a row fails it by orders of magnitude.
"""

import os

import numpy as np
import pytest

from ds4py.kernels import cpu, formats as F
from ds4py.kernels import testdata as TD

TYPES = [F.Q8_0, F.IQ2_XXS, F.Q2_K, F.Q4_K, F.F16, F.F32]


def _rng(seed):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------- formats

def test_iq2xxs_tables_match_gguf():
    from gguf.quants import IQ2_XXS

    IQ2_XXS.init_grid()
    grid = IQ2_XXS.grid.reshape(256, 8).astype(np.uint8)
    assert np.array_equal(F.IQ2XXS_GRID_BYTES, grid)
    assert np.array_equal(F.IQ2XXS_GRID, np.ascontiguousarray(grid).view("<u8").ravel())
    assert np.array_equal(F.KSIGNS_IQ2XS, np.frombuffer(IQ2_XXS.ksigns, np.uint8))
    assert set(np.unique(F.IQ2XXS_GRID_BYTES)) == set(F.GRID_LEVELS)


def test_block_geometry_matches_gguf():
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    for t in (F.F32, F.F16, F.Q8_0, F.Q2_K, F.Q4_K, F.IQ2_XXS, F.I32):
        assert F.BLOCK_GEOMETRY[t] == GGML_QUANT_SIZES[GGMLQuantizationType(t)]
    assert F.row_bytes(F.IQ2_XXS, 4096) == 1056
    assert F.row_bytes(F.Q8_0, 4096) == 4352
    assert F.row_bytes(F.Q2_K, 2048) == 672
    with pytest.raises(ValueError):
        F.row_bytes(F.Q8_0, 33)


# ---------------------------------------------------------------------- activation quantizers

def _q8_0_numpy(x):
    """§5.1 in numpy float32: d = amax/127 (f32), id = 1/d, q = clamp(rint(x*id))."""
    xb = x.reshape(-1, 32).astype(np.float32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, None]), -128, 127).astype(np.int8)
    return q.ravel(), d


def _q8_k_numpy(x):
    """§5.1 Q8_K: signed max (first largest |x|), iscale = -127/max, d = 1/iscale, bsums per 16."""
    xb = x.reshape(-1, 256).astype(np.float32)
    idx = np.argmax(np.abs(xb), axis=1)                    # first occurrence
    vmax = xb[np.arange(len(xb)), idx]
    q = np.zeros_like(xb, dtype=np.int8)
    d = np.zeros(len(xb), np.float32)
    for b in range(len(xb)):
        if vmax[b] == 0:
            continue
        iscale = np.float32(-127) / vmax[b]
        q[b] = np.clip(np.rint(iscale * xb[b]), -128, 127).astype(np.int8)
        d[b] = np.float32(1) / iscale
    bsums = q.reshape(-1, 16).astype(np.int32).sum(axis=1)
    return q.ravel(), d, bsums


def test_quantize_q8_0_random_and_zero_blocks():
    x = _rng(1).standard_normal(32 * 40).astype(np.float32) * 3
    x[64:96] = 0                               # an all-zero block: d = 0, q = 0
    q, d = cpu.quantize_q8_0(x)
    qr, dr = _q8_0_numpy(x)
    assert np.array_equal(q, qr) and np.array_equal(d, dr)
    assert d[2] == 0 and not q[64:96].any()
    assert d.dtype == np.float32 and q.dtype == np.int8


def test_quantize_q8_0_rounds_half_to_even():
    x = np.zeros(32, np.float32)
    x[0] = 127.0                               # d = 1, id = 1: x*id is x itself
    x[1:8] = [2.5, 3.5, -2.5, -3.5, 0.5, 1.5, -0.5]
    q, d = cpu.quantize_q8_0(x)
    assert d[0] == 1.0
    assert list(q[:8]) == [127, 2, 4, -2, -4, 0, 2, 0]


def test_quantize_q8_k_random_zero_and_ties():
    rng = _rng(2)
    x = rng.standard_normal(256 * 6).astype(np.float32)
    x[256:512] = 0                             # all-zero block
    x[512 + 10] = -5.0                         # tie of |max| in block 2: the first (-5) wins
    x[512 + 200] = 5.0
    x[512:768] = np.clip(x[512:768], -4.9, 4.9)
    x[512 + 10], x[512 + 200] = -5.0, 5.0
    q, d, bs = cpu.quantize_q8_k(x)
    qr, dr, bsr = _q8_k_numpy(x)
    assert np.array_equal(q, qr) and np.array_equal(d, dr) and np.array_equal(bs, bsr)
    assert d[1] == 0 and not q[256:512].any() and not bs[16:32].any()
    # max = -5 (the first): iscale = -127/-5 > 0, so d > 0 and -5 maps to -127 (not +127)
    assert q[512 + 10] == -127 and q[512 + 200] == 127 and d[2] > 0
    assert d.dtype == np.float32 and bs.dtype == np.int32


def test_quantize_q8_k_rounds_half_to_even():
    x = np.zeros(256, np.float32)
    x[0] = 127.0                               # max = 127: iscale = -1, d = -1
    x[1:5] = [2.5, 3.5, -0.5, 1.5]
    q, d, _ = cpu.quantize_q8_k(x)
    assert d[0] == -1.0
    assert list(q[:5]) == [-127, -2, -4, 0, -2]


# ------------------------------------------------------------------ matvec against references

SMALL_SHAPES = {
    F.Q8_0: [(1, 32), (7, 96), (33, 320)],
    F.IQ2_XXS: [(1, 256), (5, 768), (19, 512)],
    F.Q2_K: [(1, 256), (5, 768), (19, 512)],
    F.Q4_K: [(1, 256), (5, 768), (19, 512)],
    F.F16: [(1, 2), (7, 50), (13, 333)],
    F.F32: [(1, 1), (7, 13), (5, 100)],
}

# One layer of DeepSeek-V4-Flash (rows, K); the 129280-row output head is left to the GPU bench.
FLASH_SHAPES = [
    (F.Q8_0, 1024, 4096),      # attn q_a
    (F.Q8_0, 32768, 1024),     # attn q_b
    (F.Q8_0, 512, 4096),       # attn kv
    (F.Q8_0, 1024, 4096),      # attn out_a (one of the 8 groups)
    (F.Q8_0, 4096, 8192),      # attn out_b
    (F.Q8_0, 2048, 4096),      # shared expert gate/up
    (F.Q8_0, 4096, 2048),      # shared expert down
    (F.IQ2_XXS, 2048, 4096),   # routed expert gate/up
    (F.Q2_K, 4096, 2048),      # routed expert down
    (F.Q4_K, 2048, 4096),      # q4 files: routed expert gate/up
    (F.F16, 256, 4096),        # router
]


def _check_matvec(t, rows, K, seed, sample=None):
    rng = _rng(seed)
    w = TD.random_weights(t, (rows, K), rng)
    x = rng.standard_normal(K).astype(np.float32)
    y = cpu.matvec(w, t, x)
    assert y.shape == (rows,) and y.dtype == np.float32
    sel = np.arange(rows) if sample is None else np.sort(rng.choice(rows, sample, replace=False))
    ref, mag = TD.reference_matvec(w, t, x, sel)
    err = np.abs(y[sel].astype(np.float64) - ref)
    tol = TD.f32_sum_bound(t, K, mag)
    assert np.all(err <= tol), f"{F.TYPE_NAMES[t]} {rows}x{K}: max err/tol {np.max(err / tol):.3g}"
    assert np.max(np.abs(ref)) > 0


@pytest.mark.parametrize("t", TYPES, ids=[F.TYPE_NAMES[t] for t in TYPES])
def test_matvec_small_shapes(t):
    for i, (rows, K) in enumerate(SMALL_SHAPES[t]):
        _check_matvec(t, rows, K, seed=100 + i)


@pytest.mark.parametrize("t,rows,K", FLASH_SHAPES,
                         ids=[f"{F.TYPE_NAMES[t]}-{r}x{k}" for t, r, k in FLASH_SHAPES])
def test_matvec_flash_shapes(t, rows, K):
    _check_matvec(t, rows, K, seed=rows + K + t, sample=48)


def test_matvec_detects_a_single_flipped_weight():
    """The tolerance is tight enough that one wrong IQ2_XXS sign bit fails it."""
    rng = _rng(7)
    w = TD.random_weights(F.IQ2_XXS, (4, 4096), rng)
    x = rng.standard_normal(4096).astype(np.float32)
    ref, mag = TD.reference_matvec(w, F.IQ2_XXS, x)
    w2 = w.copy()
    w2[1, 2 + 4] ^= 1                          # sign of weight 0 in sub-block 0 of row 1
    err = np.abs(cpu.matvec(w2, F.IQ2_XXS, x).astype(np.float64) - ref)
    assert err[1] > TD.f32_sum_bound(F.IQ2_XXS, 4096, mag)[1]
    assert np.all(err[[0, 2, 3]] <= TD.f32_sum_bound(F.IQ2_XXS, 4096, mag)[[0, 2, 3]])


def test_matvec_accepts_unaligned_bytes():
    """Weights straight out of an mmap need no alignment: an odd byte offset gives the same rows."""
    rng = _rng(8)
    for t, K in ((F.Q8_0, 64), (F.F16, 10), (F.F32, 9), (F.IQ2_XXS, 256)):
        w = TD.random_weights(t, (3, K), rng)
        buf = np.zeros(w.size + 1, np.uint8)
        buf[1:] = w.ravel()
        w_odd = buf[1:].reshape(w.shape)
        x = rng.standard_normal(K).astype(np.float32)
        assert np.array_equal(cpu.matvec(w_odd, t, x), cpu.matvec(w, t, x))


# ---------------------------------------------------------------------------- matmul == matvec

@pytest.mark.parametrize("t", TYPES, ids=[F.TYPE_NAMES[t] for t in TYPES])
def test_matmul_rows_equal_matvec(t):
    rng = _rng(9 + t)
    rows, K = {F.Q8_0: (37, 512), F.F16: (37, 300), F.F32: (11, 100)}.get(t, (37, 768))
    w = TD.random_weights(t, (rows, K), rng)
    X = rng.standard_normal((5, K)).astype(np.float32)
    X[2] *= 50                                 # tokens of very different scale
    Y = cpu.matmul(w, t, X)
    for i in range(len(X)):
        assert np.array_equal(Y[i], cpu.matvec(w, t, X[i]))


# ------------------------------------------------------------------------------------------ MoE

def _moe_case(rng, n_exp, n_embd, n_ff, gate_type=F.IQ2_XXS, down_type=F.Q2_K):
    gate = TD.random_weights(gate_type, (n_exp, n_ff, n_embd), rng)
    up = TD.random_weights(gate_type, (n_exp, n_ff, n_embd), rng)
    down = TD.random_weights(down_type, (n_exp, n_embd, n_ff), rng)
    return gate, up, down


@pytest.mark.parametrize("clamp", [10.0, 0.4])
def test_moe_against_float64_reference(clamp):
    """Tolerance: g and u carry f32 rounding (~1e-6), which can flip a rare rounding tie in the
    Q8_K quantization of mid (one q off by one, ~3e-4 of an output), hence 2e-3 of the norm.
    clamp=0.4 makes the SwiGLU clamp bind on most rows."""
    rng = _rng(11)
    n_exp, n_embd, n_ff = 8, 512, 256
    gate, up, down = _moe_case(rng, n_exp, n_embd, n_ff)
    x = rng.standard_normal(n_embd).astype(np.float32)
    ids = np.array([5, 0, 7], np.int32)
    rw = np.array([0.7, 0.2, 0.6], np.float32)
    y = cpu.moe(gate, up, down, F.IQ2_XXS, F.Q2_K, x, ids, rw, clamp)
    ref = TD.reference_moe(gate, up, down, F.IQ2_XXS, F.Q2_K, x, ids, rw, clamp)
    assert np.linalg.norm(y - ref) <= 2e-3 * np.linalg.norm(ref)
    # the result depends on the clamp, the route weights and the expert choice
    assert np.linalg.norm(cpu.moe(gate, up, down, F.IQ2_XXS, F.Q2_K, x, ids, rw * 2, clamp) - 2 * ref) \
        <= 4e-3 * np.linalg.norm(ref)
    other = cpu.moe(gate, up, down, F.IQ2_XXS, F.Q2_K, x, np.array([5, 1, 7], np.int32), rw, clamp)
    assert np.linalg.norm(other - ref) > 0.05 * np.linalg.norm(ref)


def test_moe_flash_shape():
    rng = _rng(12)
    gate, up, down = _moe_case(rng, 7, 4096, 2048)
    x = rng.standard_normal(4096).astype(np.float32)
    ids = np.array([3, 6, 0, 1, 5, 2], np.int32)
    rw = rng.uniform(0.05, 0.5, 6).astype(np.float32)
    y = cpu.moe(gate, up, down, F.IQ2_XXS, F.Q2_K, x, ids, rw, 10.0)
    ref = TD.reference_moe(gate, up, down, F.IQ2_XXS, F.Q2_K, x, ids, rw, 10.0)
    assert np.linalg.norm(y - ref) <= 2e-3 * np.linalg.norm(ref)


def test_moe_q4_k_experts():
    rng = _rng(13)
    gate, up, down = _moe_case(rng, 4, 512, 256, F.Q4_K, F.Q4_K)
    x = rng.standard_normal(512).astype(np.float32)
    ids = np.array([2, 0], np.int32)
    rw = np.array([0.5, 0.9], np.float32)
    y = cpu.moe(gate, up, down, F.Q4_K, F.Q4_K, x, ids, rw, 10.0)
    ref = TD.reference_moe(gate, up, down, F.Q4_K, F.Q4_K, x, ids, rw, 10.0)
    assert np.linalg.norm(y - ref) <= 2e-3 * np.linalg.norm(ref)


def test_moe_batch_rows_equal_moe():
    rng = _rng(14)
    gate, up, down = _moe_case(rng, 8, 512, 256)
    X = rng.standard_normal((4, 512)).astype(np.float32)
    ids = np.array([[1, 2, 3], [7, 1, 0], [3, 3, 4], [6, 5, 2]], np.int32)
    rw = rng.uniform(0.1, 1.0, (4, 3)).astype(np.float32)
    Y = cpu.moe_batch(gate, up, down, F.IQ2_XXS, F.Q2_K, X, ids, rw, 10.0)
    for t in range(4):
        assert np.array_equal(Y[t], cpu.moe(gate, up, down, F.IQ2_XXS, F.Q2_K, X[t], ids[t], rw[t], 10.0))


def _group_tiles_by_loops(ids, table, T):
    """The MoE prefill grouping written plainly: pairs (token, slot) in token order, per expert in
    increasing id, cut into tiles of at most T."""
    tiles = []
    for e in sorted(set(ids.reshape(-1).tolist())):
        pairs = [(t, k) for t in range(ids.shape[0]) for k in range(ids.shape[1]) if ids[t, k] == e]
        for a in range(0, len(pairs), T):
            tiles.append((e, pairs[a:a + T]))
    off = np.array([table[e] for e, _ in tiles], np.int64)
    tok = np.zeros((len(tiles), T), np.int32)
    slot = np.zeros((len(tiles), T), np.int32)
    for i, (_, members) in enumerate(tiles):
        for j, (t, k) in enumerate(members):
            tok[i, j], slot[i, j] = t, k
    cnt = np.array([len(m) for _, m in tiles], np.int32)
    return off, tok, slot, cnt


@pytest.mark.parametrize("n_tok,n_exp,T", [(37, 16, 4), (5, 256, 4), (64, 3, 3), (1, 8, 4)])
def test_moe_prefill_tiles_match_plain_grouping(n_tok, n_exp, T):
    from ds4py.kernels.cuda import group_tiles
    rng = np.random.default_rng(n_tok + n_exp)
    ids = np.stack([rng.choice(n_exp, min(6, n_exp), replace=False) for _ in range(n_tok)]).astype(np.int32)
    table = rng.integers(0, 1 << 40, (n_exp, 3)).astype(np.int64)
    got = group_tiles(ids, table, T)
    want = _group_tiles_by_loops(ids, table, T)
    for name, g, w in zip(("offsets", "tokens", "slots", "counts"), got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), name


def _is_kernel_decorator(dec) -> bool:
    """@cuda.jit, @cuda.jit(...), @jit, @wide_jit, @jit_for_threads(...): a kernel unless
    device=True (device functions and @_inline helpers run inside a kernel that already waited)."""
    import ast
    call = dec if isinstance(dec, ast.Call) else None
    target = call.func if call else dec
    name = ast.unparse(target)
    if "jit" not in name:
        return False
    return not (call and any(k.arg == "device" for k in call.keywords))


# kernels whose statements before pdl_enter() (when compiled with the knob named here) read only
# weight bytes or constant tables, which no grid writes while a decode graph replays; moe_down_sb's
# (EARLY) read slot_off too, written two or more grids earlier (route or the host, gate/up, the
# middle's Q8_K: its docstring says why that is visible before the wait)
PROLOGUE_KERNELS = {"q8_0_rows": "PRE", "q8_0_pairs": "PRE", "moe_gate_up_decode": "PRE",
                    "moe_gate_up_halves": "PRE", "hc_mix_partial": "PRE", "moe_down_sb": "EARLY"}


def test_every_cuda_kernel_starts_with_pdl_enter():
    """Decode graphs use programmatic edges: a kernel may be launched while its predecessor still
    runs, so its first statement must be pdl_enter() (wait for the predecessors, then let the next
    grid launch). A kernel without it would read its inputs before they are written."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "kernels"
    missing, found = [], 0
    for path in (root / "cuda.py", root / "cuda_ops.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not any(map(_is_kernel_decorator, node.decorator_list)):
                continue
            found += 1
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            first = body[0]
            if isinstance(first, ast.Expr) and ast.unparse(first.value) == "pdl_enter()":
                continue
            # a prologue: `if not KNOB: pdl_enter()` first, and the statements up to the
            # pdl_enter() at the end of an `if KNOB:` block read only what no recent grid writes
            # (reviewed: listed here by name)
            knob = PROLOGUE_KERNELS.get(node.name)
            if (knob and isinstance(first, ast.If)
                    and ast.unparse(first) == f"if not {knob}:\n    pdl_enter()"
                    and any(isinstance(s, ast.If) and ast.unparse(s.test) == knob
                            and ast.unparse(s.body[-1]) == "pdl_enter()" for s in body)):
                continue
            missing.append(f"{path.name}:{node.lineno} {node.name}")
    assert found >= 35, f"only {found} kernels found: the decorator scan is broken"
    assert not missing, "kernels that do not start with pdl_enter(): " + ", ".join(missing)


# ---- the factory kernels' disk-cache keys (kernels/cuda.py, _CACHE_KERNELS) -----------------------

def _kernel_catalogue():
    """scripts/check_cuda_compile.py's catalogue of the factory kernels: name -> builder."""
    import runpy
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "check_cuda_compile.py"
    quant = runpy.run_path(str(path), run_name="catalogue")["quant"]
    return {name: entry[0] for name, entry in quant.items()}


_CLOSURE_HASHES = """
import hashlib, runpy, sys
from numba.cuda.serialize import dumps
quant = runpy.run_path(sys.argv[1], run_name="catalogue")["quant"]
for name, entry in quant.items():
    f = entry[0]().py_func
    cells = tuple(c.cell_contents for c in (f.__closure__ or ()))
    print(name, hashlib.sha256(dumps(cells)).hexdigest())
"""


def test_factory_kernel_closures_pickle_the_same_in_every_process():
    """numba-cuda's disk cache keys a kernel by a pickle of its closure's cells: the factory
    kernels can be cached only if that pickle is the same in every process. It was not while the
    intrinsics pickled with a per-process uuid (cuda_intrinsics now gives them fixed ones)."""
    import subprocess
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "check_cuda_compile.py"
    env = dict(os.environ, PYTHONHASHSEED="random")
    runs = [subprocess.run([sys.executable, "-c", _CLOSURE_HASHES, str(path)], capture_output=True,
                           text=True, timeout=300, env=env) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.splitlines() for r in runs)
    assert len(first) >= 40, "the catalogue lost its kernels"
    changed = [a.split()[0] for a, b in zip(first, second) if a != b]
    assert not changed, f"closure pickles differ between processes: {changed}"


# the only module-level scalars a factory kernel may read as globals: values no knob changes
KERNEL_CONSTANTS = {"FULL_MASK", "WARP", "HC_MAX", "_M16", "_M32", "_LOW2", "_LOW4", "_MAGIC", "_MAGIC_F",
                    "USE_SHUFFLES"}   # cuda_ops: fixed by the simulator switch at import


def _scalar_globals(func, seen):
    """Names of the module-level int/float/bool globals that func and the device functions it
    calls (through its closure or its globals) read."""
    import types as pytypes
    found = set()
    if id(func) in seen:
        return found
    seen.add(id(func))
    for name in func.__code__.co_names:
        value = func.__globals__.get(name)
        if isinstance(value, (bool, int, float, np.integer, np.floating)):
            found.add(name)
        inner = getattr(value, "py_func", value)
        if isinstance(inner, pytypes.FunctionType):
            found |= _scalar_globals(inner, seen)
    for cell in func.__closure__ or ():
        inner = getattr(cell.cell_contents, "py_func", None)
        if inner is not None:
            found |= _scalar_globals(inner, seen)
    return found


def test_factory_kernels_read_knobs_only_through_their_closure():
    """The disk cache's key holds a kernel's closure but not the module globals it reads, and the
    tests and kbench set kernels/cuda.py knobs at run time: a kernel that read a knob as a global
    could be loaded from the cache compiled with another value. So the factories bind every knob
    to a closure constant; as globals the kernels read only fixed values (KERNEL_CONSTANTS)."""
    bad = {}
    for name, build in _kernel_catalogue().items():
        extra = _scalar_globals(build().py_func, set()) - KERNEL_CONSTANTS
        if extra:
            bad[name] = sorted(extra)
    assert not bad, f"kernels that read module knobs as globals: {bad}"


def test_disk_cache_keys_hold_the_register_cap_and_the_sources():
    """numba-cuda leaves the jit options and the device functions a kernel reaches through module
    globals out of its cache key: kernels/disk_cache.py adds the options and a digest of the
    kernels' sources, so the same kernel built with two caps (kbench sweeps them) gets two entries,
    the uncapped one a third, and every key changes with any kernels/*.py file."""
    from ds4py.kernels import cuda as K
    from ds4py.kernels import disk_cache

    class Codegen:                      # what _index_key asks of the target's code generator
        def magic_tuple(self):
            return ("nvptx64-nvidia-cuda", "sm_90", "")

    def build(cap):
        def kernel(out):
            out[0] = 1
        return K._jit_capped(cap)(kernel)

    kernels = [build(64), build(64), build(96), build(0)]
    for k in kernels:
        assert isinstance(k._cache, disk_cache.KernelCache), "the kernel is not disk-cached"
    keys = [k._cache._index_key("sig", Codegen()) for k in kernels]
    assert keys[0] == keys[1], "one kernel and one cap: one entry"
    assert len({keys[0], keys[2], keys[3]}) == 3, "a cap must change the key"
    assert all(("ds4py kernels", disk_cache.SOURCES_DIGEST) in key for key in keys)


def test_kernel_sources_digest_follows_every_source_file(tmp_path):
    from ds4py.kernels.digest import sources_digest
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    first = sources_digest(tmp_path)
    assert sources_digest(tmp_path) == first
    (tmp_path / "b.py").write_text("y = 3\n")
    assert sources_digest(tmp_path) != first
    (tmp_path / "b.py").write_text("y = 2\n")
    assert sources_digest(tmp_path) == first
    (tmp_path / "c.py").write_text("")
    assert sources_digest(tmp_path) != first


def test_dense_kernels_refuse_blocks_that_cannot_hold_whole_rows(monkeypatch):
    """_dense_split gives small matrices up to 8 warps per row: a block of fewer warps would hold
    0 rows and compute garbage (decode_ab with _NW_DENSE=4 changed the logits), so it raises."""
    from ds4py.kernels import cuda as K
    monkeypatch.setattr(K, "_NW_DENSE", 4)
    assert K._rows_per_block(2) == 2
    with pytest.raises(ValueError, match="_NW_DENSE"):
        K._rows_per_block(8)
