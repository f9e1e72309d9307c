#!/bin/bash
# On the GPU machine: GPU kernel tests, the kernel benchmark, optionally an ncu profile.
# Logs and JSON go to $OUT.
# usage (device run, carry [".whl"]): bash scripts/device-kernels.sh [tests|bench|all|profile|all+profile] [bench parts]
set -o pipefail
source scripts/device-prelude.sh || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
what=${1:-all}
parts=${2:-dense,moe,layer,prefill,tune}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee $OUT/gpu.txt
case $what in tests|all|all+profile)
  timeout 300 python3 -m pytest -m gpu tests/test_kernels_cuda.py -q -rf --timeout=90 -p no:warnings 2>&1 | tee $OUT/gpu_tests.log ;;
esac
case $what in bench|all|all+profile)
  timeout 300 python3 scripts/bench_kernels.py --out $OUT/bench_kernels.json --parts $parts 2>&1 | tee $OUT/bench.log ;;
esac
case $what in profile|all+profile)
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    timeout 150 $NCU --clock-control none --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis -k 'regex:moe_|q8_0_rows' \
      --launch-skip 3 --launch-count 6 \
      python3 -c "from ds4py.kernels.bench import profile_target; profile_target()" > $OUT/ncu.txt 2>&1
    grep -E "^  [a-zA-Z_]|Duration|Throughput|Achieved Occupancy|Registers|Stall|Warp Cycles|Issued|Eligible|No Eligible|Theoretical Occ|L1/TEX Hit|Block Limit" $OUT/ncu.txt | head -120
  else
    echo "no ncu found"
  fi ;;
esac
