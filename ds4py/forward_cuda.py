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

import gc
import math
import time
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.options import DEFAULT_PREFILL_CHUNK
from ds4py.io.detect import decode_attention
from ds4py.io.gguf import GGML_F16, GGML_Q8_0
from ds4py.kernels import compat  # noqa: F401
from ds4py.kernels import cuda_ops as ops, numerics
from ds4py.kernels.launch import view as memo_view
from ds4py.kernels.graph import CapturedGraph
from numba import cuda
from numba.cuda import config as numba_config

if numba_config.ENABLE_CUDASIM:
    qk = None      # the quantized kernels need a real GPU (dp4a); simulator tests swap in host versions
else:
    from ds4py.kernels import cuda as qk

BLOCK = ops.BLOCK


class LayerState:
    """KV state of one layer on the device: raw ring, compressor lanes, compressed rows."""

    def __init__(self, spec, il: int, n_ctx: int, raw_cap: int):
        self.ratio = r = spec.ratio(il)
        self.raw = cuda.device_array((raw_cap, spec.head_dim), np.float32)
        self.comp = self.kv_state = self.score_state = None
        self.icomp = self.ikv_state = self.iscore_state = None
        if r:
            coff = 2 if r == 4 else 1
            self.comp = cuda.device_array((spec.compressed_rows(n_ctx, r), spec.head_dim), np.float32)
            self.kv_state = cuda.device_array((coff * r, coff * spec.head_dim), np.float32)
            self.score_state = cuda.device_array((coff * r, coff * spec.head_dim), np.float32)
        if r == 4:
            self.icomp = cuda.device_array((spec.compressed_rows(n_ctx, 4), spec.idx_dim), np.float32)
            self.ikv_state = cuda.device_array((8, 2 * spec.idx_dim), np.float32)
            self.iscore_state = cuda.device_array((8, 2 * spec.idx_dim), np.float32)

    def arrays(self):
        return [a for a in (self.raw, self.comp, self.kv_state, self.score_state, self.icomp,
                            self.ikv_state, self.iscore_state) if a is not None]

    def reset(self, stream) -> None:
        for a in self.arrays():
            fill = ops.NEG_INF if a is self.score_state or a is self.iscore_state else 0.0
            fill_device(a, fill, stream)


@contextmanager
def _no_gc():
    """The garbage collector off while a prefill enqueues its launches: a collection in the middle
    stalls the host, and with it the GPU, that waits for the next launches (measured on the H200:
    512-token chunks of 338-356 ms with it off against 457-620 ms with it on, numba's launch path)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def fill_device(array, value, stream) -> None:
    host = np.full(array.shape, value, dtype=array.dtype)
    array.copy_to_device(host, stream=stream)


def compute_capability() -> tuple[int, int]:
    """This GPU's (major, minor); the simulator counts as an H100 / H200."""
    return (9, 0) if numba_config.ENABLE_CUDASIM else tuple(cuda.get_current_device().compute_capability)


def prefill_attention_mma(spec, n_tok: int, n_splits: int) -> bool:
    """Whether a chunk of tokens takes attention_prefill_mma (the tensor cores; head_dim 512, one
    row range per head) rather than attention_partial (decode, and the tiny shapes)."""
    return (n_tok > 1 and n_splits == 1 and ops.ATTN_PREFILL_MMA and spec.head_dim == ops.ATTN_MMA_DIM
            and spec.n_head % ops.ATTN_MMA_HEADS == 0)


