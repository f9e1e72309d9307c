"""The float64 reference forward of DeepSeek-V4-Flash, one token at a time: the oracle.

Plain numpy, one function per stage of ds4-model.md §6, no speed concerns. Weights are dequantized
with gguf-py to float64. Everything is float64 except where ds4's numerics change the result, which
this file models on purpose:

* activations are quantized before every Q8_0 / K-quant matvec (§5.1): Q8_0 blocks of 32 with an
  f32 scale, Q8_K blocks of 256 for routed experts; round-half-even, in f32 as ds4 does it;
* KV rows and compressed rows are rounded to f16 precision when stored (§5.2);
* the FP8 E4M3 / FP4 E2M1 / Hadamard quantization-aware simulations (§6.9);
* the 2^-14 floor of the expert-weight sum (§6.11).

The decode state is explicit (`RefState`): the raw window, the compressor states, the compressed
attention rows and the indexer rows of every layer.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from gguf.quants import dequantize

from ds4py.io.gguf import GGML_F16, GGML_F32, GGML_I32, GGML_Q8_0
from ds4py.io.sources import HostSource

NEG_INF = -1e30                 # ds4's mask value
EMPTY_WINDOW = -5e29            # "no candidate" threshold of the ratio-4 pooling
EXPERT_SUM_FLOOR = 2.0 ** -14   # 6.103515625e-5
FP8_MAX, FP8_AMAX_FLOOR, FP8_BLOCK = 448.0, 1e-4, 64
FP4_MAX, FP4_AMAX_FLOOR, FP4_BLOCK = 6.0, 7.052966104933725e-38, 32
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- weights -----------------------------------------------------------------------------------

class RefWeights:
    """Tensors from a weight source, dequantized to float64 (cached; the tiny model is small)."""

    def __init__(self, model, source=None):
        self.model = model
        self.source = source or HostSource(model)
        self._cache: dict[str, np.ndarray] = {}

    def ggml_type(self, name: str) -> int:
        return self.model.file.tensors[name].ggml_type

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def raw(self, name: str) -> np.ndarray:
        return self.source.host(name)

    def get(self, name: str) -> np.ndarray:
        """The whole tensor as float64, numpy row-major (rows = outputs)."""
        w = self._cache.get(name)
        if w is None:
            w = self._dequant(self.raw(name), self.ggml_type(name))
            self._cache[name] = w
        return w

    def get_f32(self, name: str) -> np.ndarray:
        """A large quantized tensor dequantized to f32 only (exact for Q8_0), cached."""
        key = name + "#f32"
        w = self._cache.get(key)
        if w is None:
            w = dequantize(np.ascontiguousarray(self.raw(name)), self.ggml_type(name))
            self._cache[key] = w
        return w

    def expert(self, name: str, e: int) -> np.ndarray:
        """One routed expert's matrix [rows, cols] as float64."""
        key = f"{name}#{e}"
        w = self._cache.get(key)
        if w is None:
            w = self._dequant(self.raw(name)[e], self.ggml_type(name))
            self._cache[key] = w
        return w

    @staticmethod
    def _dequant(raw: np.ndarray, ggml_type: int) -> np.ndarray:
        if ggml_type in (GGML_F32, GGML_F16, GGML_I32):
            return np.asarray(raw, dtype=np.float64)
        return dequantize(np.ascontiguousarray(raw), ggml_type).astype(np.float64)


# ---- activation quantization (§5.1) ----------------------------------------------------------

# Exact rounding ties are undecided by the math: whether a value lands on k+0.5 ± one ulp depends
# on f32 noise upstream (§5.3, §12.5; at position 0 the attention output is a scaled copy of an
# FP8-rounded row, so Q8 ties are everywhere). One flipped decision moves a layer's output by
# ~1e-3 relative, which the following layers amplify. For a tight comparison a harness can hand the
# reference the engine's side of each rounding decision (`TieHints`): where the reference's own
# float64 value is within `rel` (relative) of a rounding boundary it takes the engine's decision,
# and keeps its own values everywhere else. Without hints the reference rounds on its own.
_hints = None


