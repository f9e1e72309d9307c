#!/bin/bash
# On the GPU machine: GPU kernel tests, then the kernel benchmark. Logs and JSON go to $OUT.
# usage (device run, carry [".whl"]): bash scripts/device-kernels.sh [tests|bench|all] [bench parts]
set -o pipefail
source scripts/device-prelude.sh || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
what=${1:-all}
parts=${2:-dense,moe,layer,prefill,tune}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee $OUT/gpu.txt
if [ "$what" != bench ]; then
  timeout 300 python3 -m pytest -m gpu tests/test_kernels_cuda.py -q -rf --timeout=90 2>&1 | tee $OUT/gpu_tests.log
fi
if [ "$what" != tests ]; then
  timeout 300 python3 scripts/bench_kernels.py --out $OUT/bench_kernels.json --parts $parts 2>&1 | tee $OUT/bench.log
fi
