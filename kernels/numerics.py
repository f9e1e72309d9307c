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

Plain Python: the CUDA simulator runs these as they are, with Python's libm for exp.
"""

import math

from numba import float32, float64


def swiglu(g, u, clamp, w):
    """silu(min(g, c))·clamp(u, ±c)·w (ds4-model.md §6.11; w: the route weight, 1 for the shared
    expert), from f32 values to an f32 value."""
    gc = float64(min(g, clamp))
    uc = float64(max(min(u, clamp), -clamp))
    return float32(gc / (1.0 + math.exp(-gc)) * uc * float64(w))
