"""The GPU engine's non-quant kernels, run in Numba's CUDA simulator (no GPU needed).

The simulator has to be selected before numba is imported, so the checks run in a subprocess.
They compare each kernel with the float64 reference functions on fresh random inputs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_ops_in_simulator(seed):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = Path(__file__).with_name("cuda_ops_sim_checks.py")
    r = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all cuda_ops simulator checks passed" in r.stdout
