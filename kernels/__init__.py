"""Numba CUDA kernels and their Numba CPU twins (installed as ds4py.kernels)."""
