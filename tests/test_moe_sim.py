"""The MoE decode kernel variants of kernels/cuda.py in numba's CUDA simulator (no GPU):
moe_down_sb (a lane per Q2_K super-block) and moe_gate_up_halves against the
shipped decode kernels, bit for bit, and the decode matvecs against their CPU twins, bit for bit
(scripts/check_moe_decode_sim.py, in a subprocess: it sets NUMBA_ENABLE_CUDASIM before numba
loads). They check their indexing and sum order; the compiled kernels are tested on the GPU
(test_kernels_cuda.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_moe_decode_sim.py"


# the cases each part prints: down 10 (rows of 8, 4, 3, 1 super-blocks; experts on and off 16 bytes;
# 4, 8 and 12 rows a block; with and without the HC post; none or 2 weight groups (the default: 1)
# copied before the wait), halves 9 (K 256 .. 4096 against the
# decode kernel, the SwiGLU per unit at K 768 and 4096, repacked rows at K 2048 and 4096, the
# deferred SwiGLU's flushes), twins 20 (Q8_0 split-K 1 / 2 / 4, a pair launch
# and the pairs kernel; F16 split-K 1 / 4 and a partial step; IQ2_XXS, Q2_K and Q4_K rows of 1 .. 16
# super-blocks; the routed gate/up with its SwiGLU; the routed down projection's slot sums)
@pytest.mark.parametrize("which,n_cases", [("down", 10), ("halves", 9), ("twins", 20)])
def test_moe_decode_variants_give_the_shipped_bits_in_the_simulator(which, n_cases):
    r = subprocess.run([sys.executable, str(SCRIPT), which], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "all MoE decode simulator checks passed" in r.stdout, \
        (r.stdout[-3000:] + r.stderr[-3000:])
    assert r.stdout.count("ok ") == n_cases and "BAD" not in r.stdout
