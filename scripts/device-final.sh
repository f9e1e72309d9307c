#!/usr/bin/env bash
# One device call for the end of a session (carry [".whl", ".data"]): the GPU tests, then the engine
# bench (BENCH_ARGS), then whatever of these fits before DEADLINE_S seconds (default 540) have
# passed since the start, in this order: ATTN_BENCH=1 (scripts/bench_attention.py), DECODE_AB
# (scripts/decode_ab.py, knob sets separated by ';'), PREFILL_AB (scripts/prefill_ab.py, the same),
# KBENCH_PARTS (scripts/bench_kernels.py
# parts, e.g. tune_moe), BENCH_LIKE=1 (scripts/prefill_timing.py --bench-like: per-chunk times of
# the bench's prefills), PROFILE_CHUNK=1 (per-kernel ncu profile of a 512-token prefill chunk after each of
# PROFILE_PROMPTS tokens, default 1535), REGIMES=1 (`ds4py bench` page-cache then stream with
# `--gpu-vram ${REGIME_VRAM:-24G}`: a card too small for every expert; REGIME_CTX tokens of prompt).
# A mid-session check: TESTS_K (only the GPU tests matching a -k expression), SKIP_BENCH=1;
# SKIP_TESTS=1: no tests.
source scripts/device-prelude.sh >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-540} - ($(date +%s) - T0) )); }
budget() { local l; l=$(left); echo $(( l < $1 ? l : $1 )); }     # min(left, $1)
# the GPU tests: the kernel tests in KSHARDS processes (default 5; numba compiles each kernel variant
# on one core, DS4PY_TEST_SHARD in tests/conftest.py), the forward tests beside them, then the
# VRAM-filling source tests alone (they take all free VRAM on purpose)
gpu_tests() { timeout ${TESTS_S:-300} python3 -m pytest -m gpu -q -p no:warnings "$@"; local rc=$?
              [ $rc -eq 124 ] && echo "TIMED OUT after ${TESTS_S:-300} s: pytest $*"; return $rc; }
if [ -z "${SKIP_TESTS:-}" ]; then     # SKIP_TESTS=1: the bench and A/Bs only
  KSHARDS=${KSHARDS:-5}
  KFILES="tests/test_kernels_cuda.py tests/test_cuda_ops_sim.py"
  # TESTS_K: only the GPU tests that match this -k expression (a mid-session check); SKIP_BENCH=1
  for i in $(seq 0 $((KSHARDS - 1))); do
    DS4PY_TEST_SHARD=$i/$KSHARDS gpu_tests $KFILES ${TESTS_K:+-k "$TESTS_K"} > $OUT/gpu_tests_kernels_$i.log 2>&1 &
  done
  gpu_tests tests/test_forward_cuda.py ${TESTS_K:+-k "$TESTS_K"} > $OUT/gpu_tests_forward.log 2>&1
  wait
  if [ -n "${TESTS_K:-}" ]; then touch $OUT/gpu_tests_sources.log
  else gpu_tests tests/test_sources_cuda.py > $OUT/gpu_tests_sources.log 2>&1; fi
  cat $(ls $OUT/gpu_tests_kernels_*.log 2>/dev/null) $OUT/gpu_tests_forward.log $OUT/gpu_tests_sources.log > $OUT/gpu_tests.log
  rm -f $OUT/gpu_tests_kernels_*.log $OUT/gpu_tests_forward.log $OUT/gpu_tests_sources.log
  grep -E "passed|failed|FAILED|Error|TIMED OUT" $OUT/gpu_tests.log | tail -16
  echo "tests done at $(( $(date +%s) - T0 )) s"
fi
[ -z "${SKIP_BENCH:-}" ] && BENCH_S=$(budget ${BENCH_S:-280}) bash scripts/device-engine.sh bench
if [ -n "${ATTN_BENCH:-}" ] && [ "$(left)" -gt 40 ]; then
  timeout $(budget 60) python3 scripts/bench_attention.py 2>&1 | grep -v Warn > $OUT/bench_attention.log
  tail -6 $OUT/bench_attention.log
fi
if [ -n "${DECODE_AB:-}" ] && [ "$(left)" -gt 40 ]; then     # ';'-separated knob sets
  IFS=';' read -ra sets <<< "$DECODE_AB"
  timeout $(budget ${DECODE_AB_S:-100}) python3 scripts/decode_ab.py --reps 2 $(printf -- '--set %s ' "${sets[@]}") 2>&1 \
    | grep -v Warn > $OUT/decode_ab.log
  grep -E "step ms" $OUT/decode_ab.log
fi
if [ -n "${PREFILL_AB:-}" ] && [ "$(left)" -gt 60 ]; then     # ';'-separated knob sets, one process
  IFS=';' read -ra sets <<< "$PREFILL_AB"
  timeout $(budget ${PREFILL_AB_S:-240}) python3 scripts/prefill_ab.py $(printf -- '--set %s ' "${sets[@]}") 2>&1 \
    | grep -v Warn > $OUT/prefill_ab.log
  grep -E "prefill" $OUT/prefill_ab.log | tail -${PREFILL_AB_LINES:-20}
fi
if [ -n "${KBENCH_PARTS:-}" ] && [ "$(left)" -gt 40 ]; then
  timeout $(budget ${KBENCH_S:-120}) python3 scripts/bench_kernels.py --out $OUT/kernel_bench.json \
    --parts $KBENCH_PARTS > $OUT/kernel_bench.log 2>&1
  grep -E "bits|BITS|us|copy" $OUT/kernel_bench.log | tail -${KBENCH_LINES:-30}
fi
if [ -n "${BENCH_LIKE:-}" ] && [ "$(left)" -gt 40 ]; then
  timeout $(budget 90) python3 scripts/prefill_timing.py --bench-like 2>&1 | grep -v Warn > $OUT/bench_like.log
  grep -E "prefill|probe|again" $OUT/bench_like.log
fi
if [ -n "${PROFILE_CHUNK:-}" ] && [ "$(left)" -gt 60 ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for prompt in ${PROFILE_PROMPTS:-1535}; do     # 512 tokens from position prompt+1 (after the prompt and one decoded token)
    [ "$(left)" -gt 60 ] || break
    timeout $(budget ${PROFILE_S:-150}) $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
      python3 scripts/profile_step.py --prompt $prompt --prefill 512 > $OUT/ncu_prefill_$prompt.csv 2>/dev/null
    python3 scripts/profile_step.py --summarize $OUT/ncu_prefill_$prompt.csv > $OUT/prefill_kernels_$prompt.txt
    echo "== chunk after $prompt tokens"; head -14 $OUT/prefill_kernels_$prompt.txt
  done
fi
if [ -n "${REGIMES:-}" ] && [ "$(left)" -gt 60 ]; then
  [ -f /tmp/flash.gguf ] || ds4py make-model /tmp/flash.gguf --preset flash --alias per-role > /dev/null
  for w in page-cache stream; do
    [ "$(left)" -gt 30 ] || break
    timeout $(budget ${REGIME_S:-150}) ds4py bench -m /tmp/flash.gguf --prompt-file .data/promessi_sposi.txt \
      --ctx-start ${REGIME_CTX:-64} --ctx-max ${REGIME_CTX:-64} --gen-tokens ${REGIME_GEN:-32} --weights $w \
      --gpu-vram ${REGIME_VRAM:-24G} --csv $OUT/regime_$w.csv > $OUT/regime_$w.log 2>&1
    echo "== $w"; grep -v Warn $OUT/regime_$w.log | tail -14; cat $OUT/regime_$w.csv
  done
fi
echo "device-final: $(( $(date +%s) - T0 )) s"
