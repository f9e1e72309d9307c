#!/usr/bin/env bash
# On the GPU machine (carry [".whl"]): ncu's stall reasons, pipe utilizations, L1 wavefronts and SASS
# mix of the MoE decode kernels, one step with the shipped kernels and one per knob configuration
# (scripts/ncu_moe_variants.py), into $OUT/ncu_moe_variants.txt:
#   bash scripts/ncu_moe_variants.sh "_GU_HALVES=0,_IQ2_REPACKED_GATE_UP=1"
# NCU_REGEX picks the kernels (default: gate/up and down decode).
source scripts/device-prelude.sh >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
stalls="long_scoreboard short_scoreboard mio_throttle lg_throttle wait math_pipe_throttle not_selected selected
        dispatch_stall no_instruction tex_throttle branch_resolving barrier drain misc"
metrics=$(for r in $stalls; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done)
for p in alu fma fmaheavy fmalite lsu uniform; do metrics+="sm__inst_executed_pipe_$p.avg.pct_of_peak_sustained_active,"; done
metrics+="sm__mio_inst_issued.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,"
metrics+="l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,"
metrics+="sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
timeout ${NCU_S:-200} "$NCU" --profile-from-start off --clock-control none -k "${NCU_REGEX:-regex:moe_gate_up|moe_down}" \
  --metrics "$metrics" --section InstructionStats --print-details all \
  python3 scripts/ncu_moe_variants.py "$@" > $OUT/ncu_moe_variants.txt 2>&1
grep -E "^  [_a-z]|stalled|pipe|wavefront|conflict|inst_executed.sum|warps_active|issue_active|duration|rror" \
  $OUT/ncu_moe_variants.txt | cut -c1-150
