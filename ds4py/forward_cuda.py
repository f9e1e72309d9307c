"""The DS4 forward on an NVIDIA GPU: device state, one decode step as a captured CUDA graph.

The decode step is the sequence of ds4-model.md §6 written as kernel launches on one stream. Every
per-token value (the token id, the position) lives in a device buffer, so the whole step is
captured once and replayed per token. When routed experts come through an expert cache (page-cache
and streaming sources) the step is cut at each router: the host reads the 6 selected ids, the
source makes those experts resident, and the next piece of the graph runs.

The engine never learns where weight bytes live: it asks the weight source for (arena, offset)
pairs and for the byte offsets of the selected experts.
"""

from __future__ import annotations

import math

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.io.gguf import GGML_F16, GGML_Q8_0
from ds4py.kernels import compat  # noqa: F401
from ds4py.kernels import cuda_ops as ops
from ds4py.kernels.graph import CapturedGraph
from numba import cuda
from numba.cuda import config as numba_config

if numba_config.ENABLE_CUDASIM:
    qk = None      # the quantized kernels need a real GPU (dp4a); simulator tests swap in host versions
else:
    from ds4py.kernels import cuda as qk

BLOCK = ops.BLOCK


def rope_freqs(spec, compressed: bool) -> np.ndarray:
    """Per pair k the angle per position (θ = pos·freq[k]); YaRN blend on compressed layers
    (ds4-model.md §6.7), computed in float64 and stored as f32."""
    half = spec.n_rot // 2
    k = np.arange(half, dtype=np.float64)
    if not compressed:
        return (spec.rope_freq_base ** (-2.0 * k / spec.n_rot)).astype(np.float32)
    base = spec.compress_rope_freq_base
    freq = base ** (-2.0 * k / spec.n_rot)

    def corr(beta):
        return spec.n_rot * math.log(spec.rope_orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))
    low = max(0, math.floor(corr(spec.yarn_beta_fast)))
    high = min(spec.n_rot - 1, math.ceil(corr(spec.yarn_beta_slow)))
    ramp = 1.0 - np.clip((k - low) / max(0.001, high - low), 0.0, 1.0)
    return (freq / spec.rope_scale_factor * (1 - ramp) + freq * ramp).astype(np.float32)


