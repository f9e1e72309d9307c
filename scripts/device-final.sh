#!/usr/bin/env bash
# One device call for the end of a session (carry [".whl", ".data"]): the GPU tests, then the engine
# bench (BENCH_ARGS), then, with PROFILE_CHUNK set, the per-kernel ncu profile of a 512-token
# prefill chunk ending at position 2,047 (~420 s in all with a cold start, session 12).
source scripts/device-prelude.sh >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
timeout ${TESTS_S:-300} python3 -m pytest -m gpu -q -p no:warnings > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -8
BENCH_S=${BENCH_S:-280} bash scripts/device-engine.sh bench
if [ -n "${PROFILE_CHUNK:-}" ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  timeout ${PROFILE_S:-150} $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/profile_step.py --prompt 1535 --prefill 512 > $OUT/ncu_prefill.csv 2>/dev/null
  python3 scripts/profile_step.py --summarize $OUT/ncu_prefill.csv > $OUT/prefill_kernels.txt
  head -14 $OUT/prefill_kernels.txt
fi
