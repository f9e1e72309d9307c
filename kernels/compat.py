"""Environment shims for numba-cuda, applied once before the first CUDA compile.

NumPy 2.5 removed ``np.row_stack``; numba-cuda 0.30.4 registers an overload for it while its
array support loads, so the first kernel compile fails with AttributeError (NVIDIA/numba-cuda#907,
closed won't-fix). Aliasing it to ``np.vstack`` (what it always was) restores the old behaviour.
"""

import numpy as np

_applied = False


def apply() -> None:
    """Install the shims (idempotent). Must run before numba.cuda compiles anything."""
    global _applied
    if _applied:
        return
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    _applied = True


apply()


def cuda_available() -> bool:
    """True when numba-cuda can see a usable GPU. Never raises."""
    try:
        from numba import cuda

        if getattr(cuda.config, "ENABLE_CUDASIM", False):
            return False
        return bool(cuda.is_available())
    except Exception:
        return False