class LayerState:
    """KV state of one layer on the device: raw ring, compressor lanes, compressed rows."""

    def __init__(self, spec, il: int, n_ctx: int, raw_cap: int):
        self.ratio = r = spec.ratio(il)
        self.raw = cuda.device_array((raw_cap, spec.head_dim), np.float32)
        self.comp = self.kv_state = self.score_state = None
        self.icomp = self.ikv_state = self.iscore_state = None
        if r:
            coff = 2 if r == 4 else 1
            self.comp = cuda.device_array((n_ctx // r + 2, spec.head_dim), np.float32)
            self.kv_state = cuda.device_array((coff * r, coff * spec.head_dim), np.float32)
            self.score_state = cuda.device_array((coff * r, coff * spec.head_dim), np.float32)
        if r == 4:
            self.icomp = cuda.device_array((n_ctx // 4 + 2, spec.idx_dim), np.float32)
            self.ikv_state = cuda.device_array((8, 2 * spec.idx_dim), np.float32)
            self.iscore_state = cuda.device_array((8, 2 * spec.idx_dim), np.float32)

    def arrays(self):
        return [a for a in (self.raw, self.comp, self.kv_state, self.score_state, self.icomp,
                            self.ikv_state, self.iscore_state) if a is not None]

    def reset(self, stream) -> None:
        for a in self.arrays():
            fill = ops.NEG_INF if a is self.score_state or a is self.iscore_state else 0.0
            fill_device(a, fill, stream)


def fill_device(array, value, stream) -> None:
    host = np.full(array.shape, value, dtype=array.dtype)
    array.copy_to_device(host, stream=stream)


class Scratch:
    """Every activation buffer of one decode step, allocated once (graphs bake addresses in)."""

    def __init__(self, spec, max_rows: int):
        f32, i8, i32 = np.float32, np.int8, np.int32
        d = cuda.device_array
        s = spec
        q_dim = s.n_head * s.head_dim
        self.state = d((s.n_hc, s.n_embd), f32)
        self.hc_chunk = ops.hc_chunk(s.n_embd)
        n_chunks = s.n_hc * s.n_embd // self.hc_chunk
        assert n_chunks <= 32, "hc_mix_values adds at most 32 chunk partials (one warp)"
        self.part_dot = d((s.hc_mix, n_chunks), f32)
        self.part_sq = d(n_chunks, np.float64)
        self.post = d(s.n_hc, f32)
        self.comb = d(s.n_hc * s.n_hc, f32)
        self.x, self.xq, self.xd = d(s.n_embd, f32), d(s.n_embd, i8), d(s.n_embd // 32, f32)
        # outputs of two projections launched together are halves of one buffer
        self.qr_kv = d(s.q_lora + s.head_dim, f32)
        self.qr, self.kv = self.qr_kv[:s.q_lora], self.qr_kv[s.q_lora:]
        self.qrn, self.qrn_q, self.qrn_d = d(s.q_lora, f32), d(s.q_lora, i8), d(s.q_lora // 32, f32)
        self.q = d(q_dim, f32)
        self.comp_pair = d(4 * s.head_dim, f32)      # a compressor's kv and gate projections
        self.icomp_pair = d(4 * s.idx_dim, f32)
        self.iq = d(s.n_ihead * s.idx_dim, f32)
        self.head_w = d(s.n_ihead, f32)
        self.scores = d(max_rows, f32)
        self.selected = d(s.idx_topk, i32)
        self.n_selected = d(1, i32)
        self.attn = d(q_dim, f32)
        self.part_max = d((s.n_head, ops.ATTN_SPLITS), f32)
        self.part_den = d((s.n_head, ops.ATTN_SPLITS), f32)
        self.part_acc = d((s.n_head, ops.ATTN_SPLITS, s.head_dim), f32)
        self.attn_q, self.attn_d = d(q_dim, i8), d(q_dim // 32, f32)
        self.low = d(s.n_group * s.o_lora, f32)
        self.low_q, self.low_d = d(s.n_group * s.o_lora, i8), d(s.n_group * s.o_lora // 32, f32)
        self.f_attn = d(s.n_embd, f32)
        self.zeros = cuda.to_device(np.zeros(s.n_embd, f32))
        self.router = d(s.n_exp, f32)
        self.expert_ids = d(s.n_used, i32)
        self.route_w = d(s.n_used, f32)
        self.slot_offsets = d((s.n_used, 3), np.int64)
        self.moe_out = d(s.n_embd, f32)
        self.sh_gate_up = d(2 * s.n_ff, f32)
        self.sh_gate, self.sh_up = self.sh_gate_up[:s.n_ff], self.sh_gate_up[s.n_ff:]
        self.sh_mid, self.sh_q, self.sh_d = d(s.n_ff, f32), d(s.n_ff, i8), d(s.n_ff // 32, f32)
        self.sh_out = d(s.n_embd, f32)
        self.logits = d(s.n_vocab, f32)
        self.next_token = d(1, i32)
        self.argmax_val, self.argmax_idx = d(ops.ARGMAX_BLOCKS, f32), d(ops.ARGMAX_BLOCKS, i32)
        self.forbid = cuda.to_device(np.full(1, -1, i32))
        self.pos = cuda.to_device(np.zeros(1, i32))
        self.token = cuda.to_device(np.zeros(1, i32))
        self.moe_work = qk.MoEWorkspace(s.n_used, s.n_embd, s.n_ff)


class CudaEngine:
    """prefill(tokens) / decode(token) on the GPU, with the same interface as the CPU engine."""

    def __init__(self, model, source, n_ctx: int):
        self.model, self.source, self.spec = model, source, model.spec
        s = self.spec
        self.n_ctx = n_ctx
        most_rows = s.n_swa + max([n_ctx // r for r in s.compress_ratios if r > 4] + [s.idx_topk])
        if most_rows > ops.ATTN_MAX_ROWS:
            raise Ds4Error(f"--ctx {n_ctx} gives up to {most_rows} attention rows per head; the GPU attention "
                           f"kernel allows {ops.ATTN_MAX_ROWS}: lower --ctx")
        if s.head_dim > ops.ATTN_MAX_DIM or s.head_dim % 2:
            raise Ds4Error(f"head_dim {s.head_dim}: the GPU attention kernel handles even sizes up to {ops.ATTN_MAX_DIM}")
        self.stream = cuda.stream()
        self.arena = source.arena
        self.w16 = self.arena.view(np.float16)
        self.w32 = self.arena.view(np.float32)
        self.i32 = self.arena.view(np.int32)
        self.freqs_dense = cuda.to_device(rope_freqs(s, False))
        self.freqs_comp = cuda.to_device(rope_freqs(s, True))
        self.layers = [LayerState(s, il, n_ctx, s.n_swa) for il in range(s.n_layer)]
        self.buf = Scratch(s, n_ctx // 4 + 2)
        # Experts resident in the arena (device / host-mapped sources): the router kernel computes
        # their offsets on the device. Otherwise the host fetches them into the expert cache.
        self.experts_resident = source.expert_base(0) is not None
        self._zero_bases = cuda.to_device(np.zeros(6, np.int64))     # router offsets unused: cache path
        self.expert_bases = [cuda.to_device(np.asarray(tuple(source.expert_base(il)), dtype=np.int64))
                             if self.experts_resident else None for il in range(s.n_layer)]
        self._n_past = 0
        self._forbid = -1
        self.skip: set[str] = set()
        self._graphs = None
        self.use_graphs = not numba_config.ENABLE_CUDASIM
        self.reset()

    # ---- weights ------------------------------------------------------------------------------

    def off(self, name: str) -> int:
        """Byte offset of a dense tensor in the arena."""
        return self.source.dense(name)[1]

    def off16(self, name: str) -> int:
        return self.off(name) // 2

    def off32(self, name: str) -> int:
        return self.off(name) // 4

    def info(self, name: str):
        return self.model.file.tensors[name]

    # ---- state ----------------------------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return self._n_past

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset(self.stream)
        self._n_past = 0
        self.stream.synchronize()

    def snapshot(self):
        self.stream.synchronize()
        return self._n_past, [[a.copy_to_host() for a in layer.arrays()] for layer in self.layers]

    def restore(self, snap) -> None:
        n_past, arrays = snap
        for layer, saved in zip(self.layers, arrays):
            for a, host in zip(layer.arrays(), saved):
                a.copy_to_device(host, stream=self.stream)
        self._n_past = n_past
        self.stream.synchronize()

    # ---- one decode step as launches -------------------------------------------------------------

    def _matvec(self, name: str, x_f32, xq, xd, out, x_offset: int = 0, rows=None, row0: int = 0):
        """out = W[name] · x with ds4's numerics for W's type (Q8_0 on xq/xd, F16 on x_f32)."""
        info = self.info(name)
        k = info.ne[0]
        n_rows = rows if rows is not None else info.ne[1]
        off = self.off(name) + row0 * info.row_bytes
        if info.ggml_type == GGML_Q8_0:
            qk.matvec_q8_0(self.arena, off, n_rows, k, xq[x_offset:x_offset + k],
                           xd[x_offset // 32:(x_offset + k) // 32], out, self.stream)
        elif info.ggml_type == GGML_F16:
            qk.matvec_f16(self.arena, off, n_rows, k, x_f32[x_offset:x_offset + k], out, self.stream)
        else:
            raise ValueError(f"{name}: no matvec for type {info.type_name}")

    def _matvec_pair(self, name_a: str, name_b: str, x_f32, xq, xd, out):
        """out = concat(W[name_a] · x, W[name_b] · x): one launch when both have the same type and
        row length (the usual case), two otherwise."""
        a, b = self.info(name_a), self.info(name_b)
        rows_a, rows_b = a.ne[1], b.ne[1]
        if a.ggml_type == b.ggml_type and a.ne[0] == b.ne[0] and a.ggml_type in (GGML_Q8_0, GGML_F16):
            if a.ggml_type == GGML_Q8_0:
                qk.matvec_q8_0_pair(self.arena, self.off(name_a), rows_a, self.off(name_b), rows_b, a.ne[0],
                                    xq, xd, out, self.stream)
            else:
                qk.matvec_f16_pair(self.arena, self.off(name_a), rows_a, self.off(name_b), rows_b, a.ne[0],
                                   x_f32, out, self.stream)
            return
        self._matvec(name_a, x_f32, xq, xd, out[:rows_a])
        self._matvec(name_b, x_f32, xq, xd, out[rows_a:rows_a + rows_b])

    def _hc_pre(self, prefix: str, sub: str, norm_name: str):
        """Sublayer input from the HC state: the mixer's partial dots, then hc_pre."""
        s, b, st = self.spec, self.buf, self.stream
        self._hc_mix(self.off16(f"{prefix}hc_{sub}_fn.weight"), s.hc_mix)
        ops.hc_pre[2, ops.wide_block(), st](b.state, b.part_dot[:s.hc_mix], b.part_sq, self.w32, self.off32(f"{prefix}hc_{sub}_scale.weight"),
                                 self.off32(f"{prefix}hc_{sub}_base.weight"), self.off32(norm_name),
                                 s.n_sinkhorn, s.hc_eps, s.rms_eps, b.post, b.comb, b.x, b.xq, b.xd)

    def _hc_mix(self, fn_off16: int, n_rows: int):
        """mix = fn · RMS-normalised flat state, as partial dots over chunks of the flat state; the
        consumer (hc_pre, hc_head) adds the partials."""
        b, st = self.buf, self.stream
        n_chunks = b.part_dot.shape[1]
        ops.hc_mix_partial[(n_rows, n_chunks), BLOCK, st](b.state, self.w16, fn_off16, b.hc_chunk,
                                                          b.part_dot[:n_rows], b.part_sq)

    def _attention(self, il: int):
        s, b, st, layer = self.spec, self.buf, self.stream, self.layers[il]
        p = f"blk.{il}."
        ratio = layer.ratio
        freqs = self.freqs_comp if ratio else self.freqs_dense
        if self._on("hc"):
            self._hc_pre(p, "attn", p + "attn_norm.weight")
        if self._on("attn_proj"):
            self._attn_proj(il, freqs)
        if ratio and self._on("compress"):
            self._compressor(p + "attn_compressor", ratio, s.head_dim, freqs, b.comp_pair,
                             layer.kv_state, layer.score_state, layer.comp, False)
        if ratio == 4 and self._on("index"):
            self._indexer(il, freqs)
        if self._on("attention"):
            # head groups x row ranges (fixed for the graph; ranges past the visible rows write neutral
            # partials), then (head, 2*COMBINE_THREADS dims) blocks for the merge
            groups = (s.n_head + ops.ATTN_HEADS - 1) // ops.ATTN_HEADS
            ops.attention_partial[(groups, ops.ATTN_SPLITS), ops.ATTN_THREADS, st](
                b.q, layer.raw, layer.comp if ratio else layer.raw, b.selected, b.n_selected, b.pos,
                s.n_swa, ratio, ratio == 4, s.head_dim, b.part_max, b.part_den, b.part_acc)
            dim_blocks = (s.head_dim + 2 * ops.COMBINE_THREADS - 1) // (2 * ops.COMBINE_THREADS)
            ops.attention_combine[(s.n_head, dim_blocks), ops.COMBINE_THREADS, st](
                b.part_max, b.part_den, b.part_acc, self.w32, self.off32(p + "attn_sinks.weight"), b.pos,
                s.head_dim, s.n_rot, freqs, b.attn)
        if self._on("attn_out"):
            self._attn_out(il)
        if self._on("hc"):
            ops.hc_post[16, BLOCK, st](b.state, b.f_attn, b.zeros, b.post, b.comb)

    def _attn_proj(self, il: int, freqs):
        s, b, st, layer = self.spec, self.buf, self.stream, self.layers[il]
        p = f"blk.{il}."
        self._matvec_pair(p + "attn_q_a.weight", p + "attn_kv.weight", b.x, b.xq, b.xd, b.qr_kv)
        ops.rmsnorm_q8[1, BLOCK, st](b.qr, self.w32, self.off32(p + "attn_q_a_norm.weight"), s.rms_eps,
                                     b.qrn, b.qrn_q, b.qrn_d)
        self._matvec(p + "attn_q_b.weight", b.qrn, b.qrn_q, b.qrn_d, b.q)
        ops.q_heads[s.n_head, BLOCK, st](b.q, s.head_dim, s.n_rot, s.rms_eps, b.pos, freqs)
        ops.kv_finish[1, BLOCK, st](b.kv, self.w32, self.off32(p + "attn_kv_a_norm.weight"), s.rms_eps,
                                    b.pos, freqs, s.n_rot, layer.raw)

    def _indexer(self, il: int, freqs):
        """The indexer lane's compressor, then the top-idx_topk selection of compressed rows."""
        s, b, st, layer = self.spec, self.buf, self.stream, self.layers[il]
        p = f"blk.{il}."
        self._compressor(p + "indexer_compressor", 4, s.idx_dim, freqs, b.icomp_pair,
                         layer.ikv_state, layer.iscore_state, layer.icomp, True)
        self._matvec(p + "indexer.attn_q_b.weight", b.qrn, None, None, b.iq)
        ops.indexer_q[s.n_ihead, max(64, s.idx_dim), st](b.iq, s.idx_dim, s.n_rot, b.pos, freqs)
        self._matvec(p + "indexer.proj.weight", b.x, None, None, b.head_w)
        max_rows = b.scores.shape[0]
        ops.indexer_scores[max_rows, 64, st](
            b.iq, b.head_w, 1.0 / math.sqrt(s.idx_dim * s.n_ihead), layer.icomp, b.pos,
            s.n_ihead, s.idx_dim, b.scores)
        ops.indexer_select[1, BLOCK, st](b.scores.view(np.uint32), b.pos, s.idx_topk,
                                         b.selected, b.n_selected)

    def _attn_out(self, il: int):
        """Grouped low-rank output: 8 groups of heads through their o_lora slices, then out_b."""
        s, b, st = self.spec, self.buf, self.stream
        p = f"blk.{il}."
        q_dim = s.n_head * s.head_dim
        qk.quantize_q8_0(b.attn, b.attn_q, b.attn_d, st)
        group_in = q_dim // s.n_group
        name = p + "attn_output_a.weight"
        if self.info(name).ggml_type == GGML_Q8_0:       # the 8 groups in one launch
            qk.matvec_q8_0_grouped(self.arena, self.off(name), s.n_group * s.o_lora, group_in, s.n_group,
                                   b.attn_q, b.attn_d, b.low, self.stream)
        else:
            for g in range(s.n_group):
                self._matvec(name, b.attn, b.attn_q, b.attn_d, b.low[g * s.o_lora:(g + 1) * s.o_lora],
                             x_offset=g * group_in, rows=s.o_lora, row0=g * s.o_lora)
        qk.quantize_q8_0(b.low, b.low_q, b.low_d, st)
        self._matvec(p + "attn_output_b.weight", None, b.low_q, b.low_d, b.f_attn)

    def _on(self, group: str) -> bool:
        """False for a group of launches left out while profiling (see profile())."""
        return group not in self.skip

    def _compressor(self, prefix, ratio, head_dim, freqs, pair, kv_state, score_state, cache,
                    indexer_lane):
        s, b, st = self.spec, self.buf, self.stream
        width = (2 if ratio == 4 else 1) * head_dim
        self._matvec_pair(prefix + "_kv.weight", prefix + "_gate.weight", b.x, None, None, pair[:2 * width])
        kv_t, sc_t = pair[:width], pair[width:2 * width]
        threads = BLOCK if head_dim <= BLOCK else ops.BLOCK2    # its scratch holds BLOCK2
        assert head_dim <= ops.BLOCK2, "compressor_step handles head_dim <= BLOCK2"
        ops.compressor_step[1, threads, st](
            kv_t, sc_t, self.w16, self.off16(prefix + "_ape.weight"), self.w32,
            self.off32(prefix + "_norm.weight"), s.rms_eps, b.pos, ratio, head_dim, s.n_rot, freqs,
            indexer_lane, kv_state, score_state, cache)

    def _ffn_route(self, il: int):
        s, b, st = self.spec, self.buf, self.stream
        p = f"blk.{il}."
        if self._on("hc"):
            self._hc_pre(p, "ffn", p + "ffn_norm.weight")
        if not self._on("router"):
            return
        self._matvec(p + "ffn_gate_inp.weight", b.x, None, None, b.router)
        is_hash = il < s.n_hash
        has_bias = (p + "exp_probs_b.bias") in self.model.file.tensors
        ops.route[1, BLOCK, st](
            b.router, b.token, self.w32, self.off32(p + "exp_probs_b.bias") if has_bias else 0, has_bias,
            self.i32, self.off(p + "ffn_gate_tid2eid.weight") // 4 if is_hash else 0, is_hash, s.n_used,
            s.expert_weights_scale, self.expert_bases[il] if self.expert_bases[il] is not None
            else self._zero_bases, b.expert_ids, b.route_w, b.slot_offsets)

    def _ffn_experts(self, il: int):
        s, b, st = self.spec, self.buf, self.stream
        p = f"blk.{il}."
        clamp = s.swiglu_clamp[il]
        arena = self.source.expert_arena
        gate_type = self.info(p + "ffn_gate_exps.weight").ggml_type
        down_type = self.info(p + "ffn_down_exps.weight").ggml_type
        if self._on("moe"):
            qk.moe_decode(arena, b.slot_offsets, gate_type, down_type, b.x, b.route_w, clamp, b.moe_out,
                          b.moe_work, st)
        if self._on("shared"):
            self._matvec_pair(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight", b.x, b.xq, b.xd,
                              b.sh_gate_up)
            ops.swiglu_q8[1, ops.wide_block(), st](b.sh_gate, b.sh_up, clamp, b.sh_mid, b.sh_q, b.sh_d)
            self._matvec(p + "ffn_down_shexp.weight", None, b.sh_q, b.sh_d, b.sh_out)
        if self._on("hc"):
            ops.hc_post[16, BLOCK, st](b.state, b.moe_out, b.sh_out, b.post, b.comb)

    def _head(self):
        s, b, st = self.spec, self.buf, self.stream
        self._hc_mix(self.off16("output_hc_fn.weight"), s.n_hc)
        ops.hc_head[1, ops.wide_block(), st](b.state, b.part_dot[:s.n_hc], b.part_sq, self.w32, self.off32("output_hc_scale.weight"),
                                  self.off32("output_hc_base.weight"), self.off32("output_norm.weight"),
                                  s.hc_eps, s.rms_eps, b.x, b.xq, b.xd)
        self._matvec("output.weight", None, b.xq, b.xd, b.logits)
        ops.argmax_partial[ops.ARGMAX_BLOCKS, BLOCK, st](b.logits, b.forbid, b.argmax_val, b.argmax_idx)
        ops.argmax_finish[1, BLOCK, st](b.argmax_val, b.argmax_idx, b.next_token)

    def _segments(self):
        """The decode step as a list of launch functions; the host runs `_between(il)` after
        segment il when experts must be made resident first."""
        s, b, st = self.spec, self.buf, self.stream
        segments = []

        def first():
            ops.embed[16, BLOCK, st](b.token, self.w16, self.off16("token_embd.weight"), s.n_embd,
                                     s.n_hc, b.state)
            self._attention(0)
            self._ffn_route(0)
        segments.append(first)
        for il in range(s.n_layer):
            def middle(il=il):
                self._ffn_experts(il)
                if il + 1 < s.n_layer:
                    self._attention(il + 1)
                    self._ffn_route(il + 1)
                elif self._on("head"):
                    self._head()
            segments.append(middle)
        return segments

    # ---- running ---------------------------------------------------------------------------------

    def _build_graphs(self):
        """Warm every kernel up eagerly once (compiles, loads modules), then capture."""
        segments = self._segments()
        resident = self.experts_resident
        if resident:
            graph = CapturedGraph(self.stream)
            with graph:
                for seg in segments:
                    seg()
            self._graphs = [graph]
        else:
            self._graphs = []
            for seg in segments:
                graph = CapturedGraph(self.stream)
                with graph:
                    seg()
                self._graphs.append(graph)

    def _step(self, token: int, pos: int) -> None:
        b = self.buf
        if not self.use_graphs:            # the CUDA simulator has no graphs: launch eagerly
            b.token.copy_to_device(np.array([token], np.int32), stream=self.stream)
            b.pos.copy_to_device(np.array([pos], np.int32), stream=self.stream)
            for il, seg in enumerate(self._segments()):
                seg()
                if not self.experts_resident and il < self.spec.n_layer:
                    self._fetch_experts(il)
            return
        if self._graphs is None:
            self._warm_up(token, pos)
            self._build_graphs()
        b.token.copy_to_device(np.array([token], np.int32), stream=self.stream)
        b.pos.copy_to_device(np.array([pos], np.int32), stream=self.stream)
        if self.experts_resident:
            self._graphs[0].replay()
        else:
            for il, graph in enumerate(self._graphs):
                graph.replay()
                if il < self.spec.n_layer:
                    self._fetch_experts(il)

    def _warm_up(self, token: int, pos: int) -> None:
        """Run one step eagerly so every kernel is compiled and loaded before capture (a capture
        cannot contain module loads), then put the state back as it was."""
        saved = self.snapshot()
        self.buf.token.copy_to_device(np.array([token], np.int32), stream=self.stream)
        self.buf.pos.copy_to_device(np.array([pos], np.int32), stream=self.stream)
        for il, seg in enumerate(self._segments()):
            seg()
            if not self.experts_resident and il < self.spec.n_layer:
                self._fetch_experts(il)
        self.restore(saved)

    def _fetch_experts(self, il: int) -> None:
        """Cache path: read the selected ids, make those experts resident, write their offsets."""
        b = self.buf
        ids = b.expert_ids.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        offsets = np.ascontiguousarray(self.source.fetch_experts(il, ids, stream=self.stream), dtype=np.int64)
        b.slot_offsets.copy_to_device(offsets, stream=self.stream)

    def decode(self, token: int) -> np.ndarray:
        """Run one token at position n_past and return its logits (float32[n_vocab])."""
        self._step(token, self._n_past)
        self._n_past += 1
        logits = self.buf.logits.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return logits

    def decode_greedy(self, token: int, forbid: int = -1) -> int:
        """One token, returning only the argmax (4 bytes back instead of the logits); `forbid`
        is a token the argmax skips (the bench probe forbids EOS)."""
        if forbid != self._forbid:
            self.buf.forbid.copy_to_device(np.array([forbid], np.int32), stream=self.stream)
            self._forbid = forbid
        self._step(token, self._n_past)
        self._n_past += 1
        out = self.buf.next_token.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return int(out[0])

    def prefill(self, tokens) -> np.ndarray:
        """Evaluate a prompt; returns the logits of its last token."""
        for token in tokens[:-1]:
            self._step(int(token), self._n_past)
            self._n_past += 1
        return self.decode(int(tokens[-1]))

    GROUPS = ("hc", "attn_proj", "compress", "index", "attention", "attn_out", "router", "moe",
              "shared", "head")

    def profile(self, token: int, reps: int = 20) -> dict:
        """Device ms per decode step with each group of launches left out in turn (METHOD.md:
        time variants that leave a stage out, take differences). Device-resident sources only;
        the KV state is saved and restored around it."""
        if not self.experts_resident:
            raise RuntimeError("profile() needs a device-resident source")
        saved = self.snapshot()
        self.decode_greedy(token)                   # compile, warm, capture the full graph
        full = self._graphs[0]

        def time_graph(graph) -> float:
            start, end = cuda.event(), cuda.event()
            graph.replay()
            start.record(self.stream)
            for _ in range(reps):
                graph.replay()
            end.record(self.stream)
            end.synchronize()
            return cuda.event_elapsed_time(start, end) / reps
        result = {"step_ms": time_graph(full), "nodes": full.n_nodes}
        for group in self.GROUPS:
            self.skip = {group}
            graph = CapturedGraph(self.stream)
            with graph:
                for seg in self._segments():
                    seg()
            result[group] = result["step_ms"] - time_graph(graph)
            graph.close()
        self.skip = set()
        self.restore(saved)
        return result
