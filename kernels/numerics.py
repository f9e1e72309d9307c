"""Elementwise math written once for both engines.

The CUDA kernels compile these functions as device functions (kernels/cuda.py, cuda_ops.py) and
the CPU twins as njit functions (kernels/cpu.py, cpu_ops.py): the same source, so the same
operations in the same order. Inputs are f32; the arithmetic is f64 with one rounding to f32 at
the end. Products of f32 values are exact in f64, so NVVM's fusing of a multiply into an add (the
CPU never fuses) cannot change the f32 result, and the f64 exp of libdevice and of libm (each
within an ulp of f64) give the same f32 but for a ~2^-28 chance per value. Two f32 engines that
differ in their last bits flip rounding ties downstream (ds4's Q8 activations, the routers' top-k):
on the tiny model that moves logits by 4-13 % of their std, where a difference of 2^-40 moves
nothing (scripts/reference_sensitivity.py; notes/gpu-engine.md, Session 32).

Plain Python: the CUDA simulator runs these as they are, with Python's libm for exp. A function here
calls no other (each engine compiles each function on its own: a call would be an untyped global).
"""

import math

from numba import float32, float64


def swiglu(g, u, clamp, w):
    """silu(min(g, c))·clamp(u, ±c)·w (ds4-model.md §6.11; w: the route weight, 1 for the shared
    expert), from f32 values to an f32 value."""
    gc = float64(min(g, clamp))
    uc = float64(max(min(u, clamp), -clamp))
    return float32(gc / (1.0 + math.exp(-gc)) * uc * float64(w))


def rope_frequencies(spec, compressed: bool):
    """RoPE's angle per position of each pair k, float64 (θ = pos·freq[k], ds4-model.md §6.7):
    base^(−2k/n_rot); on compressed layers the compressed base with YaRN's blend
    freq/factor·(1 − ramp) + freq·ramp. One table for both engines (host numpy)."""
    import numpy as np
    k = np.arange(spec.n_rot // 2, dtype=np.float64)
    if not compressed:
        return spec.rope_freq_base ** (-2.0 * k / spec.n_rot)
    base = spec.compress_rope_freq_base
    freq = base ** (-2.0 * k / spec.n_rot)

    def corr(beta):
        return spec.n_rot * math.log(spec.rope_orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))
    low = max(0, math.floor(corr(spec.yarn_beta_fast)))
    high = min(spec.n_rot - 1, math.ceil(corr(spec.yarn_beta_slow)))
    ramp = 1.0 - np.clip((k - low) / max(0.001, high - low), 0.0, 1.0)
    return freq / spec.rope_scale_factor * (1 - ramp) + freq * ramp


def rotate_pair(x0, x1, theta, inverse):
    """One RoPE pair (x0, x1) rotated by the f64 angle θ (−θ: inverse), f32 values in and out."""
    c = math.cos(theta)
    s = -math.sin(theta) if inverse else math.sin(theta)
    a, b = float64(x0), float64(x1)
    return float32(a * c - b * s), float32(a * s + b * c)


# ---- Hyper-Connections (ds4-model.md §6.2, §6.12) ---------------------------------------------------
# The mixer's dot products are f64 sums of exact f32·f16 products on both engines (in different
# orders: the GPU over chunk partials, the CPU in one pass), rounded once here with the f32 RMS
# scale of the flat state. The gates and the Sinkhorn matrix are f64 from the f32 mix; the collapse
# y = Σ_h a_h·X_h is f64 and rounded once after its norm.

def hc_mix_value(dot, rs):
    """One mixer value from its f64 dot product over the unnormalized flat state and the state's
    f32 RMS scale: (Σ fn·x)·rs, which is Σ fn·(x·rs) but for the rounding."""
    return float32(dot * float64(rs))


def hc_logit(mix, scale, base):
    """A gate's or a comb entry's logit mix·scale + base, f64 (the product of two f32 is exact)."""
    return float64(mix) * float64(scale) + float64(base)


def hc_pre_gate(mix, scale, base, eps):
    """The weight of an HC stream in a sublayer's (or the head's) input: sigmoid(logit) + eps."""
    logit = float64(mix) * float64(scale) + float64(base)     # hc_logit (these functions call no other)
    return float32(1.0 / (1.0 + math.exp(-logit)) + float64(float32(eps)))


def hc_post_gate(mix, scale, base):
    """The weight of a sublayer's output in an HC stream: 2·sigmoid(logit)."""
    logit = float64(mix) * float64(scale) + float64(base)     # hc_logit
    return float32(2.0 / (1.0 + math.exp(-logit)))


def hc_normed(y, scale, w):
    """One value of the collapsed, RMS-normed sublayer input: y (f64) · scale (f32 RMS scale) · w."""
    return float32(y * float64(scale) * float64(w))


# ---- router (ds4-model.md §6.11) ---------------------------------------------------------------------

def router_prob(z):
    """An expert's unbiased probability sqrt(softplus(z)) from its f32 logit: f64 inside (softplus
    = z past 20, e^z below −20, else log1p(e^z)), one rounding."""
    x = float64(z)
    if x > 20.0:
        sp = x
    elif x < -20.0:
        sp = math.exp(x)
    else:
        sp = math.log1p(math.exp(x))
    return float32(math.sqrt(sp))
