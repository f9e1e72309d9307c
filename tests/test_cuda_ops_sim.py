"""The GPU engine's non-quant kernels against the float64 reference: in Numba's CUDA simulator
(no GPU needed; shared-memory reductions) and, marked gpu, on the device (warp-shuffle paths).

The simulator has to be selected before numba is imported, so the checks run in a subprocess.
They compare each kernel with the float64 reference functions on fresh random inputs: the seed is
drawn per run and printed (DS4PY_TEST_SEED reproduces a run)."""

import os
import secrets

import pytest
import subprocess
import sys
from pathlib import Path


def run_checks(simulator: bool):
    seed = int(os.environ.get("DS4PY_TEST_SEED", secrets.randbelow(2**31)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1" if simulator else "0")
    script = Path(__file__).with_name("cuda_ops_sim_checks.py")
    # ~10-19 minutes in the simulator on 2 cores (session 14), most of CI's time; the bound only
    # catches a hang
    r = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True, timeout=3000)
    print(f"seed {seed}\n{r.stdout}")
    assert r.returncode == 0, f"seed {seed}\n" + r.stdout[-3000:] + r.stderr[-3000:]
    assert "all cuda_ops simulator checks passed" in r.stdout


def test_cuda_ops_in_simulator():
    run_checks(simulator=True)


@pytest.mark.gpu
def test_cuda_ops_on_gpu():
    run_checks(simulator=False)
