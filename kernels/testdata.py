"""Random valid GGUF weights and float64 references, for the kernel tests and the benchmark.

Random blocks follow ds4-model.md §12.3: random bytes everywhere, with the f16 scale fields
overwritten by finite values sized for a weight std of about sigma (every other bit pattern of a
block is valid). The references dequantize with gguf-py (the independent oracle) and apply the
same activation quantization ds4 does, in float64.
"""

import numpy as np

from . import formats as F

# per-type f16 scale fields: (byte offset in the block, divisor of sigma)
_SCALE_FIELDS = {
    F.Q8_0: ((0, 74.0),),
    F.IQ2_XXS: ((0, 55.0),),
    F.Q2_K: ((80, 12.0), (82, 8.0)),
    F.Q4_K: ((0, 140.0), (2, 230.0)),
}


def random_weights(ggml_type, shape, rng, sigma=None):
    """Raw GGUF bytes of a random tensor: shape = (rows, K) or (n_exp, rows, K) in weights.

    Returns uint8[..., row_bytes]. sigma defaults to 1/sqrt(K)."""
    *lead, K = shape
    sigma = 1.0 / np.sqrt(K) if sigma is None else sigma
    rows = int(np.prod(lead))
    if ggml_type in (F.F16, F.F32):
        dt = np.float16 if ggml_type == F.F16 else np.float32
        w = (rng.standard_normal((rows, K), dtype=np.float32) * sigma).astype(dt)
        return w.view(np.uint8).reshape(*lead, -1)
    weights, nbytes = F.BLOCK_GEOMETRY[ggml_type]
    nblk = K // weights
    blocks = rng.integers(0, 256, size=(rows, nblk, nbytes), dtype=np.uint8)
    for off, div in _SCALE_FIELDS[ggml_type]:
        scale = (sigma / div) * rng.uniform(0.5, 1.5, size=(rows, nblk))
        blocks[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, nblk, 2)
    return blocks.reshape(*lead, nblk * nbytes)


def dequantize(w, ggml_type):
    """float64 weights of raw bytes w (..., row_bytes) through gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = np.ascontiguousarray(w)
    if ggml_type == F.F32:
        return w.view(np.float32).astype(np.float64)
    return gguf_dequantize(w, GGMLQuantizationType(ggml_type)).astype(np.float64)


def split_scale_min(w, ggml_type):
    """(scale part, min part) of Q2_K/Q4_K bytes: the same blocks with dmin = 0, resp. d = 0.

    w = d*sc*q - dmin*m, and the two parts can cancel; error bounds use both magnitudes."""
    d_off, m_off = {F.Q2_K: (80, 82), F.Q4_K: (0, 2)}[ggml_type]
    nbytes = F.block_bytes(ggml_type)
    a = np.array(w, copy=True).reshape(*w.shape[:-1], -1, nbytes)
    b = a.copy()
    a[..., m_off:m_off + 2] = 0
    b[..., d_off:d_off + 2] = 0
    return a.reshape(w.shape), b.reshape(w.shape)


def dequantized_activation(x, ggml_type):
    """The activation ds4 multiplies with weights of ggml_type, in float64 (quantized for quants)."""
    from . import cpu

    kind = F.activation_kind(ggml_type)
    if kind == "q8_0":
        q, d = cpu.quantize_q8_0(x)
        return (q.reshape(-1, 32).astype(np.float64) * d[:, None].astype(np.float64)).ravel()
    if kind == "q8_k":
        q, d, _ = cpu.quantize_q8_k(x)
        return (q.reshape(-1, 256).astype(np.float64) * d[:, None].astype(np.float64)).ravel()
    return np.asarray(x, np.float64)


def reference_matvec(w, ggml_type, x, rows=None):
    """(float64 result, error magnitude M) for the selected rows.

    M = sum_i |w_i| |x_i| (for Q2_K/Q4_K with w split into its scale and min parts): the f32
    rounding of any summation order of the row is bounded by a small multiple of u*n_terms*M."""
    sel = np.arange(w.shape[0]) if rows is None else np.asarray(rows)
    xr = dequantized_activation(x, ggml_type)
    wsel = w[sel]
    W = dequantize(wsel, ggml_type)
    ref = W @ xr
    if ggml_type in (F.Q2_K, F.Q4_K):
        a, b = split_scale_min(wsel, ggml_type)
        mag = np.abs(dequantize(a, ggml_type)) @ np.abs(xr) + np.abs(dequantize(b, ggml_type)) @ np.abs(xr)
    else:
        mag = np.abs(W) @ np.abs(xr)
    return ref, mag


def f32_sum_bound(ggml_type, K, mag):
    """Bound on |f32 result - exact| for a row: (terms + 8) * 2u * M, u = 2^-24.

    Block types sum K/block f32 terms (each an exact integer dot times a product of two f32
    scales: 2 roundings), F16/F32 sum K products; any summation order obeys the same bound."""
    u = 2.0 ** -24
    terms = K // F.block_size(ggml_type) if ggml_type not in (F.F16, F.F32) else K
    return (terms + 8) * 2 * u * mag + 1e-30


def silu(z):
    return z / (1.0 + np.exp(-z))


def reference_moe(gate_w, up_w, down_w, gate_type, down_type, x, ids, route_w, clamp):
    """float64 routed MoE with ds4's activation quantizations (x and mid are quantized to Q8_K)."""
    xr = dequantized_activation(x, gate_type)
    out = np.zeros(down_w.shape[1], np.float64)
    for e, wk in zip(ids, route_w):
        g = dequantize(gate_w[e], gate_type) @ xr
        u = dequantize(up_w[e], gate_type) @ xr
        g = np.minimum(g, clamp)
        u = np.clip(u, -clamp, clamp)
        mid = (silu(g) * u * float(wk)).astype(np.float32)
        out += dequantize(down_w[e], down_type) @ dequantized_activation(mid, down_type)
    return out