class TieHints:
    """The engine's inputs to its activation quantizers (in call order) and the cache rows it
    stored, keyed (kind, layer) with kind in raw/comp/index, for one decoded token."""

    def __init__(self, q8_0=(), q8_k=(), rows=None, rel=1e-5):
        self.q8_0, self.q8_k = deque(q8_0), deque(q8_k)
        self.rows = dict(rows or {})
        self.rel = rel
        self.taken = 0            # decisions taken from the engine

    def __enter__(self):
        global _hints
        self._saved, _hints = _hints, self
        return self

    def __exit__(self, *exc):
        global _hints
        _hints = self._saved


def _q8_0_codes(xb: np.ndarray):
    """(q, d, 1/d) of ds4's Q8_0 activation quantizer on f32 blocks [n, 32]."""
    amax = np.abs(xb).max(axis=1, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    return np.clip(np.rint(xb * inv), -128, 127), d, inv


def _q8_k_codes(xb: np.ndarray):
    """(q, d, iscale) of ds4's Q8_K quantizer on f32 blocks [n, 256] (all-zero block: d = 0)."""
    signed_max = xb[np.arange(len(xb)), np.argmax(np.abs(xb), axis=1)][:, None]
    with np.errstate(divide="ignore"):
        iscale = np.where(signed_max != 0, np.float32(-127.0) / signed_max, np.float32(0.0)).astype(np.float32)
        d = np.where(iscale != 0, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)
    return np.clip(np.rint(iscale * xb), -128, 127), d, iscale


def _take_engine_ties(q, x, scale, hint_codes, rel):
    """q with the engine's codes where x·scale (float64) sits within 127·rel of a .5 boundary."""
    exact = np.asarray(x, dtype=np.float64).reshape(q.shape) * scale.astype(np.float64)
    near_tie = np.abs(np.abs(exact - np.floor(exact)) - 0.5) < 127 * rel
    take = near_tie & (hint_codes != q)
    if _hints is not None:
        _hints.taken += int(take.sum())
    return np.where(take, hint_codes, q)


def q8_0_activation(x: np.ndarray) -> np.ndarray:
    """x as ds4 feeds it to a Q8_0 dot: per 32-block d = amax/127 (f32), q = rint(x/d) clamped,
    in f32. Returned dequantized (d·q), so W·result equals ds4's integer dot."""
    xb = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    q, d, inv = _q8_0_codes(xb)
    if _hints is not None and _hints.q8_0:
        hint = np.asarray(_hints.q8_0.popleft(), dtype=np.float32).reshape(-1, 32)
        q = _take_engine_ties(q, x, inv, _q8_0_codes(hint)[0], _hints.rel)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(-1)


def q8_k_activation(x: np.ndarray, hinted: bool = False) -> np.ndarray:
    """x as ds4 feeds it to an IQ2_XXS / Q2_K dot: per 256-block, iscale = -127/max where max is the
    signed value of largest magnitude (first occurrence), q = rint(iscale·x), d = 1/iscale.
    `hinted`: the engine's input of this call is the next TieHints.q8_k entry."""
    xb = np.asarray(x, dtype=np.float32).reshape(-1, 256)
    q, d, iscale = _q8_k_codes(xb)
    if hinted and _hints is not None and _hints.q8_k:
        hint = np.asarray(_hints.q8_k.popleft(), dtype=np.float32).reshape(-1, 256)
        q = _take_engine_ties(q, x, iscale, _q8_k_codes(hint)[0], _hints.rel)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(-1)


def aligned_row(row: np.ndarray, pre: np.ndarray, rounding, key) -> np.ndarray:
    """A cache row `rounding(pre)`, with the engine's element where the reference's pre-rounding
    value is within rel of the boundary that separates the two (see TieHints): rel of the value
    (the row scaled, which also moves a block's FP8 scale), or, for an element whose two sides
    are neighbours, rel of the row's largest value (an f32 engine's error in an element is a
    fraction of the row's magnitude, not of the element's: a small element near an f16 boundary)."""
    if _hints is None or key not in _hints.rows:
        return row
    engine = np.asarray(_hints.rows[key], dtype=np.float64)
    up, down = rounding(pre * (1 + _hints.rel)), rounding(pre * (1 - _hints.rel))
    take = (row != engine) & ((up == engine) | (down == engine))
    window = _hints.rel * float(np.max(np.abs(pre), initial=0.0))
    for i in np.flatnonzero((row != engine) & ~take):
        boundary = (row[i] + engine[i]) / 2
        across = pre.copy()
        across[i] = 2 * boundary - pre[i]          # pre reflected across that boundary
        take[i] = abs(pre[i] - boundary) <= window and rounding(across)[i] == engine[i]
    _hints.taken += int(take.sum())
    return np.where(take, engine, row)


def matvec(w: RefWeights, name: str, x: np.ndarray) -> np.ndarray:
    """W·x with the activation quantized the way ds4 does for W's type (F16: no quantization)."""
    t = w.ggml_type(name)
    xin = q8_0_activation(x) if t == GGML_Q8_0 else np.asarray(x, dtype=np.float64)
    return w.get(name) @ xin


def f16_round(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


# ---- elementwise pieces --------------------------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x) + eps)
    return y if weight is None else y * weight


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def silu(z):
    return z * sigmoid(z)


def softplus(z: np.ndarray) -> np.ndarray:
    return np.where(z > 20, z, np.where(z < -20, np.exp(np.minimum(z, 20)), np.log1p(np.exp(np.minimum(z, 20)))))


# ---- quantization-aware simulations (§6.9) --------------------------------------------------------

def ceil_log2_pow(y: float) -> float:
    """2^ceil(log2(y)) for y > 0, exactly (frexp instead of a rounded log2)."""
    m, e = math.frexp(y)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def fp8_e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round |v| ≤ 448 to the nearest finite E4M3 value, ties to the even mantissa."""
    a = np.abs(v)
    exponent = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    # exact exponent: fix the rare log2 rounding at binade edges
    exponent = np.where(2.0 ** exponent > a, exponent - 1, exponent)
    exponent = np.where(2.0 ** (exponent + 1) <= a, exponent + 1, exponent)
    step = 2.0 ** (np.maximum(exponent, -6) - 3)     # 3 mantissa bits; subnormals below 2^-6
    return np.sign(v) * np.rint(a / step) * step


def fp8_e4m3_sim(x: np.ndarray) -> np.ndarray:
    out = np.array(x, dtype=np.float64)
    for b in range(0, len(out), FP8_BLOCK):
        block = out[b:b + FP8_BLOCK]
        s = ceil_log2_pow(max(np.abs(block).max(), FP8_AMAX_FLOOR) / FP8_MAX)
        out[b:b + FP8_BLOCK] = fp8_e4m3_round(np.clip(block / s, -FP8_MAX, FP8_MAX)) * s
    return out


def fp4_e2m1_round(v: np.ndarray) -> np.ndarray:
    """Nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} (by magnitude), ties to the even grid index."""
    a = np.abs(v)
    dist = np.abs(a[:, None] - FP4_GRID[None, :])
    best = dist.min(axis=1, keepdims=True)
    candidates = dist == best
    # among equally near grid points prefer an even index
    even = candidates & (np.arange(len(FP4_GRID)) % 2 == 0)[None, :]
    pick = np.where(even.any(axis=1), even.argmax(axis=1), candidates.argmax(axis=1))
    return np.sign(v) * FP4_GRID[pick]


def fp4_e2m1_sim(x: np.ndarray) -> np.ndarray:
    out = np.array(x, dtype=np.float64)
    for b in range(0, len(out), FP4_BLOCK):
        block = out[b:b + FP4_BLOCK]
        s = ceil_log2_pow(max(np.abs(block).max(), FP4_AMAX_FLOOR) / FP4_MAX)
        out[b:b + FP4_BLOCK] = fp4_e2m1_round(np.clip(block / s, -FP4_MAX, FP4_MAX)) * s
    return out


def hadamard(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard butterfly (strides 1, 2, …), then × 1/√n."""
    y = np.array(x, dtype=np.float64)
    n = len(y)
    stride = 1
    while stride < n:
        y = y.reshape(-1, 2, stride)
        y = np.stack([y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]], axis=1).reshape(-1)
        stride *= 2
    return y / math.sqrt(n)