class Scratch:
    """Every activation buffer of up to n_tok tokens, allocated once (graphs bake addresses in).

    Per-token buffers are [n_tok, ...]; `view(T)` gives the first T tokens of each (and the
    views derived from them: the halves of pair outputs, the group-major attention output), which
    is what the kernels and matmuls of a chunk of T tokens take. Decode uses n_tok = 1."""

    def __init__(self, spec, max_rows: int, n_tok: int, n_splits: int, attention_f64: bool = True):
        f32, i8, i32 = np.float32, np.int8, np.int32
        d = cuda.device_array
        s = spec
        P = n_tok
        self.spec, self.n_tok = s, n_tok
        q_dim = s.n_head * s.head_dim
        self.hc_chunk = ops.hc_chunk(s.n_embd)
        n_chunks = s.n_hc * s.n_embd // self.hc_chunk
        # the attention kernel of these buffers: the tensor-core prefill kernel, or attention_partial
        # in f64 or f32 (--attention: io/detect.decode_attention); the partials are in its arithmetic
        self.attention = ("mma" if prefill_attention_mma(s, n_tok, n_splits)
                          else "f64" if attention_f64 else "f32")
        part_t = np.float64 if self.attention == "f64" else np.float32
        assert n_chunks <= 32, "hc_mix_values adds at most 32 chunk partials (one warp)"
        # [n_tok, ...] buffers
        self.tok = dict(
            state=d((P, s.n_hc, s.n_embd), f32),
            part_dot=d((P, s.hc_mix, n_chunks), np.float64), part_sq=d((P, n_chunks), np.float64),
            part_gram=d((P, s.n_hc * s.n_hc, n_chunks), np.float64),
            post=d((P, s.n_hc), f32), comb=d((P, s.n_hc * s.n_hc), f32),
            x=d((P, s.n_embd), f32), xq=d((P, s.n_embd), i8), xd=d((P, s.n_embd // 32), f32),
            qr_kv=d((P, s.q_lora + s.head_dim), f32),     # q_a and kv projections, one launch
            qrn=d((P, s.q_lora), f32), qrn_q=d((P, s.q_lora), i8), qrn_d=d((P, s.q_lora // 32), f32),
            q=d((P, q_dim), f32),
            iq=d((P, s.n_ihead * s.idx_dim), f32), head_w=d((P, s.n_ihead), f32),
            scores=d((P, max_rows), f32), selected=d((P, s.idx_topk), i32),
            # zeroed: the attention of a layer without an indexer reads it (and ignores it); before the
            # first indexer ran, compute-sanitizer's initcheck flagged that read
            n_selected=cuda.to_device(np.zeros(P, i32)),
            # the attention's partials (scores and sums) for attention_combine: f64 from
            # attention_partial (rounded once in the combine, cuda_ops), f32 where the tensor-core
            # prefill kernel or the f32 attention_partial writes them (their sums are f32)
            part_max=d((P, s.n_head, n_splits), part_t), part_den=d((P, s.n_head, n_splits), part_t),
            part_acc=d((P, s.n_head, n_splits, s.head_dim), part_t),
            f_attn=d((P, s.n_embd), f32), zeros=cuda.to_device(np.zeros((P, s.n_embd), f32)),
            router=d((P, s.n_exp), f32), expert_ids=d((P, s.n_used), i32), route_w=d((P, s.n_used), f32),
            slot_offsets=d((P, s.n_used, 3), np.int64), moe_out=d((P, s.n_embd), f32),
            sh_gate_up=d((P, 2 * s.n_ff), f32),
            sh_mid=d((P, s.n_ff), f32), sh_q=d((P, s.n_ff), i8), sh_d=d((P, s.n_ff // 32), f32),
            sh_out=d((P, s.n_embd), f32),
            pos=cuda.to_device(np.zeros(P, i32)), token=cuda.to_device(np.zeros(P, i32)),
        )
        # flat buffers of n_tok · width values (viewed per chunk as [T, width] or group-major)
        self.flat = dict(
            comp_pair=(d(P * 4 * s.head_dim, f32), 4 * s.head_dim),    # a compressor's kv and gate
            icomp_pair=(d(P * 4 * s.idx_dim, f32), 4 * s.idx_dim),
            attn=(d(P * q_dim, f32), q_dim), attn_q=(d(P * q_dim, i8), q_dim),
            attn_d=(d(P * q_dim // 32, f32), q_dim // 32),
            low=(d(P * s.n_group * s.o_lora, f32), s.n_group * s.o_lora),      # group-major
            low_tok=(d(P * s.n_group * s.o_lora, f32), s.n_group * s.o_lora),  # token-major
            low_q=(d(P * s.n_group * s.o_lora, i8), s.n_group * s.o_lora),
            low_d=(d(P * s.n_group * s.o_lora // 32, f32), s.n_group * s.o_lora // 32),
        )
        self.logits = d(s.n_vocab, f32)
        self.next_token = d(1, i32)
        self.argmax_val, self.argmax_idx = d(ops.ARGMAX_BLOCKS, f32), d(ops.ARGMAX_BLOCKS, i32)
        self.forbid = cuda.to_device(np.full(1, -1, i32))
        self.moe_work = qk.MoEWorkspace(s.n_used, s.n_embd, s.n_ff) if n_tok == 1 else None
        # prefill: a compressor lane's state rows + the chunk's rows (compressor_chunk_*), kv and
        # scores, per lane (the two lanes run on different streams)
        ext_rows = ops.COMP_MAX_RATIO + P
        self.comp_ext = tuple(d(ext_rows * 2 * s.head_dim, f32) for _ in range(2)) if n_tok > 1 else None
        self.icomp_ext = tuple(d(ext_rows * 2 * s.idx_dim, f32) for _ in range(2)) if n_tok > 1 else None
        self._views = {}

    def view(self, T: int):
        """The buffers of the first T tokens, as attributes (cached per T)."""
        v = self._views.get(T)
        if v is not None:
            return v
        assert 1 <= T <= self.n_tok
        s = self.spec
        v = SimpleNamespace(T=T, hc_chunk=self.hc_chunk, attention=self.attention, logits=self.logits,
                            next_token=self.next_token, argmax_val=self.argmax_val, argmax_idx=self.argmax_idx,
                            forbid=self.forbid, moe_work=self.moe_work, comp_ext=self.comp_ext,
                            icomp_ext=self.icomp_ext)
        for name, a in self.tok.items():
            setattr(v, name, a[:T])
        for name, (a, width) in self.flat.items():
            setattr(v, name, a[:T * width])
        v.qr, v.kv = v.qr_kv[:, :s.q_lora], v.qr_kv[:, s.q_lora:]
        v.sh_gate, v.sh_up = v.sh_gate_up[:, :s.n_ff], v.sh_gate_up[:, s.n_ff:]
        self._views[T] = v
        return v


class CudaEngine:
    """prefill(tokens) / decode(token) on the GPU, with the same interface as the CPU engine.

    Decode is one captured graph per step (T = 1 buffers). Prefill with experts resident in the
    arena (device / host-mapped sources) is batched: chunks of up to `prefill_chunk` tokens go
    through the model layer by layer, the projections as matmuls, the per-token kernels with one
    block row per token, the routed experts through moe_prefill (tokens grouped by expert on the
    device), and the output head on the last prompt token only. Sources that page experts
    through a VRAM expert cache (`experts_resident` False) fetch each layer's chunk experts first."""

    PREFILL_SPLITS = 1      # attention row ranges per head group in prefill: T x groups blocks suffice
    INDEXER_QUERY_STREAM = True   # the indexer's q on its own stream ("idx"), else on "aux" (_attention)

    def __init__(self, model, source, n_ctx: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 pdl: bool = True, attention: str = "auto"):
        self.model, self.source, self.spec = model, source, model.spec
        s = self.spec
        self.n_ctx = n_ctx
        most_rows = s.n_swa + max([n_ctx // r for r in s.compress_ratios if r > 4] + [s.idx_topk])
        if most_rows > ops.ATTN_MAX_ROWS:
            raise Ds4Error(f"--ctx {n_ctx} gives up to {most_rows} attention rows per head; the GPU attention "
                           f"kernel allows {ops.ATTN_MAX_ROWS}: lower --ctx")
        if s.n_hc > ops.HC_MAX:
            raise Ds4Error(f"n_hc {s.n_hc}: the GPU HC kernels keep at most {ops.HC_MAX} streams in registers")
        if (s.n_ihead > ops.ISC_HEADS or s.n_ihead * s.idx_dim > ops.ISC_IQ or s.idx_dim > ops.ISC_DIM
                or s.idx_dim % ops.ISD_UNROLL):
            raise Ds4Error(f"indexer {s.n_ihead} heads x {s.idx_dim}: the GPU indexer keeps at most "
                           f"{ops.ISC_HEADS} heads of {ops.ISC_DIM} dims (a multiple of {ops.ISD_UNROLL}) "
                           f"and {ops.ISC_IQ} query values in shared memory")
        if s.head_dim > ops.ATTN_MAX_DIM or s.head_dim % 32:
            raise Ds4Error(f"head_dim {s.head_dim}: the GPU attention kernel handles multiples of 32 up to "
                           f"{ops.ATTN_MAX_DIM}")
        self.use_graphs = not numba_config.ENABLE_CUDASIM
        self.pdl = pdl                  # captured graphs with programmatic kernel -> kernel edges
        self.fuse_hc_post = True        # decode: the HC post in its producers' epilogues (_hc_epilogue)
        self.stream = self.main_stream = cuda.stream()
        # Side streams for launches that do not depend on the main chain, forked from and joined
        # back into the main stream with events, so the captured step has parallel branches and the
        # small kernels of one fill the SMs the other leaves idle: "side" takes the attention
        # compressor, the KV row and the shared expert; "aux" the indexer and the routed experts'
        # input quantization (see _attention, _ffn_route); "hc" the HC post gates and Sinkhorn
        # (_hc_pre), joined before the sublayer's HC post; "idx" the indexer's query, which needs
        # only the q norm, beside the indexer lane's compressor on "aux" (see _attention). The
        # simulator has no events: there everything stays on the main stream, in order.
        names = ("side", "aux", "hc", "idx") if self.use_graphs else ()
        self.side_streams = {name: cuda.stream() for name in names}
        self._events = {name: (cuda.event(timing=False), cuda.event(timing=False)) for name in names}
        self._open_branches: set[str] = set()
        self.arena = source.arena
        self.w16 = self.arena.view(np.float16)
        self.w32 = self.arena.view(np.float32)
        self.i32 = self.arena.view(np.int32)
        self.freqs_dense = cuda.to_device(numerics.rope_frequencies(s, False))     # float64
        self.freqs_comp = cuda.to_device(numerics.rope_frequencies(s, True))
        self.prefill_chunk = max(1, int(prefill_chunk))
        # the raw ring holds the window plus a whole chunk: a chunk's KV rows are all written before
        # its attention runs, and none may overwrite a row an earlier token of the chunk still reads
        self.layers = [LayerState(s, il, n_ctx, s.n_swa + self.prefill_chunk) for il in range(s.n_layer)]
        self.max_rows = s.compressed_rows(n_ctx, 4)
        self.attention_f64 = decode_attention(attention, compute_capability())[0]   # --attention
        self.scratch = Scratch(s, self.max_rows, 1, ops.ATTN_SPLITS, self.attention_f64)
        self.buf = self.scratch.view(1)
        self._prefill_scratch = None        # allocated by the first batched prefill
        # Experts resident in the arena (device / host-mapped sources): the router kernel computes
        # their offsets on the device. Otherwise the host fetches them into the expert cache.
        self.experts_resident = source.expert_base(0) is not None
        self._zero_bases = cuda.to_device(np.zeros(6, np.int64))     # router offsets unused: cache path
        self.expert_bases = [cuda.to_device(np.asarray(tuple(source.expert_base(il)), dtype=np.int64))
                             if self.experts_resident else None for il in range(s.n_layer)]
        self._expert_tables = {}
        self._expert_tables_dev = {}
        self._n_past = 0
        self._forbid = -1
        # pinned read-back slots of decode_greedy_run (graphs only), allocated here: made on its
        # first call they cost the bench's first frontier ~5 ms of gen_first_ms (session 17)
        self._token_slots = cuda.pinned_array(2, np.int32) if self.use_graphs else None
        self._token_events = [cuda.event(timing=False) for _ in range(2)] if self.use_graphs else None
        self.skip: set[str] = set()
        self._graphs = None
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

    def expert_table(self, il: int) -> np.ndarray:
        """Host int64[n_exp, 3]: byte offsets (gate, up, down) of every expert of layer il (resident
        experts only), for moe_prefill."""
        table = self._expert_tables.get(il)
        if table is None:
            g, u, dn, gs, us, ds = (int(v) for v in self.source.expert_base(il))
            e = np.arange(self.spec.n_exp, dtype=np.int64)
            table = self._expert_tables[il] = np.stack([g + e * gs, u + e * us, dn + e * ds], axis=1)
        return table

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

    # ---- launches for T tokens (T = 1: the decode step) -----------------------------------------

    @contextmanager
    def _branch(self, name: str = "side"):
        """Launches inside go to side stream `name`, after everything issued so far on the main
        stream; the main stream waits for them at the next _join(name)."""
        side = self.side_streams.get(name)
        if side is None:                     # the simulator: one stream, in order
            yield
            return
        fork, _ = self._events[name]
        fork.record(self.main_stream)
        fork.wait(side)
        self._open_branches.add(name)
        self.stream = side
        try:
            yield
        finally:
            self.stream = self.main_stream

    def _join(self, name: str = "side"):
        """The main stream waits for side branch `name` (a no-op when it is not open)."""
        self._join_into(name, self.main_stream)

    def _wait(self, name: str) -> None:
        """The stream launches go to now (a side branch) waits for side branch `name`'s work so far;
        `name` then counts as joined (the main stream waits for it through this branch's join)."""
        self._join_into(name, self.stream)

    def _join_into(self, name: str, stream) -> None:
        if name in self._open_branches:
            _, join = self._events[name]
            join.record(self.side_streams[name])
            join.wait(stream)
            self._open_branches.discard(name)

    def _proj(self, name: str, x_f32, xq, xd, out, T: int, rows=None, row0: int = 0, k=None, hc=None):
        """out[t] = W[name] · x[t] for T tokens with ds4's numerics for W's type (Q8_0 on xq/xd, F16
        on x_f32); rows/row0/k select a block of rows and a shorter input (grouped projection); hc
        (Q8_0, one token): the HC post in the epilogue (_hc_epilogue)."""
        info = self.info(name)
        k = k if k is not None else info.ne[0]
        n_rows = rows if rows is not None else info.ne[1]
        off = self.off(name) + row0 * info.row_bytes
        if info.ggml_type == GGML_Q8_0:
            qk.matmul_q8_0(self.arena, off, n_rows, k, T, xq, xd, out, self.stream, hc=hc,
                           scales_last=name in self.source.scales_last)
        elif info.ggml_type == GGML_F16:
            qk.matmul_f16(self.arena, off, n_rows, k, T, x_f32, out, self.stream)
        else:
            raise ValueError(f"{name}: no matmul for type {info.type_name}")

    def _proj_pair(self, name_a: str, name_b: str, x_f32, xq, xd, out, T: int):
        """out[t] = concat(W[name_a] · x[t], W[name_b] · x[t]) ([T, rows_a + rows_b]): one launch when
        both have the same type and row length (the usual case), two otherwise (one token only)."""
        a, b = self.info(name_a), self.info(name_b)
        rows_a, rows_b = a.ne[1], b.ne[1]
        scales_last = self.source.scales_last
        same_layout = (name_a in scales_last) == (name_b in scales_last)
        if a.ggml_type == b.ggml_type and a.ne[0] == b.ne[0] and a.ggml_type in (GGML_Q8_0, GGML_F16) and same_layout:
            if a.ggml_type == GGML_Q8_0:
                qk.matmul_q8_0_pair(self.arena, self.off(name_a), rows_a, self.off(name_b), rows_b, a.ne[0],
                                    T, xq, xd, out, self.stream, scales_last=name_a in scales_last)
            else:
                qk.matmul_f16_pair(self.arena, self.off(name_a), rows_a, self.off(name_b), rows_b, a.ne[0],
                                   T, x_f32, out, self.stream)
            return
        if T != 1:
            raise NotImplementedError(f"{name_a} / {name_b}: batched pair of different types or layouts")
        self._proj(name_a, x_f32, xq, xd, out[0, :rows_a], 1)
        self._proj(name_b, x_f32, xq, xd, out[0, rows_a:rows_a + rows_b], 1)

    def _hc_pre(self, b, prefix: str, sub: str, norm_name: str):
        """Sublayer input from the HC state and the mixer's partials (launched by the previous
        sublayer's _hc_post, or by _embed for the first); the post gates and comb matrix, which
        only this sublayer's _hc_post reads, on the "hc" stream beside it."""
        s, st = self.spec, self.stream
        scale_off = self.off32(f"{prefix}hc_{sub}_scale.weight")
        base_off = self.off32(f"{prefix}hc_{sub}_base.weight")
        if not self._on("hc_pre"):
            return
        mix_dot = memo_view(b.part_dot, ("cols", s.hc_mix), lambda a: a[:, :s.hc_mix])
        with self._branch("hc"):
            ops.hc_sinkhorn[(1, b.T), BLOCK, self.stream](
                mix_dot, b.part_sq, s.n_hc * s.n_embd, self.w32, scale_off, base_off,
                s.n_sinkhorn, s.hc_eps, s.rms_eps, b.post, b.comb)
        x_blocks = (s.n_embd + BLOCK - 1) // BLOCK
        ops.hc_pre[(x_blocks, b.T), BLOCK, st](
            b.state, mix_dot, b.part_sq, b.part_gram, self.w32, scale_off, base_off,
            self.off32(norm_name), s.hc_eps, s.rms_eps, b.x, b.xq, b.xd)

    def _embed(self, b):
        """Token embeddings into every HC stream, then the first sublayer's mixer partials."""
        s = self.spec
        ops.embed[(16, b.T), BLOCK, self.stream](b.token, self.w16, self.off16("token_embd.weight"), s.n_embd,
                                                 s.n_hc, b.state)
        if self._on("hc"):
            self._hc_mix(b, "blk.0.hc_attn_fn.weight")

    def _hc_mix(self, b, fn_name: str):
        """The mixer partials of the next sublayer (`fn_name`: its hc_*_fn weight; output_hc_fn
        before the head) over the current state, with the streams' Gram partials hc_pre needs."""
        s = self.spec
        n_rows, gram_rows = (s.n_hc, 0) if fn_name == "output_hc_fn.weight" else (s.hc_mix, s.n_hc ** 2)
        if not self._on("hc_mix"):
            return
        mix_dot = memo_view(b.part_dot, ("cols", n_rows), lambda a: a[:, :n_rows])
        if b.T > 1:       # prefill: one block per (chunk, token) writes all its partials, same bits
            assert b.hc_chunk <= ops.HC_MIX_VALS * BLOCK, "hc_mix_tokens caches HC_MIX_VALS values per thread"
            groups = (b.T + ops.HC_TOKENS - 1) // ops.HC_TOKENS
            ops.hc_mix_tokens[(b.part_dot.shape[2], groups), BLOCK, self.stream](
                b.state, self.w16, self.off16(fn_name), b.hc_chunk, gram_rows > 0, mix_dot,
                b.part_sq, b.part_gram)
            return
        ops.hc_mix_partial[(n_rows + gram_rows, b.part_dot.shape[2], b.T), BLOCK, self.stream](
            b.state, self.w16, self.off16(fn_name), b.hc_chunk, mix_dot, b.part_sq, b.part_gram, ops.HC_MIX_PRE)

    def _hc_post(self, b, f_a, f_b, next_fn: str, done: bool = False):
        """HC post of the sublayer just computed (in place; done: the kernel that wrote f_a did it,
        see _hc_epilogue), then the next sublayer's mixer partials."""
        self._join("hc")                         # its post gates and comb matrix (_hc_pre)
        if not done and self._on("hc_post"):
            ops.hc_post[(16, b.T), BLOCK, self.stream](b.state, f_a, f_b, b.post, b.comb)
        self._hc_mix(b, next_fn)

    def _hc_epilogue(self, b, f_b):
        """The HC post as the epilogue of the decode kernel that writes the sublayer's output f_a
        (attention: out_b's Q8_0 matvec; FFN: the MoE down kernel, f_b the shared expert): the
        thread that writes dim d of f_a updates the n_hc streams at d (hc_post_dim, the same bits
        as hc_post), one launch fewer on the critical path of each HC site. The caller joins the
        "hc" stream (post gates, comb) first. None (a separate hc_post) for a prefill chunk."""
        if b.T != 1 or not self._on("hc_post") or not self.fuse_hc_post:
            return None
        return b.state[0], f_b[0], b.post[0], b.comb[0]

    def _next_fn(self, il: int, sub: str) -> str:
        """The mixer weight of the sublayer after (layer il, sub)."""
        if sub == "attn":
            return f"blk.{il}.hc_ffn_fn.weight"
        return f"blk.{il + 1}.hc_attn_fn.weight" if il + 1 < self.spec.n_layer else "output_hc_fn.weight"

    def _attention(self, b, il: int, pos0=None):
        """The attention sublayer for b.T tokens; pos0 (prefill) is the chunk's first position, known
        on the host; None in the decode graph, where everything position-dependent is decided on
        the device."""
        s, st, layer = self.spec, self.stream, self.layers[il]
        p = f"blk.{il}."
        ratio = layer.ratio
        T = b.T
        freqs = self.freqs_comp if ratio else self.freqs_dense
        if self._on("hc"):
            self._hc_pre(b, p, "attn", p + "attn_norm.weight")
        # the indexer selects only once a token sees more than idx_topk rows; a prefill chunk
        # whose tokens all see fewer attends to every compressed row (the same rows)
        use_selected = ratio == 4 and (pos0 is None or (pos0 + T) // 4 > s.idx_topk)
        # Four streams until the attention: main q_a+kv -> q norm -> q_b -> q heads; side: the
        # attention compressor, then the KV row; aux: the indexer lane's compressor and head
        # weights, then the scores and top-k; idx (from the q norm on): the indexer's q, which the
        # scores wait for. (With the indexer's q on aux, behind the lane's compressor, the ratio-4
        # layers' attention waited ~18 us longer for the top-k than for the q heads: ncu kernel
        # times of a step at 2,049 on the H200, session 18; profile()'s "index" group, 0.43 ms.)
        if ratio and self._on("compress"):
            with self._branch():
                self._compressor(b, p + "attn_compressor", ratio, s.head_dim, freqs, b.comp_pair,
                                 layer.kv_state, layer.score_state, layer.comp, False, pos0, b.comp_ext)
        if ratio == 4 and self._on("index"):
            with self._branch("aux"):
                self._compressor(b, p + "indexer_compressor", 4, s.idx_dim, freqs, b.icomp_pair,
                                 layer.ikv_state, layer.iscore_state, layer.icomp, True, pos0, b.icomp_ext)
                if use_selected:
                    self._proj(p + "indexer.proj.weight", b.x, None, None, b.head_w, T)
        if self._on("attn_proj"):
            self._q_a_kv(b, il, freqs)
        if use_selected and self._on("index"):
            with self._branch("idx" if self.INDEXER_QUERY_STREAM else "aux"):
                self._indexer_query(b, il, freqs)
            with self._branch("aux"):
                self._wait("idx")
                self._indexer_select(b, il, pos0)
        if self._on("attn_proj"):
            self._q_b(b, il, freqs)
        self._join()
        self._join("aux")
        if self._on("attention"):
            # head groups x row ranges (fixed for the graph; ranges past the visible rows write neutral
            # partials) x tokens, then (head, 2*COMBINE_THREADS dims, token) blocks for the merge
            groups = (s.n_head + ops.ATTN_HEADS - 1) // ops.ATTN_HEADS
            n_splits = b.part_max.shape[2]
            # prefill: the tensor-core kernel, same partials (not the same bits); a chunk of one
            # token takes it too (its scratch's choice)
            if b.attention == "mma":
                ops.attention_prefill_mma[(s.n_head // ops.ATTN_MMA_HEADS, 1, T), ops.ATTN_MMA_THREADS, st](
                    b.q, layer.raw, layer.comp if ratio else layer.raw, b.selected, b.n_selected, b.pos,
                    s.n_swa, ratio, use_selected, b.part_max, b.part_den, b.part_acc)
            else:
                partial = ops.decode_attention_kernel(b.attention == "f64")
                partial[(groups, n_splits, T), ops.ATTN_THREADS, st](
                    b.q, layer.raw, layer.comp if ratio else layer.raw, b.selected, b.n_selected, b.pos,
                    s.n_swa, ratio, use_selected, s.head_dim, b.part_max, b.part_den, b.part_acc)
            dim_blocks = (s.head_dim + 2 * ops.COMBINE_THREADS - 1) // (2 * ops.COMBINE_THREADS)
            if self._on("combine"):
                ops.combine_kernel(n_splits)[(s.n_head, dim_blocks, T), ops.COMBINE_THREADS, st](
                    b.part_max, b.part_den, b.part_acc, self.w32, self.off32(p + "attn_sinks.weight"), b.pos,
                    s.head_dim, s.n_rot, freqs, s.n_group, b.attn, b.attn_q, b.attn_d)
        post_done = False
        if self._on("attn_out"):
            post_done = self._attn_out(b, il)
        if self._on("hc"):
            self._hc_post(b, b.f_attn, b.zeros, self._next_fn(il, "attn"), done=post_done)

    def _q_a_kv(self, b, il: int, freqs):
        """q_a and kv projections (one launch), the KV row into the raw ring (side stream: only
        the attention reads it), the q_a norm (read by q_b and by the indexer's q)."""
        s, st, layer = self.spec, self.stream, self.layers[il]
        p = f"blk.{il}."
        T = b.T
        self._proj_pair(p + "attn_q_a.weight", p + "attn_kv.weight", b.x, b.xq, b.xd, b.qr_kv, T)
        with self._branch():
            ops.kv_finish[(1, T), BLOCK, self.stream](b.kv, self.w32, self.off32(p + "attn_kv_a_norm.weight"),
                                                      s.rms_eps, b.pos, freqs, s.n_rot, layer.raw)
        if self._on("q_norm"):
            ops.rmsnorm_q8[(1, T), BLOCK, st](b.qr, self.w32, self.off32(p + "attn_q_a_norm.weight"), s.rms_eps,
                                              b.qrn, b.qrn_q, b.qrn_d)

    def _q_b(self, b, il: int, freqs):
        """The 64 query heads: q_b, then per-head norm and RoPE."""
        s, st = self.spec, self.stream
        self._proj(f"blk.{il}.attn_q_b.weight", b.qrn, b.qrn_q, b.qrn_d, b.q, b.T)
        if self._on("q_heads"):
            ops.q_heads[(s.n_head, b.T), ops.Q_HEADS_THREADS, st](b.q, s.head_dim, s.n_rot, s.rms_eps, b.pos, freqs)

    def _indexer_query(self, b, il: int, freqs):
        """The indexer's q per token from the q norm: its q_b projection, then indexer_q."""
        s, T = self.spec, b.T
        self._proj(f"blk.{il}.indexer.attn_q_b.weight", b.qrn, None, None, b.iq, T)
        ops.indexer_q[(s.n_ihead, T), max(64, s.idx_dim), self.stream](b.iq, s.idx_dim, s.n_rot, b.pos, freqs)

    def _indexer_select(self, b, il: int, pos0):
        """The indexer's scores and top-idx_topk selection of compressed rows per token (after the
        indexer lane's compressor and head weights, on the same stream, and the indexer's q)."""
        s, st, layer = self.spec, self.stream, self.layers[il]
        T = b.T
        # rows: the graph's fixed bound in decode, the rows the chunk's last token sees in prefill
        n_rows = self.max_rows if pos0 is None else max(1, (pos0 + T) // 4)
        scale = 1.0 / math.sqrt(s.idx_dim * s.n_ihead)
        if T == 1:
            ops.indexer_scores[(ops.indexer_decode_blocks(n_rows), T), ops.ISD_THREADS, st](
                b.iq, b.head_w, scale, layer.icomp, b.pos, s.n_ihead, s.idx_dim, b.scores)
        else:
            ops.indexer_scores_rows[ops.indexer_score_grid(n_rows, T), ops.ISC_THREADS, st](
                b.iq, b.head_w, scale, layer.icomp, b.pos, s.n_ihead, s.idx_dim, T, b.scores)
        ops.indexer_select[(1, T), BLOCK, st](memo_view(b.scores, "u32", lambda a: a.view(np.uint32)), b.pos, s.idx_topk,
                                              b.selected, b.n_selected)

    def _attn_out(self, b, il: int) -> bool:
        """Grouped low-rank output: 8 groups of heads through their o_lora slices, then out_b. The
        attention output is group-major, so group g's T input rows are one contiguous block.
        Returns whether out_b did the HC post too (decode, Q8_0 out_b: _hc_epilogue)."""
        s, st = self.spec, self.stream
        p = f"blk.{il}."
        T = b.T
        q_dim = s.n_head * s.head_dim              # attention_combine left b.attn Q8_0-quantized too
        group_in = q_dim // s.n_group
        name = p + "attn_output_a.weight"
        if T == 1 and self.info(name).ggml_type == GGML_Q8_0:       # decode: the 8 groups in one launch
            qk.matvec_q8_0_grouped(self.arena, self.off(name), s.n_group * s.o_lora, group_in, s.n_group,
                                   b.attn_q, b.attn_d, b.low, self.stream,
                                   scales_last=name in self.source.scales_last)
        else:
            for g in range(s.n_group):
                x0 = g * T * group_in
                self._proj(name, b.attn[x0:x0 + T * group_in], b.attn_q[x0:x0 + T * group_in],
                           b.attn_d[x0 // 32:(x0 + T * group_in) // 32],
                           b.low[g * T * s.o_lora:(g + 1) * T * s.o_lora], T,
                           rows=s.o_lora, row0=g * s.o_lora, k=group_in)
        if T == 1:                          # group-major is token-major for one token
            low = b.low
        else:
            low_w = s.n_group * s.o_lora
            ops.groups_to_tokens[((low_w + BLOCK - 1) // BLOCK, T), BLOCK, st](b.low, s.n_group, s.o_lora,
                                                                               b.low_tok)
            low = b.low_tok
        qk.quantize_q8_0(low, b.low_q, b.low_d, st)
        name_b = p + "attn_output_b.weight"
        hc = self._hc_epilogue(b, b.zeros) if self.info(name_b).ggml_type == GGML_Q8_0 else None
        if hc is not None:
            self._join("hc")
        self._proj(name_b, None, b.low_q, b.low_d, b.f_attn, T, hc=hc)
        return hc is not None

    def _on(self, group: str) -> bool:
        """False for a group of launches left out while profiling (see profile()); a subgroup is
        also off when its group is."""
        return group not in self.skip and self.SUBGROUPS.get(group) not in self.skip

    def _compressor(self, b, prefix, ratio, head_dim, freqs, pair_flat, kv_state, score_state, cache,
                    indexer_lane, pos0, ext):
        """A compressor lane over the T tokens: in one block, token by token (decode: compressor_step),
        or, for a prefill chunk (pos0 known on the host), staged, pooled one block per window and
        carried over (compressor_chunk_*: the same rows and state, in parallel)."""
        s, st = self.spec, self.stream
        T = b.T
        width = (2 if ratio == 4 else 1) * head_dim
        pair = memo_view(pair_flat, ("pair", T, width), lambda a: a[:T * 2 * width].reshape(T, 2 * width))
        pair_kv = memo_view(pair, "kv", lambda a: a[:, :width])
        pair_gate = memo_view(pair, "gate", lambda a: a[:, width:])
        self._proj_pair(prefix + "_kv.weight", prefix + "_gate.weight", b.x, None, None, pair, T)
        threads = BLOCK if head_dim <= BLOCK else ops.BLOCK2    # its scratch holds BLOCK2
        assert head_dim <= ops.BLOCK2, "compressor_step handles head_dim <= BLOCK2"
        assert ratio <= ops.COMP_MAX_RATIO, f"compress ratio {ratio} > {ops.COMP_MAX_RATIO}"
        ape_off, norm_off = self.off16(prefix + "_ape.weight"), self.off32(prefix + "_norm.weight")
        if pos0 is not None and ext is not None and T > 1:
            n_state = kv_state.shape[0]
            ext_kv, ext_sc = (memo_view(a, ("ext", n_state + T, width),
                                        lambda a: a[:(n_state + T) * width].reshape(n_state + T, width))
                              for a in ext)
            ops.compressor_chunk_stage[n_state + T, min(width, ops.BLOCK2), st](
                pair_kv, pair_gate, self.w16, ape_off, pos0, ratio, kv_state, score_state,
                ext_kv, ext_sc)
            n_rows = (pos0 + T) // ratio - pos0 // ratio
            if n_rows:
                ops.compressor_chunk_rows[n_rows, threads, st](
                    ext_kv, ext_sc, n_state, pos0, ratio, head_dim, self.w32, norm_off, s.rms_eps, s.n_rot,
                    freqs, indexer_lane, cache)
            ops.compressor_chunk_carry[(width + BLOCK - 1) // BLOCK, BLOCK, st](
                ext_kv, ext_sc, pos0, T, ratio, kv_state, score_state)
            return
        ops.compressor_step[1, threads, st](
            pair_kv, pair_gate, self.w16, ape_off, self.w32, norm_off, s.rms_eps, b.pos,
            ratio, head_dim, s.n_rot, freqs, indexer_lane, kv_state, score_state, cache)

    def _ffn_route(self, b, il: int):
        s, st = self.spec, self.stream
        p = f"blk.{il}."
        if self._on("hc"):
            self._hc_pre(b, p, "ffn", p + "ffn_norm.weight")
        if self._on("shared"):
            with self._branch():              # joined before hc_post, in _ffn_experts
                self._shared_expert(b, il)
        if b is self.buf and self._on("moe"):  # decode: joined before the experts run
            with self._branch("aux"):
                qk.moe_decode_input(b.x[0], b.moe_work, self.stream)
        if not self.experts_resident:         # the graph is cut after the router: join inside it
            self._join()
            self._join("aux")
            self._join("hc")
        if not self._on("router"):
            return
        self._proj(p + "ffn_gate_inp.weight", b.x, None, None, b.router, b.T)
        is_hash = il < s.n_hash
        has_bias = (p + "exp_probs_b.bias") in self.model.file.tensors
        if self._on("route"):
            ops.route[(1, b.T), BLOCK, st](
                b.router, b.token, self.w32, self.off32(p + "exp_probs_b.bias") if has_bias else 0, has_bias,
                self.i32, self.off(p + "ffn_gate_tid2eid.weight") // 4 if is_hash else 0, is_hash, s.n_used,
                s.expert_weights_scale, self.expert_bases[il] if self.expert_bases[il] is not None
                else self._zero_bases, b.expert_ids, b.route_w, b.slot_offsets)

    def _ffn_experts(self, b, il: int, prefill: bool = False):
        """Routed experts (decode: moe_decode on the device-side slot offsets; prefill: moe_prefill,
        tokens grouped by expert), then HC post once the shared expert (side stream) is joined."""
        s, st = self.spec, self.stream
        p = f"blk.{il}."
        clamp = s.swiglu_clamp[il]
        arena = self.source.expert_arena
        gate_type = self.info(p + "ffn_gate_exps.weight").ggml_type
        down_type = self.info(p + "ffn_down_exps.weight").ggml_type
        post_done = False
        if self._on("moe"):
            if not prefill:                   # its input was quantized in _ffn_route
                self._join("aux")
                hc = self._hc_epilogue(b, b.sh_out)

                def before_down():            # the shared expert's output and the post gates
                    self._join()
                    self._join("hc")
                qk.moe_decode_experts(arena, b.slot_offsets[0], gate_type, down_type, b.route_w[0], clamp,
                                      b.moe_out[0], b.moe_work, st, before_down=before_down if hc else None,
                                      hc=hc)
                post_done = hc is not None
            else:
                ids, table = self._prefill_experts(b, il)
                qk.moe_prefill(arena, table, gate_type, down_type, s.n_embd, s.n_ff, b.x, ids, b.route_w, clamp,
                               b.moe_out, st)
        self._join()
        if self._on("hc"):
            self._hc_post(b, b.moe_out, b.sh_out, self._next_fn(il, "ffn"), done=post_done)

    def _prefill_experts(self, b, il: int):
        """(expert ids, offset table) for moe_prefill. Resident experts: both stay on the device
        (moe_prefill groups the tokens there; no host sync). With an expert cache the host reads
        the chunk's ids and makes those experts resident first (the table rows of the others stay
        0 and are never read)."""
        if self.experts_resident:
            table = self._expert_tables_dev.get(il)
            if table is None:
                table = self._expert_tables_dev[il] = cuda.to_device(self.expert_table(il), stream=self.stream)
            return b.expert_ids, table
        ids = b.expert_ids.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        used = np.unique(ids)
        table = np.zeros((self.spec.n_exp, 3), np.int64)
        table[used] = self.source.fetch_experts(il, used, stream=self.stream)
        return ids, table

    def _prefill_chunk_limit(self) -> int:
        """Most tokens per prefill chunk: with an expert cache smaller than a layer's experts, few
        enough that a chunk's experts (n_used per token at most) fit in the cache together."""
        held = self.source.experts_at_once()
        if held is None or held >= self.spec.n_exp:
            return self.prefill_chunk
        return max(1, min(self.prefill_chunk, held // self.spec.n_used))

    def _shared_expert(self, b, il: int):
        s, st = self.spec, self.stream
        p = f"blk.{il}."
        self._proj_pair(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight", b.x, b.xq, b.xd,
                        b.sh_gate_up, b.T)
        ops.swiglu_q8[(1, b.T), ops.wide_block(), st](b.sh_gate, b.sh_up, s.swiglu_clamp[il], b.sh_mid,
                                                      b.sh_q, b.sh_d)
        self._proj(p + "ffn_down_shexp.weight", None, b.sh_q, b.sh_d, b.sh_out, b.T)

    def _head(self, b):
        """Output head of b's last token: logits, then the greedy pick."""
        s, st = self.spec, self.stream
        last = b.T - 1                  # the mixer partials came with the last _hc_post
        ops.hc_head[(1, 1), ops.wide_block(), st](
            b.state[last:], b.part_dot[last:, :s.n_hc], b.part_sq[last:], self.w32,
            self.off32("output_hc_scale.weight"),
            self.off32("output_hc_base.weight"), self.off32("output_norm.weight"),
            s.hc_eps, s.rms_eps, b.x[:1], b.xq[:1], b.xd[:1])
        self._proj("output.weight", None, b.xq[:1], b.xd[:1], b.logits, 1)
        ops.argmax_partial[ops.ARGMAX_BLOCKS, BLOCK, st](b.logits, b.forbid, b.argmax_val, b.argmax_idx)
        ops.argmax_finish[1, BLOCK, st](b.argmax_val, b.argmax_idx, b.next_token)

    def _segments(self):
        """The decode step as a list of launch functions; the host runs `_between(il)` after
        segment il when experts must be made resident first."""
        s, b = self.spec, self.buf
        segments = []

        def first():
            self._embed(b)
            self._attention(b, 0)
            self._ffn_route(b, 0)
        segments.append(first)
        for il in range(s.n_layer):
            def middle(il=il):
                self._ffn_experts(b, il)
                if il + 1 < s.n_layer:
                    self._attention(b, il + 1)
                    self._ffn_route(b, il + 1)
                elif self._on("head"):
                    self._head(b)
                    ops.advance_token[1, 32, self.stream](b.next_token, b.token, b.pos)
            segments.append(middle)
        return segments

    # ---- running ---------------------------------------------------------------------------------

    def _capture(self, segments, programmatic: bool) -> CapturedGraph:
        """One graph of the given decode segments, launched in order on the main stream."""
        graph = CapturedGraph(self.stream, programmatic=programmatic)
        with graph:
            for seg in segments:
                seg()
        return graph

    def _build_graphs(self):
        """Capture the step (its kernels were compiled and loaded by _warm_up): one graph with
        resident experts, else one per segment (the host fetches experts between them)."""
        segments = self._segments()
        if self.experts_resident:
            self._graphs = [self._capture(segments, self.pdl)]
        else:
            self._graphs = [self._capture([seg], self.pdl) for seg in segments]

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
        ids = b.expert_ids.copy_to_host(stream=self.stream)[0]
        self.stream.synchronize()
        offsets = np.ascontiguousarray(self.source.fetch_experts(il, ids, stream=self.stream), dtype=np.int64)
        b.slot_offsets[0].copy_to_device(offsets, stream=self.stream)

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

    def decode_greedy_run(self, token: int, n: int, forbid: int = -1):
        """n greedy steps after `token`, yielding each step's pick as it is read back. With the
        step as one graph (resident experts), step k + 1 is launched before token k is read:
        advance_token leaves each step's pick and position on the device for the next, so the
        host's launch, copies and Python overlap the GPU's work instead of following it. Runs
        exactly n steps (none ahead of what the caller asked for: a launched step cannot be taken
        back, the ratio-4 compressors move their window at its end). Same tokens as n calls of
        decode_greedy."""
        if n <= 0:
            return
        if not (self.use_graphs and self.experts_resident):
            for _ in range(n):
                token = self.decode_greedy(token, forbid)
                yield token
            return
        if forbid != self._forbid:
            self.buf.forbid.copy_to_device(np.array([forbid], np.int32), stream=self.stream)
            self._forbid = forbid
        slots, events = self._token_slots, self._token_events

        def read_back(k):          # step k's pick into pinned slot k % 2, in stream order
            self.buf.next_token.copy_to_host(slots[k % 2:k % 2 + 1], stream=self.stream)
            events[k % 2].record(self.stream)

        self._step(token, self._n_past)            # copies the first token and position
        self._n_past += 1
        read_back(0)
        for k in range(1, n + 1):
            if k < n:
                self._graphs[0].replay()           # reads what step k - 1 left on the device
                self._n_past += 1
                read_back(k)
            events[(k - 1) % 2].synchronize()
            yield int(slots[(k - 1) % 2])

    def prefill(self, tokens) -> np.ndarray:
        """Evaluate a prompt at positions n_past.. and return the logits of its last token.

        Batched, in chunks of up to prefill_chunk tokens (prefill_batched); with an expert cache
        each layer first makes the chunk's experts resident (fewer tokens per chunk when the cache
        cannot hold a whole layer)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) > 1:
            return self.prefill_batched(tokens)
        return self.prefill_by_token(tokens)

    def prefill_by_token(self, tokens) -> np.ndarray:
        """The prompt as a sequence of decode steps (the reference for prefill_batched)."""
        for token in tokens[:-1]:
            self._step(int(token), self._n_past)
            self._n_past += 1
        return self.decode(int(tokens[-1]))

    def prefill_batched(self, tokens, chunk: int | None = None) -> np.ndarray:
        """Chunks of up to `chunk` (<= prefill_chunk) tokens, each through the model layer by layer
        with the same kernels as decode (T tokens per launch); the output head runs for the last
        prompt token only. Launched eagerly (few launches per chunk); with resident experts no host
        sync until the logits (moe_prefill groups the tokens on the device), with an expert cache one
        per layer (the chunk's expert ids, for the fetch)."""
        limit = self._prefill_chunk_limit()
        P = min(chunk or limit, limit)
        if self._prefill_scratch is None:
            self._prefill_scratch = Scratch(self.spec, self.max_rows, self.prefill_chunk, self.PREFILL_SPLITS,
                                            self.attention_f64)
        st = self.stream
        b = None
        with _no_gc():
            for start in range(0, len(tokens), P):
                b = self._prefill_chunk(tokens[start:start + P])
        self._head(b)
        logits = b.logits.copy_to_host(stream=st)
        st.synchronize()
        return logits

    def _prefill_chunk(self, part):
        """One chunk of prefill_batched through every layer; returns its scratch view."""
        s, st = self.spec, self.stream
        T = len(part)
        b = self._prefill_scratch.view(T)
        pos0 = self._n_past
        b.token.copy_to_device(np.asarray(part, np.int32), stream=st)
        b.pos.copy_to_device(np.arange(pos0, pos0 + T, dtype=np.int32), stream=st)
        self._embed(b)
        for il in range(s.n_layer):
            self._attention(b, il, pos0)
            self._ffn_route(b, il)
            self._ffn_experts(b, il, prefill=True)
        self._n_past += T
        return b

    WARM_TOKENS = 16        # a throwaway chunk: enough tokens for the tensor-core paths

    def warm_up(self) -> None:
        """Compile and capture before anything is timed. Numba compiles a kernel at its first
        launch, so a benchmark's first prefill, and its first chunk past position 4·idx_topk
        (where the indexer starts selecting: other kernels), would include compile time. Runs a
        throwaway chunk of a whole prefill_chunk at position 0 (the first chunk of that size also
        grows the MoE scratch and fills the launch memo for its views: 0.2-0.3 s of host time
        that the first timed prefill paid after a short warm-up, session 16/17 on the H200), and,
        when the context allows, a short one past that threshold, then one decode step (graph
        capture), and puts the state back. The chunks repeat one token, so every position routes
        to the same experts: with an expert cache a warm-up fetches 6 experts per layer, not a
        chunk's worth (its first page-cache bench spent 12 s of compiling inside the clock,
        session 19); the source then rewinds its counters and forgets those experts."""
        if not self.use_graphs or self.n_ctx <= self.WARM_TOKENS:
            return
        saved, mark = self.snapshot(), self.source.mark()
        # one chunk of the size prefill_batched will use (smaller with a small expert cache)
        chunks = [(0, min(self._prefill_chunk_limit(), self.n_ctx - 1))]
        selecting_from = self.spec.indexer_selects_from
        if selecting_from + self.WARM_TOKENS + 1 <= self.n_ctx:
            chunks.append((selecting_from, self.WARM_TOKENS))
        for pos0, n_tokens in chunks:
            self._n_past = pos0
            self.prefill_batched([0] * n_tokens)
        self.decode(0)
        self.restore(saved)
        self.source.rewind(mark)

    GROUPS = ("hc", "attn_proj", "compress", "index", "attention", "attn_out", "router", "moe",
              "shared", "head")
    # single launches inside a group, timed apart by profile() too: subgroup -> its group
    SUBGROUPS = {"hc_mix": "hc", "hc_pre": "hc", "hc_post": "hc", "q_norm": "attn_proj",
                 "q_heads": "attn_proj", "combine": "attention", "route": "router"}

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

        def time_serial(graph) -> float:
            """ms per step when each replay waits for the one before, as a token loop does."""
            graph.replay()
            self.stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                graph.replay()
                self.stream.synchronize()
            return (time.perf_counter() - t0) * 1e3 / reps

        def time_tokens() -> float:
            """ms per decode_greedy call: the serial step plus the token/position copies in, the
            token copy out and the Python around them."""
            tok = token
            t0 = time.perf_counter()
            for _ in range(reps):
                tok = self.decode_greedy(tok)
            return (time.perf_counter() - t0) * 1e3 / reps

        result = {"step_ms": time_graph(full), "step_ms_serial": time_serial(full), "token_ms": time_tokens(),
                  "nodes": full.n_nodes, "programmatic_edges": full.programmatic_edges}
        other = self._capture(self._segments(), not self.pdl)   # the same step, the other kind of edges
        result["step_ms_pdl_off" if self.pdl else "step_ms_pdl_on"] = time_graph(other)
        other.close()
        for group in self.GROUPS + tuple(self.SUBGROUPS):
            self.skip = {group}
            graph = self._capture(self._segments(), self.pdl)
            result[group] = result["step_ms"] - time_graph(graph)
            graph.close()
        self.skip = set()
        self.restore(saved)
        return result