def attention_inputs(rng, n_head, head_dim, n_swa, cap, ratio, n_comp_rows, positions, selected=None):
    """Random inputs of the attention kernels for tokens at `positions`: the raw ring [cap,
    head_dim] and compressed cache [n_comp_rows, head_dim] with f16-rounded values (as kv_finish
    and the compressors leave them), q [T, n_head·head_dim] (f32), the selection [T, width] with
    its counts (selected: one list of compressed rows per token, or None: all of them)."""
    n_tok = len(positions)
    raw = rng.normal(0, 1, (cap, head_dim)).astype(np.float16).astype(np.float32)
    comp = rng.normal(0, 1, (max(n_comp_rows, 1), head_dim)).astype(np.float16).astype(np.float32)
    q = rng.normal(0, 1, (n_tok, n_head * head_dim)).astype(np.float32)
    sels = [np.asarray(s, np.int32) for s in selected] if selected is not None else [np.zeros(0, np.int32)] * n_tok
    width = max(1, max(len(s) for s in sels))
    sel = np.zeros((n_tok, width), np.int32)
    for t, s in enumerate(sels):
        sel[t, :len(s)] = s
    return dict(q=q, raw=raw, comp=comp, selected=sel, n_selected=np.array([len(s) for s in sels], np.int32),
                pos=np.asarray(positions, np.int32), n_swa=n_swa, ratio=ratio, use_selected=selected is not None)


def attention_visible(inp, t):
    """The rows token t sees (§6.5), in the kernels' order: the raw window, then the compressed rows."""
    pos, n_swa, cap = int(inp["pos"][t]), inp["n_swa"], inp["raw"].shape[0]
    n_raw = min(pos + 1, n_swa)
    raw_rows = inp["raw"][[(pos + 1 - n_raw + i) % cap for i in range(n_raw)]]
    if inp["use_selected"]:
        comp_rows = inp["selected"][t, :inp["n_selected"][t]]
    else:
        comp_rows = np.arange((pos + 1) // inp["ratio"] if inp["ratio"] else 0)
    return np.concatenate([raw_rows, inp["comp"][comp_rows]]).astype(np.float64)


def attention_reference(inp, head_dim):
    """float64 softmax attention per token and head without the sink: (log Σexp of the scaled
    scores [T, n_head], the normalized output [T, n_head, head_dim])."""
    n_tok = len(inp["pos"])
    q = inp["q"].reshape(n_tok, -1, head_dim).astype(np.float64)
    lse = np.zeros(q.shape[:2])
    out = np.zeros(q.shape)
    for t in range(n_tok):
        rows = attention_visible(inp, t)
        s = q[t] @ rows.T / np.sqrt(head_dim)
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        den = e.sum(axis=1, keepdims=True)
        lse[t] = (m + np.log(den))[:, 0]
        out[t] = e @ rows / den
    return lse, out
