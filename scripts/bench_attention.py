"""Prefill attention on the H200: attention_partial (one split, f64 sums) against attention_prefill_mma
(tensor cores; also its variant without the staging prefetch), a 512-token chunk from position 2048 (flash shape: 64 heads x 512 dims, window 128 +
512 selected compressed rows = 640 visible rows per token). CUDA events, median of --reps launches.

    python scripts/bench_attention.py [--tokens 512] [--pos 2048] [--reps 20]

Prints each kernel's ms and the largest differences of the normalized output (relative to its
largest value) and of log Σexp between the two."""
import argparse

import numpy as np
from numba import cuda

from ds4py.kernels import cuda_ops as ops, testdata as TD


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--pos", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=512)
    a = ap.parse_args()
    n_head, head_dim, n_swa, ratio, T = a.heads, ops.ATTN_MMA_DIM, 128, 4, a.tokens
    rng = np.random.default_rng(0)
    positions = a.pos + np.arange(T)
    n_comp = (int(positions[-1]) + 1) // ratio
    selected = [np.sort(rng.choice((p + 1) // ratio, min(a.top_k, (p + 1) // ratio), replace=False)) for p in positions]
    inp = TD.attention_inputs(rng, n_head, head_dim, n_swa, n_swa + T, ratio, n_comp, positions, selected)
    rows = min(a.pos + 1, n_swa) + min(a.top_k, (a.pos + 1) // ratio)   # the first token's
    args = [cuda.to_device(inp[k]) for k in ("q", "raw", "comp", "selected", "n_selected", "pos")]
    args += [inp["n_swa"], inp["ratio"], inp["use_selected"]]
    outs = {}
    for name in ("attention_partial", "attention_prefill_mma", "attention_prefill_mma_no_prefetch"):
        pm = cuda.device_array((T, n_head, 1), np.float64)      # the engine's f64 partials
        pd = cuda.device_array((T, n_head, 1), np.float64)
        pa = cuda.device_array((T, n_head, 1, head_dim), np.float64)
        if name == "attention_partial":
            def launch():
                ops.attention_partial[((n_head + ops.ATTN_HEADS - 1) // ops.ATTN_HEADS, 1, T), ops.ATTN_THREADS](
                    *args, head_dim, pm, pd, pa)
        else:
            def launch(kernel=getattr(ops, name)):
                kernel[(n_head // ops.ATTN_MMA_HEADS, 1, T), ops.ATTN_MMA_THREADS](*args, pm, pd, pa)
        launch()
        cuda.synchronize()
        times = []
        for _ in range(a.reps):
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            launch()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        ms = float(np.median(times))
        m = pm.copy_to_host()[:, :, 0].astype(np.float64)
        den = pd.copy_to_host()[:, :, 0].astype(np.float64)
        outs[name] = (m + np.log(den), pa.copy_to_host()[:, :, 0] / den[:, :, None], ms)
        flops = 2 * 2 * T * n_head * rows * head_dim
        print(f"{name:34s} {ms:8.3f} ms  ({flops / ms / 1e9:6.1f} TFLOPS of q·k + p·v, {T} tokens x "
              f"{n_head} heads x {rows} rows)")
    l0, o0, ms0 = outs["attention_partial"]
    for name in ("attention_prefill_mma", "attention_prefill_mma_no_prefetch"):
        l1, o1, ms1 = outs[name]
        print(f"{name}: speed-up {ms0 / ms1:.2f}x; max|Δ out| / max|out| "
              f"{np.max(np.abs(o1 - o0)) / np.max(np.abs(o0)):.3g}, max|Δ log Σexp| {np.max(np.abs(l1 - l0)):.3g}")
    if T <= 64:       # the float64 reference is slow beyond
        lse, out = TD.attention_reference(inp, head_dim)
        for name, (l_, o_, _) in outs.items():
            print(f"{name} vs float64: max|Δ out| / max|out| {np.max(np.abs(o_ - out)) / np.max(np.abs(out)):.3g}, "
                  f"max|Δ log Σexp| {np.max(np.abs(l_ - lse)):.3g}")


if __name__ == "__main__":
    main()
