"""Environment shims for numba-cuda, applied once before the first CUDA compile.

NumPy 2.5 removed ``np.row_stack``; numba-cuda 0.30.4 registers an overload for it while its
array support loads, so the first kernel compile fails with AttributeError (NVIDIA/numba-cuda#907,
closed won't-fix). Aliasing it to ``np.vstack`` (what it always was) restores the old behaviour.

numba-cuda warns (NumbaPerformanceWarning) at every launch of a grid of fewer than 128 blocks. The
decode chain launches such grids on purpose (one block per token for the Sinkhorn, 16 for the HC
post...): a GPU `ds4py run` printed 58 of them. They are off unless NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS
is set.
"""

import os
import sys

import numpy as np

_applied = False


def apply() -> None:
    """Install the shims (idempotent). Must run before numba.cuda compiles anything."""
    global _applied
    if _applied:
        return
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
        os.environ["NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS"] = "0"     # read when numba-cuda loads
        config = sys.modules.get("numba.cuda.core.config")
        if config is not None:                                    # it loaded before this shim
            config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
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
