#!/bin/bash
# On the GPU machine: GPU tests, the engine benchmark, a per-kernel ncu profile of one decode step
# and (optional) ncu counters of chosen kernels (moe: NCU_REGEX, NCU_COUNT). Everything lands in $OUT (8 files at most).
# usage (device run, carry [".whl", ".data"]): bash scripts/device-engine.sh [tests] [bench] [kernels] [kbench] [moe] [sanitize]
# (BENCH_CHUNKS="1024 2048": the bench again at those prefill chunk sizes)
source scripts/device-prelude.sh || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
parts=" $* "
bench_args=${BENCH_ARGS:---frontiers 2048 --gen 32 --budget-s 0 --skip-cpu}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [[ $parts == *" tests "* ]]; then
  timeout ${TESTS_S:-240} python3 -m pytest -m gpu -q -p no:warnings -rA ${TESTS:-} > $OUT/gpu_tests.log 2>&1
  grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | tail -8
fi
if [[ $parts == *" bench "* ]]; then
  timeout ${BENCH_S:-300} python3 scripts/gpu_engine_bench.py --out $OUT $bench_args > $OUT/bench.log 2>&1
  grep -E "ceiling|profile|bench:|tok/s|page-cache|stream|done" $OUT/bench.log | tail -14
  for c in ${BENCH_CHUNKS:-}; do      # the same bench at other prefill chunk sizes (log only)
    timeout ${BENCH_S:-300} python3 scripts/gpu_engine_bench.py --out /tmp/bench_c$c $bench_args \
      --prefill-chunk $c > $OUT/bench_c$c.log 2>&1
    grep -E "bench:" $OUT/bench_c$c.log | sed "s/^/chunk $c: /"
  done
fi
if [[ $parts == *" kernels "* ]]; then
  timeout ${KERNELS_S:-150} $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/profile_step.py ${PROFILE_ARGS:-} > $OUT/ncu_step.csv 2> /tmp/ncu.err
  { tail -3 /tmp/ncu.err; python3 scripts/profile_step.py --summarize $OUT/ncu_step.csv; } > $OUT/kernels.txt 2>&1
  head -40 $OUT/kernels.txt
fi
if [[ $parts == *" kbench "* ]]; then
  # standalone kernel benchmark parts (KBENCH_PARTS, e.g. dense,moe,tune_moe), graph-replayed
  timeout ${KBENCH_S:-200} python3 scripts/bench_kernels.py --out $OUT/kernel_bench.json \
    --parts ${KBENCH_PARTS:-moe,tune_moe} > $OUT/kernel_bench.log 2>&1
  tail -40 $OUT/kernel_bench.log
fi
if [[ $parts == *" moe "* ]]; then
  # ncu counters of chosen kernels inside a real decode step (or, with PROFILE_ARGS="--prefill 512",
  # a prefill chunk): NCU_REGEX picks them, NCU_COUNT how many launches (in launch order)
  # (NCU_SECTIONS replaces the section list, e.g. "SpeedOfLight MemoryWorkloadAnalysis_Tables
  # ComputeWorkloadAnalysis": shared-memory bank conflicts, L1 wavefronts, pipe utilization)
  sections=${NCU_SECTIONS:-SpeedOfLight Occupancy LaunchStats WarpStateStats MemoryWorkloadAnalysis SchedulerStats}
  timeout ${MOE_S:-180} $NCU --profile-from-start off --clock-control none $(printf -- '--section %s ' $sections) \
    -k "${NCU_REGEX:-regex:moe_}" --launch-count ${NCU_COUNT:-6} \
    python3 scripts/profile_step.py ${PROFILE_ARGS:-} > $OUT/ncu_moe.txt 2>&1
  grep -E "^  [a-zA-Z_]|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Eligible Warps|No Eligible|Theoretical Occ|${NCU_GREP:-Duration}" $OUT/ncu_moe.txt | head -${NCU_LINES:-60}
fi
if [[ $parts == *" sanitize "* ]]; then
  # compute-sanitizer over GPU tests (SAN_TESTS, default: the GPU-vs-CPU logits test) with each
  # tool of SAN_TOOLS: initcheck (device memory read before any write), racecheck (shared-memory
  # hazards), memcheck (out-of-bounds accesses)
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in ${SAN_TOOLS:-initcheck memcheck}; do
    timeout ${SAN_S:-240} $SAN --tool $tool --print-limit 20 python3 -m pytest -m gpu -q -x -p no:warnings \
      ${SAN_TESTS:-tests/test_forward_cuda.py -k logits_match} > $OUT/sanitize_$tool.log 2>&1
    echo "== $tool"; grep -E "ERROR SUMMARY|Uninitialized|Invalid|Race|passed|failed|at 0x|by thread" $OUT/sanitize_$tool.log | head -20
  done
fi
