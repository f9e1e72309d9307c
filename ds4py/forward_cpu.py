"""The CPU engine: DS4's forward in f32 on Numba kernels, prefill and decode (ds4-model.md §6–§8).

Layer-major, like ds4's CPU prefill (§7): a chunk of n tokens goes through layer 0, then layer 1,
and so on. Inside a layer the projections are batched (one matmul over the chunk, the same
per-token activation quantization as a matvec), and the cache push, the compressor steps, the
indexer selection and the attention run token by token in order, so a compressed row emitted at a
position is visible to that position's query. Decode is the same code with n = 1.

Weights come only through a weight source (`source.host(name)`): quantized tensors as raw GGUF
bytes, F16/F32 as typed views. The quantized matvecs, matmuls and routed experts are
kernels/cpu.py; everything else is kernels/cpu_ops.py.

State (per layer, f32, rows f16-rounded): the raw window (a ring of min(n_swa, n_ctx) rows), the
compressed attention rows (n_ctx/r + 2), the indexer rows (ratio 4: n_ctx/4 + 2) and the compressor
states. `snapshot()` / `restore()` copy all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.io.sources import HostSource
from ds4py.kernels import cpu, numerics
from ds4py.kernels import cpu_ops as ops

DEFAULT_PREFILL_CHUNK = 256     # tokens per layer-major pass (bounds activation memory)


# ---- RoPE parameters of a layer (§6.7) --------------------------------------------------------------

@dataclass(frozen=True)
class RopeParams:
    freqs: np.ndarray           # float64 [n_rot/2]: the angle per position of each pair (numerics)

    def rotate(self, x: np.ndarray, pos0: int, inverse: bool = False) -> None:
        """x [n, rows, dim]: token t at position pos0 + t; tail n_rot dims, in place."""
        ops.rope_tokens_inplace(x, pos0, self.freqs, inverse)


def rope_params(spec, il: int) -> RopeParams:
    """Dense layers: base rope_freq_base, no scaling. Compressed layers: the compressed base with
    YaRN (factor, beta_fast/slow, original context), no magnitude correction. The GPU engine's
    table (kernels/numerics.py)."""
    return RopeParams(numerics.rope_frequencies(spec, spec.ratio(il) != 0))


# ---- weights -----------------------------------------------------------------------------------------

class Weights:
    """Named tensors from a source: quantized/F16 matrices as the source lays them out (with their
    GGML type), small F32/F16 vectors converted once to f32."""

    def __init__(self, model, source):
        self.tensors = model.file.tensors
        self.source = source
        self._small: dict[str, np.ndarray] = {}
        self._mats: dict[str, tuple[np.ndarray, int]] = {}

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def mat(self, name: str) -> tuple[np.ndarray, int]:
        """(raw GGUF bytes as uint8 rows, GGML type): what kernels/cpu.py takes for every type.
        The view is made once per tensor (the host source maps the file in place)."""
        mat = self._mats.get(name)
        if mat is None:
            data = self.source.host(name)
            if data.dtype != np.uint8:
                data = data.view(np.uint8)      # F16/F32 rows: the same bytes, untyped
            mat = self._mats[name] = (data, self.tensors[name].ggml_type)
        return mat

    def vec(self, name: str) -> np.ndarray:
        """A small tensor (norm, HC scale/base, sinks, bias, ape) or an HC mixer matrix (hc_*_fn:
        cpu_ops.hc_mix_rows sums it in f64; 1.5 MB a site at ds4's shapes) as contiguous f32."""
        v = self._small.get(name)
        if v is None:
            v = np.ascontiguousarray(self.source.host(name), dtype=np.float32)
            self._small[name] = v
        return v

    def ids(self, name: str) -> np.ndarray:
        return self.source.host(name)


def mm(w: tuple[np.ndarray, int], x: np.ndarray, order_rows: int | None = None) -> np.ndarray:
    """x [n, K] -> [n, rows]: a matvec for one token, a matmul for a chunk (identical rows).
    order_rows: the rows of the GPU engine's launch for this matrix (cpu.matmul)."""
    data, ggml_type = w
    if x.shape[0] == 1:
        return cpu.matvec(data, ggml_type, np.ascontiguousarray(x[0]), order_rows)[None, :]
    return cpu.matmul(data, ggml_type, np.ascontiguousarray(x), order_rows)


def pair_rows(w_a: tuple[np.ndarray, int], w_b: tuple[np.ndarray, int]) -> int | None:
    """order_rows of two matrices of one input: the GPU engine launches such a pair as one matrix
    when their type and row length agree (forward_cuda's _proj_pair), which sets their sum order."""
    together = w_a[1] == w_b[1] and w_a[0].shape[1] == w_b[0].shape[1]
    return w_a[0].shape[0] + w_b[0].shape[0] if together else None


def mm_pair(w_a: tuple[np.ndarray, int], w_b: tuple[np.ndarray, int], x: np.ndarray):
    """mm of a pair of matrices of one input, in the GPU's pair order (pair_rows)."""
    rows = pair_rows(w_a, w_b)
    return mm(w_a, x, rows), mm(w_b, x, rows)


# ---- state -----------------------------------------------------------------------------------------

class CompressorLane:
    """One compressor (attention lane d = head_dim, or indexer lane d = idx_dim) and its rows."""

    def __init__(self, ratio: int, dim: int, capacity: int):
        coff = 2 if ratio == 4 else 1
        self.ratio, self.dim = ratio, dim
        self.kv_state = np.zeros((coff * ratio, coff * dim), dtype=np.float32)
        self.score_state = np.full((coff * ratio, coff * dim), ops.NEG_INF, dtype=np.float32)
        self.rows = np.zeros((capacity, dim), dtype=np.float32)
        self.n_rows = 0


class LayerCache:
    def __init__(self, spec, il: int, n_ctx: int):
        r = spec.ratio(il)
        self.raw = np.zeros((min(spec.n_swa, n_ctx), spec.head_dim), dtype=np.float32)
        self.attn = CompressorLane(r, spec.head_dim, spec.compressed_rows(n_ctx, r)) if r else None
        self.index = CompressorLane(4, spec.idx_dim, spec.compressed_rows(n_ctx, 4)) if r == 4 else None
        self.no_rows = np.zeros((0, spec.head_dim), dtype=np.float32)


@dataclass
class KvSnapshot:
    """A copy of the whole decode state at n_past tokens."""

    n_past: int
    layers: list


# ---- the engine ------------------------------------------------------------------------------------

class CpuEngine:
    """DS4 on the CPU. `prefill(tokens)` and `decode(token)` return the f32 logits of the last token."""

    def __init__(self, model, source=None, n_ctx: int = 4096, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.model = model
        self.spec = s = model.spec
        self.source = source or HostSource(model)
        self.w = Weights(model, self.source)
        self.n_ctx = int(n_ctx)
        if self.n_ctx < 1:
            raise Ds4Error(f"--ctx must be at least 1, not {n_ctx}")
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.ropes = [rope_params(s, il) for il in range(s.n_layer)]
        self.attn_scale = np.float32(1.0 / math.sqrt(s.head_dim))
        self.index_scale = np.float32(1.0 / math.sqrt(s.idx_dim * s.n_ihead))
        self.last_routing: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # il -> (ids, weights), last token
        self.reset()

    # -- public API --------------------------------------------------------------------------------

    def reset(self) -> None:
        self.layers = [LayerCache(self.spec, il, self.n_ctx) for il in range(self.spec.n_layer)]
        self.n_past = 0

    def prefill(self, tokens) -> np.ndarray:
        """Evaluate a prompt chunk after the current state; the logits of its last token."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("prefill needs at least one token")
        logits = None
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[start:start + self.prefill_chunk]
            logits = self._forward(chunk, want_logits=start + len(chunk) == len(tokens))
        return logits

    def decode(self, token: int) -> np.ndarray:
        return self._forward([int(token)], want_logits=True)

    WARM_TOKENS = 8     # a warm-up chunk: two ratio-4 compressor rows, every kernel's types

    def warm_up(self) -> None:
        """Compile (or load from numba's disk cache) the kernels of a prefill chunk and a decode
        step before anything is timed, then put the state back: the bench's first frontier would
        otherwise include ~50 s of compiling on a fresh machine. Numba compiles per argument
        type, not per length, so a short chunk covers a long one. The indexer's scoring runs only
        once a lane holds more than idx_topk rows, so a second chunk starts where it would (the
        state in between is garbage: restore() overwrites it)."""
        if self.n_ctx <= self.WARM_TOKENS:
            return
        saved = self.snapshot()        # (the host source counts nothing per read)
        self.prefill([0] * self.WARM_TOKENS)
        selecting_from = self.spec.indexer_selects_from
        if selecting_from + self.WARM_TOKENS + 1 <= self.n_ctx:
            self.n_past = selecting_from
            for cache in self.layers:
                if cache.index is not None:
                    cache.index.n_rows = self.spec.idx_topk + 1
            self.prefill([0] * self.WARM_TOKENS)
        self.decode(0)
        self.restore(saved)

    def snapshot(self) -> KvSnapshot:
        """A copy of the state: raw windows, compressor states and the rows emitted so far
        (only the used rows, so a snapshot costs what the context holds, not what --ctx reserves)."""
        layers = []
        for cache in self.layers:
            lanes = [None if lane is None else (lane.kv_state.copy(), lane.score_state.copy(),
                                                lane.rows[:lane.n_rows].copy())
                     for lane in (cache.attn, cache.index)]
            layers.append((cache.raw.copy(), lanes))
        return KvSnapshot(self.n_past, layers)

    def restore(self, snap: KvSnapshot) -> None:
        """Return to a snapshot taken from this engine (same model and --ctx)."""
        for cache, (raw, lanes) in zip(self.layers, snap.layers):
            cache.raw[:] = raw
            for lane, saved in zip((cache.attn, cache.index), lanes):
                if lane is not None:
                    lane.kv_state[:], lane.score_state[:] = saved[0], saved[1]
                    lane.rows[:len(saved[2])] = saved[2]
                    lane.n_rows = len(saved[2])
        self.n_past = snap.n_past

    # -- the forward ---------------------------------------------------------------------------------

    def _forward(self, tokens: list[int], want_logits: bool) -> np.ndarray | None:
        s = self.spec
        n, pos0 = len(tokens), self.n_past
        if pos0 + n > self.n_ctx:
            raise Ds4Error(f"context full: {pos0} + {n} tokens exceed --ctx {self.n_ctx}")
        for t in tokens:
            if not 0 <= t < s.n_vocab:
                raise Ds4Error(f"token id {t} is outside the vocabulary [0, {s.n_vocab})")
        X = self._embed(tokens)
        for il in range(s.n_layer):
            X = self._attention(il, X, pos0)
            X = self._ffn(il, X, tokens)
        self.n_past += n
        return self._output_head(X[-1:])[0] if want_logits else None

    def _embed(self, tokens: list[int]) -> np.ndarray:
        """§6.1: every HC stream starts as the token's f16 embedding: X [n, n_hc, n_embd]."""
        emb = self.w.ids("token_embd.weight")
        rows = np.asarray(emb[np.asarray(tokens)], dtype=np.float32)
        return np.ascontiguousarray(np.repeat(rows[:, None, :], self.spec.n_hc, axis=1))

    def _hc_pre(self, prefix: str, X: np.ndarray, norm_name: str):
        """§6.2: (the sublayer's normed input x [n, n_embd], post [n, n_hc], comb [n, n_hc, n_hc])."""
        s, w = self.spec, self.w
        mix = ops.hc_mix_rows(X, w.vec(prefix + "_fn.weight"), s.rms_eps)
        pre, post, comb = ops.hc_gates_rows(mix, w.vec(prefix + "_scale.weight"), w.vec(prefix + "_base.weight"),
                                            s.n_hc, s.n_sinkhorn, np.float32(s.hc_eps))
        return ops.hc_collapse_norm_rows(pre, X, w.vec(norm_name), s.rms_eps), post, comb

    # -- attention (§6.4–6.10) ---------------------------------------------------------------------

    def _attention(self, il: int, X: np.ndarray, pos0: int) -> np.ndarray:
        s, w, p = self.spec, self.w, f"blk.{il}."
        n, ratio, rope, cache = X.shape[0], s.ratio(il), self.ropes[il], self.layers[il]
        x, post, comb = self._hc_pre(p + "hc_attn", X, p + "attn_norm.weight")
        q_a_kv = pair_rows(w.mat(p + "attn_q_a.weight"), w.mat(p + "attn_kv.weight"))
        qrn = ops.rms_norm_rows(mm(w.mat(p + "attn_q_a.weight"), x, q_a_kv), w.vec(p + "attn_q_a_norm.weight"),
                                s.rms_eps)
        q = mm(w.mat(p + "attn_q_b.weight"), qrn).reshape(n, s.n_head, s.head_dim)
        ops.rms_norm_heads_inplace(q, s.rms_eps)
        rope.rotate(q, pos0)
        kv = ops.rms_norm_rows(mm(w.mat(p + "attn_kv.weight"), x, q_a_kv), w.vec(p + "attn_kv_a_norm.weight"),
                               s.rms_eps)
        rope.rotate(kv.reshape(n, 1, s.head_dim), pos0)
        for t in range(n):
            ops.fp8_e4m3_sim_inplace(kv[t], s.n_nope)
        ops.f16_round_inplace(kv)

        # batched inputs of the per-token steps
        if ratio:
            attn_kv, attn_sc = mm_pair(w.mat(p + "attn_compressor_kv.weight"), w.mat(p + "attn_compressor_gate.weight"), x)
        if ratio == 4:
            idx_kv, idx_sc = mm_pair(w.mat(p + "indexer_compressor_kv.weight"),
                                     w.mat(p + "indexer_compressor_gate.weight"), x)
            iq = mm(w.mat(p + "indexer.attn_q_b.weight"), qrn).reshape(n, s.n_ihead, s.idx_dim)
            rope.rotate(iq, pos0)
            for t in range(n):
                ops.indexer_qat_rows(iq[t])
            head_w = mm(w.mat(p + "indexer.proj.weight"), x) * self.index_scale

        # per token, in order: raw row, attention compressor, indexer compressor, selection, attention
        sinks = w.vec(p + "attn_sinks.weight")
        o = np.empty((n, s.n_head, s.head_dim), dtype=np.float32)
        cap = cache.raw.shape[0]
        for t in range(n):
            pos = pos0 + t
            cache.raw[pos % cap] = kv[t]
            comp_rows, comp_ids = cache.no_rows, np.zeros(0, dtype=np.int64)
            if ratio:
                self._compress(p + "attn_compressor", cache.attn, attn_kv[t], attn_sc[t], pos, rope, "attn")
                comp_rows, comp_ids = cache.attn.rows, np.arange(cache.attn.n_rows)
            if ratio == 4:
                self._compress(p + "indexer_compressor", cache.index, idx_kv[t], idx_sc[t], pos, rope, "index")
                if cache.index.n_rows > s.idx_topk:
                    scores = ops.indexer_scores(cache.index.rows, cache.index.n_rows, iq[t], head_w[t])
                    comp_ids = np.sort(ops.topk_desc(scores, s.idx_topk))
            n_raw = min(pos + 1, cap)
            o[t] = ops.sink_attention(q[t], cache.raw, (pos + 1 - n_raw) % cap, n_raw,
                                      comp_rows, comp_ids, sinks, self.attn_scale)
        rope.rotate(o, pos0, inverse=True)
        f = self._grouped_output(p, o)
        return ops.hc_post_rows(f, X, post, comb)

    def _compress(self, prefix: str, lane: CompressorLane, kv_t, sc_t, pos: int, rope: RopeParams, kind: str) -> None:
        """§6.8: store the token's row; every r tokens pool, norm, rope, QAT, f16-round, push."""
        s, r = self.spec, lane.ratio
        ape = self.w.vec(prefix + "_ape.weight")
        ops.compressor_store(lane.kv_state, lane.score_state, kv_t, sc_t, ape[pos % r], r, pos)
        if (pos + 1) % r:
            return
        pooled = ops.compressor_pool(lane.kv_state, lane.score_state, r, lane.dim)
        lane.rows[lane.n_rows] = ops.compressed_row(pooled, self.w.vec(prefix + "_norm.weight"), s.rms_eps,
                                                    pos + 1 - r, rope.freqs, kind == "index", s.n_nope)
        lane.n_rows += 1
        if r == 4:
            ops.compressor_shift(lane.kv_state, lane.score_state)

    def _grouped_output(self, p: str, o: np.ndarray) -> np.ndarray:
        """Each group of n_head/n_group heads through its own o_lora rows of attn_output_a, then
        attn_output_b over the concatenated low-rank outputs."""
        s, n = self.spec, o.shape[0]
        data, ggml_type = self.w.mat(p + "attn_output_a.weight")
        grouped = o.reshape(n, s.n_group, -1)
        low = np.empty((n, s.n_group * s.o_lora), dtype=np.float32)
        for g in range(s.n_group):
            rows = (data[g * s.o_lora:(g + 1) * s.o_lora], ggml_type)
            # the GPU launches all groups as one matrix of n_group·o_lora rows
            low[:, g * s.o_lora:(g + 1) * s.o_lora] = mm(rows, np.ascontiguousarray(grouped[:, g]),
                                                         s.n_group * s.o_lora)
        return mm(self.w.mat(p + "attn_output_b.weight"), low)

    # -- FFN (§6.11) -----------------------------------------------------------------------------

    def _ffn(self, il: int, X: np.ndarray, tokens: list[int]) -> np.ndarray:
        s, w, p = self.spec, self.w, f"blk.{il}."
        x, post, comb = self._hc_pre(p + "hc_ffn", X, p + "ffn_norm.weight")
        expert_ids, expert_w = self._route(il, x, tokens)
        clamp = float(s.swiglu_clamp[il])
        gate, up, down = (w.mat(p + name) for name in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
        routed = cpu.moe_batch(gate[0], up[0], down[0], gate[1], down[1], x, expert_ids, expert_w, clamp)
        g, u = mm_pair(w.mat(p + "ffn_gate_shexp.weight"), w.mat(p + "ffn_up_shexp.weight"), x)
        shared = mm(w.mat(p + "ffn_down_shexp.weight"), ops.swiglu_clamped_rows(g, u, clamp))
        return ops.hc_post_rows(routed + shared, X, post, comb)

    def _route(self, il: int, x: np.ndarray, tokens: list[int]):
        """Expert ids [n, n_used] and weights [n, n_used]: hash table (il < n_hash) or biased top-k;
        weights from the unbiased probabilities."""
        s, w, p = self.spec, self.w, f"blk.{il}."
        logits = mm(w.mat(p + "ffn_gate_inp.weight"), x)
        bias_name = p + "exp_probs_b.bias"
        bias = w.vec(bias_name) if w.has(bias_name) else np.zeros(0, dtype=np.float32)
        ids = np.empty((len(tokens), s.n_used), dtype=np.int32)
        weights = np.empty((len(tokens), s.n_used), dtype=np.float32)
        for t, token in enumerate(tokens):
            if il < s.n_hash:
                ids[t] = w.ids(p + "ffn_gate_tid2eid.weight")[token]
            else:
                ids[t] = ops.router_topk(logits[t], bias, s.n_used)
            weights[t] = ops.router_weights(logits[t], ids[t], s.expert_weights_scale, s.expert_weights_norm)
        self.last_routing[il] = (ids[-1].copy(), weights[-1].copy())
        return ids, weights

    # -- output head (§6.12) ---------------------------------------------------------------------------

    def _output_head(self, X: np.ndarray) -> np.ndarray:
        s, w = self.spec, self.w
        mix = ops.hc_mix_rows(X, w.vec("output_hc_fn.weight"), s.rms_eps)
        a = ops.hc_head_weights(mix, w.vec("output_hc_scale.weight")[0], w.vec("output_hc_base.weight"),
                                np.float32(s.hc_eps))
        z = ops.hc_collapse_norm_rows(a, X, w.vec("output_norm.weight"), s.rms_eps)
        return mm(w.mat("output.weight"), z)
