#!/bin/bash
# A/B of the engine between git revisions inside ONE device call. Between calls (other machines,
# other clocks) the decode step moves by ~0.1 ms, more than most single changes gain; inside one
# call, alternating the trees A B A B shows the difference and the noise together.
#
# here (needs git):   bash scripts/ab_bench.sh prepare REV [REV ...]
#     exports each revision into .ab/<rev>/ (git-ignored; `prepare` again replaces them). "WORK"
#     exports the working tree as it is (tracked and untracked files).
# on the device:      bash scripts/ab_bench.sh run [ROUNDS] [-- gpu_engine_bench.py args]
#     carry [".whl", ".data", ".ab"]; installs each tree in turn (editable) and runs its
#     scripts/gpu_engine_bench.py (default: one 2k frontier, 64 generated tokens, no CPU check),
#     ROUNDS times (default 2); prints each run's step time and decode rate, and leaves the logs
#     in $OUT/ab_<rev>_<round>.log. The project's own install is restored at the end.
# on the device:      bash scripts/ab_bench.sh profile
#     the same trees, each installed in turn: a per-kernel ncu profile (scripts/profile_step.py)
#     for each ';'-separated argument set of PROFILES (default: a decode step after 2,048 tokens,
#     then a 512-token prefill chunk after 1,535), after one unprofiled run that fills the kernel
#     cache (so no compile worker runs under ncu); summaries in $OUT/kernels_<rev>_<i>.txt.
set -u
cmd=${1:-}
shift || true
if [[ $cmd == prepare ]]; then
  rm -rf .ab && mkdir -p .ab
  for rev in "$@"; do
    if [[ $rev == WORK ]]; then
      mkdir -p .ab/WORK && git ls-files -co --exclude-standard -z | grep -zv '^\.ab/' \
        | xargs -0 tar -c | tar -x -C .ab/WORK
    else
      mkdir -p ".ab/$rev" && git archive "$rev" | tar -x -C ".ab/$rev"
    fi
    echo "prepared .ab/$rev"
  done
  exit 0
fi
if [[ $cmd != run && $cmd != profile ]]; then
  echo "usage: bash scripts/ab_bench.sh prepare REV [REV ...] | run [ROUNDS] [-- bench args] | profile" >&2
  exit 2
fi
rounds=2
if [[ ${1:-} =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
bench_args=${*:---frontiers 2048 --gen 64 --budget-s 0 --skip-cpu}
source scripts/device-prelude.sh >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
root=$PWD
install_tree() { ( cd "$1" && ln -sfn "$root/.data" .data \
                   && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 ); }
if [[ $cmd == profile ]]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  IFS=';' read -ra sets <<< "${PROFILES:---prompt 2048;--prompt 1535 --prefill 512}"
  for tree in .ab/*/; do
    rev=$(basename "$tree")
    install_tree "$tree" || { echo "$rev: install failed"; continue; }
    ( cd "$tree" && timeout "${WARM_S:-200}" python3 scripts/profile_step.py ${sets[0]} > /dev/null 2>&1 ) \
      || echo "$rev: the warm-up run failed"
    for i in "${!sets[@]}"; do
      ( cd "$tree" && DS4PY_COMPILE_JOBS=1 timeout "${PROFILE_S:-150}" $NCU --profile-from-start off \
          --clock-control none --metrics gpu__time_duration.sum --csv \
          python3 scripts/profile_step.py ${sets[$i]} > "/tmp/ncu_${rev}_$i.csv" 2> "/tmp/ncu_${rev}_$i.err"
        python3 scripts/profile_step.py --summarize "/tmp/ncu_${rev}_$i.csv" ) > "$OUT/kernels_${rev}_$i.txt" 2>&1 \
        || tail -3 "/tmp/ncu_${rev}_$i.err" >> "$OUT/kernels_${rev}_$i.txt"
      echo "== $rev: ${sets[$i]}"; head -${PROFILE_LINES:-24} "$OUT/kernels_${rev}_$i.txt"
    done
  done
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
  exit 0
fi
for round in $(seq 1 "$rounds"); do
  for tree in .ab/*/; do
    rev=$(basename "$tree")
    log=$OUT/ab_${rev}_$round.log
    ( install_tree "$tree" && cd "$tree" && timeout "${AB_S:-150}" python3 scripts/gpu_engine_bench.py --out "/tmp/ab_$rev" $bench_args ) > "$log" 2>&1
    step=$(grep -o '"step_ms": [0-9.]*' "$log" | head -1)
    rate=$(grep '^bench:' "$log" | head -1 | cut -d, -f8)
    echo "round $round  $rev  ${step:-no step}  steady tok/s ${rate:-?}"
  done
done
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