def indexer_qat(x: np.ndarray) -> np.ndarray:
    return fp4_e2m1_sim(hadamard(x))


# ---- RoPE (§6.7) -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Rope:
    """The rotation of one layer kind: dense (ratio 0) or compressed (YaRN)."""

    n_rot: int
    base: float
    yarn: bool
    factor: float = 1.0
    ramp: tuple = ()

    @classmethod
    def for_layer(cls, spec, il: int) -> "Rope":
        if spec.ratio(il) == 0:
            return cls(spec.n_rot, spec.rope_freq_base, False)
        base, n = spec.compress_rope_freq_base, spec.n_rot

        def corr(beta):
            return n * math.log(spec.rope_orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))
        low = max(0, math.floor(corr(spec.yarn_beta_fast)))
        high = min(n - 1, math.ceil(corr(spec.yarn_beta_slow)))
        ramp = tuple(1 - min(max((k - low) / max(0.001, high - low), 0.0), 1.0) for k in range(n // 2))
        return cls(n, base, True, spec.rope_scale_factor, ramp)

    def angles(self, pos: int) -> np.ndarray:
        k = np.arange(self.n_rot // 2)
        theta = pos * self.base ** (-2.0 * k / self.n_rot)
        if self.yarn:
            ramp = np.array(self.ramp)
            theta = theta / self.factor * (1 - ramp) + theta * ramp
        return theta

    def apply(self, x: np.ndarray, pos: int, inverse: bool = False) -> np.ndarray:
        """Rotate the interleaved pairs of the last n_rot dims of each row of x [.., dim]."""
        theta = self.angles(pos)
        c, s = np.cos(theta), np.sin(theta) * (-1.0 if inverse else 1.0)
        y = np.array(x, dtype=np.float64)
        tail = y[..., -self.n_rot:]
        x0, x1 = tail[..., 0::2].copy(), tail[..., 1::2].copy()
        tail[..., 0::2] = x0 * c - x1 * s
        tail[..., 1::2] = x0 * s + x1 * c
        return y


# ---- state (§8) --------------------------------------------------------------------------------

@dataclass
class CompressorState:
    """kv_state / score_state: [coff·r rows × coff·d]; rows written per token, pooled every r."""

    ratio: int
    dim: int
    kv: np.ndarray
    score: np.ndarray

    @classmethod
    def new(cls, ratio: int, dim: int) -> "CompressorState":
        coff = 2 if ratio == 4 else 1
        return cls(ratio, dim, np.zeros((coff * ratio, coff * dim)), np.full((coff * ratio, coff * dim), NEG_INF))


@dataclass
class LayerState:
    raw: list = field(default_factory=list)            # (pos, row) of the last n_swa tokens
    comp: list = field(default_factory=list)           # compressed attention rows
    index: list = field(default_factory=list)          # compressed indexer rows
    attn_comp: CompressorState | None = None
    index_comp: CompressorState | None = None


@dataclass
class RefState:
    layers: list
    n_past: int = 0


# ---- the model -----------------------------------------------------------------------------

class Reference:
    """Decode-only float64 forward. `decode(token)` returns the float64 logits of that position."""

    def __init__(self, model, source=None):
        self.model = model
        self.spec = model.spec
        self.w = RefWeights(model, source)
        self.ropes = [Rope.for_layer(self.spec, il) for il in range(self.spec.n_layer)]
        self.reset()
        self.last_routing: dict[int, tuple] = {}      # il -> (expert ids, weights) of the last token

    def reset(self) -> None:
        s = self.spec
        layers = []
        for il in range(s.n_layer):
            st = LayerState()
            r = s.ratio(il)
            if r:
                st.attn_comp = CompressorState.new(r, s.head_dim)
            if r == 4:
                st.index_comp = CompressorState.new(4, s.idx_dim)
            layers.append(st)
        self.state = RefState(layers)

    @property
    def n_past(self) -> int:
        return self.state.n_past

    def decode(self, token: int, want_logits: bool = True) -> np.ndarray | None:
        s, w = self.spec, self.w
        pos = self.state.n_past
        X = embed(w, token, s.n_hc)
        for il in range(s.n_layer):
            X = self.attention_block(il, X, pos)
            X = self.ffn_block(il, X, token)
        self.state.n_past += 1
        return output_head(w, s, X) if want_logits else None

    # -- attention sublayer (§6.4) ----------------------------------------------------------------

    def attention_block(self, il: int, X: np.ndarray, pos: int) -> np.ndarray:
        s, w, p = self.spec, self.w, f"blk.{il}."
        st, rope, ratio = self.state.layers[il], self.ropes[il], s.ratio(il)
        y, post, comb = hc_pre(w, s, p + "hc_attn", X)
        x = rms_norm(y, w.get(p + "attn_norm.weight"), s.rms_eps)
        qr = matvec(w, p + "attn_q_a.weight", x)
        qrn = rms_norm(qr, w.get(p + "attn_q_a_norm.weight"), s.rms_eps)
        q = matvec(w, p + "attn_q_b.weight", qrn).reshape(s.n_head, s.head_dim)
        q = np.stack([rms_norm(qh, None, s.rms_eps) for qh in q])
        q = rope.apply(q, pos)
        kv = rms_norm(matvec(w, p + "attn_kv.weight", x), w.get(p + "attn_kv_a_norm.weight"), s.rms_eps)
        kv = rope.apply(kv, pos)

        def cache_rounding(v):     # FP8 on the nope dims, then f16 storage
            return f16_round(np.concatenate([fp8_e4m3_sim(v[:s.n_nope]), v[s.n_nope:]]))
        # order per token: raw row, attention compressor, indexer compressor, selection, attention
        st.raw.append(aligned_row(cache_rounding(kv), kv, cache_rounding, ("raw", il)))
        st.raw = st.raw[-s.n_swa:]
        if ratio:
            row = compressor_step(w, s, p + "attn_compressor", st.attn_comp, x, pos, rope, ("comp", il))
            if row is not None:
                st.comp.append(row)
        allowed = list(range(len(st.comp)))
        if ratio == 4:
            row = compressor_step(w, s, p + "indexer_compressor", st.index_comp, x, pos, rope, ("index", il))
            if row is not None:
                st.index.append(row)
            if len(st.index) > s.idx_topk:
                allowed = indexer_select(w, s, p, x, qrn, np.array(st.index), pos, rope)
        rows = np.array(st.raw + [st.comp[c] for c in allowed])
        o = sink_attention(q, rows, w.get(p + "attn_sinks.weight"), s.head_dim)
        o = rope.apply(o, pos, inverse=True)
        f = grouped_output(w, s, p, o)
        return hc_post(f, X, post, comb)

    # -- FFN sublayer (§6.11) --------------------------------------------------------------------

    def ffn_block(self, il: int, X: np.ndarray, token: int) -> np.ndarray:
        s, w, p = self.spec, self.w, f"blk.{il}."
        y, post, comb = hc_pre(w, s, p + "hc_ffn", X)
        x = rms_norm(y, w.get(p + "ffn_norm.weight"), s.rms_eps)
        expert_ids, expert_w = route(w, s, il, x, token)
        self.last_routing[il] = (expert_ids, expert_w)
        clamp = s.swiglu_clamp[il]
        f = routed_experts(w, p, x, expert_ids, expert_w, clamp) + shared_expert(w, p, x, clamp)
        return hc_post(f, X, post, comb)


# ---- stages ------------------------------------------------------------------------------------

def embed(w: RefWeights, token: int, n_hc: int) -> np.ndarray:
    """§6.1: the f16 embedding row copied into every HC stream: X [n_hc, n_embd]."""
    e = np.asarray(w.raw("token_embd.weight")[token], dtype=np.float64)
    return np.tile(e, (n_hc, 1))


def hc_pre(w: RefWeights, s, prefix: str, X: np.ndarray):
    """§6.2: mixer weights from the normalised flat state, Sinkhorn on the comb matrix, reduce."""
    n = s.n_hc
    flat = rms_norm(X.reshape(-1), None, s.rms_eps)
    mix = w.get(prefix + "_fn.weight") @ flat
    scale, base = w.get(prefix + "_scale.weight"), w.get(prefix + "_base.weight")
    pre = sigmoid(mix[:n] * scale[0] + base[:n]) + s.hc_eps
    post = 2.0 * sigmoid(mix[n:2 * n] * scale[1] + base[n:2 * n])
    comb = (mix[2 * n:] * scale[2] + base[2 * n:]).reshape(n, n)
    comb = sinkhorn(comb, s.n_sinkhorn, s.hc_eps)
    y = pre @ X
    return y, post, comb


def sinkhorn(logits: np.ndarray, n_iter: int, eps: float) -> np.ndarray:
    """Row softmax (+eps), a column pass, then n_iter-1 row+column passes."""
    c = np.exp(logits - logits.max(axis=1, keepdims=True))
    c = c / c.sum(axis=1, keepdims=True) + eps
    c = c / (c.sum(axis=0, keepdims=True) + eps)
    for _ in range(n_iter - 1):
        c = c / (c.sum(axis=1, keepdims=True) + eps)
        c = c / (c.sum(axis=0, keepdims=True) + eps)
    return c


def hc_post(f: np.ndarray, X: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """§6.3: X_new[j] = post[j]·f + Σ_i comb[i][j]·X[i]."""
    return post[:, None] * f[None, :] + comb.T @ X


def compressor_step(w: RefWeights, s, prefix: str, st: CompressorState, x: np.ndarray, pos: int,
                    rope: Rope, key: tuple):
    """§6.8: store this token's kv/score row; every r tokens pool one compressed row (else None).
    key = ("comp", il) for the attention lane, ("index", il) for the indexer lane."""
    r, d = st.ratio, st.dim
    kv_t = w.get(prefix + "_kv.weight") @ x
    sc_t = w.get(prefix + "_gate.weight") @ x + w.get(prefix + "_ape.weight")[pos % r]
    row = 4 + pos % 4 if r == 4 else pos % r
    st.kv[row], st.score[row] = kv_t, sc_t
    if (pos + 1) % r:
        return None
    if r == 4:
        # previous window through the first half of the columns, current through the second
        kv = np.concatenate([st.kv[:4, :d], st.kv[4:, d:]])
        sc = np.concatenate([st.score[:4, :d], st.score[4:, d:]])
    else:
        kv, sc = st.kv, st.score
    m = sc.max(axis=0)
    e = np.exp(sc - m)
    pooled = (e * kv).sum(axis=0) / e.sum(axis=0)
    pooled = np.where(m <= EMPTY_WINDOW, 0.0, pooled)
    c = rms_norm(pooled, w.get(prefix + "_norm.weight"), s.rms_eps)
    c = rope.apply(c, pos + 1 - r)

    def cache_rounding(v):        # attention lane: FP8 nope dims; indexer lane: Hadamard + FP4
        if key[0] == "comp":
            return f16_round(np.concatenate([fp8_e4m3_sim(v[:s.n_nope]), v[s.n_nope:]]))
        return f16_round(indexer_qat(v))
    if r == 4:
        st.kv[:4], st.score[:4] = st.kv[4:].copy(), st.score[4:].copy()
    return aligned_row(cache_rounding(c), c, cache_rounding, key)


def indexer_scores(w: RefWeights, s, p: str, x, qrn, index_rows, pos, rope) -> np.ndarray:
    """§6.10: score_c = Σ_h w_h·relu(row_c · q_h) with QAT'd, roped indexer queries."""
    iq = (w.get(p + "indexer.attn_q_b.weight") @ qrn).reshape(s.n_ihead, s.idx_dim)
    iq = rope.apply(iq, pos)
    iq = np.stack([indexer_qat(h) for h in iq])
    head_w = (w.get(p + "indexer.proj.weight") @ x) / math.sqrt(s.idx_dim * s.n_ihead)
    return np.maximum(index_rows @ iq.T, 0.0) @ head_w


def indexer_select(w, s, p, x, qrn, index_rows, pos, rope) -> list[int]:
    """The idx_topk best rows, ties to the lower index, in ascending row order."""
    scores = indexer_scores(w, s, p, x, qrn, index_rows, pos, rope)
    order = np.lexsort((np.arange(len(scores)), -scores))
    return sorted(order[:s.idx_topk].tolist())


def sink_attention(q: np.ndarray, rows: np.ndarray, sinks: np.ndarray, head_dim: int) -> np.ndarray:
    """§6.6: one shared K=V row set; the sink logit joins the softmax denominator only."""
    scores = q @ rows.T / math.sqrt(head_dim)                  # [n_head, n_rows]
    m = np.maximum(scores.max(axis=1), sinks)
    e = np.exp(scores - m[:, None])
    den = np.exp(sinks - m) + e.sum(axis=1)
    return (e @ rows) / den[:, None]


def grouped_output(w: RefWeights, s, p: str, o: np.ndarray) -> np.ndarray:
    """Grouped low-rank output: each group of heads through its own o_lora slice, then out_b."""
    heads_per_group = s.n_head // s.n_group
    wa = w.get(p + "attn_output_a.weight")
    low = []
    for g in range(s.n_group):
        og = o[g * heads_per_group:(g + 1) * heads_per_group].reshape(-1)
        low.append(wa[g * s.o_lora:(g + 1) * s.o_lora] @ q8_0_activation(og))
    return matvec(w, p + "attn_output_b.weight", np.concatenate(low))


def route(w: RefWeights, s, il: int, x: np.ndarray, token: int):
    """§6.11 router: sqrt-softplus probabilities; hash table or biased top-k picks the experts;
    the weights use the unbiased probabilities, normalised (floor 2^-14) and scaled."""
    p = f"blk.{il}."
    probs = np.sqrt(softplus(w.get(p + "ffn_gate_inp.weight") @ x))
    if il < s.n_hash:
        expert_ids = np.asarray(w.raw(p + "ffn_gate_tid2eid.weight")[token], dtype=np.int64)
    else:
        biased = probs + (w.get(p + "exp_probs_b.bias") if w.has(p + "exp_probs_b.bias") else 0.0)
        expert_ids = np.lexsort((np.arange(s.n_exp), -biased))[:s.n_used]
    sel = probs[expert_ids]
    if s.expert_weights_norm:
        sel = sel / max(sel.sum(), EXPERT_SUM_FLOOR)
    return expert_ids, sel * s.expert_weights_scale


def routed_experts(w: RefWeights, p: str, x, expert_ids, expert_w, clamp: float) -> np.ndarray:
    xq = q8_k_activation(x, hinted=True)
    out = np.zeros_like(x)
    for e, we in zip(expert_ids, expert_w):
        g = w.expert(p + "ffn_gate_exps.weight", int(e)) @ xq
        u = w.expert(p + "ffn_up_exps.weight", int(e)) @ xq
        mid = silu(np.minimum(g, clamp)) * np.clip(u, -clamp, clamp) * we
        out += w.expert(p + "ffn_down_exps.weight", int(e)) @ q8_k_activation(mid, hinted=True)
    return out


def shared_expert(w: RefWeights, p: str, x, clamp: float) -> np.ndarray:
    g = matvec(w, p + "ffn_gate_shexp.weight", x)
    u = matvec(w, p + "ffn_up_shexp.weight", x)
    return matvec(w, p + "ffn_down_shexp.weight", silu(np.minimum(g, clamp)) * np.clip(u, -clamp, clamp))


def output_head(w: RefWeights, s, X: np.ndarray) -> np.ndarray:
    """§6.12: HC collapse with sigmoid weights, RMSNorm, Q8_0 vocabulary projection."""
    flat = rms_norm(X.reshape(-1), None, s.rms_eps)
    pre = w.get("output_hc_fn.weight") @ flat
    a = sigmoid(pre * w.get("output_hc_scale.weight")[0] + w.get("output_hc_base.weight")) + s.hc_eps
    z = rms_norm(a @ X, w.get("output_norm.weight"), s.rms_eps)
    return output_logits(w, z)


def output_logits(w: RefWeights, z: np.ndarray) -> np.ndarray:
    """The vocabulary projection. Q8_0 weights are exact in f32 (f16 scale × int8), so the head is
    kept dequantized as f32 and multiplied in float64 slice by slice."""
    head = w.get_f32("output.weight")
    zq = q8_0_activation(z)
    out = np.empty(head.shape[0])
    step = 16384
    for start in range(0, head.shape[0], step):
        out[start:start + step] = head[start:start + step].astype(np.float64) @ zq
    return out
