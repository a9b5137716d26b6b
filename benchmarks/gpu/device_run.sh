#!/bin/bash
# One call on a lent GPU machine (the device tool): install nmcompile in place (its torch.compile
# backend is found through the package's entry point), say what the machine has, then run
# gpu_check.py with every log under $OUT. Arguments go to gpu_check.py.
#     bash benchmarks/gpu/device_run.sh --budget-s 420 --tests-s 120
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
device_env
python3 benchmarks/gpu/gpu_check.py --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
