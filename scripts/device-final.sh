#!/usr/bin/env bash
# One device call for the end of a session (carry [".whl", ".data"]): kbench tune_prefill picks the
# prefill kernel variants (CHOICE lines: applied to this copy of kernels/cuda.py), then the GPU
# tests, then the engine bench (BENCH_ARGS), then, time permitting, the per-kernel ncu profile of a
# 512-token prefill chunk ending at position 2,047.
source scripts/device-prelude.sh >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
TUNE_PREFILL_QUICK=1 timeout ${KB_S:-150} python3 scripts/bench_kernels.py --out $OUT/kb.json --parts tune_prefill \
  > $OUT/kb.log 2>&1
grep -E "x[0-9]+ |MoE prefill|CHOICE" $OUT/kb.log
grep "^CHOICE" $OUT/kb.log | while read -r _ kv _; do
  name=${kv%%=*}; value=${kv#*=}
  sed -i -E "s/^${name} = (True|False)/${name} = ${value}/" kernels/cuda.py
done
grep -E "^_F16_FULL|^_MOE_GU_SHARED_B|^_MMA_STAGED" kernels/cuda.py
timeout ${TESTS_S:-300} python3 -m pytest -m gpu -q -p no:warnings > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -8
BENCH_S=${BENCH_S:-280} bash scripts/device-engine.sh bench
if [ -n "${PROFILE_CHUNK:-}" ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  timeout ${PROFILE_S:-150} $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/profile_step.py --prompt 1535 --prefill 512 > $OUT/ncu_prefill.csv 2>/dev/null
  python3 scripts/profile_step.py --summarize $OUT/ncu_prefill.csv | head -14
fi
