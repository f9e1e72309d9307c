"""The GPU engine's non-quant kernels, run in Numba's CUDA simulator (no GPU needed).

The simulator has to be selected before numba is imported, so the checks run in a subprocess.
They compare each kernel with the float64 reference functions on fresh random inputs: the seed is
drawn per run and printed (DS4PY_TEST_SEED reproduces a run)."""

import os
import secrets
import subprocess
import sys
from pathlib import Path


def test_cuda_ops_in_simulator():
    seed = int(os.environ.get("DS4PY_TEST_SEED", secrets.randbelow(2**31)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = Path(__file__).with_name("cuda_ops_sim_checks.py")
    r = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True, timeout=1200)
    print(f"seed {seed}\n{r.stdout}")
    assert r.returncode == 0, f"seed {seed}\n" + r.stdout[-3000:] + r.stderr[-3000:]
    assert "all cuda_ops simulator checks passed" in r.stdout
