#!/bin/bash
# One call on a lent GPU machine for the 2:4 training questions, every output under $OUT, in at most
# TOTAL_S seconds (default 540) however slow a part is: each part runs under `timeout` with its own
# cap, shortened so that the parts after it keep their minimum.
#
#   part            cap s  kept for later  what
#   env               60        480        install in place, versions (device_env.sh)
#   gpu_tile         150        330        benchmarks/gpu/gpu_tile.py: tile op against _cslt_compress
#   recipe_steps     300        130        benchmarks/training/recipe_steps.py --profile auto: nine recipes' GPT-2 step
#   cpu24_build       90        100        build (or load) the 2:4 CPU kernel once
#   cpu24_tests       90         60        pytest tests/kernels/test_cpu24.py -n 8 (a refusal crashed there once)
#   cpu_deploy_t2     60         30        OMP_NUM_THREADS=2 benchmarks/cpu/cpu_deploy.py --quick --skip decode aoti
#   cpu_deploy_t16    60          0        the same with 16 threads
#
#     bash benchmarks/gpu/device_run_41.sh              # on the lent machine (repository root, $OUT set)
#     PYTHON=.venv/bin/python bash benchmarks/gpu/device_run_41.sh --dry-run   # here: every part in its CPU mode
#
# --dry-run (no GPU needed) runs each part's CPU path: gpu_tile says it has no GPU, recipe_steps runs
# --device cpu --tiny --inner aot_eager, the CPU tests are only collected, cpu_deploy measures the
# bandwidth only; nothing is installed. $OUT/parts.txt lists each part's exit status and seconds
# (124: its timeout).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/device_41}
TOTAL_S=${TOTAL_S:-540}
PY=${PYTHON:-python3}
DRY=0
[ "$1" = "--dry-run" ] && DRY=1
START=$(date +%s)
mkdir -p "$OUT"
: > "$OUT/parts.txt"

# budget CAP KEEP: min(CAP, seconds left - KEEP)
budget() {
  local t=$(( TOTAL_S - ($(date +%s) - START) - $2 ))
  [ "$t" -gt "$1" ] && t=$1
  echo "$t"
}
# part NAME SECONDS CMD...: CMD under `timeout SECONDS`, its output in $OUT/NAME.log
part() {
  local name=$1 t=$2 began
  shift 2
  if [ "$t" -lt 10 ]; then
    echo "$name skipped: $t s left" | tee -a "$OUT/parts.txt"
    return
  fi
  began=$(date +%s)
  echo "=== $name (at most $t s): $*"
  timeout -k 5 "$t" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "$name rc=${PIPESTATUS[0]} seconds=$(( $(date +%s) - began )) limit=$t" | tee -a "$OUT/parts.txt"
}

if [ $DRY = 1 ]; then
  echo "dry run: $($PY -c 'import nmcompile, torch; print(nmcompile.__file__, torch.__version__)')" | tee "$OUT/env.txt"
else
  export OUT
  part env "$(budget 60 480)" bash -c 'source benchmarks/gpu/device_env.sh && device_env'
fi

part gpu_tile "$(budget 150 330)" "$PY" benchmarks/gpu/gpu_tile.py --out "$OUT/gpu_tile.json"

T=$(budget 300 130)
if [ $DRY = 1 ]; then
  part recipe_steps "$T" "$PY" benchmarks/training/recipe_steps.py --device cpu --tiny --inner aot_eager --reps 2 --warmup 0 \
    --profile auto --profile-above 0 --profile-steps 1 --budget-s $(( T - 20 )) --out "$OUT/recipe_steps.json"
else
  part recipe_steps "$T" "$PY" benchmarks/training/recipe_steps.py --profile auto --budget-s $(( T - 25 )) \
    --out "$OUT/recipe_steps.json"
fi

part cpu24_build "$(budget 90 100)" "$PY" -c \
  "from nmcompile.kernels import cpu24; s = cpu24.status(); print(s); raise SystemExit(0 if s.available else 1)"

XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
if [ $DRY = 1 ]; then
  part cpu24_tests "$(budget 90 60)" "$PY" -m pytest tests/kernels/test_cpu24.py -q --collect-only -p no:cacheprovider
else
  part cpu24_tests "$(budget 90 60)" "$PY" -m pytest tests/kernels/test_cpu24.py $XDIST -q -p no:cacheprovider -rfE
fi

SKIP="decode aoti"
[ $DRY = 1 ] && SKIP="layers decode aoti"
for THREADS in 2 16; do
  KEEP=30
  [ $THREADS = 16 ] && KEEP=0
  part "cpu_deploy_t$THREADS" "$(budget 60 $KEEP)" env OMP_NUM_THREADS=$THREADS "$PY" benchmarks/cpu/cpu_deploy.py --quick \
    --skip $SKIP --out "$OUT/cpu_deploy_t$THREADS.json"
done

echo "=== parts ($(( $(date +%s) - START )) s in all)"
cat "$OUT/parts.txt"
