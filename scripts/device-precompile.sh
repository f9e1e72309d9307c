#!/usr/bin/env bash
# First-run compile times on the device (carry [".whl"]): the tiny model's first run with an empty
# kernel cache (serial compile at first use; records the manifest), the same after a simulated
# upgrade (cache emptied, manifest kept: worker processes compile ahead; this run goes through
# scripts/compile_log.py, which lists each kernel the run itself still COMPILED rather than
# loaded), then with everything cached; the same for the flash preset when FLASH=1. The manifests
# land in $OUT. KEY_PAT with DS4PY_CACHE_KEY_LOG=1 shows the cache keys of matching kernels.
source scripts/device-prelude.sh >/dev/null 2>&1 || exit 1
export XDG_CACHE_HOME=/tmp/xdg PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
MAN=$XDG_CACHE_HOME/ds4py/kernel-manifest.json
empty_cache() { find kernels -name "*.nbi" -delete; find kernels -name "*.nbc" -delete; }
forget_compiled() { python3 - "$MAN" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d["compiled"] = {}; json.dump(d, open(sys.argv[1], "w"))
PY
}
show() { grep -v Warn | grep -E "compil|COMPIL|t/s|rror|worker\]|cache-key\] ${KEY_PAT:-none}" | grep -vE "loaded" | tail -${LINES_SHOWN:-8}; }
run_once() { local t0=$(date +%s%N)
  ${RUNNER:-ds4py} run ${MODEL:+-m $MODEL} -p "Ciao, come stai?" -n 8 --temp 0 2>&1 | show
  echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms"; }
logged() { DS4PY_COMPILE_DEBUG=1 RUNNER="python3 scripts/compile_log.py" LINES_SHOWN=60 run_once; }
empty_cache; rm -f $MAN
echo "== tiny: empty cache, no manifest"; run_once
cp $MAN $OUT/manifest_after_tiny.json
empty_cache; forget_compiled
echo "== tiny: empty cache, manifest (workers)"; logged
echo "== tiny: all cached"; logged
if [ -n "${FLASH:-}" ]; then
  python3 -c "from ds4py import synth; synth.build_model('/tmp/flash.gguf', 'flash', 'per-role', 0)"
  export MODEL=/tmp/flash.gguf
  empty_cache
  echo "== flash: empty cache, no manifest for its shape"; run_once
  cp $MAN $OUT/manifest_after_flash.json
  empty_cache; forget_compiled
  echo "== flash: empty cache, manifest (workers)"; logged
  echo "== flash: all cached"; logged
fi
